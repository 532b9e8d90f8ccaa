"""The mixed matvec kernel and the norm kernel (``pallas_kernels/mix_matvec/kernel_gpu.py``) against their
reference, interpreted on CPU (and compiled on the GPU), the reference against the model's own mix and norm,
and the errors.

The kernel rounds where the reference does (the partial sum plus its addends, the mix, the norm, the
products' or the activation's output), so the two differ only where another float32 summation order
flips a rounding: by one ulp of the output dtype, relative to the row's largest output."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from k3jax.layers.mixed_input import MixedInput
from pallas_kernels.mix_matvec.kernel_gpu import MatvecTiles, mixed_matvec, mixed_norm
from pallas_kernels.mix_matvec.reference import mixed_input, mixed_matvec_reference

BF16_ULP = 2.0 ** -7
ACT = (("activation", "situ"), ("situ_beta", 4.0), ("situ_linear_beta", 25.0))


def _inputs(seed, T, D, N, n_src, n_w=1, proj=jnp.bfloat16, addend=0, group=None, gate=False):
    rng = np.random.default_rng(seed)
    bf = jnp.bfloat16
    sources = tuple(jnp.asarray(rng.normal(size=(T, D)) * (n + 1), bf) for n in range(n_src))
    mix = ((jnp.asarray(rng.normal(size=D) * 0.3, bf), jnp.asarray(1 + 0.1 * rng.normal(size=D), bf))
           if n_src > 1 else ())
    scale = jnp.asarray(1 + 0.1 * rng.normal(size=group or D), jnp.float32 if group else bf)
    weights = tuple(jnp.asarray(rng.normal(size=(N, D)) * D ** -0.5, proj) for _ in range(n_w))
    add = tuple(jnp.asarray(rng.normal(size=(T, D)), bf) for _ in range(int(addend)))  # 2: routed + shared
    logits = jnp.asarray(rng.normal(size=(T, D)) * 2, bf) if gate else None
    return sources, mix, scale, weights, add, logits


def _run(args, proj=jnp.bfloat16, out=None, epilogue=None, tiles=MatvecTiles(), interpret=True):
    sources, mix, scale, weights, add, gate = args
    kw = dict(dtype=jnp.bfloat16, proj_dtype=proj, out_dtype=out, epilogue=epilogue, addends=add, gate=gate)
    got = mixed_matvec(sources, mix, scale, weights, mix_eps=1e-5, norm_eps=1e-5, tiles=tiles, interpret=interpret,
                       activation=ACT if len(weights) == 2 else None, **kw)
    want = mixed_matvec_reference(sources, mix, 1e-5, scale, 1e-5, weights, activation=dict(ACT), **kw)
    return got, want


def _assert_close(got, want, ulp=BF16_ULP):
    assert got.dtype == want.dtype and got.shape == want.shape
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    bound = ulp * (np.abs(want) + np.max(np.abs(want), axis=-1, keepdims=True))
    assert np.all(np.abs(got - want) <= bound), np.max(np.abs(got - want) / bound)


@pytest.mark.parametrize("T,D,N,n_src,n_w,addend,group", [
    (1, 64, 48, 3, 1, False, None),  # a KDA layer's packed inputs: one token, a mix of three sources
    (1, 96, 40, 5, 1, 1, None),  # D in three 32-column steps, N in 8-column blocks, the stream's add inside
    (2, 64, 32, 2, 2, 2, None),  # an MLP's gate and up with the activation; the MoE's two outputs added
    (4, 128, 16, 1, 1, False, None),  # one source: the norm only (the latent norm before up_proj)
    (2, 64, 16, 1, 1, False, 16),  # KDA's output: a norm per head of 16 and the output gate, then o_proj
    (1, 96, 16, 1, 1, False, 16),  # the same over three 32-column steps: the gate read a step at a time
])
def test_kernel_matches_reference(T, D, N, n_src, n_w, addend, group):
    got, want = _run(_inputs(T * 10 + n_src, T, D, N, n_src, n_w, addend=addend, group=group, gate=bool(group)))
    _assert_close(got, want)


def test_router_in_float32_with_its_sigmoid():
    proj = jnp.float32
    got, want = _run(_inputs(7, 1, 64, 16, 4, proj=proj), proj=proj, epilogue="sigmoid")
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-6, atol=2e-7)


@settings(max_examples=12, deadline=None)
@given(T=st.sampled_from([1, 2, 4]), n_src=st.integers(1, 5), D=st.sampled_from([32, 48, 64]),
       N=st.sampled_from([8, 16, 24]), n_w=st.integers(1, 2), addend=st.integers(0, 2), seed=st.integers(0, 99))
def test_property_kernel_equals_reference(T, n_src, D, N, n_w, addend, seed):
    """Any token count the kernel takes, any number of sources, step and block sizes that do not divide
    evenly into the defaults (D = 48: 16-column steps; N = 24: 8-column blocks)."""
    got, want = _run(_inputs(seed, T, D, N, n_src, n_w, addend=addend))
    _assert_close(got, want)


@settings(max_examples=8, deadline=None)
@given(T=st.integers(1, 9), n_src=st.integers(1, 4), addend=st.integers(0, 2), group=st.sampled_from([None, 16]),
       seed=st.integers(0, 99))
def test_property_norm_kernel_equals_reference(T, n_src, addend, group, seed):
    """``mixed_norm`` (the input alone, one program a token, any token count: batch 64's layer inputs)."""
    n_src, addend = (1, 0) if group else (n_src, addend)
    sources, mix, scale, _, add, gate = _inputs(seed, T, 64, 8, n_src, addend=addend, group=group, gate=bool(group))
    got = mixed_norm(sources, mix, scale, mix_eps=1e-5, norm_eps=1e-5, dtype=jnp.bfloat16, addends=add, gate=gate,
                     interpret=True)
    _assert_close(got, mixed_input(sources, mix, 1e-5, scale, 1e-5, jnp.bfloat16, add, gate))


@pytest.mark.parametrize("n_src,addend,group", [(1, 0, None), (3, 0, None), (3, 1, None), (3, 2, None), (1, 0, 16)])
def test_reference_is_the_models_mix_and_norm(n_src, addend, group):
    """The reference's input equals what the model computes without the kernel (``MixedInput.materialize``:
    ``attn_res_mix`` of the sources in float32, rounded, then ``rms_norm``; per head with the output gate,
    ``gated_rms_norm``), so the kernel's reference is the layer's own definition."""
    sources, mix, scale, _, add, gate = _inputs(3, 2, 64, 8, n_src, addend=addend, group=group, gate=bool(group))
    # [B, T, D] as the layers hold them; per head [B, T, H, G]
    tokens = lambda a: None if a is None else a.reshape((1, 2) + ((-1, group) if group else (-1,)))
    lazy = MixedInput(sources=tuple(map(tokens, sources)), mix=mix, mix_eps=1e-5, scale=scale, norm_eps=1e-6,
                      dtype=jnp.bfloat16, wide=jnp.float32, addends=tuple(map(tokens, add)), gate=tokens(gate))
    want = mixed_input(sources, mix, 1e-5, scale, 1e-6, jnp.bfloat16, add, gate)
    np.testing.assert_array_equal(np.asarray(lazy.materialize().reshape(want.shape), np.float32),
                                  np.asarray(want, np.float32))


@pytest.mark.unchecked
def test_bad_inputs_raise():
    sources, mix, scale, weights, _, _ = _inputs(0, 1, 64, 16, 2)
    call = lambda **kw: mixed_matvec(**{**dict(sources=sources, mix=mix, scale=scale, weights=weights, mix_eps=1e-5,
                                               norm_eps=1e-5, dtype=jnp.bfloat16, proj_dtype=jnp.bfloat16,
                                               interpret=True), **kw})
    with pytest.raises(ValueError, match="T .* a power of two <= 4, got 3"):
        call(sources=tuple(jnp.zeros((3, 64), jnp.bfloat16) for _ in range(2)))
    with pytest.raises(ValueError, match=r"sources\[1\].shape must equal"):
        call(sources=(sources[0], jnp.zeros((1, 32), jnp.bfloat16)))
    with pytest.raises(ValueError, match="mix must be the .query, key norm. pair"):
        call(mix=())
    with pytest.raises(ValueError, match=r"weights\[0\] must be \[N, D\] with D=64"):
        call(weights=(jnp.zeros((16, 32), jnp.bfloat16),))
    with pytest.raises(ValueError, match="epilogue must be one of"):
        call(weights=weights * 2, activation=ACT, epilogue="sigmoid")
    with pytest.raises(ValueError, match=r"addends\[1\] must match the partial sum"):
        call(addends=(jnp.zeros((1, 64), jnp.bfloat16), jnp.zeros((1, 64), jnp.float32)))
    with pytest.raises(ValueError, match="D=24 must be a multiple of 16"):
        call(sources=tuple(jnp.zeros((1, 24), jnp.bfloat16) for _ in range(2)), mix=(jnp.zeros(24),) * 2,
             scale=jnp.ones(24), weights=(jnp.zeros((16, 24), jnp.bfloat16),))
    with pytest.raises(ValueError, match="scale must be .D.=.64. .one norm over the row. or, for one source"):
        call(scale=jnp.ones(16))  # a norm per group needs a lone source
    with pytest.raises(ValueError, match="a norm per group of 24 needs the group a power of two"):
        call(sources=(jnp.zeros((1, 48), jnp.bfloat16),), mix=(), scale=jnp.ones(24),
             weights=(jnp.zeros((16, 48), jnp.bfloat16),))
    with pytest.raises(ValueError, match=r"gate must be \[T, D\]"):
        call(gate=jnp.zeros((1, 32), jnp.bfloat16))
    with pytest.raises(ValueError, match="takes bfloat16, float16 or float32 inputs, got int32"):
        call(weights=(jnp.zeros((16, 64), jnp.int32),))


@pytest.mark.gpu
@pytest.mark.parametrize("n_src,group", [(4, None), (1, 128)])
def test_compiled_norm_kernel_matches_reference(n_src, group):
    """``mixed_norm`` at small()'s batch 64: a layer input over four sources with the MoE's two outputs added,
    KDA's per-head output norm and gate."""
    sources, mix, scale, _, add, gate = _inputs(1, 64, 1024, 8, n_src, addend=2 if n_src > 1 else 0, group=group,
                                                gate=bool(group))
    got = jax.jit(lambda *a: mixed_norm(*a[:3], mix_eps=1e-5, norm_eps=1e-5, dtype=jnp.bfloat16, addends=a[3],
                                        gate=a[4]))(sources, mix, scale, add, gate)
    _assert_close(got, mixed_input(sources, mix, 1e-5, scale, 1e-5, jnp.bfloat16, add, gate))


@pytest.mark.gpu
@pytest.mark.parametrize("n_src,n_w,N,group", [(3, 1, 4232, None), (5, 2, 1024, None), (1, 1, 1024, None),
                                               (1, 1, 1024, 128)])
def test_compiled_kernel_matches_reference(n_src, n_w, N, group):
    """``small()``'s shapes on the GPU: a KDA layer's packed inputs, the shared experts' gate and up, the
    latent norm before up_proj (D = 512 there), KDA's per-head output norm and gate before o_proj."""
    args = _inputs(N, 1, 1024, N, n_src, n_w, addend=2 if n_src > 1 else 0, group=group, gate=bool(group))
    got, want = jax.jit(lambda a: _run(a, interpret=False))(args)
    _assert_close(got, want)


def test_the_matvec_runs_where_it_pays():
    """small()'s widest prologue (every stored block and the partial sum, 1024 wide, two addends) takes the
    matvec; K3's nine 7168-wide sources and its 12288-wide o_proj input with its gate do not (there XLA's
    kernels won on the H100: RESULTS.md, stop 54)."""
    from k3jax import config
    from pallas_kernels.mix_matvec.kernel_gpu import pays

    small = config.small()
    row = lambda d: jnp.zeros((1, d), jnp.bfloat16)
    assert pays((row(small.hidden),) * (small.num_attn_res_blocks + 1), (row(small.hidden),) * 2)
    assert not pays((row(7168),) * 9)
    assert not pays((row(12288),), gate=row(12288))
