"""The layers' math against direct numpy statements of SPEC §2-5, and per-family switches."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax import config
from k3jax.layers import KDA, MLA, MoE, attn_res_mix, causal_attention, decay_gate, l2_normalize, rms_norm, route
from k3jax.layers import mla as mla_lib
from k3jax.layers import rope
from k3jax.layers.attn_res import ResidualStream
from tests.tolerances import BF16_FWD_RTOL, F32_RTOL, rel_rmse

RNG = np.random.default_rng(0)


def test_rms_norm_and_l2_normalize():
    x = RNG.normal(size=(3, 5, 8)).astype(np.float32) * 1e-3
    w = RNG.uniform(0.5, 1.5, size=8).astype(np.float32)
    want = x / np.sqrt(np.mean(x.astype(np.float64) ** 2, -1, keepdims=True) + 1e-6) * w
    assert rel_rmse(rms_norm(jnp.asarray(x), jnp.asarray(w), 1e-6, jnp.float32), want) <= F32_RTOL
    want = x / np.sqrt(np.sum(x.astype(np.float64) ** 2, -1, keepdims=True) + 1e-6)  # eps inside the sqrt
    assert rel_rmse(l2_normalize(jnp.asarray(x), 1e-6), want) <= F32_RTOL


def _rms_norm_autodiff(x, w, eps, wide):
    xw = x.astype(wide)
    return xw * jax.lax.rsqrt(jnp.mean(jnp.square(xw), axis=-1, keepdims=True) + eps) * w.astype(wide)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_rms_norm_backward_matches_autodiff_and_keeps_one_row_copy(dtype):
    """The written-out backward equals autodiff of the formula (x and the scale), and what it keeps
    for the backward is ``x`` itself (an argument) and the per-row ``1/rms``: no fp32 row copies."""
    from jax._src.ad_checkpoint import saved_residuals

    x = jnp.asarray(RNG.normal(size=(2, 6, 16)) * 3, dtype)
    w = jnp.asarray(RNG.uniform(0.5, 1.5, size=16), dtype)
    dy = jnp.asarray(RNG.normal(size=(2, 6, 16)), jnp.float32)
    loss = lambda f: lambda x, w: jnp.sum(f(x, w, 1e-5, jnp.float32) * dy)
    got = jax.grad(loss(rms_norm), argnums=(0, 1))(x, w)
    want = jax.grad(loss(_rms_norm_autodiff), argnums=(0, 1))(x, w)
    for g, r in zip(got, want):
        assert g.dtype == r.dtype == dtype
        assert rel_rmse(np.asarray(g, np.float64), np.asarray(r, np.float64)) <= (F32_RTOL if dtype == jnp.float32 else 1e-2)
    np.testing.assert_array_equal(rms_norm(x, w, 1e-5, jnp.float32), _rms_norm_autodiff(x, w, 1e-5, jnp.float32))
    kept = [a.shape for a, why in saved_residuals(loss(rms_norm), x, w) if why.startswith("output of")]
    assert kept == [(2, 6, 1)]


def test_gated_rms_norm_equals_norm_then_gate_and_keeps_only_its_inputs():
    """``gated_rms_norm`` == the norm followed by ``sigmoid_gate`` (values bitwise, gradients to
    fp32 rounding), and its backward keeps only the arguments: no wide normed copy of ``x``."""
    from jax._src.ad_checkpoint import saved_residuals

    from k3jax.layers.gates import sigmoid_gate
    from k3jax.layers.norm import gated_rms_norm

    x = jnp.asarray(RNG.normal(size=(2, 6, 3, 16)) * 3, jnp.bfloat16)
    w = jnp.asarray(RNG.uniform(0.5, 1.5, size=16), jnp.float32)
    z = jnp.asarray(RNG.normal(size=(2, 6, 3, 16)), jnp.bfloat16)
    dy = jnp.asarray(RNG.normal(size=(2, 6, 3, 16)), jnp.float32)
    fused = lambda x, w, z: gated_rms_norm(x, w, z, 1e-5, jnp.float32, jnp.bfloat16)
    apart = lambda x, w, z: sigmoid_gate(rms_norm(x, w, 1e-5, jnp.float32), z, jnp.float32, jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(fused(x, w, z), np.float32), np.asarray(apart(x, w, z), np.float32))
    loss = lambda f: lambda x, w, z: jnp.sum(f(x, w, z).astype(jnp.float32) * dy)
    for a, b in zip(jax.grad(loss(fused), argnums=(0, 1, 2))(x, w, z), jax.grad(loss(apart), argnums=(0, 1, 2))(x, w, z)):
        assert a.dtype == b.dtype and rel_rmse(np.asarray(a, np.float64), np.asarray(b, np.float64)) <= 1e-2
    kept = lambda f: [why for _, why in saved_residuals(loss(f), x, w, z) if why.startswith("output of")]
    assert kept(fused) == [] and len(kept(apart)) == 2  # apart: the 1/rms rows and the wide normed x


def test_decay_gates():
    z = jnp.asarray(RNG.normal(size=(1, 4, 2, 3)) * 3, jnp.float32)
    a_log = jnp.asarray(np.log([1.5, 12.0]), jnp.float32)
    rate = np.array([1.5, 12.0])[:, None]
    bounded = np.asarray(decay_gate(z, a_log, -5.0))
    assert np.all((bounded >= -5) & (bounded <= 0))  # open interval, closed by fp32 saturation
    assert rel_rmse(bounded, -5.0 / (1 + np.exp(-rate * np.asarray(z)))) <= F32_RTOL
    softplus = np.asarray(decay_gate(z, a_log, None))
    assert rel_rmse(softplus, -rate * np.log1p(np.exp(np.asarray(z)))) <= F32_RTOL


def test_route_uses_bias_for_selection_only():
    scores = jax.nn.sigmoid(jnp.asarray(RNG.normal(size=(6, 8)), jnp.float32))
    bias = jnp.zeros(8).at[7].set(10.0)  # expert 7 always chosen, whatever its score
    ids, w = route(scores, bias, 3, renormalize=True, scaling=2.5)
    s, ids = np.asarray(scores), np.asarray(ids)
    assert np.all(ids[:, 0] == 7)
    for t in range(6):
        rest = np.argsort(-s[t, :7])[:2]
        assert set(ids[t, 1:]) == set(rest)
        chosen = s[t, ids[t]]
        np.testing.assert_allclose(np.asarray(w[t]), 2.5 * chosen / (chosen.sum() + 1e-20), rtol=1e-6)


def test_attn_res_mix_matches_formula():
    n, d, eps = 3, 16, 1e-5
    blocks = RNG.normal(size=(5, 2, 4, d)).astype(np.float32)  # buffer of 5, only 3 stored
    partial = RNG.normal(size=(2, 4, d)).astype(np.float32)
    direction = RNG.normal(size=d).astype(np.float32)
    got = attn_res_mix(jnp.asarray(blocks), n, jnp.asarray(partial), jnp.asarray(direction), eps, jnp.float32)
    src = np.concatenate([blocks[:n], partial[None]]).astype(np.float64)
    keys = src / np.sqrt(np.mean(src ** 2, -1, keepdims=True) + eps)
    logits = keys @ direction
    p = np.exp(logits - logits.max(0)) / np.exp(logits - logits.max(0)).sum(0)
    assert rel_rmse(got, np.einsum("nbt,nbtd->btd", p, src)) <= F32_RTOL


def _mix_by_autodiff(sources, direction, eps):
    """The AttnRes mix written plainly (jnp autodiff gives its gradient)."""
    src = jnp.stack(sources)
    logits = jnp.sum(src * direction, -1) * jax.lax.rsqrt(jnp.mean(src ** 2, -1) + eps)
    return jnp.einsum("nbt,nbtd->btd", jax.nn.softmax(logits, axis=0), src)


@pytest.mark.parametrize("count", [1, 2, 4])
def test_attn_res_mix_gradients_equal_autodiff_in_float64(count):
    """The explicit backward (every source's cotangent and the direction's) == autodiff of the formula."""
    with jax.enable_x64(True):
        blocks = tuple(jnp.asarray(RNG.normal(size=(2, 5, 16)) * (n + 1)) for n in range(count))
        partial = jnp.asarray(RNG.normal(size=(2, 5, 16)))
        direction = jnp.asarray(RNG.normal(size=16))
        ct = jnp.asarray(RNG.normal(size=(2, 5, 16)))
        got = jax.vjp(lambda b, p, d: attn_res_mix(b, count, p, d, 1e-5, jnp.float64), blocks, partial, direction)
        want = jax.vjp(lambda b, p, d: _mix_by_autodiff(b + (p,), d, 1e-5), blocks, partial, direction)
        assert float(jnp.max(jnp.abs(got[0] - want[0]))) < 1e-12
        for a, b in zip(jax.tree.leaves(got[1](ct)), jax.tree.leaves(want[1](ct)), strict=True):
            assert a.dtype == jnp.float64
            assert float(jnp.max(jnp.abs(a - b))) < 1e-10 * max(1.0, float(jnp.max(jnp.abs(b))))


def test_attn_res_mix_cotangents_keep_each_source_dtype():
    """bf16 sources get bf16 cotangents (computed in fp32), the fp32 direction an fp32 one."""
    blocks = (jnp.asarray(RNG.normal(size=(2, 3, 8)), jnp.bfloat16),)
    partial = jnp.asarray(RNG.normal(size=(2, 3, 8)), jnp.float32)
    direction = jnp.asarray(RNG.normal(size=8), jnp.float32)
    _, vjp = jax.vjp(lambda b, p, d: attn_res_mix(b, 1, p, d, 1e-5, jnp.float32), blocks, partial, direction)
    (db,), dp, dd = vjp(jnp.ones((2, 3, 8), jnp.float32))
    assert (db.dtype, dp.dtype, dd.dtype) == (jnp.bfloat16, jnp.float32, jnp.float32)
    want = jax.vjp(lambda b, p, d: _mix_by_autodiff((b.astype(jnp.float32), p), d, 1e-5), blocks[0], partial, direction)[1](
        jnp.ones((2, 3, 8), jnp.float32))
    assert rel_rmse(db.astype(jnp.float32), want[0]) < 1e-2 and rel_rmse(dd, want[2]) < 1e-5


def test_residual_stream_push():
    s = ResidualStream.start(jnp.ones((1, 2, 4)), max_blocks=3)
    s = s.push().add(2 * jnp.ones((1, 2, 4))).push()
    assert s.count == 2 and float(s.partial.sum()) == 0
    np.testing.assert_array_equal(np.asarray(s.blocks[:, 0, 0, 0]), [1, 2, 0])


def test_residual_stream_push_past_max_blocks_raises():
    s = ResidualStream.start(jnp.ones((1, 2, 4)), max_blocks=1).push()
    with pytest.raises(ValueError, match="max_blocks=1"):
        s.push()
    assert ResidualStream.start(jnp.ones((1, 2, 4)), max_blocks=0).blocks is None


def test_attn_res_mix_reads_blocks_as_array_or_tuple():
    """The stream's tuple of blocks and the stacked ``[N, B, T, D]`` array mix the same."""
    blocks = jnp.asarray(RNG.normal(size=(3, 2, 4, 8)), jnp.float32)
    partial = jnp.asarray(RNG.normal(size=(2, 4, 8)), jnp.float32)
    direction = jnp.asarray(RNG.normal(size=8), jnp.float32)
    stacked = attn_res_mix(blocks, 2, partial, direction, 1e-5, jnp.float32)
    listed = attn_res_mix(tuple(blocks[:2]), 2, partial, direction, 1e-5, jnp.float32)
    np.testing.assert_array_equal(np.asarray(stacked), np.asarray(listed))


