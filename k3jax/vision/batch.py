"""Model inputs for a multimodal batch: prompts with expanded placeholders and packed patches.

Layout (static shapes, one compiled program per ``(B, T, N, M)``): row ``b`` of the batch owns its
media; their patches are packed into ``N`` slots of that row, padding last, with a per-patch
``segments`` id (media index + 1, 0 = padding) that keeps attention inside one image or clip. So
images of any size mix in one batch, and the batch axis of the patches is the text batch axis
(sharded over ``data`` like the tokens).

Patch order inside a media item is ``(merged row, merged col, frame, kh, kw)``: the 2 x 2 window
of a merged token is four consecutive patches, so the merge is a reshape and the temporal mean a
segment mean over the ``t`` windows of one merged slot (``window_target``, ``window_weight = 1/t``).
Attention is order-free and every patch carries its own ``(row, col, frame)``, so this order
computes what the releases compute in raster order.

Placeholders: each image or clip appears as ONE ``media_token_id`` in a prompt; ``build_inputs``
expands it to the media's merged-token count (for a clip, the sum over its chunks), and the k-th
placeholder position of row b receives merged token k of row b.
"""

from __future__ import annotations

from typing import Sequence

import flax.struct
import numpy as np
from jaxtyping import ArrayLike, Bool, Float, Int

from k3jax.vision.config import MultimodalConfig, VisionConfig
from k3jax.vision.positions import grid_taps
from k3jax.vision.preprocess import Media


@flax.struct.dataclass
class MediaBatch:
    """Packed media of a batch: host (numpy) arrays from ``pack_media``, device arrays inside ``jit``."""

    pixels: Float[ArrayLike, "B N P"]  # patch pixels flattened (C, py, px), as a Conv2d weight reads them
    segments: Int[ArrayLike, "B N"]  # media index + 1 within the row; 0 = padding
    rows: Int[ArrayLike, "B N"]  # patch row / col in its image (2-D RoPE)
    cols: Int[ArrayLike, "B N"]
    frames: Int[ArrayLike, "B N"]  # frame index for the time embedding; -1: none (images, 1-frame clips)
    pos_index: Int[ArrayLike, "B N K"]  # taps into the flattened position grid
    pos_weight: Float[ArrayLike, "B N K"]
    window_target: Int[ArrayLike, "B Nw"]  # merged slot of each window of 4 patches; M = padding
    window_weight: Float[ArrayLike, "B Nw"]  # 1/t: the temporal mean
    merged_valid: Bool[ArrayLike, "B M"]

    @property
    def num_merged(self) -> int:
        return self.merged_valid.shape[1]


def _media_arrays(m: Media, cfg: VisionConfig, segment: int, offset: int) -> dict[str, np.ndarray]:
    t, h, w = m.patch_grid(cfg)
    p, (kh, kw), C = cfg.patch_size, cfg.merge, cfg.channels
    mh, mw = h // kh, w // kw
    x = m.pixels.reshape(t, mh, kh, p, mw, kw, p, C).transpose(1, 4, 0, 2, 5, 7, 3, 6)  # [mh,mw,t,kh,kw,C,p,p]
    idx = np.indices((mh, mw, t, kh, kw)).reshape(5, -1)
    rows, cols, frames = idx[0] * kh + idx[3], idx[1] * kw + idx[4], idx[2]
    pos_index, pos_weight = grid_taps(rows, cols, h, w, cfg.pos_grid, cfg.interpolation)
    n_windows = mh * mw * t
    return dict(pixels=x.reshape(-1, cfg.patch_features), segments=np.full(len(rows), segment), rows=rows, cols=cols,
                frames=frames if t > 1 else np.full(len(rows), -1), pos_index=pos_index, pos_weight=pos_weight,
                window_target=offset + np.repeat(np.arange(mh * mw), t), window_weight=np.full(n_windows, 1.0 / t))


def _check_media(m: Media, cfg: VisionConfig, name: str) -> None:
    t, H, W, C = m.pixels.shape
    fh, fw = cfg.merge_pixels
    if C != cfg.channels or H % fh or W % fw or H == 0 or W == 0:
        raise ValueError(f"{name}: pixels must be [t, H, W, {cfg.channels}] with H, W positive multiples of "
                         f"{fh}x{fw}, got {m.pixels.shape}")
    if t > cfg.pos_time:
        raise ValueError(f"{name}: a clip chunk holds at most pos_time={cfg.pos_time} frames, got {t}")


