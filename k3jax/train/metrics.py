"""Model FLOPs for MFU, and where metrics go (JSONL always, TensorBoard when installed).

Model FLOPs per token (training = 3× forward; PaLM, Chowdhery et al. 2022, App. B):
  - matmuls: 6 · active parameters (every weight a token touches, head included, input embedding
    excluded; ``k3jax.params.count_params``), plus the MTP modules' active weights and their shared head;
  - MLA: 3 · 2 · (T/2) · H · (d_qk + d_v) — causal attention sees T/2 keys on average;
  - KDA (chunkwise, chunk C): 3 · 2 · H · (C/2 · (K + V) + 3 · K · V) — the in-chunk causal
    products plus the state read, correction and update per token.
Rematerialised recomputation is not counted (model FLOPs, not hardware FLOPs).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.config import LayerKind, ModelConfig

# Dense bf16 peak per device (vendor datasheets, without sparsity).
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "B200": 2250e12}


def _mla_flops(cfg: ModelConfig, seq_len: int) -> float:
    m = cfg.mla
    return 3 * 2 * (seq_len / 2) * m.num_heads * (m.qk_head_dim + m.v_head_dim)


def _kda_flops(cfg: ModelConfig) -> float:
    k = cfg.kda
    return 3 * 2 * k.num_heads * (k.chunk_size / 2 * 2 * k.head_dim + 3 * k.head_dim * k.head_dim)


def _active_size(tree: Any, cfg: ModelConfig) -> float:
    """Parameter count a token touches: routed expert stacks count k/E of their size."""
    total = 0.0
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        keys = [str(getattr(p, "key", p)) for p in path]
        size = float(np.prod(leaf.shape))
        if keys[-1] in ("w1", "w2", "w3") and "moe" in keys:
            size *= cfg.moe.top_k / cfg.moe.num_experts
        total += size
    return total


def flops_per_token(cfg: ModelConfig, seq_len: int, mtp_params: Any = None) -> float:
    """Training model FLOPs per token (see the module docstring)."""
    from k3jax.params import count_params

    flops = 6.0 * count_params(cfg).active
    for kind in cfg.layer_kinds:
        flops += _mla_flops(cfg, seq_len) if kind is LayerKind.MLA else _kda_flops(cfg)
    if mtp_params:
        from k3jax.train.mtp import block_index

        depth_mixer = cfg.layer_kinds[block_index(cfg)]
        flops += 6.0 * (_active_size(mtp_params, cfg) + cfg.mtp.num_layers * cfg.hidden * cfg.vocab_size)
        mixer = _mla_flops(cfg, seq_len) if depth_mixer is LayerKind.MLA else _kda_flops(cfg)
        flops += cfg.mtp.num_layers * mixer
    return flops


def ep_metrics(stats: Any, balance: Any, cfg: ModelConfig, ep: int) -> dict[str, Any]:
    """Expert-parallel metrics of a step: the most assignments an expert rank received over the
    mean (worst layer and micro-batch), assignments past the a2a buffers (summed; those calls ran
    further all-to-all rounds), and the MoonEP replicas in use (all layers; ``sharding.moonep``)."""
    leaves = jax.tree_util.tree_flatten_with_path((stats, balance))[0]
    named = lambda name: [v for p, v in leaves if str(getattr(p[-1], "key", p[-1])) == name]
    out = {}
    if named("ep_received_max_mean"):
        out["ep_received_max_mean"] = jnp.max(jnp.stack([jnp.max(v) for v in named("ep_received_max_mean")]))
        out["ep_overflow"] = sum(jnp.sum(v) for v in named("ep_overflow"))
    if named("replica_expert") and ep > 1:
        from sharding.moonep_placement import active_replicas

        out["ep_replicas"] = sum(active_replicas(e, s, cfg.moe.num_experts, ep)
                                 for e, s in zip(named("replica_expert"), named("replica_share")))
    return out


def peak_flops(override: float | None = None) -> float | None:
    """Per-device peak from ``override`` or the device kind; None when unknown (e.g. CPU)."""
    if override:
        return override
    kind = jax.devices()[0].device_kind
    for name, value in PEAK_FLOPS.items():
        if name in kind:
            return value
    return None


class MetricsLog:
    """Appends one JSON object per logged step to ``<log_dir>/metrics.jsonl``; mirrors scalars to
    TensorBoard when ``tensorboardX`` or ``torch.utils.tensorboard`` is importable."""

    def __init__(self, log_dir: str | None, tensorboard: bool = True):
        self.path = None
        self.writer = None
        if log_dir is None:
            return
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        self.path = Path(log_dir) / "metrics.jsonl"
        if tensorboard:
            self.writer = _tensorboard_writer(log_dir)

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        row = {"step": int(step), "time": time.time()}
        row.update({k: _plain(v) for k, v in metrics.items()})
        if self.path is not None:
            with self.path.open("a") as f:
                f.write(json.dumps(row) + "\n")
        if self.writer is not None:
            for k, v in row.items():
                if k not in ("step", "time") and isinstance(v, (int, float)) and math.isfinite(v):
                    self.writer.add_scalar(k, v, int(step))

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def _plain(v: Any) -> Any:
    v = np.asarray(v)
    if v.ndim == 0:
        return v.item() if np.isfinite(v) or v.dtype == bool else str(v.item())
    return v.tolist()


def _tensorboard_writer(log_dir: str):
    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            return None
    return SummaryWriter(log_dir)
