"""The configurations of the model's components: the token mixers (KDA, MLA with its RoPE), the
dense MLP, the MoE, Block AttnRes and MTP — frozen dataclasses that check their own fields.

``k3jax.config.ModelConfig`` composes them (and re-exports them: ``from k3jax.config import
MoEConfig`` is the usual import).
"""

from __future__ import annotations

import dataclasses
import enum

_IMPLEMENTATIONS = (None, "xla", "pallas")


class LayerKind(str, enum.Enum):
    """The token mixer of a decoder layer."""

    KDA = "kda"
    MLA = "mla"


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _positive(**fields: int | float) -> None:
    for name, value in fields.items():
        _require(value > 0, f"{name}={value!r} must be > 0")


@dataclasses.dataclass(frozen=True)
class KDAConfig:
    """Kimi Delta Attention (SPEC §2)."""

    num_heads: int
    head_dim: int
    conv_size: int = 4
    # K3: g = lb·sigmoid(exp(A_log)·z) with lb < 0. None: Kimi-Linear's -exp(A_log)·softplus(z).
    gate_lower_bound: float | None = -5.0
    # None: full-rank output gate W_g (K3). An int r: low rank W_gb W_ga with D→r→H·V (Kimi-Linear).
    output_gate_rank: int | None = None
    chunk_size: int = 64
    implementation: str | None = None
    # The GPU kernel path's intra-chunk prep backward: "split" (two Mosaic GPU kernels; H200 KDA
    # fwd+bwd 13.7 vs 27.9 ms with "xla") or "xla" (autodiff, the reference).
    gpu_prep_backward: str = "split"

    def __post_init__(self):
        _require(self.gpu_prep_backward in ("xla", "split"),
                 f"gpu_prep_backward={self.gpu_prep_backward!r} must be 'xla' or 'split'")
        _positive(num_heads=self.num_heads, head_dim=self.head_dim, conv_size=self.conv_size,
                  chunk_size=self.chunk_size)
        _require(self.gate_lower_bound is None or self.gate_lower_bound < 0,
                 f"gate_lower_bound={self.gate_lower_bound!r} must be < 0 (or None for the softplus gate)")
        _require(self.output_gate_rank is None or self.output_gate_rank > 0,
                 f"output_gate_rank={self.output_gate_rank!r} must be > 0 or None (full rank)")
        _require(self.implementation in _IMPLEMENTATIONS,
                 f"implementation={self.implementation!r} must be one of {_IMPLEMENTATIONS}")
        _require(not (self.implementation == "pallas" and self.gate_lower_bound is None),
                 "implementation='pallas' needs gate_lower_bound < 0: the kernels assume the bounded "
                 "gate (SPEC §2); the softplus gate runs on the XLA path")

    @property
    def scan_implementation(self) -> str | None:
        """The chunk-scan path: the Pallas kernels rely on the lower-bounded gate, so the unbounded
        softplus gate always takes the XLA path."""
        return "xla" if self.gate_lower_bound is None else self.implementation

    @property
    def decay_rank(self) -> int:
        """Rank of the low-rank decay projection W_fb W_fa (D→K→H·K)."""
        return self.head_dim


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding with optional YaRN scaling (Kimi K2's MLA only; K3 and Kimi-Linear are NoPE)."""

    theta: float = 50000.0
    yarn_factor: float | None = None
    yarn_original_max_position: int = 4096
    yarn_beta_fast: float = 1.0
    yarn_beta_slow: float = 1.0
    yarn_mscale: float = 1.0
    yarn_mscale_all_dim: float = 1.0

    def __post_init__(self):
        _positive(theta=self.theta, yarn_original_max_position=self.yarn_original_max_position)
        _require(self.yarn_factor is None or self.yarn_factor >= 1,
                 f"yarn_factor={self.yarn_factor!r} must be >= 1 or None")


@dataclasses.dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (SPEC §3); gated and NoPE in K3."""

    num_heads: int
    kv_lora_rank: int = 512
    q_lora_rank: int | None = 1536  # None: q = W_q x (Kimi-Linear)
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    output_gate: bool = True
    rope: RopeConfig | None = None  # None: NoPE, the "rope" slice is used unrotated
    # The two LoRA RMSNorms use eps 1e-6, hard-coded in the references (not rms_norm_eps).
    lora_norm_eps: float = 1e-6
    # Training/prefill attention: None = flash kernel on a CUDA GPU for bf16/f16 compute, else XLA
    # (k3jax/layers/attention.py); "xla" or "pallas" force one.
    attention_implementation: str | None = None

    def __post_init__(self):
        _positive(num_heads=self.num_heads, kv_lora_rank=self.kv_lora_rank,
                  qk_nope_head_dim=self.qk_nope_head_dim, v_head_dim=self.v_head_dim)
        _require(self.qk_rope_head_dim >= 0, f"qk_rope_head_dim={self.qk_rope_head_dim} must be >= 0")
        _require(self.q_lora_rank is None or self.q_lora_rank > 0,
                 f"q_lora_rank={self.q_lora_rank!r} must be > 0 or None")
        _require(self.rope is None or self.qk_rope_head_dim % 2 == 0,
                 f"qk_rope_head_dim={self.qk_rope_head_dim} must be even when rope is used")
        _require(self.attention_implementation in _IMPLEMENTATIONS,
                 f"attention_implementation={self.attention_implementation!r} must be one of {_IMPLEMENTATIONS}")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_width(self) -> int:
        """Values cached per token per layer for decode: the latent plus the shared rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclasses.dataclass(frozen=True)
class MLPConfig:
    """The gated MLPs (dense first layers, shared and routed experts) and their activation."""

    activation: str = "situ"  # "situ" (SiTU-GLU, K3) or "swiglu"
    situ_beta: float = 4.0
    situ_linear_beta: float = 25.0
    dense_intermediate: int = 33792
    first_dense_layers: int = 1

    def __post_init__(self):
        _require(self.activation in ("situ", "swiglu"),
                 f"activation={self.activation!r} must be 'situ' or 'swiglu'")
        _positive(situ_beta=self.situ_beta, situ_linear_beta=self.situ_linear_beta,
                  dense_intermediate=self.dense_intermediate)
        _require(self.first_dense_layers >= 0, f"first_dense_layers={self.first_dense_layers} must be >= 0")


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Sigmoid-routed MoE with shared experts; LatentMoE when ``latent_dim`` is set (SPEC §4)."""

    num_experts: int = 896
    top_k: int = 16
    expert_intermediate: int = 3072
    num_shared_experts: int = 2
    shared_intermediate: int = 3072  # per shared expert; fused into one MLP of width n·F
    latent_dim: int | None = 3584  # None: experts at full width D (Kimi-Linear, K2)
    latent_norm: bool = True
    routed_scaling_factor: float = 1.0
    renormalize: bool = True
    implementation: str | None = None
    # routed experts of a decode step on the gather and dense paths (k3jax/layers/moe_decode.py):
    # "pallas" is their GPU kernels (pallas_kernels/moe/kernel_gpu_decode.py, batch 1, routing each
    # token itself where E is a power of two <= 256, and kernel_gpu_decode_dense.py, 16-256 tokens;
    # MXFP4 experts stay on "xla"); None picks them on a CUDA GPU where they take the shapes, else "xla"
    decode_implementation: str | None = None
    # MoonEP (sharding/moonep.py): redundant copies of hot experts per layer on an expert-parallel
    # mesh (a multiple of the expert axis size), re-planned from QB's loads every placement_every steps.
    redundant_experts: int = 0
    placement_every: int = 100

    def __post_init__(self):
        _positive(num_experts=self.num_experts, top_k=self.top_k,
                  expert_intermediate=self.expert_intermediate, placement_every=self.placement_every)
        _require(self.redundant_experts >= 0, f"redundant_experts={self.redundant_experts} must be >= 0")
        _require(self.top_k < self.num_experts,
                 f"top_k={self.top_k} must be < num_experts={self.num_experts}")
        _require(self.num_shared_experts >= 0, f"num_shared_experts={self.num_shared_experts} must be >= 0")
        _require(self.num_shared_experts == 0 or self.shared_intermediate > 0,
                 f"shared_intermediate={self.shared_intermediate} must be > 0 with shared experts")
        _require(self.latent_dim is None or self.latent_dim > 0,
                 f"latent_dim={self.latent_dim!r} must be > 0 or None")
        _require(not (self.latent_norm and self.latent_dim is None),
                 "latent_norm=True needs latent_dim (the norm acts on the latent)")
        _require(self.implementation in _IMPLEMENTATIONS,
                 f"implementation={self.implementation!r} must be one of {_IMPLEMENTATIONS}")
        _require(self.decode_implementation in _IMPLEMENTATIONS,
                 f"decode_implementation={self.decode_implementation!r} must be one of {_IMPLEMENTATIONS}")

    @property
    def shared_width(self) -> int:
        return self.num_shared_experts * self.shared_intermediate


@dataclasses.dataclass(frozen=True)
class AttnResConfig:
    """Block Attention Residuals (SPEC §5): block size in decoder layers."""

    block_size: int = 12
    eps: float = 1e-5  # RMS of the keys; the references use rms_norm_eps

    def __post_init__(self):
        _positive(block_size=self.block_size, eps=self.eps)


@dataclasses.dataclass(frozen=True)
class MTPConfig:
    """Multi-token prediction (SPEC §8); 0 layers in the published releases."""

    num_layers: int = 0
    loss_weight: float = 0.1

    def __post_init__(self):
        _require(self.num_layers >= 0, f"num_layers={self.num_layers} must be >= 0")
        _require(self.loss_weight >= 0, f"loss_weight={self.loss_weight} must be >= 0")
