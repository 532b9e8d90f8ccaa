"""KDA steps 1-2 for training (``short_conv_qkv``, one fused custom-VJP op) == the layer's earlier
per-tensor formulation ``l2_normalize(SiLU(causal_conv1d(x)))``: values and every gradient."""

import jax
import jax.numpy as jnp
import pytest

from k3jax.layers.kda import QK_L2_EPS, short_conv_qkv
from k3jax.layers.norm import l2_normalize
from pallas_kernels.kda import causal_conv1d
from tests.tolerances import F32_RTOL, F64_RTOL, rel_rmse

B, T, H, K, W = 2, 21, 2, 8, 4
SEG = jnp.asarray([[0] * 6 + [1] * 2 + [2] * 13, [4] * 9 + [1] * 1 + [4] * 11], jnp.int32)


def _per_tensor(xs, ws, segment_ids, wide):
    """The layer before the fused op: one ``causal_conv1d`` per tensor in the wide dtype, then the norms."""
    out = []
    for i, (x, w) in enumerate(zip(xs, ws)):
        w = w.reshape(W, H * K).T.astype(wide)
        y, _ = causal_conv1d(x.reshape(B, T, H * K).astype(wide), w, segment_ids=segment_ids)
        y = jax.nn.silu(y).reshape(B, T, H, K)
        out.append(l2_normalize(y, QK_L2_EPS) if i < 2 else y)
    return tuple(out)


def _inputs(dtype):
    ks = jax.random.split(jax.random.PRNGKey(7), 9)
    xs = tuple(jax.random.normal(ks[i], (B, T, H, K), dtype) for i in range(3))
    ws = tuple(jax.random.uniform(ks[3 + i], (W, H, K), dtype, -0.5, 0.5) for i in range(3))
    cts = tuple(jax.random.normal(ks[6 + i], (B, T, H, K), dtype) for i in range(3))
    return xs, ws, cts


@pytest.mark.parametrize("dtype,tol", [(jnp.float64, F64_RTOL), (jnp.float32, F32_RTOL)])
@pytest.mark.parametrize("with_docs", [False, True])
def test_fused_equals_per_tensor(dtype, tol, with_docs):
    seg = SEG if with_docs else None
    with jax.enable_x64(dtype == jnp.float64):
        xs, ws, cts = _inputs(dtype)
        fused = jax.jit(lambda xs, ws: short_conv_qkv(xs, ws, seg, wide_dtype=dtype, out_dtype=dtype))
        out, vjp = jax.vjp(fused, xs, ws)
        want, vjp_want = jax.vjp(lambda xs, ws: _per_tensor(xs, ws, seg, dtype), xs, ws)
        for a, b in zip(out, want):
            assert a.dtype == dtype and rel_rmse(a, b) <= tol
        grads, grads_want = jax.tree.leaves(vjp(cts)), jax.tree.leaves(vjp_want(cts))
        assert len(grads) == 6
        for a, b in zip(grads, grads_want):
            assert rel_rmse(a, b) <= tol
