"""The head logits + logsumexp-partials kernel, run by the GPU interpreter on CPU (the same tests run
compiled with -m gpu), and the loss it feeds against the XLA path.

Tolerances: with fp32 logits the kernel and XLA differ only in the order of fp32 sums (the matmul's
accumulation, the logsumexp's), so logits, logsumexp and loss agree to F32_RTOL. With bf16 logits
such a difference can move a logit across a bf16 rounding boundary (one bf16 ulp, 2^-8 relative,
on a few logits), the error of any bf16 storage: the bf16 kernel tolerances apply. The gradients
pass through ``softmax − onehot`` stored in bf16 on both paths, where the same boundary crossings
happen (on the GPU, not in the interpreter, whose matmul is XLA's): BF16_GRAD_RTOL for both.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import pytest

from k3jax.train.loss import head_cross_entropy
from pallas_kernels.head_ce import chunk_exponentials_lse, chunk_logits_lse, kernel_gpu, reference
from tests.tolerances import BF16_FWD_RTOL, BF16_GRAD_RTOL, F32_RTOL, rel_rmse

# The Pallas GPU interpreter imports the fuser on its first run (see tests/pallas_kernels/moe/conftest.py).
from jax.experimental.pallas import fuser  # noqa: F401, E402

# two row blocks, two D steps, three vocabulary blocks: 6 tiles over the interpreter's 2 SMs
SMALL = kernel_gpu.HeadTiling(tile_m=64, tile_n=64, tile_k=64, stages=2)
LOGITS_DTYPES = [jnp.float32, jnp.bfloat16]


def _features_head(c, d, v, scale=4.0):
    k = jax.random.split(jax.random.key(0), 2)
    f = jax.random.normal(k[0], (c, d)).astype(jnp.bfloat16)
    w = (jax.random.normal(k[1], (d, v)) * scale / d ** 0.5).astype(jnp.bfloat16)  # logits ~N(0, 16)
    return f, w


def _shift_labels(logits):
    """Random labels and shifts within 2 of each label's logit (row 3: +inf, a masked row)."""
    k = jax.random.split(jax.random.key(2), 2)
    c, v = logits.shape
    labels = jax.random.randint(k[0], (c,), 0, v)
    shift = logits[jnp.arange(c), labels].astype(jnp.float32) + jax.random.uniform(k[1], (c,), minval=-2, maxval=2)
    return labels, shift.at[3].set(jnp.inf)


def _loss_inputs(n, d, v):
    k = jax.random.split(jax.random.key(1), 2)
    f, w = _features_head(n, d, v)
    y = jax.random.randint(k[0], (1, n), 0, v)
    m = (jax.random.uniform(k[1], (1, n)) > 0.2).astype(jnp.float32)
    return f[None], w.astype(jnp.float32), y, m