def pack_media(media: Sequence[Sequence[Media]], cfg: VisionConfig, *, num_patches: int | None = None,
               num_merged: int | None = None) -> MediaBatch:
    """Pack each row's media into ``num_patches`` patch slots and ``num_merged`` merged slots
    (default: the batch's largest row, at least one window)."""
    window = cfg.merge[0] * cfg.merge[1]
    need_n = [sum(int(np.prod(m.patch_grid(cfg))) for m in row) for row in media]
    need_m = [sum(m.num_tokens(cfg) for m in row) for row in media]
    N = max(need_n + [window]) if num_patches is None else num_patches
    M = max(need_m + [1]) if num_merged is None else num_merged
    if N % window:
        raise ValueError(f"num_patches={N} must be a multiple of the merge window {window}")
    for b, (n, m) in enumerate(zip(need_n, need_m)):
        if n > N or m > M:
            raise ValueError(f"sample {b}: its media need {n} patches and {m} merged tokens, "
                             f"above num_patches={N} / num_merged={M}")
    B, K = len(media), (2 if cfg.interpolation == "bilinear" else 4) ** 2
    out = dict(pixels=np.zeros((B, N, cfg.patch_features), np.float32), segments=np.zeros((B, N), np.int32),
               rows=np.zeros((B, N), np.int32), cols=np.zeros((B, N), np.int32), frames=np.full((B, N), -1, np.int32),
               pos_index=np.zeros((B, N, K), np.int32), pos_weight=np.zeros((B, N, K), np.float32),
               window_target=np.full((B, N // window), M, np.int32),
               window_weight=np.zeros((B, N // window), np.float32), merged_valid=np.zeros((B, M), bool))
    for b, row in enumerate(media):
        n = m_off = 0
        for i, m in enumerate(row):
            _check_media(m, cfg, f"sample {b} media {i}")
            arrays = _media_arrays(m, cfg, i + 1, m_off)
            k = len(arrays["rows"])
            for key, value in arrays.items():
                if key.startswith("window"):
                    out[key][b, n // window:(n + k) // window] = value
                else:
                    out[key][b, n:n + k] = value
            n, m_off = n + k, m_off + m.num_tokens(cfg)
        out["merged_valid"][b, :m_off] = True
    return MediaBatch(**out)


def expand_placeholders(prompt: Sequence[int], counts: Sequence[int], media_token_id: int, name: str) -> list[int]:
    """Replace the i-th ``media_token_id`` of ``prompt`` by ``counts[i]`` copies of it."""
    slots = [i for i, t in enumerate(prompt) if t == media_token_id]
    if len(slots) != len(counts):
        raise ValueError(f"{name}: the prompt has {len(slots)} media placeholders (id {media_token_id}) "
                         f"for {len(counts)} images/clips; give exactly one per image or clip")
    out, queue = [], list(counts)
    for t in prompt:
        out.extend([t] * queue.pop(0) if t == media_token_id else [t])
    return out


def build_inputs(prompts: Sequence[Sequence[int]], media: Sequence[Sequence[Sequence[Media]]], cfg: MultimodalConfig,
                 *, length: int | None = None, pad_id: int = 0, num_patches: int | None = None,
                 num_merged: int | None = None) -> tuple[np.ndarray, np.ndarray, MediaBatch]:
    """``(tokens [B,T], lengths [B], MediaBatch)``: right-padded prompts with expanded placeholders.

    ``media[b]`` lists row b's images/clips in prompt order, each a list of ``Media`` chunks (one for
    an image); each is one placeholder in ``prompts[b]``.
    """
    if len(prompts) != len(media):
        raise ValueError(f"prompts and media must have one entry per sample, got {len(prompts)} and {len(media)}")
    v = cfg.vision
    rows = [expand_placeholders(p, [sum(c.num_tokens(v) for c in item) for item in items], cfg.media_token_id,
                                f"sample {b}") for b, (p, items) in enumerate(zip(prompts, media))]
    T = max(len(r) for r in rows) if length is None else length
    for b, r in enumerate(rows):
        if not 1 <= len(r) <= T:
            raise ValueError(f"sample {b}: {len(r)} tokens after expanding placeholders, must lie in [1, length={T}]")
    tokens = np.full((len(rows), T), pad_id, np.int32)
    for b, r in enumerate(rows):
        tokens[b, :len(r)] = r
    flat = [[chunk for item in items for chunk in item] for items in media]
    batch = pack_media(flat, v, num_patches=num_patches, num_merged=num_merged)
    return tokens, np.array([len(r) for r in rows], np.int32), batch
