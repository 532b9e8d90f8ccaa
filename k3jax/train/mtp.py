"""Multi-token prediction (DeepSeek-V3, arXiv 2412.19437 §2.2; SPEC §8).

MTP depth j = 1..D (K3 trains D = 1) predicts token ``t_{i+j+1}`` at position i:
  1. ``h'_i = M_j [RMSNorm(h^{j-1}_i); RMSNorm(Emb(t_{i+j}))]`` with ``h^0`` the main model's final
     hidden (the final-norm input, ``Transformer(..., return_hidden=True)``) and the embedding
     table shared with the main model;
  2. ``h^j = Block_j(h'_i)``: one decoder layer of the backbone's kind (MLA + MoE where the stack has
     one; a plain pre-norm residual, since the block stands alone);
  3. ``logits = RMSNorm_j(h^j) W_head`` with the main model's head ``W_head`` shared.
Loss: ``λ / D · Σ_j CE_j`` (``cfg.mtp.loss_weight``), masked where ``t_{i+j+1}`` is not in the
same document or not a training target.

Parameters live beside the model's (``{"model": …, "mtp": …}`` in the train state), so the model's
own tree stays the Hugging Face contract of docs/params.md.
"""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from k3jax.config import LayerKind, ModelConfig
from k3jax.layers.attn_res import ResidualStream
from k3jax.layers.block import DecoderLayer
from k3jax.layers.linear import proj
from k3jax.layers.norm import norm


def block_index(cfg: ModelConfig) -> int:
    """The backbone layer whose kind (mixer, dense/MoE) the MTP block copies.

    Prefer the last MLA + MoE layer; with Block AttnRes the layer must not start a block (a lone
    block has no stored sources), so ``index % block_size != 0``.
    """
    kinds, moe = cfg.layer_kinds, cfg.moe_layers

    def alone(l):
        return cfg.attn_res is None or l % cfg.attn_res.block_size != 0

    for pred in (lambda l: kinds[l] is LayerKind.MLA and moe[l], lambda l: moe[l], lambda l: True):
        found = [l for l in range(cfg.num_layers) if pred(l) and alone(l)]
        if found:
            return found[-1]
    raise ValueError(f"mtp: no layer of {cfg.name} can stand alone as the MTP block "
                     f"(attn_res.block_size={cfg.attn_res.block_size} divides every layer index)")


def shift_left(x: Array, by: int, fill=0) -> Array:
    """``x[:, i + by]`` at position i, ``fill`` past the end."""
    if by == 0:
        return x
    pad = jnp.full(x.shape[:1] + (by,) + x.shape[2:], fill, x.dtype)
    return jnp.concatenate([x[:, by:], pad], axis=1)


def mtp_targets(labels: Int[Array, "B T"], loss_mask: Array, segment_ids: Int[Array, "B T"] | None,
                depth: int) -> tuple[Int[Array, "B T"], Int[Array, "B T"], Float[Array, "B T"]]:
    """(input token ``t_{i+depth}``, target ``t_{i+depth+1}``, mask) for MTP depth ``depth`` ≥ 1.

    ``labels[:, i] = t_{i+1}``. A target counts only if every main-loss target from i to i+depth is
    one and all lie in position i's document.
    """
    mask = loss_mask.astype(jnp.float32)
    ok = mask
    for j in range(1, depth + 1):
        ok = ok * shift_left(mask, j)
        if segment_ids is not None:
            ok = ok * (shift_left(segment_ids, j, -1) == segment_ids)
    return shift_left(labels, depth - 1), shift_left(labels, depth), ok


class MTPDepth(nn.Module):
    """One MTP module: fuse, one decoder block, its own final norm; head and embedding shared."""

    cfg: ModelConfig
    remat_moe: bool = False

    @nn.compact
    def __call__(self, hidden: Float[Array, "B T D"], next_emb: Float[Array, "B T D"],
                 segment_ids: Int[Array, "B T"] | None):
        """``(RMSNorm_j(h^j) in the compute dtype — the head's input —, h^j)``."""
        cfg, D = self.cfg, self.cfg.hidden
        fused = jnp.concatenate([norm(cfg, "hidden_norm")(hidden), norm(cfg, "embed_norm")(next_emb)], -1)
        # [2D, D]: "mlp" for the 2D input axis, since a tensor may not name one logical axis twice.
        h = proj(cfg, "BTC,CD->BTD", (2 * D, D), ("mlp", "embed"), "fuse")(fused)  # [B, T, D]
        stream = ResidualStream.start(h, 0)
        stream = DecoderLayer(cfg, block_index(cfg), remat_moe=self.remat_moe, name="block")(stream, segment_ids)
        out = stream.partial
        return norm(cfg, "final_norm")(out).astype(cfg.compute_dtype), out


class MTP(nn.Module):
    """``cfg.mtp.num_layers`` sequential MTP depths; returns each depth's head input (the loss
    applies the shared head, ``k3jax.train.loss.head_cross_entropy``)."""

    cfg: ModelConfig
    remat: str = "none"

    @nn.compact
    def __call__(self, hidden: Float[Array, "B T D"], labels: Int[Array, "B T"], embedding: Float[Array, "V D"],
                 segment_ids: Int[Array, "B T"] | None = None) -> list[Array]:
        cfg = self.cfg
        depth_cls = nn.remat(MTPDepth) if self.remat == "layer" else MTPDepth
        out = []
        for j in range(1, cfg.mtp.num_layers + 1):
            tokens = shift_left(labels, j - 1)
            emb = jnp.take(embedding, tokens, axis=0).astype(cfg.compute_dtype)  # [B, T, D]
            features, hidden = depth_cls(cfg, remat_moe=self.remat == "moe", name=f"depth_{j}")(
                hidden, emb, segment_ids)
            out.append(features)
        return out