class KernelCase:
    interpret = True
    tiling = SMALL
    c, d, v = 128, 128, 384
    loss_shape = (200, 128, 512)  # tokens (two chunks of 128, the second padded), D, V
    chunk = 128

    @pytest.mark.parametrize("logits_dtype", LOGITS_DTYPES)
    def test_kernel_equals_reference(self, logits_dtype):
        f, w = _features_head(self.c, self.d, self.v)
        got = kernel_gpu.logits_partials(f, w, logits_dtype=logits_dtype, tiling=self.tiling, interpret=self.interpret)
        want = reference.logits_partials(f, w, self.tiling.tile_n, logits_dtype)
        assert got[0].dtype == jnp.dtype(logits_dtype) and got[1].shape == (self.v // self.tiling.tile_n, self.c)
        tol = F32_RTOL if logits_dtype == jnp.float32 else BF16_FWD_RTOL
        for a, b in zip(got, want):
            assert rel_rmse(a.astype(jnp.float32), b.astype(jnp.float32)) < tol
        lse = reference.combine_partials(got[1], got[2])
        exact = jax.nn.logsumexp(got[0].astype(jnp.float32), axis=-1)  # of the logits as stored
        assert rel_rmse(lse, exact) < F32_RTOL

    @pytest.mark.parametrize("logits_dtype", LOGITS_DTYPES)
    def test_shifted_kernel_equals_reference(self, logits_dtype):
        """With a shift and labels: exp(x − shift) within a bf16 ulp of the reference, exact zeros at
        the labels and on a row shifted by +inf, the same partials as without."""
        f, w = _features_head(self.c, self.d, self.v)
        run = functools.partial(kernel_gpu.logits_partials, logits_dtype=logits_dtype, tiling=self.tiling,
                                interpret=self.interpret)
        # the same accumulation: the same rounded logits (ready before the next dispatch: on a
        # 2-core host the interpreter's callbacks and a queued XLA op can wait on each other)
        logits = jax.block_until_ready(run(f, w)[0].astype(jnp.float32))
        labels, shift = _shift_labels(logits)
        got = run(f, w, shift, labels)
        want = reference.shifted_exponentials(logits, shift, labels, jnp.float32)
        assert got[0].dtype == f.dtype and got[0].shape == (self.c, self.v)
        e = got[0].astype(jnp.float32)
        assert bool(jnp.all(jnp.abs(e - want) <= 2.0 ** -7 * want + 1e-30))
        assert bool(jnp.all(e[3] == 0.0)) and bool(jnp.all(e[jnp.arange(self.c), labels] == 0.0))
        _, pmax, psum = reference.logits_partials(f, w, self.tiling.tile_n, logits_dtype)
        tol = F32_RTOL if logits_dtype == jnp.float32 else BF16_FWD_RTOL
        assert rel_rmse(got[1], pmax) < tol and rel_rmse(got[2], psum) < tol

    @pytest.mark.parametrize("rows", [128, 100])  # 100: padded to the kernel's 128-row blocks
    def test_exponentials_op_equals_xla(self, rows):
        f, w = _features_head(rows, 128, 512)
        labels, shift = _shift_labels(reference.chunk_logits(f, w))
        got = chunk_exponentials_lse(f, w, shift, labels, implementation="pallas", interpret=self.interpret)
        want = chunk_exponentials_lse(f, w, shift, labels, implementation="xla")
        assert got[0].shape == (rows, 512) and got[1].shape == got[2].shape == (rows,)
        assert rel_rmse(got[0].astype(jnp.float32), want[0].astype(jnp.float32)) < BF16_FWD_RTOL
        assert rel_rmse(got[1], want[1]) < F32_RTOL and rel_rmse(got[2], want[2]) < F32_RTOL

    @pytest.mark.parametrize("rows", [128, 100])  # 100: padded to the kernel's 128-row blocks
    def test_op_equals_xla(self, rows):
        f, w = _features_head(rows, 128, 512)
        got = chunk_logits_lse(f, w, implementation="pallas", interpret=self.interpret)
        want = chunk_logits_lse(f, w, implementation="xla")
        assert got[0].shape == (rows, 512) and got[1].shape == (rows,)
        for a, b in zip(got, want):
            assert rel_rmse(a, b) < F32_RTOL

    @pytest.mark.parametrize("logits_dtype", [None, "bfloat16"])
    def test_loss_and_grads_equal_xla_path(self, logits_dtype):
        f, w, y, m = _loss_inputs(*self.loss_shape)

        def run(implementation):
            fn = lambda f, w: head_cross_entropy(f, w, y, m, self.chunk, logits_dtype, implementation, self.interpret)
            return jax.jit(jax.value_and_grad(fn, argnums=(0, 1)))(f, w)

        (v1, (df1, dw1)), (v0, (df0, dw0)) = run("pallas"), run("xla")
        fwd = F32_RTOL if logits_dtype is None else BF16_FWD_RTOL
        assert abs(float(v1 - v0)) < fwd * abs(float(v0))
        assert df1.dtype == df0.dtype == jnp.bfloat16 and dw1.dtype == dw0.dtype == jnp.float32
        assert rel_rmse(df1.astype(jnp.float32), df0.astype(jnp.float32)) < BF16_GRAD_RTOL
        assert rel_rmse(dw1, dw0) < BF16_GRAD_RTOL
        plain = jax.jit(lambda f, w: head_cross_entropy(f, w, y, m, self.chunk, logits_dtype, "pallas", self.interpret))
        assert abs(float(plain(f, w) - v0)) < fwd * abs(float(v0))  # the primal (no gradient) path


class TestGpuInterpret(KernelCase):
    pass


OPTIONS = {"chain_tiles": dict(chain_tiles=True), "overlap_wgmma": dict(overlap_wgmma=True),
           "epi_cols": dict(epi_cols=32)}


@pytest.mark.parametrize("option", sorted(OPTIONS))
@pytest.mark.parametrize("c, v", [(128, 384), (64, 256)])  # 3 tiles per SM (chained); 1 (unchained)
def test_tiling_options_equal_reference(option, c, v):
    tiling = dataclasses.replace(SMALL, **OPTIONS[option])
    f, w = _features_head(c, 128, v)
    got = kernel_gpu.logits_partials(f, w, logits_dtype=jnp.bfloat16, tiling=tiling, interpret=True)
    want = reference.logits_partials(f, w, tiling.tile_n, jnp.bfloat16)
    for a, b in zip(got, want):
        assert rel_rmse(a.astype(jnp.float32), b.astype(jnp.float32)) < BF16_FWD_RTOL
    if option == "chain_tiles":
        with pytest.raises(ValueError, match="chain_tiles needs D/tile_k a multiple of stages"):
            kernel_gpu.logits_partials(f, w, tiling=dataclasses.replace(tiling, stages=3), interpret=True)


@pytest.mark.parametrize("option", [None, *sorted(OPTIONS)])
def test_no_smem_race(option, monkeypatch):
    """The interpreter's race detector over the operand slots and the epilogue's two logits (or
    shifted exponentials) slots and partials rows per warpgroup, which the next tile's epilogue
    rewrites while earlier TMA stores may still read them (3 tiles per SM)."""
    from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import get_races

    from pallas_kernels.moe import kernel_gpu_base

    monkeypatch.setattr(kernel_gpu_base, "_DETECT_RACES", True)
    tiling = dataclasses.replace(SMALL, tile_m=128, tile_n=128, **OPTIONS.get(option, {}))
    f, w = _features_head(256, 128, 768)
    labels, shift = _shift_labels(reference.chunk_logits(f, w))
    for logits_dtype, shifted in ((jnp.float32, False), (jnp.bfloat16, False), (jnp.float32, True)):
        operands = (f, w, shift, labels) if shifted else (f, w)
        jax.block_until_ready(kernel_gpu.logits_partials(*operands, logits_dtype=logits_dtype, tiling=tiling,
                                                         interpret=True))
        assert not get_races().races_found, (logits_dtype, shifted)


def test_bad_arguments_are_named():
    f, w = _features_head(128, 96, 512)
    with pytest.raises(ValueError, match="D=96 must be a multiple of tile_k=64"):
        chunk_logits_lse(f, w, implementation="pallas", interpret=True)
    with pytest.raises(ValueError, match="Hopper GPU or interpret=True"):
        chunk_logits_lse(f, w, implementation="pallas")
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        chunk_logits_lse(f.astype(jnp.float32), w, implementation="pallas", interpret=True)
    with pytest.raises(ValueError, match="implementation='triton' must be one of"):
        head_cross_entropy(f[None], w, jnp.zeros((1, 128), jnp.int32), jnp.ones((1, 128)), 128, None, "triton")
    assert chunk_logits_lse(f, w)[1].shape == (128,)  # None: XLA where the kernel cannot run


@pytest.mark.gpu
class TestGpuCompiled(KernelCase):
    """Compiled for the GPU (``-m gpu``) at the default tiling and small()'s D; 132 SMs."""
    interpret = False
    tiling = kernel_gpu.HEAD_TILING
    c, d, v = 1024, 1024, 163840
    loss_shape = (5000, 1024, 16384)
    chunk = 4096
