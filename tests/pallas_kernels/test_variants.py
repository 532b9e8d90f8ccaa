"""Every public op under ``chex.variants`` (jitted and eager) and under both ``jax_enable_x64``
settings: each variant equals the op's reference, float32 inputs give float32 outputs of the
documented shape, and nothing is non-finite.

x64 matters: kernels index with int32 while a Python int is int64 under x64 (``int_ops``); the
TPU KDA kernel raised ``lax.div requires arguments to have the same dtypes`` there, and the Mosaic
GPU grouped matmuls are traced with 32-bit defaults (``kernel_gpu_base.persistent_kernel``), so the
kernel is the same with x64 on and off. The Pallas paths (interpreted) run jitted only: eager
dispatch of a ``pallas_call`` compiles the same kernel.
"""

import contextlib

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

from pallas_kernels.head_ce import chunk_logits_lse
from pallas_kernels.head_ce.reference import chunk_logits_lse as chunk_logits_lse_reference
from pallas_kernels.kda import (causal_conv1d, causal_conv1d_step, chunk_kda, chunk_kda_reference,
                                naive_recurrent_kda, recurrent_kda_step)
from pallas_kernels.mla_attention import mla_attention, mla_attention_reference
from pallas_kernels.moe import combine, grouped_matmul, moe_ffn, permute, situ_glu, swiglu
from pallas_kernels.moe.reference import grouped_matmul_dense, moe_ffn_dense
from tests.pallas_kernels.kda.conftest import kda_inputs
from tests.pallas_kernels.moe.conftest import random_gmm_inputs, random_moe_inputs

F32 = dict(rtol=1e-4, atol=1e-5)
BF16 = dict(rtol=2e-2, atol=2e-2)
X64 = [dict(testcase_name="x32", x64=False), dict(testcase_name="x64", x64=True)]
GROUPS = np.asarray([5, 0, 20, 7], np.int32)  # an empty group, rows past the groups


@contextlib.contextmanager
def _x64_globally(on: bool):
    """``jax_enable_x64`` set process-wide, not with the thread-local ``jax.enable_x64`` context: the
    Mosaic GPU interpreter lowers each kernel thread's jaxpr (traced under the caller's setting) again
    in worker threads, which do not see a context set on the caller's thread, and an int64 loop
    counter of the interpreter then meets an int32 initial value ("expect operands to be compatible
    with condition block arguments"). Compiled kernels lower on the caller's thread."""
    before = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", on)
    try:
        yield
    finally:
        jax.config.update("jax_enable_x64", before)


def _normal(seed, shape, dtype=jnp.float32):
    return jax.random.normal(jax.random.PRNGKey(seed), shape, jnp.float32).astype(dtype)


