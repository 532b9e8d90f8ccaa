"""One training run of an experiment: cached data, ``k3jax.train.Trainer`` steps, held-out loss, probes.

Data: the interpreter's standard library (``k3jax.data.stdlib_corpus``), byte tokenizer, packed with
document ids (``k3jax.data.PackedBatches``). It is tokenised once per (split, batch, length) and
cached as ``.npz`` beside the results, so every run of a study sees the same batches in the same
order (step s of every run trains on batch s) and a resumed study re-reads instead of re-packing.
The held-out loss is the mean next-byte cross-entropy (nats) over fixed batches of the validation
split (documents chosen by a hash of their path, never trained on).
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.config import ModelConfig
from k3jax.data import PackedBatches, load_tokenizer, stdlib_corpus
from k3jax.params import count_params
from k3jax.train.config import OptimizerConfig, ScheduleConfig, TrainConfig
from k3jax.train.metrics import flops_per_token
from k3jax.train.step import Trainer

STEP_METRICS = ("loss", "grad_norm", "load_max_mean", "load_cv", "load_zero_experts", "max_logit")
# Packed arrays stored narrow (bytes fit uint8; a row holds < 65536 documents): 5 bytes per token.
_STORED = {"tokens": np.uint8, "labels": np.uint8, "segment_ids": np.uint16, "loss_mask": np.bool_}
_LOADED = {"tokens": np.int32, "labels": np.int32, "segment_ids": np.int32, "loss_mask": np.float32}


@dataclasses.dataclass(frozen=True)
class Recipe:
    """The optimiser recipe and token budget of a run (the model comes separately)."""

    learning_rate: float
    steps: int
    batch_size: int
    seq_len: int
    warmup_fraction: float = 0.05
    seed: int = 0

    @property
    def tokens(self) -> int:
        return self.steps * self.batch_size * self.seq_len


def train_config(model: ModelConfig, recipe: Recipe) -> TrainConfig:
    """Per-head Muon + AdamW + QK-Clip (the k3jax defaults) on a cosine schedule, one micro-batch."""
    return TrainConfig(
        model=model, optimizer=dataclasses.replace(OptimizerConfig(), learning_rate=recipe.learning_rate),
        schedule=ScheduleConfig(kind="cosine", warmup_fraction=recipe.warmup_fraction, final_lr_ratio=0.1),
        steps=recipe.steps, batch_size=recipe.batch_size, seq_len=recipe.seq_len, seed=recipe.seed,
        tensorboard=False)


def corpus_fingerprint() -> str:
    """Which standard library the data came from (its path, size, file count), hashed."""
    corpus = stdlib_corpus("train")
    return hashlib.sha256(f"{corpus.files[0].parent}|{len(corpus.files)}|{corpus.num_total}".encode()).hexdigest()[:12]


def cached_batches(folder: Path, split: str, batch_size: int, seq_len: int, num_batches: int) -> dict[str, np.ndarray]:
    """``num_batches`` packed stdlib batches ``{key: [n, B, T]}``, tokenised once and cached in ``folder``."""
    if split not in ("train", "validation"):
        raise ValueError(f"split={split!r} must be 'train' or 'validation'")
    path = Path(folder) / f"stdlib_{split}_b{batch_size}_t{seq_len}.npz"
    if path.exists():
        with np.load(path) as cached:
            if cached["tokens"].shape[0] >= num_batches:
                return {k: cached[k][:num_batches] for k in _STORED}
    tokenizer = load_tokenizer(None)
    train = split == "train"
    stream = PackedBatches(stdlib_corpus(split), tokenizer, batch_size, seq_len, seed=0, shuffle=train,
                           num_epochs=None if train else 1)
    batches = [next(stream, None) for _ in range(num_batches)]
    if any(b is None for b in batches):
        raise ValueError(f"the {split} split holds fewer than num_batches={num_batches} batches of {batch_size}×{seq_len}")
    arrays = {k: np.stack([b[k] for b in batches]).astype(t) for k, t in _STORED.items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.stem + ".tmp.npz")
    np.savez(tmp, **arrays)
    tmp.replace(path)
    return arrays


def batch(arrays: dict[str, np.ndarray], index: int) -> dict[str, np.ndarray]:
    return {k: arrays[k][index].astype(_LOADED[k]) for k in _STORED}


def model_numbers(model: ModelConfig, seq_len: int) -> dict[str, float]:
    """Parameters and training FLOPs per token (``k3jax.params`` / ``k3jax.train.metrics``)."""
    p = count_params(model)
    return {"params_total": p.total, "params_active": p.active, "flops_per_token": flops_per_token(model, seq_len)}


def _eval_fn(trainer: Trainer):
    def ce(params, balance, b):
        _, aux = trainer.loss(params, balance, b, jnp.ones([]), [])
        return aux["ce"] / jnp.maximum(jnp.sum(b["loss_mask"]), 1.0)

    return jax.jit(ce)


def train(model: ModelConfig, recipe: Recipe, data: dict[str, np.ndarray], held_out: dict[str, np.ndarray], *,
          probe: Callable | None = None, probe_points: int = 0, log_every: int = 25) -> dict:
    """Train ``model`` with ``recipe`` on ``data`` (one cached batch per step); the record of the run.

    The record holds the per-step training metrics (``STEP_METRICS``), the held-out loss of every
    validation batch at the end, the model's numbers (``model_numbers``), timing (the first step,
    which compiles, apart) and, with ``probe``, ``probe(trainer)(params, balance, tokens)`` evaluated
    on the first held-out batch at ``probe_points`` evenly spaced steps (the last one included).
    """
    if data["tokens"].shape[0] < recipe.steps:
        raise ValueError(f"data holds {data['tokens'].shape[0]} batches; recipe.steps={recipe.steps} needs one per step")
    trainer = Trainer(train_config(model, recipe))
    start = time.perf_counter()
    state = trainer.init_state(jax.random.key(recipe.seed))
    probe_fn = probe(trainer) if probe is not None else None
    probe_at = set(np.linspace(0, recipe.steps, probe_points).round().astype(int).tolist()) if probe_fn else set()
    probe_tokens = jnp.asarray(batch(held_out, 0)["tokens"])
    history, probes, pending = {k: [] for k in STEP_METRICS}, [], []
    compile_s = None
    for step in range(recipe.steps + 1):
        if step in probe_at:
            out = jax.device_get(probe_fn(state.params["model"], state.balance["model"], probe_tokens))
            probes.append({"step": step, **jax.tree.map(lambda x: np.asarray(x).tolist(), out)})
        if step == recipe.steps:
            break
        state, metrics = trainer.step(state, batch(data, step))
        pending.append({k: metrics[k] for k in STEP_METRICS if k in metrics})
        if step == 0:
            jax.block_until_ready(metrics)
            compile_s = time.perf_counter() - start
        if len(pending) == log_every or step == recipe.steps - 1:
            for row in jax.device_get(pending):
                for k in STEP_METRICS:
                    history[k].append(float(row[k]) if k in row else None)
            pending = []
            print(f"  {model.name} step {step + 1}/{recipe.steps} loss {history['loss'][-1]:.4f}", flush=True)
    train_s = time.perf_counter() - start
    eval_fn = _eval_fn(trainer)
    params, bal = state.params, state.balance
    held = [float(eval_fn(params, bal, batch(held_out, i))) for i in range(held_out["tokens"].shape[0])]
    return {"model": model.name, "recipe": dataclasses.asdict(recipe), **model_numbers(model, recipe.seq_len),
            "tokens": recipe.tokens, "held_out_losses": held, "held_out_loss": float(np.mean(held)),
            "history": history, "probes": probes, "seconds": round(time.perf_counter() - start, 2),
            "compile_seconds": round(compile_s, 2), "train_seconds": round(train_s, 2),
            "backend": jax.default_backend(), "device": jax.devices()[0].device_kind}
