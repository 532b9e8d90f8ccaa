"""``gmm_sum``: ``Σ_p lhs_p · rhs_p[e]`` per group in one accumulator (the split gate/up input
gradient ``dg·W1ᵀ + du·W3ᵀ``) equals the grouped matmul of the operands concatenated along K bit
for bit, and ``moe_ffn(gate_up="split")`` no longer copies ``[dg | du]`` or ``[W1 | W3]``.
Interpreted on CPU by default; ``TestGmmSumCompiled`` runs the Mosaic GPU kernel (``-m gpu``)."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src import core as jax_core

from pallas_kernels.moe import gate_up_matmul, grouped_matmul, kernel_gpu, kernel_gpu_base, kernel_tpu, moe_ffn
from pallas_kernels.moe.reference import grouped_matmul_sum_ragged
from tests.pallas_kernels.moe.conftest import random_moe_inputs
from tests.tolerances import BF16_FWD_RTOL, rel_rmse

E = 4
GROUP_CASES = [[40, 0, 70, 0], [0, 150, 0, 0], [0, 0, 0, 0]]
SMALL = kernel_gpu.GpuTiling(tile_m=64, tile_n=64, tile_k=64, stages=2)
# 2 + 1 K steps a tile on 3 slots: pairs of unequal K, the ring wraps inside tiles
SMALL_RING = dataclasses.replace(SMALL, stages=3, ring=True)


def _pairs(m, ks, n, seed=0):
    keys = jax.random.split(jax.random.PRNGKey(seed), 2 * len(ks))
    lhss = [jax.random.normal(keys[2 * p], (m, k)).astype(jnp.bfloat16) for p, k in enumerate(ks)]
    rhss = [(jax.random.normal(keys[2 * p + 1], (E, n, k)) / np.sqrt(k)).astype(jnp.bfloat16) for p, k in enumerate(ks)]
    return lhss, rhss


class GmmSumCase:
    interpret = True
    m, ks, n = 150, (128, 64), 128
    sum_tiling, concat_tiling = SMALL_RING, SMALL  # the concatenated product through the per-tile pipeline
    cases = GROUP_CASES

    def test_equals_concatenated_product_bitwise(self):
        lhss, rhss = _pairs(self.m, self.ks, self.n)
        lhs, rhs = jnp.concatenate(lhss, axis=1), jnp.concatenate(rhss, axis=2)
        f32 = lambda x: np.asarray(x, np.float32)
        for case in self.cases:
            gs = jnp.asarray(case, jnp.int32)
            run = dict(transpose_rhs=True, interpret=self.interpret)
            ours = kernel_gpu.gmm_sum(lhss, rhss, gs, tiling=self.sum_tiling, **run)
            packed = kernel_gpu.gmm(lhs, rhs, gs, tiling=self.concat_tiling, **run)
            np.testing.assert_array_equal(f32(ours), f32(packed), err_msg=str(case))
            total = int(gs.sum())
            assert not np.any(f32(ours)[total:]), case
            if total:
                wide = lambda x: x.astype(jnp.float32)
                want = grouped_matmul_sum_ragged([wide(x) for x in lhss], [wide(w).swapaxes(1, 2) for w in rhss], gs)
                assert rel_rmse(wide(ours), want) < BF16_FWD_RTOL, case


class TestGmmSumInterpret(GmmSumCase):
    pass


def test_gmm_sum_has_no_smem_race(monkeypatch):
    """The interpreter's race detector over the ring's slots while the loads switch pairs mid-tile."""
    from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import get_races

    monkeypatch.setattr(kernel_gpu_base, "_DETECT_RACES", True)
    lhss, rhss = _pairs(152, (128, 64), 128)  # a shape no other test traces: gmm_sum's jit cache is keyed on it
    out = kernel_gpu.gmm_sum(lhss, rhss, jnp.asarray(GROUP_CASES[0], jnp.int32), transpose_rhs=True,
                             tiling=SMALL_RING, interpret=True)
    jax.block_until_ready(out)
    assert not get_races().races_found


def test_gmm_sum_untransposed_equals_concatenated_product():
    lhss, rhss = _pairs(100, (64, 64), 128)
    rhss = [w.swapaxes(1, 2) for w in rhss]  # [E, K, N]
    gs = jnp.asarray([30, 0, 50, 20], jnp.int32)
    ours = kernel_gpu.gmm_sum(lhss, rhss, gs, tiling=SMALL_RING, interpret=True)
    lhs, rhs = jnp.concatenate(lhss, axis=1), jnp.concatenate(rhss, axis=1)
    packed = kernel_gpu.gmm(lhs, rhs, gs, tiling=SMALL, interpret=True)
    np.testing.assert_array_equal(np.asarray(ours, np.float32), np.asarray(packed, np.float32))


def test_gmm_sum_tpu_fallback_equals_concatenated_product():
    lhss, rhss = _pairs(64, (128, 128), 128)
    gs = jnp.asarray([16, 0, 40, 8], jnp.int32)
    tiling = kernel_tpu.TpuTiling(tile_m=32, tile_k=128, tile_n=128)
    ours = kernel_tpu.gmm_sum(lhss, rhss, gs, transpose_rhs=True, tiling=tiling, interpret=True)
    packed = kernel_tpu.gmm(jnp.concatenate(lhss, axis=1), jnp.concatenate(rhss, axis=2), gs, transpose_rhs=True,
                            tiling=tiling, interpret=True)
    np.testing.assert_array_equal(np.asarray(ours, np.float32), np.asarray(packed, np.float32))


def test_gmm_sum_names_its_bad_arguments():
    lhss, rhss = _pairs(64, (64, 64), 128)
    gs = jnp.asarray([16, 16, 16, 16], jnp.int32)
    call = functools.partial(kernel_gpu.gmm_sum, group_sizes=gs, transpose_rhs=True, interpret=True)
    with pytest.raises(ValueError, match="lhss and rhss must be equally long"):
        call(lhss, rhss[:1], tiling=SMALL_RING)
    with pytest.raises(ValueError, match="tiling.ring must be True"):
        call(lhss, rhss, tiling=SMALL)
    with pytest.raises(ValueError, match=r"rhss\[1\] must have 4 groups"):
        call(lhss, [rhss[0], rhss[1][:, :, :32]], tiling=SMALL_RING)
    with pytest.raises(ValueError, match=r"lhss\[1\] must have 64 rows"):
        call([lhss[0], lhss[1][:32]], rhss, tiling=SMALL_RING)


def _concatenates(jaxpr) -> list[tuple]:
    """Output shapes of every ``concatenate`` in ``jaxpr`` and its sub-jaxprs."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "concatenate":
            found.append(tuple(eqn.outvars[0].aval.shape))
        for value in eqn.params.values():
            for v in value if isinstance(value, tuple) else (value,):
                if isinstance(v, (jax_core.Jaxpr, jax_core.ClosedJaxpr)):
                    found += _concatenates(getattr(v, "jaxpr", v))
    return found