def test_query_blocked_attention_equals_full(monkeypatch):
    b, t, h, k = 2, 16, 3, 8
    q, kk, v = (jnp.asarray(RNG.normal(size=(b, t, h, k)), jnp.float32) for _ in range(3))
    seg = jnp.asarray([[0] * 5 + [1] * 11, [0] * 16], jnp.int32)
    mask = mla_lib.attention_mask(seg, b, t)
    w = jnp.asarray(RNG.normal(size=(b, t, h, k)), jnp.float32)
    loss = lambda q, kk, v: jnp.sum(causal_attention(q, kk, v, mask, 0.3)[0] * w)
    full, full_max = causal_attention(q, kk, v, mask, 0.3)
    full_grads = jax.grad(loss, argnums=(0, 1, 2))(q, kk, v)
    monkeypatch.setattr(mla_lib, "QUERY_BLOCK", 4)
    blocked, blocked_max = causal_attention(q, kk, v, mask, 0.3)
    assert rel_rmse(blocked, full) <= F32_RTOL
    np.testing.assert_array_equal(np.asarray(blocked_max), np.asarray(full_max))
    for got, want in zip(jax.grad(loss, argnums=(0, 1, 2))(q, kk, v), full_grads):  # remat per block
        assert rel_rmse(got, want) <= F32_RTOL


