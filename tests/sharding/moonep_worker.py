"""Multi-device MoonEP checks (run by test_moonep.py in a subprocess with 8 CPU devices)."""

import jax
import jax.numpy as jnp

jax.config.update("jax_default_matmul_precision", "highest")

from pallas_kernels.moe.reference import moe_ffn_dense  # noqa: E402
from sharding import make_mesh, use_mesh  # noqa: E402
from sharding.ep import moe_ffn_ep  # noqa: E402
from sharding.moonep import moe_ffn_moonep  # noqa: E402
from sharding.moonep_placement import plan_replicas, planned_rank_loads  # noqa: E402
from tests.sharding.multidevice import emit  # noqa: E402
from tests.tolerances import rel_rmse  # noqa: E402

E, K_TOP, L, F, N = 32, 4, 16, 8, 2048
RESERVE = 0.25


def zipf_router(key, tokens, exponent=0.8, temperature=1.0):
    """Top-k ids and weights of a router whose expert popularity is Zipf-like on top of a balanced one.

    A balanced (QB-converged) router's scores are exchangeable over experts; the popularity adds
    ``exponent · log(1/rank)`` to the logits, the rank of an expert a fixed shuffle of 1..E.
    """
    noise = jax.random.normal(key, (tokens, E)) * temperature
    rank = jax.random.permutation(jax.random.PRNGKey(42), E) + 1
    logits = noise - exponent * jnp.log(rank.astype(jnp.float32))
    scores = jax.nn.sigmoid(logits)
    _, ids = jax.lax.top_k(logits, K_TOP)
    w = jnp.take_along_axis(scores, ids, 1)
    return ids, w / w.sum(-1, keepdims=True)
