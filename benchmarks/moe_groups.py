"""Group sizes for the grouped-matmul benchmarks (``bench_moe.py``, ``moe_tuning.py``, ``bench_gmm_sum.py``,
``ncu_moe.py``): uneven draws, or the near-even counts of a fresh router (``bench_moe.py --groups``).

A tiling's ranking depends on the spread: at small()'s shapes the weight gradient's best tiling under
uneven groups lost to the default under a router's, and the train step showed no gain
(benchmarks/RESULTS.md, stop 43).
"""

import jax
import jax.numpy as jnp
import numpy as np

GROUPS = "uneven"  # how ``random_group_sizes`` spreads the rows: "uneven" or "router" (``--groups``)


def random_group_sizes(key, m, e):
    """Sizes summing to m: with ``GROUPS == "router"`` the counts of m / 8 tokens each sending rows to
    8 distinct experts drawn uniformly (``router_group_sizes``), else uneven: a multinomial draw with
    probabilities in [0.5, 1.5]/Σ."""
    if GROUPS == "router":
        return router_group_sizes(key, m, e)
    p = np.asarray(jax.random.uniform(key, (e,), minval=0.5, maxval=1.5), np.float64)
    rng = np.random.default_rng(int(jax.random.randint(key, (), 0, 2**31 - 1)))
    return jnp.asarray(rng.multinomial(m, p / p.sum()), jnp.int32)


def router_group_sizes(key, m, e, top_k=8):
    """Group sizes of ``m`` rows routed as a fresh router routes them: ``m / top_k`` tokens, each to
    ``top_k`` distinct experts drawn uniformly (the rest of the rows, if ``m`` does not divide, to expert 0)."""
    top_k = min(top_k, e)
    tokens = m // top_k
    ids = jnp.argsort(jax.random.uniform(key, (tokens, e)), axis=1)[:, :top_k]
    sizes = jnp.bincount(ids.reshape(-1), length=e).astype(jnp.int32)
    return sizes.at[0].add(m - tokens * top_k)
