"""Images and video frames to normalised pixel arrays (Pillow + numpy), as the Kimi releases do it.

Per image (vLLM / SGLang ``navit_resize_image``): scale down (never up) so that the image holds at
most ``max_patches`` patches of 14 x 14 and at most ``max_side_patches`` a side, resize bicubic,
then zero-pad right and bottom to a multiple of 28 (patch x merge), and normalise with
mean = std = 0.5. A clip is a list of same-size frames, split into chunks of ``frames_per_chunk``
(4) frames; each chunk is one media item with its own placeholder (the temporal pooling window).

Every check raises ``ValueError`` naming the sample (``name``) before anything reaches JAX:
unreadable or truncated files, zero-size images, inputs above ``max_input_pixels``, frames of
different sizes in one clip.
"""

from __future__ import annotations

import dataclasses
import io
import math
import os
from typing import Any, Sequence

import numpy as np
from PIL import Image

from k3jax.vision.config import VisionConfig

ImageSource = Any  # a path, bytes, a PIL image, or an [H, W, 3] uint8 array


@dataclasses.dataclass(frozen=True)
class Media:
    """One image or one clip chunk: ``pixels [t, H, W, C]`` normalised, ``H, W`` multiples of 28."""

    pixels: np.ndarray
    source_size: tuple[int, int]  # (width, height) before resizing
    kind: str  # "image" | "video"

    def patch_grid(self, cfg: VisionConfig) -> tuple[int, int, int]:
        """(frames, patch rows, patch cols)."""
        t, H, W, _ = self.pixels.shape
        return t, H // cfg.patch_size, W // cfg.patch_size

    def num_tokens(self, cfg: VisionConfig) -> int:
        """Merged tokens (placeholder positions): ``(h/2)·(w/2)`` whatever ``t`` (pooled over time)."""
        _, h, w = self.patch_grid(cfg)
        return (h // cfg.merge[0]) * (w // cfg.merge[1])


def _open(source: ImageSource, name: str) -> Image.Image:
    if isinstance(source, Image.Image):
        return source
    if isinstance(source, np.ndarray):
        if source.ndim not in (2, 3) or source.dtype != np.uint8:
            raise ValueError(f"{name}: an image array must be [H, W] or [H, W, C] uint8, "
                             f"got {source.shape} {source.dtype}")
        if 0 in source.shape[:2]:
            raise ValueError(f"{name}: zero-size image {source.shape[1]}x{source.shape[0]}")
        return Image.fromarray(source)
    try:
        if isinstance(source, (bytes, bytearray)):
            return Image.open(io.BytesIO(source))
        if isinstance(source, (str, os.PathLike)):
            return Image.open(source)
    except (OSError, Image.DecompressionBombError) as e:  # UnidentifiedImageError is an OSError
        raise ValueError(f"{name}: cannot read image {_label(source)}: {e}") from None
    raise ValueError(f"{name}: an image must be a path, bytes, a PIL image or a uint8 array, got {type(source)}")


def _label(source: ImageSource) -> str:
    return repr(os.fspath(source)) if isinstance(source, (str, os.PathLike)) else f"<{len(source)} bytes>"


def load_image(source: ImageSource, cfg: VisionConfig, name: str = "image") -> Image.Image:
    """A decoded RGB image, checked: readable to the end, non-empty, within ``max_input_pixels``."""
    image = _open(source, name)
    w, h = image.size
    if w == 0 or h == 0:
        raise ValueError(f"{name}: zero-size image {w}x{h}")
    if w * h > cfg.max_input_pixels:
        raise ValueError(f"{name}: image {w}x{h} has {w * h} pixels, above max_input_pixels={cfg.max_input_pixels}")
    try:
        image.load()  # decoding is lazy: a truncated file fails only here
    except (OSError, SyntaxError, ValueError) as e:
        raise ValueError(f"{name}: corrupt or truncated image {w}x{h}: {e}") from None
    return image.convert("RGB")


def resize_plan(width: int, height: int, cfg: VisionConfig) -> tuple[int, int, int, int]:
    """``(new_width, new_height, padded_width, padded_height)`` of the release's NaViT resize."""
    p = cfg.patch_size
    patches = max(1.0, width // p) * max(1.0, height // p)
    scale = min(1.0, math.sqrt(cfg.max_patches / patches), cfg.max_side_patches * p / width,
                cfg.max_side_patches * p / height)
    new_w = min(max(1, int(width * scale)), cfg.max_side_patches * p)
    new_h = min(max(1, int(height * scale)), cfg.max_side_patches * p)
    fh, fw = cfg.merge_pixels
    return new_w, new_h, -(-new_w // fw) * fw, -(-new_h // fh) * fh


def _pixels(image: Image.Image, plan: tuple[int, int, int, int], cfg: VisionConfig) -> np.ndarray:
    new_w, new_h, pad_w, pad_h = plan
    if (new_w, new_h) != image.size:
        image = image.resize((new_w, new_h), resample=Image.Resampling.BICUBIC)
    canvas = np.zeros((pad_h, pad_w, cfg.channels), np.uint8)  # zero padding, as the release
    canvas[:new_h, :new_w] = np.asarray(image)[..., :cfg.channels]
    mean, std = np.asarray(cfg.image_mean, np.float32), np.asarray(cfg.image_std, np.float32)
    return (canvas.astype(np.float32) / 255.0 - mean) / std


def image_media(source: ImageSource, cfg: VisionConfig, name: str = "image") -> Media:
    """One image as a media item."""
    image = load_image(source, cfg, name)
    plan = resize_plan(*image.size, cfg)
    return Media(_pixels(image, plan, cfg)[None], image.size, "image")


def video_media(frames: Sequence[ImageSource], cfg: VisionConfig, frames_per_chunk: int,
                name: str = "video") -> list[Media]:
    """A clip as media items of ``frames_per_chunk`` frames each (the last may be shorter)."""
    if len(frames) == 0:
        raise ValueError(f"{name}: a clip needs at least one frame")
    images = [load_image(f, cfg, f"{name} frame {i}") for i, f in enumerate(frames)]
    sizes = {im.size for im in images}
    if len(sizes) != 1:
        raise ValueError(f"{name}: all frames of a clip must have one size, got {sorted(sizes)}")
    plan = resize_plan(*images[0].size, cfg)
    pixels = np.stack([_pixels(im, plan, cfg) for im in images])
    return [Media(pixels[i:i + frames_per_chunk], images[0].size, "video")
            for i in range(0, len(images), frames_per_chunk)]
