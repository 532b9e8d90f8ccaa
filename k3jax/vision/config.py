"""Vision configuration: the MoonViT towers, their projector, preprocessing, and the multimodal model.

Every width is a field because no original K3 vision ``config.json`` is public (SPEC §9 [open]); the
presets follow the public serving code. Where the sources disagree:

- Norm eps of the tower's RMSNorms: SGLang's ``kimi_k3_vl.py`` builds ``nn.RMSNorm(dim)`` with no eps,
  which PyTorch resolves to ``finfo(input dtype).eps`` (1.2e-7 in fp32, 7.8e-3 in bf16). We compute
  norms in fp32, so the K3 preset uses the fp32 value; the K2.5 LayerNorms use PyTorch's 1e-5.
- Activations: the tower MLP uses tanh-GELU (``activation_func: gelu_pytorch_tanh`` in the tiny K3
  oracle's ``vision_config``), the projector the exact erf GELU (``nn.GELU()``).
- Pixel budget: the releases scale an image down to ``in_patch_limit`` patches (K2.5 default 4096)
  and at most ``patch_limit_on_one_side`` patches a side, bicubic, then zero-pad to a multiple of
  28 (SPEC and the issue say "resize to multiples of 28": the code pads). We do the same; an input
  larger than ``max_input_pixels`` is refused outright (a decompression bomb, not a photo).
- Temporal positions: ``init_pos_emb_time`` = 4 sin/cos rows, added only to clips of more than one
  frame (a one-frame clip gets none, as SGLang's ``t == 1`` branch); so a clip holds at most 4 frames
  and longer videos are split into chunks of ``frames_per_chunk`` frames, one placeholder each.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np

from k3jax.config import ModelConfig

MEDIA_PAD_ID = 163605  # <|media_pad|>
MEDIA_BEGIN_ID, MEDIA_CONTENT_ID, MEDIA_END_ID = 163602, 163603, 163604
FP32_EPS = float(np.finfo(np.float32).eps)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """A MoonViT tower (patch embedding, pre-norm ViT blocks, 2x2 merge) and its projector to D."""

    name: str
    hidden: int = 1024  # W
    num_layers: int = 27
    num_heads: int = 12
    head_dim: int = 128  # q/k/v are num_heads·head_dim wide (1536 for K3, != hidden)
    mlp_dim: int = 4096
    patch_size: int = 14
    channels: int = 3
    norm: str = "rmsnorm"  # "rmsnorm" (K3) | "layernorm" (Kimi-VL, K2.5)
    norm_eps: float = FP32_EPS
    bias: bool = False  # biases on wqkv, wo, fc0, fc1 (K2.5: yes)
    patch_bias: bool = False
    pos_grid: tuple[int, int] = (64, 64)  # the learned position grid
    pos_time: int = 4  # fixed sin/cos rows over time = the most frames per clip
    interpolation: str = "bilinear"  # "bilinear" (K3) | "bicubic" (K2.5), PyTorch align_corners=False
    rope_theta: float = 10000.0
    merge: tuple[int, int] = (2, 2)
    projector: str = "patchmergerv2"  # K3: MLP then RMSNorm(D); "patchmerger" (K2.5): LayerNorm then MLP with bias
    projector_eps: float = 1e-5
    # Preprocessing (the release's media_proc_cfg).
    max_patches: int = 4096  # in_patch_limit: images are scaled down to at most this many patches
    max_side_patches: int = 512  # patch_limit_on_one_side
    max_input_pixels: int = 100_000_000  # larger inputs are refused, not resized
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    initializer_range: float = 0.02
    dtype: Any = jnp.bfloat16
    param_dtype: Any = jnp.float32

    def __post_init__(self):
        for f in ("hidden", "num_layers", "num_heads", "head_dim", "mlp_dim", "patch_size", "channels",
                  "pos_time", "max_patches", "max_side_patches", "max_input_pixels"):
            _require(getattr(self, f) > 0, f"{f}={getattr(self, f)!r} must be > 0")
        _require(self.head_dim % 4 == 0, f"head_dim={self.head_dim} must be a multiple of 4 (2-D RoPE pairs)")
        _require(self.norm in ("rmsnorm", "layernorm"), f"norm={self.norm!r} must be 'rmsnorm' or 'layernorm'")
        _require(self.interpolation in ("bilinear", "bicubic"),
                 f"interpolation={self.interpolation!r} must be 'bilinear' or 'bicubic'")
        _require(self.projector in ("patchmergerv2", "patchmerger"),
                 f"projector={self.projector!r} must be 'patchmergerv2' or 'patchmerger'")
        _require(len(self.pos_grid) == 2 and min(self.pos_grid) > 0, f"pos_grid={self.pos_grid} must be 2 sizes > 0")
        _require(len(self.merge) == 2 and min(self.merge) > 0, f"merge={self.merge} must be 2 sizes > 0")
        _require(self.hidden % 2 == 0, f"hidden={self.hidden} must be even (sin/cos time embedding)")

    @property
    def qkv_width(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def merged_width(self) -> int:
        """Features per merged token: the merge window's patches side by side (4096 for K3)."""
        return self.merge[0] * self.merge[1] * self.hidden

    @property
    def patch_features(self) -> int:
        return self.channels * self.patch_size * self.patch_size

    @property
    def merge_pixels(self) -> tuple[int, int]:
        """Pixel sides an image is padded to a multiple of (28 x 28 for patch 14, merge 2x2)."""
        return self.merge[0] * self.patch_size, self.merge[1] * self.patch_size

    @property
    def compute_dtype(self):
        return jnp.dtype(self.dtype)

    @property
    def fp32_dtype(self):
        return jnp.promote_types(self.dtype, jnp.float32)


