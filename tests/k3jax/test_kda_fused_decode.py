"""Decoding with KDA's fused step (``KDA._fused_step``, ``ModelConfig.decode_glue_implementation``): the
kernel's reference is the layer's own XLA step bit for bit, the kernel (CPU interpreter) gives the same
logits and caches, ragged rows included, and it runs only where it should.

``kernel_runs`` is forced on (as on a CUDA GPU) and the kernels run interpreted; the comparison path is
the same layer with the fused step off (``MAX_FUSED_TOKENS`` 0), so both share KDA's output norm kernel."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import k3jax.layers.kda as kda
from k3jax import config
from k3jax.infer.cache import init_cache
from k3jax.infer.decode import decode_layout, forward_cached, prefill
from k3jax.layers import mixed_input
from k3jax.model import Transformer
from pallas_kernels.kda import kernel_gpu_decode
from pallas_kernels.kda.reference_decode import fused_step_reference


@pytest.fixture(scope="module")
def decoding():
    """tiny() (4 KDA layers of 4 heads) after 8-token prompts of 2 rows on decode_layout's tree, and 3 more
    tokens a row."""
    cfg = config.tiny()
    tokens = jax.random.randint(jax.random.key(3), (2, 11), 0, cfg.vocab_size)
    variables = nn.meta.unbox(Transformer(cfg).init(jax.random.key(0), tokens))
    variables, cfg = decode_layout({k: variables[k] for k in ("params", "balance")}, cfg)
    _, cache = prefill(variables, cfg, tokens[:, :8], jnp.array([8, 8]), init_cache(cfg, 2, 16))
    return variables, cfg, cache, tokens[:, 8:]


def _step(monkeypatch, decoding, step, tokens, num_new=None, fused=True):
    """One forward_cached call with the KDA kernels on: ``step`` as the fused step (None: the step off)."""
    variables, cfg, cache, _ = decoding
    calls = []

    def counted(*args, **kw):
        calls.append(args[0].shape)
        return step(*args, **kw)

    with monkeypatch.context() as m:
        m.setattr(kda, "kernel_runs", lambda implementation: True)
        m.setattr(kda, "normed_input", functools.partial(mixed_input.normed_input, interpret=True))
        m.setattr(kda, "fused_step", counted)
        if not fused:
            m.setattr(kernel_gpu_decode, "MAX_FUSED_TOKENS", 0)
        out = forward_cached(variables, cfg, tokens, cache, num_new=num_new)
    return out, calls


def _kernel(*args, **kw):
    return kernel_gpu_decode.fused_step_pallas(*args, **kw, interpret=True)


def _leaves(tree):
    return [np.asarray(x, np.float32) for x in jax.tree.leaves(tree)]


@pytest.mark.parametrize("T,num_new", [(1, None), (3, [3, 1])])
def test_reference_is_the_layers_step(decoding, monkeypatch, T, num_new):
    """The reference, in the layer's place, changes nothing: logits and every cache leaf bit for bit."""
    tokens = decoding[3][:, :T]
    num_new = None if num_new is None else jnp.array(num_new)
    want, none = _step(monkeypatch, decoding, None, tokens, num_new, fused=False)
    got, calls = _step(monkeypatch, decoding, fused_step_reference, tokens, num_new)
    assert not none and len(calls) == 4  # every KDA layer of tiny()
    for a, b in zip(_leaves(got), _leaves(want)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("T,num_new", [(1, None), (3, [3, 1])])
def test_kernel_step_matches_the_layers_step(decoding, monkeypatch, T, num_new):
    """The kernel in the layer: logits to float32 rounding, states to F32 tolerance, conv tails exact
    (ragged: the second row's tokens past its first leave its state and tails as after one token)."""
    tokens = decoding[3][:, :T]
    num_new = None if num_new is None else jnp.array(num_new)
    (want, want_cache), _ = _step(monkeypatch, decoding, None, tokens, num_new, fused=False)
    (got, got_cache), calls = _step(monkeypatch, decoding, _kernel, tokens, num_new)
    assert len(calls) == 4
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    for a, b in zip(_leaves(got_cache), _leaves(want_cache)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("states,product", [(256, True), (2 * 4, False)])
def test_from_enough_states_the_product_comes_first(decoding, monkeypatch, states, product):
    """Below ``FUSED_PRODUCT_STATES`` (sequence, head) states the kernel multiplies ``f_a`` by ``W_fb`` itself;
    from there (tiny(): 2 rows x 4 heads) it takes XLA's product ``z [B, T, H, K]``. Both give the layer's step."""
    tokens = decoding[3][:, :1]
    (want, want_cache), _ = _step(monkeypatch, decoding, None, tokens, fused=False)
    monkeypatch.setattr(kernel_gpu_decode, "FUSED_PRODUCT_STATES", states)
    decays = []

    def kernel(*args, **kw):
        decays.append(args[3].ndim)
        return _kernel(*args, **kw)

    (got, got_cache), _ = _step(monkeypatch, decoding, kernel, tokens)
    assert decays == [3 if product else 4] * 4
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    for a, b in zip(_leaves(got_cache), _leaves(want_cache)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_off_by_default_and_past_its_tokens(decoding, monkeypatch):
    """Off a CUDA GPU (here: the CPU, whatever ``decode_glue_implementation`` defaults to) the step never takes
    the kernel, nor with more new tokens than ``MAX_FUSED_TOKENS`` (the layer's own path then runs, its
    parameters declared once)."""
    variables, cfg, cache, tokens = decoding
    with monkeypatch.context() as m:
        m.setattr(kda, "fused_step", lambda *a, **k: pytest.fail("the fused step ran"))
        forward_cached(variables, cfg, tokens[:, :1], cache)
    monkeypatch.setattr(kernel_gpu_decode, "MAX_FUSED_TOKENS", 2)
    (want, _), _ = _step(monkeypatch, decoding, None, tokens, fused=False)
    (got, _), calls = _step(monkeypatch, decoding, _kernel, tokens)
    assert not calls
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
