"""Parameter counts (SPEC §1, §11) and the parameter-tree contract of docs/params.md."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

from k3jax import config
from k3jax.layout import unrolled
from k3jax.model import Transformer
from k3jax.params import COMPONENTS, count_params, param_table


def test_kimi_k3_totals():
    count = count_params(config.kimi_k3())
    assert count.total == pytest.approx(2779.48e9, rel=1e-4)
    assert count.active == pytest.approx(104.19e9, rel=1e-4)


def test_printed_in_billions_or_millions():
    assert str(config.ParamCount(2_779_480_000_000, 104_190_000_000)) == "total 2,779.48 B, active 104.19 B"
    assert str(config.ParamCount(1_000_000_000, 2_500_000)) == "total 1.00 B, active 0.00 B"
    assert str(config.ParamCount(1_234_567, 345_678)) == "total 1.23 M, active 0.35 M"
    assert " M, active " in str(count_params(config.tiny())) and "0.00" not in str(count_params(config.tiny()))


def test_kimi_linear_total():
    assert count_params(config.kimi_linear_48b()).total == pytest.approx(49.12e9, rel=1e-3)


def test_table_sums_to_count_and_excludes_input_embedding():
    cfg = config.tiny()
    table = param_table(cfg)
    assert [c for c, _, _ in table] == list(COMPONENTS)
    count = count_params(cfg)
    assert sum(t for _, t, _ in table) == count.total and sum(a for _, _, a in table) == count.active
    rows = {c: (t, a) for c, t, a in table}
    assert rows["embedding"] == (cfg.vocab_size * cfg.hidden, 0)
    E, k = cfg.moe.num_experts, cfg.moe.top_k
    experts = 3 * E * cfg.moe_width * cfg.moe.expert_intermediate * sum(cfg.moe_layers)
    assert rows["routed experts"] == (experts, experts * k // E)


LOGICAL_AXES = {"vocab", "embed", "heads", "head_dim", "conv", "decay_rank", "gate_rank", "q_lora", "kv_lora",
                "mlp", "experts", "expert_mlp", "latent"}

# docs/params.md for tiny(): D=64, V=256, H=4, K=16, MLA 4 heads, Rq=24, Rkv=16, dn=16, dr=8, dv=16,
# dense F=96, E=16, L=32, expert F=32, shared nF=64.
KDA_TREE = {
    "q_proj/kernel": (64, 4, 16), "k_proj/kernel": (64, 4, 16), "v_proj/kernel": (64, 4, 16),
    "q_conv": (4, 4, 16), "k_conv": (4, 4, 16), "v_conv": (4, 4, 16), "f_a/kernel": (64, 16),
    "f_b/kernel": (16, 4, 16), "dt_bias": (4, 16), "A_log": (4,), "b_proj/kernel": (64, 4),
    "g_proj/kernel": (64, 4, 16), "o_norm/scale": (16,), "o_proj/kernel": (4, 16, 64),
}
MLA_TREE = {
    "q_a/kernel": (64, 24), "q_norm/scale": (24,), "q_b/kernel": (24, 4, 24), "kv_a/kernel": (64, 24),
    "kv_norm/scale": (16,), "kv_b/kernel": (16, 4, 32), "g_proj/kernel": (64, 4, 16), "o_proj/kernel": (4, 16, 64),
}
MOE_TREE = {
    "router/kernel": (64, 16), "down_proj/kernel": (64, 32), "latent_norm/scale": (32,), "up_proj/kernel": (32, 64),
    "w1": (16, 32, 32), "w3": (16, 32, 32), "w2": (16, 32, 32), "shared/gate/kernel": (64, 64),
    "shared/up/kernel": (64, 64), "shared/down/kernel": (64, 64),
}
LAYER_COMMON = {"attn_norm/scale": (64,), "mlp_norm/scale": (64,), "attn_res/query": (64,), "attn_res/norm": (64,),
                "mlp_res/query": (64,), "mlp_res/norm": (64,)}


def _flat(tree, prefix=""):
    out = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flat(value, path + "/"))
        else:
            out[path] = value
    return out


def test_tiny_tree_matches_docs_params_md():
    cfg = unrolled(config.tiny())  # the per-layer layout (the scanned one: tests/k3jax/test_scan.py)
    boxed = jax.eval_shape(Transformer(cfg).init, jax.random.PRNGKey(0), jax.ShapeDtypeStruct((1, 4), jnp.int32))
    assert set(boxed) == {"params", "balance"}
    want = {"embed/embedding": (256, 64), "final_norm/scale": (64,), "out_res/query": (64,), "out_res/norm": (64,),
            "head/kernel": (64, 256)}
    for i, kind in enumerate(cfg.layer_kinds):
        mixer = ("kda", KDA_TREE) if kind is config.LayerKind.KDA else ("mla", MLA_TREE)
        ffn = ("moe", MOE_TREE) if cfg.moe_layers[i] else ("mlp", {"gate/kernel": (64, 96), "up/kernel": (64, 96),
                                                                  "down/kernel": (96, 64)})
        for name, tree in (("", LAYER_COMMON), mixer, ffn):
            want |= {f"layers_{i}/{name + '/' if name else ''}{k}": v for k, v in tree.items()}
    flat = _flat(boxed["params"])
    assert {k: v.value.shape for k, v in flat.items()} == want
    for path, leaf in flat.items():
        assert isinstance(leaf, nn.Partitioned) and len(leaf.names) == leaf.value.ndim, path
        assert set(leaf.names) <= LOGICAL_AXES, path

    assert {k: v.value.shape for k, v in _flat(boxed["balance"]).items()} == {
        f"layers_{i}/moe/bias": (16,) for i in range(1, cfg.num_layers)}


def test_fp32_parameters_stay_fp32_under_bf16_storage():
    """Convs, decay-gate parameters, the KDA output norm and the router are stored in fp32 (docs/params.md)."""
    import dataclasses

    cfg = dataclasses.replace(config.tiny(), param_dtype=jnp.bfloat16)
    boxed = jax.eval_shape(Transformer(cfg).init, jax.random.PRNGKey(0), jax.ShapeDtypeStruct((1, 4), jnp.int32))
    wide = ("q_conv", "k_conv", "v_conv", "dt_bias", "A_log", "o_norm/scale", "router/kernel")
    for path, leaf in _flat(nn.meta.unbox(boxed["params"])).items():
        assert leaf.dtype == (jnp.float32 if path.endswith(wide) else jnp.bfloat16), path
    assert all(b.dtype == jnp.float32 for b in jax.tree.leaves(nn.meta.unbox(boxed["balance"])))
