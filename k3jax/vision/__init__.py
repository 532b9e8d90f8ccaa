"""Native vision (SPEC §9): the MoonViT towers, image/video preprocessing, and the multimodal model."""

from k3jax.vision.batch import MediaBatch, build_inputs, pack_media
from k3jax.vision.config import (MEDIA_PAD_ID, MultimodalConfig, VisionConfig, kimi_k3_multimodal, moonvit_k25,
                                 moonvit_v2, tiny_vision)
from k3jax.vision.model import MultimodalTransformer, text_variables
from k3jax.vision.preprocess import Media, image_media, video_media

__all__ = ["MEDIA_PAD_ID", "Media", "MediaBatch", "MultimodalConfig", "MultimodalTransformer", "VisionConfig",
           "build_inputs", "image_media", "kimi_k3_multimodal", "moonvit_k25", "moonvit_v2", "pack_media",
           "text_variables", "tiny_vision", "video_media"]
