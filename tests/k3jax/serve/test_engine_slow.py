"""Slow engine checks (``-m slow``): the engine against ``k3jax.generate`` token for token, the
power-of-two page buckets (several programs) with no compilation after warm-up, and the
benchmark's ``--tiny`` runs (plain and ``--spec``)."""

import sys

import numpy as np
import pytest

from k3jax.infer.generate import generate
from k3jax.serve import Engine, EngineConfig, SamplingParams, compilations

pytestmark = pytest.mark.slow


def test_engine_equals_generate_with_power_of_two_buckets(tiny_model):
    cfg, variables = tiny_model.cfg, tiny_model.variables
    engine = Engine(variables, cfg, EngineConfig(num_slots=3, page_size=8, max_context=32, chunk=8,
                                                 snapshot_every=1))
    assert engine.ecfg.page_buckets == (1, 2, 4)
    engine.warm_up()
    before = compilations()
    rng = np.random.default_rng(3)
    prompts = [list(rng.integers(0, 256, n)) for n in (2, 9, 17, 23)]
    params = SamplingParams(max_tokens=5, temperature=0.0)
    outs = engine.generate(prompts, params)
    turn2 = prompts[2] + outs[2] + [7]
    outs.append(engine.generate([turn2], params)[0])
    assert compilations() == before
    assert engine.stats["hit_tokens"] == len(prompts[2]) + 4
    want = [generate(variables, cfg, [p], max_new_tokens=5, temperature=0)[0] for p in prompts + [turn2]]
    assert outs == want


def test_bench_serve_runs_tiny(tmp_path):
    sys.path.insert(0, "benchmarks")
    import bench_serve

    out = bench_serve.main(["--tiny", "--out", str(tmp_path / "b.json")])
    assert out["compilations_after_warm_up"] == 0
    assert out["second_turn"]["reused_tokens"] > 0
    assert (tmp_path / "b.json").is_file()


def test_bench_serve_spec_runs_tiny(tmp_path):
    sys.path.insert(0, "benchmarks")
    import bench_serve

    out = bench_serve.main(["--tiny", "--spec", "2", "--draft-minutes", "0", "--out", str(tmp_path / "s.json")])
    assert out["compilations_after_warm_up"] == 0
    for row in (out["temperature_1"], out["temperature_0"]):
        assert row["plain"]["output_tokens"] == row["speculative"]["output_tokens"] > 0
        assert 0 <= row["mean_accepted"] <= 2
