"""The key-blocked latent attention (sharding/latent_attention.py) equals the dense reference.

One device: a shard's queries at an offset against all keys, documents changing mid-block, several
key blocks skipped past the last query; outputs, max_logit and the gradients of the queries, the
latent, the rope key and ``kv_b`` against ``mla_attention_reference`` on the expanded keys.
"""

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.mla_attention.reference import mla_attention_reference
from sharding.latent_attention import key_block_for, latent_attention
from tests.tolerances import F32_RTOL, rel_rmse

B, T, S, H, R, DR, DN, DV, SCALE = 2, 16, 64, 3, 8, 4, 8, 8, 0.3


def _inputs():
    ks = jax.random.split(jax.random.PRNGKey(7), 4)
    q = jax.random.normal(ks[0], (B, T, H, DN + DR))
    c = jax.random.normal(ks[1], (B, S, R))
    kr = jax.random.normal(ks[2], (B, S, DR))
    kv_b = 0.5 * jax.random.normal(ks[3], (R, H, DN + DV))
    s = jnp.arange(S)
    seg = jnp.stack([(s >= 21) + (s >= 29), jnp.zeros(S, jnp.int32)]).astype(jnp.int32)  # row 0: 3 documents
    return (q, c, kr, kv_b), seg


def _dense(q_start, seg):
    def fn(q, c, kr, kv_b):
        kv = jnp.einsum("BSR,RHK->BSHK", c, kv_b, precision="highest")
        return mla_attention_reference(q[..., :DN], q[..., DN:], kv[..., :DN], kr, kv[..., DN:],
                                       seg[:, q_start:q_start + T], scale=SCALE, q_start=q_start, key_segment_ids=seg)
    return fn


@pytest.mark.parametrize("q_start,key_block", [(16, 8), (0, 16), (48, 4)])
def test_blocked_attention_equals_dense(q_start, key_block):
    args, seg = _inputs()
    blocked = lambda *a: latent_attention(*a, seg[:, q_start:q_start + T], seg, jnp.int32(q_start), scale=SCALE,
                                          nope_dim=DN, key_block=key_block)
    cot = lambda o: jnp.cos(3 * o)
    with jax.default_matmul_precision("highest"):
        (o, m), vjp = jax.vjp(jax.jit(blocked), *args)
        (o_ref, m_ref), vjp_ref = jax.vjp(_dense(q_start, seg), *args)
        grads, grads_ref = vjp((cot(o), jnp.zeros_like(m))), vjp_ref((cot(o_ref), jnp.zeros_like(m_ref)))
    assert rel_rmse(o, o_ref) <= F32_RTOL and rel_rmse(m, m_ref) <= F32_RTOL
    for name, g, g_ref in zip(("q", "c", "k_rope", "kv_b"), grads, grads_ref):
        assert rel_rmse(g, g_ref) <= F32_RTOL, name
    # keys past the last query take no gradient: their blocks are never visited
    assert float(jnp.abs(grads[1][:, q_start + T:]).max(initial=0.0)) == 0.0


def test_key_block_keeps_the_logits_block_under_budget_and_divides_the_keys():
    assert key_block_for(1, 96, 8192, 1 << 20) == 256  # K3, 1 M tokens on 128 shards: 0.8 GB of fp32 logits
    assert key_block_for(1, 96, 65536, 1 << 20) == 128  # the floor
    assert key_block_for(2, 3, 16, 64) == 64 and key_block_for(2, 3, 16, 48) == 16


@pytest.mark.unchecked
def test_key_block_must_divide_the_keys():
    args, seg = _inputs()
    with pytest.raises(ValueError, match="key_block=24 must divide the S=64"):
        latent_attention(*args, seg[:, :T], seg, 0, scale=SCALE, nope_dim=DN, key_block=24)