def test_split_gate_up_backward_copies_no_operands():
    """The split path's gradient builds neither ``[dg | du]`` (``[T·k, 2F]``) nor ``[W1 | W3]``
    (``[E, L, 2F]``) on the GPU kernel; before ``gmm_sum`` it built both."""
    x, ids, w, w1, w3, w2 = random_moe_inputs(0, 48, 128, 128, E, 2, jnp.bfloat16)
    ffn = functools.partial(moe_ffn, implementation="pallas", interpret=True, kernel_backend="gpu", gate_up="split")
    grad = jax.grad(lambda x, w1, w3: jnp.sum(ffn(x, ids, w, w1, w3, w2).astype(jnp.float32)), argnums=(0, 1, 2))
    shapes = _concatenates(jax.make_jaxpr(grad)(x, w1, w3).jaxpr)
    assert not [s for s in shapes if s[-1] == 2 * w1.shape[2]], shapes


def test_gate_up_matmul_is_the_packed_product_bitwise(monkeypatch):
    """``gate_up_matmul`` (what the expert-parallel layer runs): values and all three gradients equal
    ``grouped_matmul(lhs, [W1 | W3])``'s bit for bit; before, its ``dlhs`` was two products rounded to
    bf16 apart and added."""
    monkeypatch.setattr(kernel_gpu, "GMM_TILING", SMALL)
    monkeypatch.setattr(kernel_gpu, "GMM_TILING_T", SMALL)
    monkeypatch.setattr(kernel_gpu, "GMM_SUM_TILING", SMALL_RING)
    x, _, _, w1, w3, _ = random_moe_inputs(0, 150, 128, 128, E, 2, jnp.bfloat16)
    gs = jnp.asarray([40, 0, 70, 20], jnp.int32)
    cot = jax.random.normal(jax.random.PRNGKey(5), (150, 256))
    impl = dict(implementation="pallas", interpret=True, kernel_backend="gpu")

    def split(x, w1, w3):
        return jnp.concatenate(gate_up_matmul(x, w1, w3, gs, **impl), axis=1)

    def packed(x, w1, w3):
        return grouped_matmul(x, jnp.concatenate([w1, w3], axis=2), gs, **impl)

    def value_and_grads(fn):
        loss = lambda *a: (jnp.sum(fn(*a).astype(jnp.float32) * cot), fn(*a))
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(x, w1, w3)

    (_, ours), grads = value_and_grads(split)
    (_, want), want_grads = value_and_grads(packed)
    f32 = lambda a: np.asarray(a, np.float32)
    np.testing.assert_array_equal(f32(ours), f32(want))
    for name, a, b in zip(("x", "w1", "w3"), grads, want_grads):
        assert np.any(f32(b)), name
        np.testing.assert_array_equal(f32(a), f32(b), err_msg=name)


@pytest.mark.unchecked
def test_gate_up_matmul_names_mismatched_stacks():
    x, _, _, w1, w3, _ = random_moe_inputs(0, 16, 128, 128, E, 2, jnp.bfloat16)
    with pytest.raises(ValueError, match="w3.shape must equal w1.shape"):
        gate_up_matmul(x, w1, w3[:, :, :64], jnp.asarray([4, 4, 4, 4], jnp.int32))


@pytest.mark.gpu
class TestGmmSumCompiled(GmmSumCase):
    """Compiled on the GPU: 132 SMs, the default tilings (ring ``gmm_sum`` against the per-tile
    pipeline ``gmm``), K = F = 3072 per pair as at K3 width (48 K steps each)."""
    interpret = False
    m, ks, n = 4000, (3072, 3072), 768
    sum_tiling, concat_tiling = None, None
    cases = GROUP_CASES + [[1000, 7, 2900, 93]]