class XlaOpsTest(chex.TestCase):
    """The XLA paths: jitted and eager variants, with and without x64."""

    def _check(self, got, want, shape, tol=F32):
        chex.assert_shape(got, shape)
        chex.assert_type(got, want.dtype)
        chex.assert_tree_all_finite(got)
        chex.assert_trees_all_close(got, want, **tol)

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters(*X64)
    def test_kda(self, x64):
        with jax.enable_x64(x64):
            q, k, v, g, beta, s0 = kda_inputs(0, 1, 20, 2, 4, 6, dtype=jnp.float32)
            seg = jnp.asarray([[0] * 9 + [1] * 11])
            o, s = self.variant(lambda *a: chunk_kda(*a, initial_state=s0, segment_ids=seg, output_final_state=True,
                                                     implementation="xla", chunk_size=8))(q, k, v, g, beta)
            want_o, want_s = naive_recurrent_kda(q, k, v, g, beta, initial_state=s0, segment_ids=seg)
            self._check(o, want_o, (1, 20, 2, 6))
            self._check(s, want_s, (1, 2, 4, 6))
            step_o, step_s = self.variant(recurrent_kda_step)(q[:, :3], k[:, :3], v[:, :3], g[:, :3], beta[:, :3], s0)
            ref_o, ref_s = naive_recurrent_kda(q[:, :3], k[:, :3], v[:, :3], g[:, :3], beta[:, :3], initial_state=s0)
            self._check(step_o, ref_o, (1, 3, 2, 6))
            self._check(step_s, ref_s, (1, 2, 4, 6))

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters(*X64)
    def test_conv(self, x64):
        with jax.enable_x64(x64):
            x, w = _normal(0, (2, 10, 6)), _normal(1, (6, 4))
            y, state = self.variant(causal_conv1d)(x, w)
            y1, s1 = causal_conv1d(x[:, :7], w)
            y2, s2 = self.variant(causal_conv1d_step)(x[:, 7:], w, s1)
            self._check(jnp.concatenate([y1, y2], axis=1), y, (2, 10, 6))
            self._check(s2, state, (2, 3, 6))

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters(*X64)
    def test_mla_attention(self, x64):
        with jax.enable_x64(x64):
            args = [_normal(i, s) for i, s in enumerate([(1, 12, 2, 8), (1, 12, 2, 4), (1, 12, 2, 8), (1, 12, 4),
                                                          (1, 12, 2, 8)])]
            o, m = self.variant(lambda *a: mla_attention(*a, scale=0.3, implementation="xla"))(*args)
            want_o, want_m = mla_attention_reference(*args, None, scale=0.3)
            self._check(o, want_o, (1, 12, 2, 8))
            self._check(m, want_m, (2,))

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters(*X64)
    def test_moe(self, x64):
        with jax.enable_x64(x64):
            lhs, rhs = random_gmm_inputs(0, 40, 8, 8, 4, jnp.float32)
            want = grouped_matmul_dense(lhs, rhs, jnp.asarray(GROUPS))
            for impl in ("xla", None):  # None on CPU: the tile loop
                got = self.variant(lambda a, b, g: grouped_matmul(a, b, g, implementation=impl))(lhs, rhs, GROUPS)
                self._check(got, want, (40, 8))
            x, ids, w, w1, w3, w2 = random_moe_inputs(0, 6, 8, 16, 4, 2, jnp.float32)
            self._check(self.variant(moe_ffn)(x, ids, w, w1, w3, w2), moe_ffn_dense(x, ids, w, w1, w3, w2), (6, 8))
            xs, sizes, inverse = self.variant(permute, static_argnums=2)(x, ids, 4)
            self._check(self.variant(combine)(xs, inverse, w), jnp.einsum("tk,td->td", w, x), (6, 8))
            chex.assert_trees_all_equal(int(sizes.sum()), 12)
            gate, up = _normal(3, (5, 16)), _normal(4, (5, 16))
            self._check(self.variant(swiglu)(gate, up), jax.nn.silu(gate) * up, (5, 16))
            chex.assert_shape(self.variant(situ_glu)(gate, up), (5, 16))


    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters(*X64)
    def test_head_ce(self, x64):
        with jax.enable_x64(x64):
            f, w = _normal(0, (12, 8)), _normal(1, (8, 40))
            logits, lse = self.variant(lambda a, b: chunk_logits_lse(a, b, implementation="xla"))(f, w)
            self._check(logits, f @ w, (12, 40))
            self._check(lse, jax.nn.logsumexp(f @ w, axis=-1), (12,))


