"""Prompts with images and clips: files or frames plus text -> ``(tokens, lengths, MediaBatch)``.

A sample is a sequence of parts: ``str`` is text; a ``pathlib.Path``, ``bytes``, PIL image or uint8
array is an image; a ``list``/``tuple`` of those is a clip's frames. With a tokenizer whose vocabulary
holds the K3 media ids, each image becomes the K3 chat template's block
``<|media_begin|>image {w}x{h}<|media_content|><|media_pad|><|media_end|>`` (source size, as K3's
template writes it) and each clip chunk a ``<|media_begin|>video<|media_content|><|media_pad|><|media_end|>``
block of its own (K2.5 also prefixes a timestamp, which needs the frame rate: not given here);
without one (e.g. the byte tokenizer of the tiny models) a part is just one placeholder.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import numpy as np
from PIL import Image

from k3jax.vision.batch import MediaBatch, build_inputs
from k3jax.vision.config import MEDIA_BEGIN_ID, MEDIA_CONTENT_ID, MEDIA_END_ID, MultimodalConfig
from k3jax.vision.preprocess import Media, image_media, video_media


def _has_markers(tokenizer, cfg: MultimodalConfig) -> bool:
    return tokenizer is not None and tokenizer.vocab_size > MEDIA_END_ID and cfg.media_token_id > MEDIA_END_ID


def _block(kind: str, tokenizer, cfg: MultimodalConfig) -> list[int]:
    return [MEDIA_BEGIN_ID, *map(int, tokenizer.encode(kind)), MEDIA_CONTENT_ID, cfg.media_token_id, MEDIA_END_ID]


def _text(part: str, tokenizer, name: str) -> list[int]:
    if tokenizer is None:
        raise ValueError(f"{name}: text parts need a tokenizer (or give token ids directly to build_inputs)")
    return [int(t) for t in tokenizer.encode(part)]


def sample_ids(parts: Sequence[Any], cfg: MultimodalConfig, tokenizer=None,
               name: str = "sample") -> tuple[list[int], list[list[Media]]]:
    """One sample's prompt ids (one placeholder per media item) and its media items, in order."""
    ids, items = [], []
    markers = _has_markers(tokenizer, cfg)
    for j, part in enumerate(parts):
        where = f"{name} part {j}"
        if isinstance(part, str):
            ids += _text(part, tokenizer, where)
        elif isinstance(part, (list, tuple)):
            chunks = video_media(part, cfg.vision, cfg.frames_per_chunk, f"{where} (video)")
            if markers:
                for chunk in chunks:
                    ids += _block("video", tokenizer, cfg)
                    items.append([chunk])
            else:
                ids.append(cfg.media_token_id)
                items.append(chunks)
        elif isinstance(part, (os.PathLike, bytes, bytearray, np.ndarray, Image.Image)):
            m = image_media(part, cfg.vision, f"{where} (image)")
            ids += _block(f"image {m.source_size[0]}x{m.source_size[1]}", tokenizer, cfg) if markers \
                else [cfg.media_token_id]
            items.append([m])
        else:
            raise ValueError(f"{where}: a part must be text (str), an image (Path, bytes, PIL image, uint8 array) "
                             f"or a clip (list of images), got {type(part)}")
    return ids, items


def prepare(samples: Sequence[Sequence[Any]], cfg: MultimodalConfig, tokenizer=None, *, bos: bool = True,
            **pack) -> tuple[np.ndarray, np.ndarray, MediaBatch]:
    """Model inputs for a batch of samples (``pack``: ``length``, ``pad_id``, ``num_patches``, ``num_merged``)."""
    prompts, media = [], []
    for b, parts in enumerate(samples):
        ids, items = sample_ids(parts, cfg, tokenizer, f"sample {b}")
        head = [cfg.text.bos_token_id] if bos and cfg.text.bos_token_id is not None else []
        prompts.append(head + ids)
        media.append(items)
    return build_inputs(prompts, media, cfg, **pack)