@dataclasses.dataclass(frozen=True)
class MultimodalConfig:
    """The language model, the tower, and the placeholder id their features replace."""

    text: ModelConfig
    vision: VisionConfig
    media_token_id: int = MEDIA_PAD_ID
    frames_per_chunk: int = 4  # video frames per clip (the temporal pooling window)

    def __post_init__(self):
        _require(0 <= self.media_token_id < self.text.vocab_size,
                 f"media_token_id={self.media_token_id} must lie in [0, text.vocab_size={self.text.vocab_size})")
        _require(1 <= self.frames_per_chunk <= self.vision.pos_time,
                 f"frames_per_chunk={self.frames_per_chunk} must lie in [1, vision.pos_time={self.vision.pos_time}]")


def moonvit_v2(**overrides) -> VisionConfig:
    """K3's MoonViT-V2 (SGLang ``configs/kimi_k3.py`` defaults; ~0.40 B in the tower)."""
    return dataclasses.replace(VisionConfig(name="moonvit_v2"), **overrides)


def moonvit_k25(**overrides) -> VisionConfig:
    """Kimi-VL / K2.5's MoonViT: width 1152, 16 heads of 72, MLP 4304, LayerNorm and biases, bicubic."""
    base = VisionConfig(name="moonvit_k25", hidden=1152, num_layers=27, num_heads=16, head_dim=72, mlp_dim=4304,
                        norm="layernorm", norm_eps=1e-5, bias=True, patch_bias=True, interpolation="bicubic",
                        projector="patchmerger")
    return dataclasses.replace(base, **overrides)


def tiny_vision(**overrides) -> VisionConfig:
    """Every K3 tower feature at CPU-test size (patch 14, a 6x6 position grid)."""
    base = VisionConfig(name="tiny_vision", hidden=32, num_layers=2, num_heads=2, head_dim=16, mlp_dim=64,
                        pos_grid=(6, 6), max_patches=256, max_side_patches=32)
    return dataclasses.replace(base, **overrides)


VISION_PRESETS = {f.__name__: f for f in (moonvit_v2, moonvit_k25, tiny_vision)}


def kimi_k3_multimodal() -> MultimodalConfig:
    from k3jax.config import kimi_k3

    return MultimodalConfig(text=kimi_k3(), vision=moonvit_v2())


def to_float32(cfg: MultimodalConfig) -> MultimodalConfig:
    """The same model with float32 compute everywhere (for exact-comparison tests)."""
    return dataclasses.replace(cfg, text=dataclasses.replace(cfg.text, dtype=jnp.float32),
                               vision=dataclasses.replace(cfg.vision, dtype=jnp.float32))
