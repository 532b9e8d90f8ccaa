"""Hugging Face checkpoint keys <-> the k3jax parameter tree (docs/params.md), as data.

One ``Entry`` per HF tensor (one per expert *stack* for routed experts): its HF key, its leaf in
``variables`` and the ``Layout`` that turns PyTorch's ``[out, in]`` matrices into the tree's
``[in, out]`` kernels with explicit head axes, and back. The families differ in the key prefix
(K3 nests the text model under ``language_model.``), the ``A_log`` and output-gate layouts,
and K2's DeepSeek-V3 MoE names (SPEC §12).
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable

import numpy as np

from k3jax.config import LayerKind, ModelConfig
from k3jax.convert.hf_config import family

Shape = tuple[int, ...]
A_LOG_PAD = 128  # K3 pads A_log to a multiple of 128 entries (real heads first, then zeros)
EXPERT = "{e}"  # placeholder for the expert index in an expert-stack key


@dataclasses.dataclass(frozen=True)
class Layout:
    """How one tree leaf is stored in HF: the HF shape of a tree shape, and the two conversions."""

    name: str
    hf_shape: Callable[[Shape], Shape]
    to_tree: Callable[[np.ndarray, Shape], np.ndarray]
    to_hf: Callable[[np.ndarray], np.ndarray]


def _pad_a_log(a: np.ndarray) -> np.ndarray:
    return np.pad(a, (0, -len(a) % A_LOG_PAD))


LAYOUTS = {layout.name: layout for layout in (
    Layout("same", lambda s: s, lambda a, s: a, lambda a: a),
    # Linear [out, in] -> kernel [in, out].
    Layout("T", lambda s: (s[1], s[0]), lambda a, s: a.T, lambda a: a.T),
    # Linear [H·K, in] -> kernel [in, H, K].
    Layout("in_hk", lambda s: (s[1] * s[2], s[0]), lambda a, s: a.T.reshape(s), lambda a: a.reshape(a.shape[0], -1).T),
    # Linear [out, H·K] -> kernel [H, K, out].
    Layout("hk_out", lambda s: (s[2], s[0] * s[1]), lambda a, s: a.T.reshape(s), lambda a: a.reshape(-1, a.shape[2]).T),
    # AttnRes query, a Linear(D, 1) weight [1, D] -> [D].
    Layout("row", lambda s: (1, s[0]), lambda a, s: a.reshape(s), lambda a: a.reshape(1, -1)),
    # Depthwise conv taps [H·K, 1, W] -> [W, H, K] (tap W-1 multiplies the current token).
    Layout("conv", lambda s: (s[1] * s[2], 1, s[0]), lambda a, s: a[:, 0, :].T.reshape(s),
           lambda a: a.reshape(a.shape[0], -1).T[:, None, :]),
    # Per-channel vector [H·K] -> [H, K].
    Layout("hk", lambda s: (s[0] * s[1],), lambda a, s: a.reshape(s), lambda a: a.reshape(-1)),
    # K3's A_log [ceil(H/128)·128] -> [H]: the zero padding is dropped, and restored on save.
    Layout("a_log_padded", lambda s: (-(-s[0] // A_LOG_PAD) * A_LOG_PAD,), lambda a, s: a[:s[0]], _pad_a_log),
    # Kimi-Linear's A_log [1, 1, H, 1] -> [H].
    Layout("a_log_4d", lambda s: (1, 1, s[0], 1), lambda a, s: a.reshape(s), lambda a: a.reshape(1, 1, -1, 1)),
)}


@typing.runtime_checkable
class KeyEntry(typing.Protocol):
    """A checkpoint entry of either table: a text ``Entry`` or a tower / projector
    ``k3jax.vision.hf_keys.VisionEntry`` (what the conversion's shared code reads of both)."""

    hf: str
    path: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Entry:
    """One HF tensor (or, with ``{e}`` in ``hf``, one stack of per-expert tensors) and its tree leaf."""

    hf: str
    path: tuple[str, ...]  # leaf path inside ``variables[collection]``
    shape: Shape  # tree shape; for expert stacks [E, in, out]
    layout: str
    wide: bool = False  # leaf kept in float32 or wider (the SPEC §10 fp32 parameters)
    hf_f32: bool = False  # stored as F32 in the release layout
    collection: str = "params"
    aliases: tuple[str, ...] = ()  # other spellings accepted on load (saving writes ``hf``)

    @property
    def is_experts(self) -> bool:
        return EXPERT in self.hf

    @property
    def hf_shape(self) -> Shape:
        """HF shape of one tensor (one expert's for stacks)."""
        return LAYOUTS[self.layout].hf_shape(self.shape[1:] if self.is_experts else self.shape)

    def expert_key(self, e: int) -> str:
        return self.hf.replace(EXPERT, str(e))


def prefix(cfg: ModelConfig) -> str:
    """Key prefix of the text model: K3 nests it in the multimodal checkpoint."""
    return "language_model." if family(cfg) == "kimi_k3" else ""


def ignored_prefixes(cfg: ModelConfig) -> tuple[str, ...]:
    """Tensors of K3's vision tower / projector: not part of the text model, skipped on load."""
    return ("vision_tower.", "mm_projector.", "multi_modal_projector.") if family(cfg) == "kimi_k3" else ()


def _kda(cfg: ModelConfig, p: str, lp: tuple[str, ...]) -> list[Entry]:
    k, D = cfg.kda, cfg.hidden
    H, K, W = k.num_heads, k.head_dim, k.conv_size
    lp = lp + ("kda",)
    out = [Entry(f"{p}{n}_proj.weight", lp + (f"{n}_proj", "kernel"), (D, H, K), "in_hk") for n in "qkv"]
    out += [Entry(f"{p}{n}_conv1d.weight", lp + (f"{n}_conv",), (W, H, K), "conv", True, True) for n in "qkv"]
    a_log = "a_log_padded" if family(cfg) == "kimi_k3" else "a_log_4d"
    out += [
        Entry(f"{p}f_a_proj.weight", lp + ("f_a", "kernel"), (D, K), "T"),
        Entry(f"{p}f_b_proj.weight", lp + ("f_b", "kernel"), (K, H, K), "in_hk"),
        Entry(f"{p}A_log", lp + ("A_log",), (H,), a_log, True, True),
        Entry(f"{p}dt_bias", lp + ("dt_bias",), (H, K), "hk", True, True),
        Entry(f"{p}b_proj.weight", lp + ("b_proj", "kernel"), (D, H), "T"),
        Entry(f"{p}o_norm.weight", lp + ("o_norm", "scale"), (K,), "same", True, True),  # docs/params.md: kda/o_norm/scale
        Entry(f"{p}o_proj.weight", lp + ("o_proj", "kernel"), (H, K, D), "hk_out"),
    ]
    if k.output_gate_rank is None:
        out.append(Entry(f"{p}g_proj.weight", lp + ("g_proj", "kernel"), (D, H, K), "in_hk"))
    else:
        R = k.output_gate_rank
        out += [Entry(f"{p}g_a_proj.weight", lp + ("g_a", "kernel"), (D, R), "T"),
                Entry(f"{p}g_b_proj.weight", lp + ("g_b", "kernel"), (R, H, K), "in_hk")]
    return out


def _mla(cfg: ModelConfig, p: str, lp: tuple[str, ...]) -> list[Entry]:
    m, D = cfg.mla, cfg.hidden
    H, dn, dr, dv = m.num_heads, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
    lp = lp + ("mla",)
    if m.q_lora_rank is None:
        out = [Entry(f"{p}q_proj.weight", lp + ("q_proj", "kernel"), (D, H, dn + dr), "in_hk")]
    else:
        Rq = m.q_lora_rank
        out = [Entry(f"{p}q_a_proj.weight", lp + ("q_a", "kernel"), (D, Rq), "T"),
               Entry(f"{p}q_a_layernorm.weight", lp + ("q_norm", "scale"), (Rq,), "same"),
               Entry(f"{p}q_b_proj.weight", lp + ("q_b", "kernel"), (Rq, H, dn + dr), "in_hk")]
    out += [
        Entry(f"{p}kv_a_proj_with_mqa.weight", lp + ("kv_a", "kernel"), (D, m.kv_lora_rank + dr), "T"),
        Entry(f"{p}kv_a_layernorm.weight", lp + ("kv_norm", "scale"), (m.kv_lora_rank,), "same"),
        Entry(f"{p}kv_b_proj.weight", lp + ("kv_b", "kernel"), (m.kv_lora_rank, H, dn + dv), "in_hk"),
        Entry(f"{p}o_proj.weight", lp + ("o_proj", "kernel"), (H, dv, D), "hk_out"),
    ]
    if m.output_gate:
        out.append(Entry(f"{p}g_proj.weight", lp + ("g_proj", "kernel"), (D, H, dv), "in_hk"))
    return out


def _gated_mlp(p: str, lp: tuple[str, ...], D: int, F: int, alias: str | None = None) -> list[Entry]:
    def entry(name: str, tree: str, shape: Shape) -> Entry:
        aliases = () if alias is None else (f"{alias}{name}_proj.weight",)
        return Entry(f"{p}{name}_proj.weight", lp + (tree, "kernel"), shape, "T", aliases=aliases)

    return [entry("gate", "gate", (D, F)), entry("up", "up", (D, F)), entry("down", "down", (F, D))]


def _moe(cfg: ModelConfig, p: str, lp: tuple[str, ...]) -> list[Entry]:
    m, D, L = cfg.moe, cfg.hidden, cfg.moe_width
    E, F = m.num_experts, m.expert_intermediate
    k2 = family(cfg) == "kimi_k2"
    p = p + ("mlp." if k2 else "block_sparse_moe.")
    lp = lp + ("moe",)
    # Kimi-Linear keeps the router in fp32 in its checkpoints (transformers' keep_in_fp32 list); K3 ships bf16.
    router_f32 = family(cfg) == "kimi_linear"
    out = [Entry(f"{p}gate.weight", lp + ("router", "kernel"), (D, E), "T", True, router_f32),
           Entry(f"{p}gate.e_score_correction_bias", lp + ("bias",), (E,), "same", True, True, "balance")]
    if m.latent_dim is not None:
        out += [Entry(f"{p}routed_expert_down_proj.weight", lp + ("down_proj", "kernel"), (D, L), "T"),
                Entry(f"{p}routed_expert_up_proj.weight", lp + ("up_proj", "kernel"), (L, D), "T")]
        if m.latent_norm:
            out.append(Entry(f"{p}routed_expert_norm.weight", lp + ("latent_norm", "scale"), (L,), "same"))
    names = ("gate_proj", "up_proj", "down_proj") if k2 else ("w1", "w3", "w2")
    ex = f"{p}experts.{EXPERT}."
    out += [Entry(f"{ex}{names[0]}.weight", lp + ("w1",), (E, L, F), "T"),
            Entry(f"{ex}{names[1]}.weight", lp + ("w3",), (E, L, F), "T"),
            Entry(f"{ex}{names[2]}.weight", lp + ("w2",), (E, F, L), "T")]
    if m.num_shared_experts:
        out += _gated_mlp(f"{p}shared_experts.", lp + ("shared",), D, m.shared_width)
    return out


def _layer(cfg: ModelConfig, i: int) -> list[Entry]:
    p, lp, D = f"{prefix(cfg)}model.layers.{i}.", (f"layers_{i}",), cfg.hidden
    out = [Entry(f"{p}input_layernorm.weight", lp + ("attn_norm", "scale"), (D,), "same"),
           Entry(f"{p}post_attention_layernorm.weight", lp + ("mlp_norm", "scale"), (D,), "same")]
    if cfg.attn_res is not None:
        for hf, tree in (("self_attention_res", "attn_res"), ("mlp_res", "mlp_res")):
            out += [Entry(f"{p}{hf}_norm.weight", lp + (tree, "norm"), (D,), "same"),
                    Entry(f"{p}{hf}_proj.weight", lp + (tree, "query"), (D,), "row")]
    mixer = _kda if cfg.layer_kinds[i] is LayerKind.KDA else _mla
    out += mixer(cfg, f"{p}self_attn.", lp)
    if cfg.moe_layers[i]:
        out += _moe(cfg, p, lp)
    else:
        # transformers 5 saves Kimi-Linear's dense layers under block_sparse_moe. (it renames every .mlp.)
        alias = f"{p}block_sparse_moe." if family(cfg) == "kimi_linear" else None
        out += _gated_mlp(f"{p}mlp.", lp + ("mlp",), D, cfg.mlp.dense_intermediate, alias)
    return out


def entries(cfg: ModelConfig) -> list[Entry]:
    """Every tensor of the text model's HF checkpoint, in layer order."""
    if cfg.mtp.num_layers:
        raise ValueError(f"mtp.num_layers={cfg.mtp.num_layers} must be 0: the MTP layers have no HF mapping yet "
                         "(the releases ship none)")
    p, D, V = prefix(cfg), cfg.hidden, cfg.vocab_size
    out = [Entry(f"{p}model.embed_tokens.weight", ("embed", "embedding"), (V, D), "same")]
    for i in range(cfg.num_layers):
        out += _layer(cfg, i)
    out.append(Entry(f"{p}model.norm.weight", ("final_norm", "scale"), (D,), "same"))
    if cfg.attn_res is not None:
        out += [Entry(f"{p}model.output_attn_res_norm.weight", ("out_res", "norm"), (D,), "same"),
                Entry(f"{p}model.output_attn_res_proj.weight", ("out_res", "query"), (D,), "row")]
    if not cfg.tie_embeddings:
        out.append(Entry(f"{p}lm_head.weight", ("head", "kernel"), (D, V), "T"))
    return out
