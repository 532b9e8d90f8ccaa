"""The MLA flash kernels against the dense reference: interpreted on CPU (default run), compiled on GPU.

Outputs and gradients within the bf16 tolerances; ``max_logit`` to fp32 rounding (both sides form
the same bf16 products, exact in fp32, and differ only in summation order). Packed documents
(a reused segment id too), lengths off the block grid, head widths off the power-of-two grid and
no rope slice at all.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.mla_attention import BlockSizes, mla_attention, mla_attention_reference
from tests.tolerances import BF16_FWD_RTOL, BF16_GRAD_RTOL, F32_RTOL, rel_rmse

# the Triton kernels at small tiles (the Mosaic GPU forward has its own tests: test_kernel_fwd.py)
SMALL_BLOCKS = BlockSizes(block_q=32, block_k=16, block_q_dkv=16, block_k_dkv=32, block_q_dq=32, block_k_dq=16,
                          mosaic_forward=False)


def _inputs(B, T, H, N, R, V, seed=0):
    ks = jax.random.split(jax.random.key(seed), 6)
    shapes = [(B, T, H, N), (B, T, H, R), (B, T, H, N), (B, T, R), (B, T, H, V), (B, T, H, V)]
    qn, qr, kn, kr, v, w = (jax.random.normal(k, s, jnp.float32) for k, s in zip(ks, shapes))
    return [x.astype(jnp.bfloat16) for x in (qn, qr, kn, kr, v)], w


def _packed(B, T):
    """Documents of several lengths per row; row 1 reuses id 3 in two separate runs."""
    cuts = [[0, T // 3, T // 3 + 5, T], [0, 7, T // 2, T - 3, T]]
    seg = np.zeros((B, T), np.int32)
    for b in range(B):
        c = cuts[b % 2]
        for d in range(len(c) - 1):
            seg[b, c[d]:c[d + 1]] = [3, 9, 3, 4][d] if b % 2 else d
    return jnp.asarray(seg)


def _check(args, w, seg, scale, **kw):
    kernel = lambda *a: mla_attention(*a, seg, scale=scale, implementation="pallas", **kw)
    ref = lambda *a: mla_attention(*a, seg, scale=scale, implementation="xla")
    (o, mx), (ro, rmx) = kernel(*args), ref(*args)
    assert o.dtype == args[0].dtype and mx.shape == (args[0].shape[2],)  # o rounded once to the inputs' dtype
    assert rel_rmse(o, ro) <= BF16_FWD_RTOL
    assert rel_rmse(mx, rmx) <= F32_RTOL
    loss = lambda f: (lambda *a: jnp.sum(f(*a)[0] * w))
    grads = jax.grad(loss(kernel), argnums=range(5))(*args)
    ref_grads = jax.grad(loss(ref), argnums=range(5))(*args)
    for name, g, rg in zip(("q_nope", "q_rope", "k_nope", "k_rope", "v"), grads, ref_grads):
        assert g.dtype == jnp.bfloat16 and g.shape == rg.shape, name
        assert rel_rmse(g, rg) <= BF16_GRAD_RTOL, name


@pytest.mark.parametrize("T,N,R,V,packed", [(64, 16, 16, 16, True), (37, 16, 8, 24, True), (40, 16, 0, 16, False)])
def test_interpreted_kernel_matches_reference(T, N, R, V, packed):
    args, w = _inputs(2, T, 2, N, R, V)
    seg = _packed(2, T) if packed else None
    _check(args, w, seg, 0.3, interpret=True, blocks=SMALL_BLOCKS)


def test_interpreted_kernel_full_tiles_of_other_documents_stay_masked():
    """Documents aligned to the blocks: whole key blocks of one document lie causally before whole
    query blocks of another (the skip-the-mask test must see the documents differ) and of the same
    document (the mask is skipped); against the reference, values and gradients."""
    T = 128
    args, w = _inputs(2, T, 2, 16, 16, 16, seed=3)
    seg = jnp.asarray(np.repeat([[0, 0, 1, 1, 1, 2, 2, 2], [5, 5, 5, 5, 5, 5, 9, 9]], 16, axis=1), jnp.int32)
    _check(args, w, seg, 0.3, interpret=True, blocks=SMALL_BLOCKS)


def test_interpreted_kernel_skips_the_blocks_of_other_documents():
    """Two block-aligned documents with NaN in the first one's keys and values (forward) and in the
    second one's output cotangent (backward): a loop that visited the other document's blocks and
    masked them would form 0·NaN; the document bounds skip them, so each document's results equal
    those of the document alone."""
    T, half = 128, 64
    args, w = _inputs(1, T, 2, 16, 16, 16, seed=5)
    seg = jnp.asarray(np.repeat([[1, 2]], half, axis=1), jnp.int32)
    kernel = lambda *a: mla_attention(*a, seg, scale=0.3, implementation="pallas", interpret=True, blocks=SMALL_BLOCKS)
    alone = lambda *a: mla_attention(*a, scale=0.3, implementation="xla")
    first, second = (slice(None, half), slice(half, None))
    poisoned = [x.at[:, first].set(jnp.nan) if i in (2, 3, 4) else x for i, x in enumerate(args)]
    o = kernel(*poisoned)[0]
    assert rel_rmse(o[:, second], alone(*(x[:, second] for x in args))[0]) <= BF16_FWD_RTOL
    w_nan = w.at[:, second].set(jnp.nan)
    grads = jax.grad(lambda *a: jnp.sum(kernel(*a)[0] * w_nan), argnums=(2, 3, 4))(*args)
    want = jax.grad(lambda *a: jnp.sum(alone(*a)[0] * w[:, first]), argnums=(2, 3, 4))(*(x[:, first] for x in args))
    for name, g, rg in zip(("k_nope", "k_rope", "v"), grads, want):
        assert rel_rmse(g[:, first], rg) <= BF16_GRAD_RTOL, name


def test_max_logit_is_the_visible_maximum():
    """A huge logit placed on a key that only a later document's queries could see if unmasked."""
    args, _ = _inputs(1, 32, 2, 16, 16, 16, seed=1)
    seg = jnp.asarray([[0] * 16 + [1] * 16], jnp.int32)
    qn, qr, kn, kr, v = args
    qn = qn.at[0, 20, 1].set(8.0)
    kn = kn.at[0, 3, 1].set(8.0)  # key 3 is in document 0: invisible from query 20 (document 1)
    kn = kn.at[0, 25, 1].set(8.0)  # key 25 is after query 20: invisible too
    _, mx = mla_attention(qn, qr, kn, kr, v, seg, scale=0.1, implementation="pallas", interpret=True,
                          blocks=SMALL_BLOCKS)
    _, ref = mla_attention_reference(qn, qr, kn, kr, v, seg, scale=0.1)
    assert rel_rmse(mx, ref) <= F32_RTOL
    _, leaky = mla_attention_reference(qn, qr, kn, kr, v, None, scale=0.1)
    assert float(leaky[1]) > float(ref[1]) + 1.0  # the check above would catch a leaked document


