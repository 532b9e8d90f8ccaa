"""QK-Clip: a planted large logit is clipped to τ; other heads, values and the rope key untouched."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from k3jax.config import MLAConfig
from k3jax.train.qk_clip import clip_factors, max_logits_from_stats, qk_clip
from tests.k3jax.train import toy

MLA = MLAConfig(num_heads=toy.H, kv_lora_rank=toy.RKV, q_lora_rank=toy.RQ, qk_nope_head_dim=toy.DN,
                qk_rope_head_dim=toy.DR, v_head_dim=toy.DV)


def _max_logits(mla, cq, ckv, k_rope):
    """Per-head max of the MLA pre-softmax logits (NoPE: the rope slice unrotated), scale 1/√(dn+dr)."""
    q = jnp.einsum("TR,RHW->THW", cq, mla["q_b"]["kernel"])
    kv = jnp.einsum("TR,RHW->THW", ckv, mla["kv_b"]["kernel"])
    k = jnp.concatenate([kv[..., :toy.DN], jnp.broadcast_to(k_rope[:, None], (len(k_rope), toy.H, toy.DR))], -1)
    logits = jnp.einsum("SHW,THW->HST", q, k) / np.sqrt(toy.DN + toy.DR)
    return logits.max(axis=(1, 2))


def test_planted_logit_is_clipped_to_tau_and_other_heads_untouched():
    params = nn.unbox(toy.boxed_params())
    mla = params["layers_1"]["mla"]
    mla["q_b"]["kernel"] = mla["q_b"]["kernel"].at[:, 2].multiply(400.0)
    mla["kv_b"]["kernel"] = mla["kv_b"]["kernel"].at[:, 2].multiply(3.0)
    keys = jax.random.split(jax.random.key(3), 3)
    cq, ckv = jax.random.normal(keys[0], (24, toy.RQ)), jax.random.normal(keys[1], (24, toy.RKV))
    k_rope = jax.random.normal(keys[2], (24, toy.DR))
    tau = 5.0
    before = _max_logits(mla, cq, ckv, k_rope)
    assert before[2] > 10 * tau and np.all(np.asarray(before)[[0, 1, 3]] < tau)
    stats = {"layers_1": {"mla": {"max_logit": (before,)}}}
    new, gammas = qk_clip(params, max_logits_from_stats(stats), MLA, tau)
    after = _max_logits(new["layers_1"]["mla"], cq, ckv, k_rope)
    assert after[2] <= tau * (1 + 1e-5) and after[2] > tau * (1 - 1e-5)
    np.testing.assert_array_equal(np.asarray(gammas[("layers_1", "mla")])[[0, 1, 3]], 1.0)
    old_mla, new_mla = params["layers_1"]["mla"], new["layers_1"]["mla"]
    for name in ("q_b", "kv_b"):
        keep = [0, 1, 3]
        np.testing.assert_array_equal(new_mla[name]["kernel"][:, keep], old_mla[name]["kernel"][:, keep])
    np.testing.assert_array_equal(new_mla["kv_b"]["kernel"][..., toy.DN:], old_mla["kv_b"]["kernel"][..., toy.DN:])
    np.testing.assert_array_equal(new_mla["kv_a"]["kernel"], old_mla["kv_a"]["kernel"])
    g = float(gammas[("layers_1", "mla")][2])
    np.testing.assert_allclose(new_mla["q_b"]["kernel"][:, 2, toy.DN:], g * old_mla["q_b"]["kernel"][:, 2, toy.DN:],
                               rtol=1e-6)
    assert new["layers_0"] is params["layers_0"]


def test_clip_factors_never_grow_weights():
    g = clip_factors(jnp.asarray([-5.0, 0.0, 50.0, 100.0, 400.0]), 100.0)
    np.testing.assert_allclose(g, [1, 1, 1, 1, 0.25])


def test_q_proj_without_q_lora():
    params = nn.unbox(toy.boxed_params())
    mla = dict(params["layers_1"]["mla"])
    mla["q_proj"] = mla.pop("q_b")
    params["layers_1"] = {"mla": mla}
    cfg = dataclasses.replace(MLA, q_lora_rank=None)
    new, _ = qk_clip(params, {("layers_1", "mla"): jnp.asarray([1.0, 400.0, 1.0, 1.0])}, cfg, 100.0)
    ratio = new["layers_1"]["mla"]["q_proj"]["kernel"] / mla["q_proj"]["kernel"]
    np.testing.assert_allclose(ratio[:, 1, :toy.DN], 0.5, rtol=1e-6)
    np.testing.assert_allclose(ratio[:, 1, toy.DN:], 0.25, rtol=1e-6)


def test_real_mla_layer_clipped_to_tau():
    """The model's own max-logit statistic: after QK-Clip the planted head's max logit is τ."""
    from k3jax.model import Transformer
    from k3jax.train.loop import make_data

    toy.use_compilation_cache()
    cfg = toy.micro_train_config()
    model = Transformer(dataclasses.replace(cfg.model, dtype=jnp.float32))
    batch = next(make_data(cfg))
    variables = nn.unbox(model.init(jax.random.key(0), batch["tokens"][:1]))
    params = variables["params"]
    q_b = params["layers_1"]["mla"]["q_b"]["kernel"]
    params["layers_1"]["mla"]["q_b"]["kernel"] = q_b.at[:, 1].multiply(300.0)
    forward = jax.jit(lambda p: model.apply({**variables, "params": p}, batch["tokens"],
                                            segment_ids=batch["segment_ids"], mutable=["stats"])[1]["stats"])
    before = max_logits_from_stats(forward(params))[("layers_1", "mla")]
    tau = 0.5 * float(before[1])
    assert float(jnp.max(before.at[1].set(0))) < tau
    clipped, _ = qk_clip(params, max_logits_from_stats(forward(params)), cfg.model.mla, tau)
    after = max_logits_from_stats(forward(clipped))[("layers_1", "mla")]
    np.testing.assert_allclose(after[1], tau, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(after)[[0, 2, 3]], np.asarray(before)[[0, 2, 3]], rtol=1e-6)
