"""Decoding with the layer inputs' mix and norm inside their projections' kernel (``k3jax.layers.mixed_input``,
``ModelConfig.decode_glue_implementation``): the same step as XLA's path, every projection that reads a
normed input routed to the kernel, the stream's add inside it, and the switch's errors.

On CPU the kernel runs in the Pallas interpreter (``kernel_runs`` forced, ``interpret=True``)."""

import collections
import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import k3jax.layers.block as block
import k3jax.layers.kda as kda
import k3jax.layers.moe as moe
import k3jax.model as model
from k3jax import config
from k3jax.infer.cache import init_cache
from k3jax.infer.decode import decode_layout, forward_cached, prefill
from k3jax.layers import linear, mixed_input
from k3jax.model import Transformer
from pallas_kernels.target import Target, compile_for
from sharding import use_mesh


@pytest.fixture(scope="module")
def decoding():
    """tiny() after an 8-token prompt on decode_layout's tree, and the next token."""
    cfg = config.tiny()
    tokens = jax.random.randint(jax.random.key(1), (1, 9), 0, cfg.vocab_size)
    variables = nn.meta.unbox(Transformer(cfg).init(jax.random.key(0), tokens))
    variables, cfg = decode_layout({k: variables[k] for k in ("params", "balance")}, cfg)
    _, cache = prefill(variables, cfg, tokens[:, :8], jnp.array([8]), init_cache(cfg, 1, 16))
    return variables, cfg, cache, tokens[:, 8:]


def _interpreted(monkeypatch, drop=None, tokens=False):
    """Force the kernel path (interpreted); count its calls by (width, weights, epilogue, addends, with a
    gate)."""
    calls = collections.Counter()
    run = mixed_input.kernel_gpu.mixed_matvec

    def counted(sources, mix, scale, weights, **kw):
        calls[(sources[0].shape[-1], len(weights), kw.get("epilogue"), len(kw.get("addends", ())),
               kw.get("gate") is not None)] += 1
        return run(sources, mix, scale, weights, **kw)

    def lazy_input(mix, norm, stream, addends=()):
        if drop == "mixer":  # the feed-forward's input without the mixer's output
            addends = ()
        if drop == "ffn" and stream.last:  # the next layer's input without the feed-forward's outputs
            stream = stream.replace(last=stream.last[:1])
        return mixed_input.mixed_input(mix, norm, stream, addends, interpret=True)

    monkeypatch.setattr(mixed_input.kernel_gpu, "mixed_matvec", counted)
    monkeypatch.setattr(block, "kernel_runs", lambda implementation: True)
    monkeypatch.setattr(moe, "kernel_runs", lambda implementation: True)
    monkeypatch.setattr(kda, "kernel_runs", lambda implementation: True)
    monkeypatch.setattr(kda, "normed_input", functools.partial(mixed_input.normed_input, interpret=True))
    monkeypatch.setattr(kda, "fused_step", functools.partial(kda.fused_step, interpret=True))
    monkeypatch.setattr(block, "mixed_input", lazy_input)
    monkeypatch.setattr(model, "kernel_runs", lambda implementation: True)
    monkeypatch.setattr(model, "mixed_input", lazy_input)
    monkeypatch.setattr(moe, "normed_input", functools.partial(mixed_input.normed_input, interpret=True))
    # token_matmul at 5-64 rows of plain inputs (a MixedInput's take it wherever the glue kernels run)
    monkeypatch.setattr(linear, "kernel_runs", lambda implementation: tokens)
    return calls


def test_decode_step_matches_the_xla_path(decoding, monkeypatch):
    """tiny() (6 layers: the first a dense MLP, 5 MoE; every layer two mixing points): per layer the mixer's
    packed inputs (the previous layer's output added inside) and the feed-forward's inputs (the mixer's
    output added inside) — the router with its sigmoid, the latent down_proj, the shared experts' gate
    and up with the activation (the dense layer's MLP alike) — the latent norm before each up_proj and
    each KDA layer's per-head output norm and gate before o_proj. The logits equal XLA's path's to
    float32 rounding."""
    variables, cfg, cache, token = decoding
    want, _ = forward_cached(variables, cfg, token, cache)
    calls = _interpreted(monkeypatch)
    got, _ = forward_cached(variables, cfg, token, cache)
    D, L = cfg.hidden, cfg.moe.latent_dim
    HK = cfg.kda.num_heads * cfg.kda.head_dim
    assert calls == {(D, 1, None, 0, False): 1,  # layer 0's input: the embedding alone
                     (D, 1, None, 2, False): 4,  # the next MoE layers' inputs: the routed and shared outputs added
                     (D, 1, None, 1, False): 6,  # layer 1's input (the dense MLP's output added), down_proj
                     (D, 1, "sigmoid", 1, False): 5,  # the router (the mixer's output added)
                     (D, 2, None, 1, False): 6,  # the shared experts' (and the dense MLP's) gate and up
                     (L, 1, None, 0, False): 5,  # the latent norm and up_proj
                     (HK, 1, None, 0, True): 4}  # KDA's per-head output norm and gate, o_proj
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_the_heads_input_is_one_norm_kernel(decoding, monkeypatch):
    """At batch 1 too the head's input (the output mix over every block, the final norm, the last MoE layer's
    routed and shared outputs added inside) is one ``mixed_norm`` kernel before XLA's product; without the
    glue kernels (``return_hidden``, which needs the mix itself) the head is XLA's alone. Same logits."""
    variables, cfg, cache, token = decoding
    want, _ = forward_cached(variables, cfg, token, cache)
    _interpreted(monkeypatch)
    norms = []
    run = mixed_input.kernel_gpu.mixed_norm

    def counted(sources, mix, scale, **kw):
        norms.append((len(sources), len(kw.get("addends", ()))))
        return run(sources, mix, scale, **kw)

    monkeypatch.setattr(mixed_input.kernel_gpu, "mixed_norm", counted)
    got, _ = forward_cached(variables, cfg, token, cache)
    assert norms == [(cfg.num_attn_res_blocks + 1, 2)]  # every stored block and the partial sum
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    norms.clear()
    forward_cached(variables, cfg, token, cache, return_hidden=True)
    assert not norms


