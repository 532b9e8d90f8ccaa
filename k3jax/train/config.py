"""Training configuration: one frozen ``TrainConfig`` (nested sections) next to the ``ModelConfig``.

Experiments are Python files whose ``get_config()`` returns a ``TrainConfig`` built with
``dataclasses.replace``; the CLI applies ``--set section.field=value`` overrides with `override`
(typed by the fields' annotations, `k3jax.overrides`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from k3jax.config import ModelConfig, tiny
from k3jax.data.config import CopyConfig, TextConfig
from k3jax.overrides import apply_overrides

REMAT_POLICIES = ("none", "layer", "moe")
LOSS_LOGITS_DTYPES = (None, "float32", "bfloat16")  # k3jax.train.loss.head_cross_entropy
LOSS_IMPLEMENTATIONS = (None, "xla", "pallas")  # k3jax.train.loss.head_cross_entropy
SCHEDULES = ("cosine", "wsd")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


MATMUL_PRECISIONS = ("default", "high", "highest", "bfloat16", "tensorfloat32", "float32",
                     "BF16_BF16_F32", "BF16_BF16_F32_X3", "BF16_BF16_F32_X6", "TF32_TF32_F32", "F32_F32_F32")
NS_DTYPES = ("bfloat16", "float32")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """Per-head Muon for matrices + AdamW for the rest (SPEC §7), global-norm clipping, QK-Clip.

    ``muon=False`` sends every parameter to AdamW (the baseline to compare against).
    ``qk_clip_tau=None`` turns QK-Clip off.
    """

    learning_rate: float = 2e-3
    adam_learning_rate: float | None = None  # None: same as learning_rate (Moonlight RMS matching)
    weight_decay: float = 0.1
    muon: bool = True
    muon_beta: float = 0.95
    ns_steps: int = 5
    consistent_rms: float = 0.2
    adam_b1: float = 0.9
    adam_b2: float = 0.95
    eps: float = 1e-8
    grad_clip_norm: float | None = 1.0
    qk_clip_tau: float | None = 100.0
    # Matmul precision inside the optimizer update (Newton–Schulz): a jax.default_matmul_precision
    # name. bf16 operands with fp32 accumulation, as in Jordan's Muon; None: JAX's default (TF32
    # for fp32 on a GPU). float64 runs always use the default.
    ns_precision: str | None = "BF16_BF16_F32"
    # Storage dtype of the Newton–Schulz iterate and its products (the momentum stays fp32 and the
    # update returns to fp32): bf16 as in Jordan's Muon; None: the momentum's dtype (fp32).
    # float64 runs always keep float64.
    ns_dtype: str | None = "bfloat16"

    def __post_init__(self):
        _require(self.learning_rate > 0, f"learning_rate={self.learning_rate} must be > 0")
        _require(self.adam_learning_rate is None or self.adam_learning_rate > 0,
                 f"adam_learning_rate={self.adam_learning_rate} must be > 0 or None")
        _require(self.weight_decay >= 0, f"weight_decay={self.weight_decay} must be >= 0")
        _require(0 <= self.muon_beta < 1, f"muon_beta={self.muon_beta} must be in [0, 1)")
        _require(self.ns_steps >= 1, f"ns_steps={self.ns_steps} must be >= 1")
        _require(self.grad_clip_norm is None or self.grad_clip_norm > 0,
                 f"grad_clip_norm={self.grad_clip_norm} must be > 0 or None")
        _require(self.qk_clip_tau is None or self.qk_clip_tau > 0,
                 f"qk_clip_tau={self.qk_clip_tau} must be > 0 or None")
        _require(self.ns_precision is None or self.ns_precision in MATMUL_PRECISIONS,
                 f"ns_precision={self.ns_precision!r} must be None or one of {MATMUL_PRECISIONS}")
        _require(self.ns_dtype is None or self.ns_dtype in NS_DTYPES,
                 f"ns_dtype={self.ns_dtype!r} must be None or one of {NS_DTYPES}")


@dataclasses.dataclass(frozen=True)
class ScheduleConfig:
    kind: str = "cosine"
    warmup_fraction: float = 0.01
    decay_fraction: float = 0.2  # WSD only: the final linear decay, as a fraction of all steps
    final_lr_ratio: float = 0.1

    def __post_init__(self):
        _require(self.kind in SCHEDULES, f"kind={self.kind!r} must be one of {SCHEDULES}")
        _require(0 <= self.warmup_fraction < 1, f"warmup_fraction={self.warmup_fraction} must be in [0, 1)")
        _require(0 < self.decay_fraction <= 1, f"decay_fraction={self.decay_fraction} must be in (0, 1]")
        _require(0 <= self.final_lr_ratio <= 1, f"final_lr_ratio={self.final_lr_ratio} must be in [0, 1]")


@dataclasses.dataclass(frozen=True)
class RecallConfig:
    """Multi-query associative recall (Zoology, Arora et al., arXiv 2312.04927): ``num_pairs`` key-value
    pairs, then ``num_queries`` of the keys again; the model must answer each with its value."""

    num_pairs: int = 8
    num_queries: int = 8
    num_keys: int = 64
    num_values: int = 64

    def __post_init__(self):
        _require(self.num_pairs >= 1, f"num_pairs={self.num_pairs} must be >= 1")
        _require(1 <= self.num_queries <= self.num_pairs,
                 f"num_queries={self.num_queries} must be in [1, num_pairs={self.num_pairs}]")
        _require(self.num_keys >= self.num_pairs,
                 f"num_keys={self.num_keys} must be >= num_pairs={self.num_pairs} (keys are distinct)")
        _require(self.num_values >= 2, f"num_values={self.num_values} must be >= 2")


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """``source``: "recall" (synthetic MQAR, built in), "random" (uniform tokens, for benchmarks), or a
    source of ``k3jax.data``: "copy" (synthetic), "text" (local files at ``path``), "stdlib" (the
    interpreter's standard library); ``copy`` and ``text`` hold their options."""

    source: str = "recall"
    path: str | None = None
    seed: int = 0
    recall: RecallConfig = RecallConfig()
    copy: CopyConfig = CopyConfig()
    text: TextConfig = TextConfig()


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    dir: str | None = None  # None: no checkpoints
    every_steps: int = 100
    keep_last: int = 2
    keep_best: int = 1  # by training loss at the save step (0: off)
    async_save: bool = True
    resume: bool = True  # restore the newest good checkpoint in ``dir`` if there is one
    # A fresh run's model parameters (not its optimizer state) from a Hugging Face folder, a run
    # folder or a checkpoints folder (k3jax.checkpoint_source); ignored when resuming from ``dir``.
    init_from: str | None = None

    def __post_init__(self):
        _require(self.every_steps >= 1, f"every_steps={self.every_steps} must be >= 1")
        _require(self.keep_last >= 1, f"keep_last={self.keep_last} must be >= 1")
        _require(self.keep_best >= 0, f"keep_best={self.keep_best} must be >= 0")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Device mesh as ``((axis, size), …)`` over ``sharding.AXES`` (data, fsdp, expert, sequence,
    tensor); empty: single device, no sharding. ``rules``: a table of ``sharding.STRATEGIES``, or
    None for the one that fits the mesh (``sharding.rules_for_mesh``)."""

    axes: tuple[tuple[str, int], ...] = ()
    rules: str | None = None

    def __post_init__(self):
        object.__setattr__(self, "axes", tuple((str(n), int(s)) for n, s in self.axes))
        for name, size in self.axes:
            _require(size >= 1, f"mesh axis {name!r} has size={size}; must be >= 1")

    @property
    def num_devices(self) -> int:
        n = 1
        for _, size in self.axes:
            n *= size
        return n


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything a training run needs. ``batch_size`` is the global batch of sequences per optimizer
    step, split into ``micro_batches`` equal micro-batches (gradient accumulation)."""

    model: ModelConfig = dataclasses.field(default_factory=tiny)
    optimizer: OptimizerConfig = OptimizerConfig()
    schedule: ScheduleConfig = ScheduleConfig()
    data: DataConfig = DataConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    mesh: MeshConfig = MeshConfig()
    steps: int = 100
    batch_size: int = 8
    seq_len: int = 128
    micro_batches: int = 1
    remat: str = "none"
    seed: int = 0
    log_dir: str | None = None  # JSONL metrics (and TensorBoard if installed) go here
    log_every: int = 10
    tensorboard: bool = True
    max_consecutive_nonfinite: int = 5
    peak_flops: float | None = None  # per device, for MFU; None: looked up from the device kind
    loss_chunk: int = 4096  # tokens per chunk of the fused head + cross-entropy (k3jax.train.loss)
    # dtype the head's matmul stores the fp32-accumulated logits in (None: fp32; "bfloat16": half
    # the loss's memory traffic, as a bf16 PyTorch lm_head; k3jax.train.loss)
    loss_logits_dtype: str | None = None
    # the head's logits and their logsumexp: "xla", "pallas" (Hopper: one Mosaic GPU kernel whose
    # matmul epilogue emits the logsumexp's partials; pallas_kernels.head_ce), or None: the kernel
    # where it runs (a Hopper GPU, bf16/f16 features, shapes its tiling divides), else XLA
    loss_implementation: str | None = None
    # XLA's --xla_allow_excess_precision for the train step (its default: True). True lets the GPU
    # compiler drop the bf16 roundings the model writes (f32 -> bf16 -> f32 pairs): it then keeps
    # and re-reads fp32 copies of bf16 activations (AttnRes mixes, norm inputs), 17.9 GB more glue
    # traffic per small() micro-batch of 8 x 4096 tokens (benchmarks/layer_glue.py --train small).
    # False rounds where the code says, as the CPU backend always does (SPEC §10: bf16 activations).
    excess_precision: bool = False
    # More XLA options for the train step, "NAME=VALUE" each (e.g. "xla_gpu_enable_cublaslt=true");
    # values read as bool, int, float or else string (`xla_compiler_options`). bench_train.py and
    # bench_layer.py --variant time such options against the defaults in one process.
    xla_options: tuple[str, ...] = ()

    def __post_init__(self):
        for name in ("steps", "batch_size", "seq_len", "micro_batches", "log_every",
                     "max_consecutive_nonfinite", "loss_chunk"):
            _require(getattr(self, name) >= 1, f"{name}={getattr(self, name)} must be >= 1")
        xla_compiler_options(self.excess_precision, self.xla_options)  # names a malformed entry
        _require(self.batch_size % self.micro_batches == 0,
                 f"batch_size={self.batch_size} must be divisible by micro_batches={self.micro_batches}")
        _require(self.loss_logits_dtype in LOSS_LOGITS_DTYPES,
                 f"loss_logits_dtype={self.loss_logits_dtype!r} must be one of {LOSS_LOGITS_DTYPES}")
        _require(self.loss_implementation in LOSS_IMPLEMENTATIONS,
                 f"loss_implementation={self.loss_implementation!r} must be one of {LOSS_IMPLEMENTATIONS}")
        _require(self.remat in REMAT_POLICIES, f"remat={self.remat!r} must be one of {REMAT_POLICIES}")
        _require(self.seq_len <= self.model.max_position,
                 f"seq_len={self.seq_len} must be <= model.max_position={self.model.max_position}")

    @property
    def micro_batch_size(self) -> int:
        return self.batch_size // self.micro_batches

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len


def xla_compiler_options(excess_precision: bool = False, xla_options=()) -> dict[str, bool | int | float | str]:
    """The train step's XLA options: ``xla_allow_excess_precision`` and each ``"NAME=VALUE"`` of
    ``xla_options`` (``TrainConfig``'s fields), the value as a bool (true / false), an int, a float or
    else a string. A malformed entry raises ``ValueError`` naming it."""
    options: dict[str, bool | int | float | str] = {"xla_allow_excess_precision": excess_precision}
    for entry in xla_options:
        name, sep, raw = entry.partition("=") if isinstance(entry, str) else ("", "", "")
        _require(sep == "=" and name.startswith("xla_") and raw != "",
                 f"xla_options entry {entry!r} must read NAME=VALUE with NAME an XLA option (xla_…)")
        options[name] = _option_value(raw)
    return options


def _option_value(raw: str) -> bool | int | float | str:
    if raw.lower() in ("true", "false"):
        return raw.lower() == "true"
    for kind in (int, float):
        try:
            return kind(raw)
        except ValueError:
            pass
    return raw


def override(cfg: Any, assignments: list[str]) -> Any:
    """Apply ``["section.field=value", …]`` to a frozen dataclass tree, each value parsed against its
    field's type (`k3jax.overrides`); a bad key or value raises ``ValueError`` naming both."""
    return apply_overrides(cfg, assignments)


def to_dict(cfg: Any) -> Any:
    """JSON-friendly nested dict of a config (dtypes and enums as names), for checkpoints and logs."""
    if dataclasses.is_dataclass(cfg):
        return {f.name: to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, (tuple, list)):
        return [to_dict(v) for v in cfg]
    if isinstance(cfg, (int, float, str, bool)) or cfg is None:
        return cfg
    if hasattr(cfg, "value") and isinstance(getattr(cfg, "value"), str):
        return cfg.value
    try:
        import numpy as np

        return np.dtype(cfg).name
    except TypeError:
        return repr(cfg)



def from_dict(cls: type, data: dict) -> Any:
    """The (nested, frozen) config dataclass ``cls`` from the JSON form ``to_dict`` writes; fields
    absent from ``data`` keep their defaults (checkpoints written before a field existed)."""
    import typing

    import jax.numpy as jnp

    hints = typing.get_type_hints(cls)
    kwargs = {}
    for field in dataclasses.fields(cls):
        if field.name not in data:
            continue
        value, hint = data[field.name], hints[field.name]
        if isinstance(value, dict):
            sub = [a for a in typing.get_args(hint) or (hint,) if dataclasses.is_dataclass(a)]
            value = from_dict(sub[0], value)
        elif field.name.endswith("dtype") and value is not None:
            value = jnp.dtype(value)
        elif isinstance(value, list):
            value = tuple(tuple(v) if isinstance(v, list) else v for v in value)
        kwargs[field.name] = value
    return cls(**kwargs)
