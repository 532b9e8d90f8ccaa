"""benchmarks/bench_moe_decode.py: the dense path's TMA rows compute what the XLA path computes, so the ratios
it prints compare like with like."""

import jax.numpy as jnp
import numpy as np

from benchmarks.bench_moe_decode import _inputs, _router_outputs, tma_dense, xla_read
from k3jax.layers import moe_decode
from k3jax.layers.routing import RENORM_EPS
from pallas_kernels.moe.kernel_gpu_decode_dense_tma import TmaTiles
from pallas_kernels.moe.rank_routing import Routing


def test_dense_rows_match_the_xla_path():
    """Interpreted at 4 experts of 256 × 256, k = 2, 16 tokens: within one bf16 ulp of XLA's output."""
    T, E, L, F, k = 16, 4, 256, 256, 2
    x, ws = _inputs(T, E, L, F)
    scores, bias = _router_outputs(T, E)
    routing = Routing(k, True, 1.0, RENORM_EPS)
    ref = np.asarray(moe_decode.routed_experts(x, scores, bias, *ws, path="dense", top_k=k, renormalize=True,
                                               scaling=1.0, activation="situ", implementation="xla"), np.float32)
    ulp = 2.0 ** -7 * np.abs(ref).max()
    got = tma_dense(x, scores, bias, *ws, routing=routing, activation="situ", tiles=TmaTiles(), interpret=True)
    assert got.shape == x.shape and got.dtype == x.dtype
    assert np.abs(np.asarray(got, np.float32) - ref).max() <= ulp


def test_the_read_returns_its_input():
    x, ws = _inputs(4, 2, 64, 64)
    assert jnp.array_equal(xla_read(x, None, None, *ws), x)