@pytest.mark.parametrize("drop", ["mixer", "ffn"])
def test_the_adds_inside_the_kernel_are_checked(decoding, monkeypatch, drop):
    """The test above fails for kernels that mix the stream without the outputs just added to it: the
    mixer's (the feed-forward's input) or the feed-forward's (``ResidualStream.last``, the next layer's)."""
    variables, cfg, cache, token = decoding
    want, _ = forward_cached(variables, cfg, token, cache)
    _interpreted(monkeypatch, drop)
    got, _ = forward_cached(variables, cfg, token, cache)
    assert np.max(np.abs(np.asarray(got) - np.asarray(want))) > 1e-3


def test_batch_8_takes_the_norm_and_token_kernels(monkeypatch):
    """Above the matvec kernel's 4 tokens the normed input is one ``mixed_norm`` kernel a mixing point (the
    outputs just added to the stream added inside) and the 16-bit projections, of it and of plain inputs,
    are ``token_matmul`` kernels (an MLP's gate and up one kernel with the activation; the float32 router
    stays XLA's): same logits."""
    cfg = config.tiny()
    tokens = jax.random.randint(jax.random.key(2), (8, 9), 0, cfg.vocab_size)
    variables = nn.meta.unbox(Transformer(cfg).init(jax.random.key(0), tokens))
    variables, cfg = decode_layout({k: variables[k] for k in ("params", "balance")}, cfg)
    _, cache = prefill(variables, cfg, tokens[:, :8], jnp.full((8,), 8), init_cache(cfg, 8, 16))
    want, _ = forward_cached(variables, cfg, tokens[:, 8:], cache)
    calls = _interpreted(monkeypatch, tokens=True)
    norms = collections.Counter()
    run = mixed_input.kernel_gpu.mixed_norm

    def counted(sources, mix, scale, **kw):
        norms[(len(sources), len(kw.get("addends", ())), kw.get("gate") is not None)] += 1
        return run(sources, mix, scale, **kw)

    products = collections.Counter()
    run_tokens = mixed_input.kernel_gpu_tokens.token_matmul

    def counted_tokens(x, weights, **kw):
        products[(x.shape[-1], weights[0].shape[0], len(weights))] += 1
        return run_tokens(x, weights, **{**kw, "interpret": True})

    monkeypatch.setattr(mixed_input.kernel_gpu, "mixed_norm", counted)
    monkeypatch.setattr(mixed_input.kernel_gpu_tokens, "token_matmul", counted_tokens)
    got, _ = forward_cached(variables, cfg, tokens[:, 8:], cache)
    assert not calls  # no matvec kernel at 8 tokens
    by_kind = collections.Counter()
    for (_, adds, gated), n in norms.items():
        by_kind[adds, gated] += n
    # (run eagerly, each reader materializes its input: one kernel a reader) layer 0's input (the latent
    # norms are the dense path's: in its combine, moe_decode.routed_experts(norm_scale=)); KDA's output norms;
    # the feed-forwards' inputs (the mixer's output added: router, down_proj, the shared experts' gate and up
    # together, the dense MLP's gate and up); the layer inputs after a MoE layer and the head's (its two outputs)
    assert by_kind == {(0, False): 1, (0, True): 4, (1, False): 17, (2, False): 7}
    # tiny(): up_proj (latent 32 -> 64) and down_proj (64 -> 32) in each of the 5 MoE layers, the shared
    # experts' gate and up (64 -> 2 x 32) there and the dense MLP's (64 -> 96) in layer 0, KDA's o_proj
    # (4 heads x 16 -> 64) in its 4 layers, MLA's packed q_a and kv_a (64 -> 24 + 16 + 8, padded to 64) in its
    # 2, KDA's packed inputs (64 -> 276, padded to 288: ``linear.PACKED_ROWS``) in its 4; of plain inputs
    # (``Proj``): the shared experts' down (2 x 32 -> 64) in 5 layers, MLA's o_proj (4 x 16 -> 64) in 2, the
    # dense MLP's down (96 -> 64); MLA's q_b (not stored output axis first) stays XLA's
    assert products == {(32, 64, 1): 5, (64, 32, 1): 5, (64, 64, 2): 5, (64, 96, 2): 1, (64, 64, 1): 4 + 5 + 2 + 2,
                        (64, 288, 1): 4, (96, 64, 1): 1}
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_the_switch():
    """None: the kernels where a CUDA GPU compiles, never on a CPU; "xla": never; off a mesh
    only; "pallas" without a CUDA GPU and unknown values: errors naming the field."""
    with compile_for(Target("gpu", "NVIDIA H200", cuda=True)):
        assert mixed_input.kernel_runs(None) and mixed_input.kernel_runs("pallas")
        assert not mixed_input.kernel_runs("xla")
        mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]), ("data",))
        with use_mesh(mesh):  # sharded decoding stays on XLA
            assert not mixed_input.kernel_runs(None)
    with compile_for("cpu"):
        assert not mixed_input.kernel_runs(None)
        with pytest.raises(ValueError, match="decode_glue_implementation='pallas' needs a CUDA GPU"):
            mixed_input.kernel_runs("pallas")
    with pytest.raises(ValueError, match="decode_glue_implementation='triton' must be one of"):
        dataclasses.replace(config.tiny(), decode_glue_implementation="triton")