class PallasOpsTest(chex.TestCase):
    """The kernels in their interpreters (jitted), with and without x64, against the XLA path."""

    @chex.variants(with_jit=True)
    @parameterized.named_parameters(*X64)
    def test_kda_tpu_kernel(self, x64):
        with jax.enable_x64(x64):
            q, k, v, g, beta, s0 = kda_inputs(0, 1, 40, 2, 8, 8, dtype=jnp.float32)
            got = self.variant(lambda *a: chunk_kda(*a, initial_state=s0, output_final_state=True,
                                                    implementation="pallas", interpret=True, chunk_size=16))(
                q, k, v, g, beta)
            want = chunk_kda_reference(q, k, v, g, beta, initial_state=s0)
            chex.assert_trees_all_equal_shapes_and_dtypes(got, want)
            chex.assert_trees_all_close(got, want, **F32)

    @chex.variants(with_jit=True)
    @parameterized.named_parameters(*X64)
    def test_mla_gpu_kernel(self, x64):
        with jax.enable_x64(x64):
            args = [_normal(i, s, jnp.bfloat16) for i, s in enumerate([(1, 24, 2, 16), (1, 24, 2, 8),
                                                                       (1, 24, 2, 16), (1, 24, 8), (1, 24, 2, 16)])]
            o, _ = self.variant(lambda *a: mla_attention(*a, scale=0.2, implementation="pallas", interpret=True))(*args)
            want, _ = mla_attention_reference(*[a.astype(jnp.float32) for a in args], None, scale=0.2)
            chex.assert_shape(o, (1, 24, 2, 16))
            chex.assert_trees_all_close(o.astype(jnp.float32), want, **BF16)

    @chex.variants(with_jit=True)
    def test_grouped_matmul_kernels_agree_across_x64(self):
        """Both backends' kernels, forward and both gradients: the same bits with x64 off and on,
        and the dense reference's values (the backward runs the transposed gmm and the tgmm)."""
        lhs, rhs = random_gmm_inputs(0, 40, 32, 48, 4, jnp.bfloat16)
        f32 = lambda x: x.astype(jnp.float32)
        want = jax.value_and_grad(lambda a, b: jnp.sum(jnp.sin(grouped_matmul_dense(a, b, jnp.asarray(GROUPS)))),
                                  argnums=(0, 1))(f32(lhs), f32(rhs))
        for backend in ("tpu", "gpu"):
            gmm = lambda a, b: grouped_matmul(a, b, GROUPS, implementation="pallas", interpret=True,
                                              kernel_backend=backend)
            run = self.variant(jax.value_and_grad(lambda a, b: jnp.sum(jnp.sin(f32(gmm(a, b)))), argnums=(0, 1)))
            got = []
            for x64 in (False, True):
                with _x64_globally(x64):
                    got.append(jax.block_until_ready(run(lhs, rhs)))
            chex.assert_trees_all_equal(got[0], got[1])
            chex.assert_trees_all_equal_dtypes(got[0], (jnp.float32, (jnp.bfloat16, jnp.bfloat16)))
            chex.assert_trees_all_close(jax.tree.map(f32, got[0]), want, **BF16)


    @chex.variants(with_jit=True)
    def test_head_ce_gpu_kernel_agrees_across_x64(self):
        """The head logits kernel: the same bits with x64 off and on, and the XLA path's values."""
        f, w = _normal(0, (100, 128), jnp.bfloat16), _normal(1, (128, 512), jnp.bfloat16)
        run = self.variant(lambda a, b: chunk_logits_lse(a, b, implementation="pallas", interpret=True))
        got = []
        for x64 in (False, True):
            with _x64_globally(x64):
                got.append(jax.block_until_ready(run(f, w)))
        chex.assert_trees_all_equal(got[0], got[1])
        chex.assert_trees_all_equal_dtypes(got[0], (jnp.float32, jnp.float32))
        chex.assert_trees_all_close(got[0], chunk_logits_lse_reference(f, w), **F32)


@pytest.mark.gpu
def test_compiled_grouped_matmul_agrees_across_x64():
    """On the GPU: the compiled kernels (forward, input and weight gradients) give the same bits
    with x64 off and on."""
    lhs, rhs = random_gmm_inputs(0, 1000, 512, 768, 8, jnp.bfloat16)
    groups = np.asarray([300, 0, 1, 255, 128, 0, 200, 80], np.int32)  # 36 rows past the groups
    run = jax.jit(jax.value_and_grad(
        lambda a, b: jnp.sum(jnp.sin(grouped_matmul(a, b, groups, implementation="pallas").astype(jnp.float32))),
        argnums=(0, 1)))
    got = []
    for x64 in (False, True):
        with _x64_globally(x64):
            got.append(jax.block_until_ready(run(lhs, rhs)))
    chex.assert_trees_all_equal(got[0], got[1])
