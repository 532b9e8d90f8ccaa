"""Model configuration: ``ModelConfig`` (composing the component configs of
``k3jax.component_configs``, re-exported here), the layer pattern as data, and presets.

Every field has one meaning and one home. Family differences (Kimi K3, Kimi-Linear, Kimi K2)
are switches here, so one model code path runs all three (SPEC §1). Reading Hugging Face
``config.json`` files lives in ``k3jax.convert.hf_config``; ``from_hf_config`` is re-exported here.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from k3jax.balance import BalanceConfig
from k3jax.component_configs import (  # noqa: F401  (re-exported: the usual import path)
    AttnResConfig, KDAConfig, LayerKind, MLAConfig, MLPConfig, MoEConfig, MTPConfig, RopeConfig,
    _positive, _require)


def hybrid_mla_layers(num_layers: int, period: int = 4) -> tuple[int, ...]:
    """0-based MLA layers of the K3 / Kimi-Linear pattern: ``(l+1) % period == 0`` or the last layer."""
    return tuple(l for l in range(num_layers) if (l + 1) % period == 0 or l == num_layers - 1)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """One Kimi-family decoder-only language model.

    ``dtype`` is the compute dtype (matmul operands, activations between layers); ``param_dtype``
    the stored parameter dtype. The fp32 islands of SPEC §10 use ``promote(dtype, float32)``, so a
    float64 model stays float64 everywhere.
    """

    name: str
    vocab_size: int
    hidden: int
    num_layers: int
    kda: KDAConfig | None
    mla: MLAConfig
    mlp: MLPConfig
    moe: MoEConfig
    attn_res: AttnResConfig | None  # None: plain pre-norm residual
    rms_norm_eps: float = 1e-5
    max_position: int = 1_048_576
    mla_layers: tuple[int, ...] | None = None  # 0-based; None: the hybrid rule (all MLA if kda is None)
    mtp: MTPConfig = MTPConfig()
    balance: BalanceConfig = BalanceConfig()
    tie_embeddings: bool = False
    initializer_range: float = 0.02
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    dtype: Any = jnp.bfloat16
    param_dtype: Any = jnp.float32
    # Scan the longest run of repeating layers (``k3jax.layout``): one traced copy of the repeating
    # unit, parameters stacked on a leading ``layers`` axis. False: every layer traced on its own.
    scan_layers: bool = True
    # Decoding a few tokens, the glue between the projections on ``decode_layout``'s tree inside the
    # kernels: each normed input (the AttnRes mix and RMSNorm before a layer's input projections, the
    # latent norm before ``up_proj``, the head's) computed by one kernel (``k3jax.layers.mixed_input``),
    # and KDA's convs, norms and gates by its step's kernel (``KDA._fused_step``): "pallas"; None (the
    # default): where a CUDA GPU runs it (small() on the H100: batch 1 0.774 -> 0.727 ms, batch 64 level;
    # benchmarks/RESULTS.md, stop 54); "xla": XLA's kernels. Both run the 16-bit projections of 5-64 rows
    # on ``kernel_gpu_tokens.token_matmul`` (batch 64 -1.4 % on the H100, RESULTS.md stop 56).
    decode_glue_implementation: str | None = None

    def __post_init__(self):
        _require(self.decode_glue_implementation in (None, "xla", "pallas"),
                 f"decode_glue_implementation={self.decode_glue_implementation!r} must be one of "
                 "(None, 'xla', 'pallas')")
        _positive(vocab_size=self.vocab_size, hidden=self.hidden, num_layers=self.num_layers,
                  rms_norm_eps=self.rms_norm_eps, max_position=self.max_position)
        for field in ("dtype", "param_dtype"):
            value = getattr(self, field)
            _require(jnp.issubdtype(jnp.dtype(value), jnp.floating),
                     f"{field}={value!r} must be a floating dtype")
        if self.mla_layers is not None:
            object.__setattr__(self, "mla_layers", tuple(int(l) for l in self.mla_layers))
            bad = [l for l in self.mla_layers if not 0 <= l < self.num_layers]
            _require(not bad, f"mla_layers={self.mla_layers} must lie in [0, num_layers={self.num_layers})")
            _require(len(set(self.mla_layers)) == len(self.mla_layers),
                     f"mla_layers={self.mla_layers} has duplicates")
        _require(self.kda is not None or all(k is LayerKind.MLA for k in self.layer_kinds),
                 "kda=None (an all-MLA model) but mla_layers leaves KDA layers; set kda or mla_layers=None")
        _require(self.mlp.first_dense_layers <= self.num_layers,
                 f"mlp.first_dense_layers={self.mlp.first_dense_layers} must be <= num_layers={self.num_layers}")
        for token in ("bos_token_id", "eos_token_id", "pad_token_id"):
            value = getattr(self, token)
            _require(value is None or 0 <= value < self.vocab_size,
                     f"{token}={value} must lie in [0, vocab_size={self.vocab_size})")

    @property
    def layer_kinds(self) -> tuple[LayerKind, ...]:
        """The token mixer of every layer, in order: the hybrid stack as data."""
        if self.mla_layers is not None:
            mla = set(self.mla_layers)
        elif self.kda is None:
            mla = set(range(self.num_layers))
        else:
            mla = set(hybrid_mla_layers(self.num_layers))
        return tuple(LayerKind.MLA if l in mla else LayerKind.KDA for l in range(self.num_layers))

    @property
    def moe_layers(self) -> tuple[bool, ...]:
        """Whether each layer's MLP is the MoE (else the dense MLP)."""
        return tuple(l >= self.mlp.first_dense_layers for l in range(self.num_layers))

    @property
    def moe_width(self) -> int:
        """Width the routed experts act on: the latent L for LatentMoE, else D."""
        return self.moe.latent_dim or self.hidden

    @property
    def num_attn_res_blocks(self) -> int:
        """Block-sum sources stored after the last layer (embedding + finished blocks)."""
        if self.attn_res is None:
            return 0
        return -(-self.num_layers // self.attn_res.block_size)

    @property
    def compute_dtype(self):
        return jnp.dtype(self.dtype)

    @property
    def fp32_dtype(self):
        """The dtype of the fp32 islands: float32, or wider if the policy is wider."""
        return jnp.promote_types(self.dtype, jnp.float32)


@dataclasses.dataclass(frozen=True)
class ParamCount:
    total: int
    active: int

    def __str__(self) -> str:
        """Billions (``total 2,779.48 B, active 104.19 B``), or millions below a billion, where
        billions would print ``0.00 B`` for the small presets."""
        scale, unit = (1e9, "B") if self.total >= 1e9 else (1e6, "M")
        return f"total {self.total / scale:,.2f} {unit}, active {self.active / scale:,.2f} {unit}"


def kimi_k3() -> ModelConfig:
    """The published Kimi K3 text model (``moonshotai/Kimi-K3`` config.json)."""
    return ModelConfig(
        name="kimi_k3", vocab_size=163840, hidden=7168, num_layers=93,
        kda=KDAConfig(num_heads=96, head_dim=128, conv_size=4, gate_lower_bound=-5.0),
        mla=MLAConfig(num_heads=96, kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128,
                      qk_rope_head_dim=64, v_head_dim=128, output_gate=True),
        mlp=MLPConfig(activation="situ", dense_intermediate=33792, first_dense_layers=1),
        moe=MoEConfig(num_experts=896, top_k=16, expert_intermediate=3072, num_shared_experts=2,
                      shared_intermediate=3072, latent_dim=3584, latent_norm=True,
                      routed_scaling_factor=1.0),
        attn_res=AttnResConfig(block_size=12), rms_norm_eps=1e-5, max_position=1_048_576,
        bos_token_id=163584, eos_token_id=163586, pad_token_id=163839,
    )


def kimi_linear_48b() -> ModelConfig:
    """Kimi-Linear-48B-A3B: softplus KDA gate, low-rank output gate, plain residual, SwiGLU."""
    return ModelConfig(
        name="kimi_linear_48b", vocab_size=163840, hidden=2304, num_layers=27,
        kda=KDAConfig(num_heads=32, head_dim=128, conv_size=4, gate_lower_bound=None,
                      output_gate_rank=128),
        mla=MLAConfig(num_heads=32, kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128,
                      qk_rope_head_dim=64, v_head_dim=128, output_gate=False),
        mlp=MLPConfig(activation="swiglu", dense_intermediate=9216, first_dense_layers=1),
        moe=MoEConfig(num_experts=256, top_k=8, expert_intermediate=1024, num_shared_experts=1,
                      shared_intermediate=1024, latent_dim=None, latent_norm=False,
                      routed_scaling_factor=2.446),
        attn_res=None, rms_norm_eps=1e-5, max_position=1_048_576,
        bos_token_id=163584, eos_token_id=163586, pad_token_id=163839,
    )


def kimi_k2() -> ModelConfig:
    """Kimi K2 (the baseline): all-MLA with RoPE + YaRN, SwiGLU, plain residual."""
    return ModelConfig(
        name="kimi_k2", vocab_size=163840, hidden=7168, num_layers=61, kda=None,
        mla=MLAConfig(num_heads=64, kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128,
                      qk_rope_head_dim=64, v_head_dim=128, output_gate=False,
                      rope=RopeConfig(theta=50000.0, yarn_factor=32.0, yarn_original_max_position=4096)),
        mlp=MLPConfig(activation="swiglu", dense_intermediate=18432, first_dense_layers=1),
        moe=MoEConfig(num_experts=384, top_k=8, expert_intermediate=2048, num_shared_experts=1,
                      shared_intermediate=2048, latent_dim=None, latent_norm=False,
                      routed_scaling_factor=2.827),
        attn_res=None, rms_norm_eps=1e-6, max_position=131_072,
        bos_token_id=163584, eos_token_id=163585, pad_token_id=163839,
    )


def small() -> ModelConfig:
    """A K3-shaped model of about 0.8 B parameters for one GPU (K3 head dims, so kernels apply)."""
    return ModelConfig(
        name="small", vocab_size=163840, hidden=1024, num_layers=12,
        kda=KDAConfig(num_heads=8, head_dim=128, conv_size=4, gate_lower_bound=-5.0),
        mla=MLAConfig(num_heads=8, kv_lora_rank=256, q_lora_rank=384, qk_nope_head_dim=128,
                      qk_rope_head_dim=64, v_head_dim=128, output_gate=True),
        mlp=MLPConfig(activation="situ", dense_intermediate=4096, first_dense_layers=1),
        moe=MoEConfig(num_experts=64, top_k=8, expert_intermediate=512, num_shared_experts=2,
                      shared_intermediate=512, latent_dim=512, latent_norm=True,
                      routed_scaling_factor=1.0),
        attn_res=AttnResConfig(block_size=4), rms_norm_eps=1e-5, max_position=1_048_576,
        # Unrolled: at 12 layers the H200 runs the train step 1.34x faster and compiles it faster
        # unrolled (2.01 against 2.70 s at 64 x 4096 tokens; benchmarks/RESULTS.md, stop 34).
        scan_layers=False,
    )


def tiny() -> ModelConfig:
    """A K3-shaped model of every feature for CPU tests (vocab 256, so byte-level text fits)."""
    return ModelConfig(
        name="tiny", vocab_size=256, hidden=64, num_layers=6,
        kda=KDAConfig(num_heads=4, head_dim=16, conv_size=4, gate_lower_bound=-5.0, chunk_size=16),
        mla=MLAConfig(num_heads=4, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=16,
                      qk_rope_head_dim=8, v_head_dim=16, output_gate=True),
        mlp=MLPConfig(activation="situ", dense_intermediate=96, first_dense_layers=1),
        moe=MoEConfig(num_experts=16, top_k=4, expert_intermediate=32, num_shared_experts=2,
                      shared_intermediate=32, latent_dim=32, latent_norm=True,
                      routed_scaling_factor=1.0),
        attn_res=AttnResConfig(block_size=2), rms_norm_eps=1e-5, max_position=8192,
    )


PRESETS = {f.__name__: f for f in (kimi_k3, kimi_linear_48b, kimi_k2, small, tiny)}


def preset(name: str) -> ModelConfig:
    """A preset by name: one of ``PRESETS``."""
    if name not in PRESETS:
        raise ValueError(f"preset {name=} must be one of {sorted(PRESETS)}")
    return PRESETS[name]()


def to_float64(cfg: ModelConfig) -> ModelConfig:
    """The same model with float64 compute and parameters (needs ``jax_enable_x64``)."""
    return dataclasses.replace(cfg, dtype=jnp.float64, param_dtype=jnp.float64)


def first_layers(cfg: ModelConfig, n: int) -> ModelConfig:
    """The first ``n`` layers of ``cfg``'s pattern at its real widths (quick compile and memory probes)."""
    if not isinstance(n, int) or not 1 <= n <= cfg.num_layers:
        raise ValueError(f"n={n!r} layers must be an int in [1, num_layers={cfg.num_layers}]")
    mla = tuple(i for i, k in enumerate(cfg.layer_kinds[:n]) if k is LayerKind.MLA)
    return dataclasses.replace(cfg, num_layers=n, mla_layers=mla)


def from_hf_config(config: dict | str) -> ModelConfig:
    """A ``ModelConfig`` from a Hugging Face ``config.json`` (dict, file or folder) of either family."""
    from k3jax.convert.hf_config import from_hf_config as _from_hf

    return _from_hf(config)