def test_rope_is_relative_and_yarn_blends_frequencies():
    cfg = config.RopeConfig(theta=50000.0, yarn_factor=32.0, yarn_original_max_position=4096)
    inv = rope.inverse_frequencies(cfg, 64)
    plain = 1.0 / 50000.0 ** (np.arange(0, 64, 2) / 64)
    np.testing.assert_allclose(inv[:4], plain[:4])  # high frequencies extrapolate
    np.testing.assert_allclose(inv[-4:], plain[-4:] / 32.0)  # low frequencies interpolate
    q = jnp.asarray(RNG.normal(size=(1, 1, 64)), jnp.float32)
    k = jnp.asarray(RNG.normal(size=(1, 1, 64)), jnp.float32)
    dot = lambda m, n: float(jnp.sum(rope.apply_rope(q, jnp.full((1, 1), m), cfg, jnp.float32)
                                     * rope.apply_rope(k, jnp.full((1, 1), n), cfg, jnp.float32)))
    assert dot(7, 3) == pytest.approx(dot(107, 103), rel=1e-4)
    assert rope.softmax_scale_factor(cfg) == pytest.approx((0.1 * np.log(32.0) + 1) ** 2)


def _family(name: str) -> config.ModelConfig:
    """tiny-sized variants of the other two families."""
    base = dataclasses.replace(config.tiny(), dtype=jnp.float32)
    if name == "kimi_linear":
        return dataclasses.replace(
            base, kda=dataclasses.replace(base.kda, gate_lower_bound=None, output_gate_rank=8),
            mla=dataclasses.replace(base.mla, q_lora_rank=None, output_gate=False),
            mlp=dataclasses.replace(base.mlp, activation="swiglu"),
            moe=dataclasses.replace(base.moe, latent_dim=None, latent_norm=False, routed_scaling_factor=2.446),
            attn_res=None)
    return dataclasses.replace(
        base, kda=None, mla=dataclasses.replace(base.mla, output_gate=False, rope=config.RopeConfig(yarn_factor=4.0)),
        mlp=dataclasses.replace(base.mlp, activation="swiglu"),
        moe=dataclasses.replace(base.moe, latent_dim=None, latent_norm=False), attn_res=None)