@pytest.mark.unchecked
def test_switch_errors():
    args, _ = _inputs(1, 16, 2, 16, 16, 16)
    with pytest.raises(ValueError, match="implementation must be one of"):
        mla_attention(*args, scale=1.0, implementation="cudnn")
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        mla_attention(*[a.astype(jnp.float32) for a in args], scale=1.0, implementation="pallas", interpret=True)
    if jax.default_backend() == "cpu":
        with pytest.raises(ValueError, match="needs a CUDA GPU"):
            mla_attention(*args, scale=1.0, implementation="pallas")
    with pytest.raises(ValueError, match="k_rope must have shape"):
        mla_attention(args[0], args[1], args[2], args[3][:, :8], args[4], scale=1.0)
    with pytest.raises(ValueError, match="segment_ids must have shape"):
        mla_attention(*args, jnp.zeros((1, 8), jnp.int32), scale=1.0)


def test_default_picks_reference_off_gpu():
    args, _ = _inputs(1, 16, 2, 16, 16, 16)
    if jax.default_backend() == "cpu":
        got = mla_attention(*args, scale=0.5)
        want = mla_attention(*args, scale=0.5, implementation="xla")
        assert all(np.array_equal(a, b) for a, b in zip(got, want))


@pytest.mark.gpu
@pytest.mark.parametrize("packed", [False, True])
def test_compiled_kernel_matches_reference(packed):
    args, w = _inputs(2, 1024, 4, 128, 64, 128)
    _check(args, w, _packed(2, 1024) if packed else None, 192 ** -0.5)


@pytest.mark.gpu
def test_compiled_kernel_odd_shapes():
    args, w = _inputs(2, 300, 2, 16, 8, 24)
    _check(args, w, _packed(2, 300), 0.3)
