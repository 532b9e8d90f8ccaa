"""The serving tests' engines: tiny() in float32, all of one shape so they share compiled programs.

Every engine here has the same slots, lanes, chunk, page size, context and pool sizes (a small
pool, so eviction happens), hence jit's cache compiles the model programs once per session.
"""

import pytest

from k3jax.serve import Engine, EngineConfig
from k3jax.serve.pages import init_paged, page_bytes, snapshot_bytes

PAGES, SNAPSHOTS = 14, 8  # 4 slots x 2 pages of context, plus room to keep a few prefixes


def engine_config(cfg, **changes) -> EngineConfig:
    """EngineConfig whose budget splits into exactly PAGES pages (+ trash) and SNAPSHOTS snapshots."""
    probe = init_paged(cfg, num_slots=1, num_pages=1, page_size=16, num_snapshots=1)
    page, snap = page_bytes(probe), snapshot_bytes(probe)
    budget = (PAGES + 1) * page + SNAPSHOTS * snap
    share = (SNAPSHOTS * snap + 0.5) / budget
    fields = dict(num_slots=4, page_size=16, max_context=32, chunk=16, prefill_lanes=2, snapshot_every=1,
                  cache_bytes=budget, snapshot_share=share, buckets=(2,))  # one bucket: two programs
    return EngineConfig(**{**fields, **changes})


@pytest.fixture(scope="session")
def make_engine(tiny_model):
    """``make_engine(prefix_cache=True, decode=None)``: a fresh, warmed-up engine."""
    cfg, variables = tiny_model.cfg, tiny_model.variables

    def make(prefix_cache: bool = True, decode=None) -> Engine:
        engine = Engine(variables, cfg, engine_config(cfg, prefix_cache=prefix_cache), decode=decode)
        assert (engine.budget.num_pages - 1, engine.budget.num_snapshots) == (PAGES, SNAPSHOTS)
        engine.warm_up()
        return engine

    return make