def _layer_is_causal(module, x):
    """Initialise ``module`` and check d y[:, t] / d x[:, >t] == 0 (and != 0 up to t), jitted."""
    variables = jax.jit(module.init)(jax.random.key(0, impl="unsafe_rbg"), x)

    @jax.jit
    def grad_of_middle_token(x):
        y, vjp = jax.vjp(lambda x: module.apply(variables, x, mutable=["stats"])[0], x)
        return vjp(jnp.zeros_like(y).at[:, x.shape[1] // 2].set(1.0))[0]

    g, t = np.asarray(grad_of_middle_token(x)), x.shape[1] // 2
    return variables, bool(np.all(g[:, t + 1:] == 0) and np.abs(g[:, : t + 1]).max() > 0)


@pytest.mark.parametrize("family", ["kimi_linear", "kimi_k2"])
def test_family_mixers_are_causal_with_their_parameters(family):
    cfg = _family(family)
    x = jnp.asarray(RNG.normal(size=(1, 12, cfg.hidden)), jnp.float32)
    mla_vars, causal = _layer_is_causal(MLA(cfg), x)
    assert causal
    mla = nn.meta.unbox(mla_vars["params"])
    assert "g_proj" not in mla
    if family == "kimi_k2":  # LoRA query, RoPE + YaRN on the rope slices
        assert mla["q_b"]["kernel"].shape == (24, 4, 24)
        return
    assert "q_a" not in mla and mla["q_proj"]["kernel"].shape == (cfg.hidden, 4, 24)
    kda_vars, causal = _layer_is_causal(KDA(cfg), x)  # softplus decay, low-rank output gate
    assert causal
    kda = nn.meta.unbox(kda_vars["params"])
    assert kda["g_a"]["kernel"].shape == (cfg.hidden, 8) and "g_proj" not in kda


def test_non_latent_moe_has_no_projections_and_scales_weights():
    cfg = _family("kimi_linear")
    x = jnp.asarray(RNG.normal(size=(1, 6, cfg.hidden)), jnp.float32)
    variables = jax.jit(MoE(cfg).init)(jax.random.key(0, impl="unsafe_rbg"), x)
    params = nn.meta.unbox(variables["params"])
    assert "down_proj" not in params and "latent_norm" not in params
    assert params["w1"].shape == (cfg.moe.num_experts, cfg.hidden, cfg.moe.expert_intermediate)
    y, stats = jax.jit(lambda v, x: MoE(cfg).apply(v, x, mutable=["stats"]))(variables, x)
    assert y.shape == x.shape and int(stats["stats"]["loads"][0].sum()) == 6 * cfg.moe.top_k


_DEEPSEEK_V3_MLA = """
import sys, numpy as np, torch
from transformers import DeepseekV3Config
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as m
torch.manual_seed(0)
cfg = DeepseekV3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16,
    qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, max_position_embeddings=256, num_hidden_layers=1,
    rope_parameters={"rope_type": "yarn", "rope_theta": 50000.0, "factor": 4.0, "original_max_position_embeddings": 64,
                     "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
    rope_interleave=True, attention_bias=False)
cfg._attn_implementation = "eager"
attn = m.DeepseekV3Attention(cfg, 0).double()
for p in attn.parameters():
    torch.nn.init.normal_(p, std=0.3)
T = 40
x = torch.randn(2, T, 64, dtype=torch.float64)
cos, sin = m.DeepseekV3RotaryEmbedding(cfg).double()(x, torch.arange(T)[None].expand(2, T))
mask = torch.full((T, T), float("-inf"), dtype=torch.float64).triu(1)[None, None].expand(2, 1, T, T)
with torch.no_grad():
    out = attn(x, (cos, sin), mask)[0]
np.savez(sys.argv[1], x=x.numpy(), out=out.numpy(), **{k: v.numpy() for k, v in attn.state_dict().items()})
"""


def test_k2_mla_with_yarn_matches_transformers_deepseek_v3(tmp_path):
    """K2's MLA (LoRA query, RoPE + YaRN on the rope slices, mscale² on the softmax scale) against
    transformers' DeepseekV3Attention in float64; its rotary tables are float32, hence F32_RTOL."""
    import subprocess

    from tests.reference.env import reference_python

    python = reference_python()
    if python is None:
        pytest.skip("PyTorch reference venv not found (set K3JAX_REF_PYTHON or run `make refvenv`)")
    out = tmp_path / "mla.npz"
    done = subprocess.run([python, "-c", _DEEPSEEK_V3_MLA, str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    r = dict(np.load(out))
    rope_cfg = config.RopeConfig(theta=50000.0, yarn_factor=4.0, yarn_original_max_position=64, yarn_beta_fast=1.0,
                                 yarn_beta_slow=1.0, yarn_mscale=1.0, yarn_mscale_all_dim=1.0)
    cfg = dataclasses.replace(config.to_float64(config.tiny()), kda=None, mla=config.MLAConfig(
        num_heads=4, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        output_gate=False, rope=rope_cfg))
    params = {"q_a": {"kernel": r["q_a_proj.weight"].T}, "q_norm": {"scale": r["q_a_layernorm.weight"]},
              "q_b": {"kernel": r["q_b_proj.weight"].T.reshape(24, 4, 24)},
              "kv_a": {"kernel": r["kv_a_proj_with_mqa.weight"].T}, "kv_norm": {"scale": r["kv_a_layernorm.weight"]},
              "kv_b": {"kernel": r["kv_b_proj.weight"].T.reshape(16, 4, 32)},
              "o_proj": {"kernel": r["o_proj.weight"].T.reshape(4, 16, 64)}}
    with jax.enable_x64(True):
        y, _ = jax.jit(lambda p, x: MLA(cfg).apply({"params": p}, x, mutable=["stats"]))(params, r["x"])
        assert y.dtype == jnp.float64
    assert rel_rmse(y, r["out"]) <= F32_RTOL


def test_attn_res_direction_gradient_reads_narrow_sources_as_they_are():
    """With bf16 sources the direction's gradient contracts them in bf16 (no float32 copy of a
    source feeds the product) and still equals the float32 contraction to float32 rounding."""
    from k3jax.layers.attn_res import _weighted_column_sum

    w = jnp.asarray(RNG.normal(size=(2, 1, 64)), jnp.float32)
    v = jnp.asarray(RNG.normal(size=(2, 1, 64, 32)), jnp.bfloat16)
    want = jnp.einsum("kbt,kbtd->d", w, v.astype(jnp.float32), precision="highest")
    assert rel_rmse(_weighted_column_sum(w, v, jnp.float32), want) < 1e-6
    hlo = jax.jit(lambda w, v: _weighted_column_sum(w, v, jnp.float32)).lower(w, v).as_text()
    assert "tensor<2x1x64x32xf32>" not in hlo, "a float32 copy of the bf16 source was made"


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_proj_split_gives_the_packed_products_halves(dtype):
    """``Proj(x, split=s)`` (MLA's flash path: q and kv per part) returns the two halves of the packed
    product as separate products: the same values, and the same gradients for ``x`` and the one stored
    kernel (whose halves' gradients land in its halves). A decode-layout kernel is refused."""
    from k3jax.layers.linear import Proj

    layer = Proj("BTR,RHK->BTHK", (6, 2, 10), (None, None, None), dtype, jnp.float32, name="kv_b")
    x = jnp.asarray(RNG.normal(size=(2, 3, 6)), dtype)
    params = nn.meta.unbox(layer.init(jax.random.key(0), x)["params"])
    packed = layer.apply({"params": params}, x)
    a, b = layer.apply({"params": params}, x, split=4)
    tol = F32_RTOL if dtype == jnp.float32 else BF16_FWD_RTOL  # other GEMM shapes: other summation orders
    assert rel_rmse(a, packed[..., :4]) <= tol and rel_rmse(b, packed[..., 4:]) <= tol
    w = jnp.asarray(RNG.normal(size=packed.shape), jnp.float32)
    loss = lambda p, x, s: sum(jnp.sum(y.astype(jnp.float32) * w[..., sl]) for y, sl in zip(
        layer.apply({"params": p}, x, split=s) if s else [layer.apply({"params": p}, x)],
        [slice(0, 4), slice(4, None)] if s else [slice(None)]))
    got, want = jax.grad(loss, argnums=(0, 1))(params, x, 4), jax.grad(loss, argnums=(0, 1))(params, x, None)
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert rel_rmse(g, r) <= tol
    with pytest.raises(ValueError, match="decode layout"):
        layer.apply({"params": params, "decode": {"kernel_t": params["kernel"]}}, x, split=4)
