"""The training loop: checks → (resume | init) → steps with logging and checkpoints → clean exit.

Everything that can be wrong with a config (mesh, data path, a checkpoint of another model) is
raised as ``ValueError`` before anything is compiled. Ctrl-C (SIGINT) or SIGTERM finishes the
current step, saves a checkpoint and returns; a second Ctrl-C aborts at once.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import time
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np

from k3jax.train.checkpoint import Checkpointer
from k3jax.train.config import TrainConfig
from k3jax.train.metrics import MetricsLog, flops_per_token, peak_flops
from k3jax.train.parallel import make_train_mesh
from k3jax.train.recall import RecallBatches
from k3jax.train.step import TrainState, Trainer


log = logging.getLogger(__name__)


class NonFiniteLossError(RuntimeError):
    """Too many consecutive steps with a non-finite loss or gradient."""


class RandomBatches:
    """Uniform random tokens (throughput benchmarks); batch n depends only on ``(seed, n)``."""

    def __init__(self, batch_size: int, seq_len: int, vocab_size: int, seed: int = 0):
        self.shape, self.vocab, self.seed, self.position = (batch_size, seq_len), vocab_size, seed, 0

    def __iter__(self):
        return self

    def __next__(self):
        rng = np.random.default_rng([self.seed, self.position])
        self.position += 1
        tokens = rng.integers(0, self.vocab, self.shape, dtype=np.int32)
        labels = np.concatenate([tokens[:, 1:], tokens[:, :1]], axis=1)
        return {"tokens": tokens, "segment_ids": np.ones(self.shape, np.int32), "labels": labels,
                "loss_mask": np.ones(self.shape, np.float32)}

    def get_state(self) -> dict:
        return {"kind": "random", "seed": self.seed, "position": self.position}

    def set_state(self, state: dict) -> None:
        self.position = int(state["position"])


def make_data(cfg: TrainConfig):
    """The batch iterator of ``cfg.data`` (``get_state``/``set_state`` for exact resume)."""
    d = cfg.data
    if d.path is not None and not Path(d.path).exists():
        raise ValueError(f"data.path={d.path!r} does not exist")
    if d.source == "recall":
        return RecallBatches(d.recall, cfg.batch_size, cfg.seq_len, cfg.model.vocab_size, d.seed)
    if d.source == "random":
        return RandomBatches(cfg.batch_size, cfg.seq_len, cfg.model.vocab_size, d.seed)
    try:
        from k3jax.data import make_batches
    except ImportError as err:
        raise ValueError(f"data.source={d.source!r} needs k3jax.data.make_batches ({err}); "
                         "built-in sources are 'recall' and 'random'") from err
    return make_batches(cfg)


@dataclasses.dataclass
class TrainResult:
    state: TrainState
    trainer: Trainer
    last_metrics: dict[str, Any]
    interrupted: bool
    checkpointer: Checkpointer | None


class _Interrupt:
    """SIGINT/SIGTERM → a flag the loop checks between steps; a second SIGINT raises at once."""

    def __init__(self):
        self.requested = False
        self._old = {}

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: no handlers, Ctrl-C behaves as usual
                pass
        return self

    def _handle(self, signum, frame):
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = True

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)


def _restore_or_init(trainer: Trainer, ckpt: Checkpointer | None, data, cfg: TrainConfig) -> TrainState:
    """The newest good checkpoint of the run; else a fresh state, its model parameters taken from
    ``checkpoint.init_from`` when set (the optimizer state stays fresh)."""
    if ckpt is not None and cfg.checkpoint.resume:
        restored = ckpt.restore(trainer.abstract_state())
        if restored is not None:
            state, data_state, step = restored
            data.set_state(data_state)
            log.info("resumed from step %d (%s)", step, ckpt.dir / str(step))
            return state
    state = trainer.init_state(jax.random.key(cfg.seed))
    if cfg.checkpoint.init_from is not None:
        state = _init_from(trainer, state, cfg.checkpoint.init_from)
    return state


def _init_from(trainer: Trainer, state: TrainState, path: str) -> TrainState:
    """``state`` with the main model's parameters and balancing biases read from ``path`` (a Hugging
    Face folder, a run folder or a checkpoints folder), placed with the state's own shardings."""
    from k3jax.checkpoint_source import load_variables

    abstract = trainer.abstract_state()
    want = {"params": abstract.params["model"], "balance": abstract.balance["model"]}
    _, variables = load_variables(path, abstract=lambda _: want)  # ValueError for another shape
    log.info("initialised the model parameters from %s (optimizer state fresh)", path)
    return state.replace(params={**state.params, "model": variables["params"]},
                         balance={**state.balance, "model": variables["balance"]})


def train(cfg: TrainConfig, *, progress: bool = True,
          on_step: Callable[[int, TrainState, Checkpointer | None], None] | None = None) -> TrainResult:
    """Run ``cfg`` to ``cfg.steps`` (resuming from ``cfg.checkpoint.dir`` when it holds a checkpoint)."""
    mesh = make_train_mesh(cfg)
    data = make_data(cfg)
    trainer = Trainer(cfg, mesh)
    ckpt = Checkpointer(cfg.checkpoint, cfg) if cfg.checkpoint.dir else None
    state = _restore_or_init(trainer, ckpt, data, cfg)
    log = MetricsLog(cfg.log_dir, cfg.tensorboard)
    flops = flops_per_token(cfg.model, cfg.seq_len, trainer.abstract["params"].get("mtp")) * cfg.tokens_per_step
    peak = peak_flops(cfg.peak_flops)
    start = int(state.step)
    bar = _progress(cfg.steps, start, progress)
    last, pending, interrupted = {}, None, False
    t_log, steps_since = time.perf_counter(), 0
    with _Interrupt() as stop:
        for step in range(start, cfg.steps):
            first = step == start
            if first:
                t_compile = _compiling(bar)
            state, metrics = trainer.step(state, next(data))
            if first:
                _compiled(bar, metrics, t_compile)
            steps_since += 1
            if pending is not None:  # one step behind, so the host never waits on the step it just queued
                _check_streak(pending, cfg)
            pending = metrics
            done = step + 1
            if done % cfg.log_every == 0 or done == cfg.steps or stop.requested:
                last = {k: np.asarray(v) for k, v in jax.device_get(metrics).items()}
                now = time.perf_counter()
                last.update(_throughput(steps_since, now - t_log, cfg, flops, peak, mesh))
                t_log, steps_since = now, 0
                log.write(done, last)
                bar.set_postfix(loss=f"{float(last['loss']):.4f}", refresh=False)
            bar.update(1)
            if ckpt is not None and (done % cfg.checkpoint.every_steps == 0 or done == cfg.steps or stop.requested):
                loss = float(last["loss"]) if last else None
                ckpt.save(done, state, data.get_state(), loss=loss)
            if on_step is not None:
                on_step(done, state, ckpt)
            if stop.requested:
                interrupted = True
                break
        if pending is not None:
            _check_streak(pending, cfg)
    bar.close()
    log.close()
    if ckpt is not None:
        ckpt.wait()
    return TrainResult(state, trainer, last, interrupted, ckpt)


def _check_streak(metrics, cfg: TrainConfig) -> None:
    streak = int(metrics["nonfinite_streak"])
    if streak >= cfg.max_consecutive_nonfinite:
        raise NonFiniteLossError(f"{streak} consecutive steps had a non-finite loss or gradient norm "
                                 f"(max_consecutive_nonfinite={cfg.max_consecutive_nonfinite}); stopping")


def _throughput(steps: int, seconds: float, cfg: TrainConfig, flops: float, peak, mesh) -> dict[str, float]:
    if steps == 0 or seconds <= 0:
        return {}
    out = {"tokens_per_s": steps * cfg.tokens_per_step / seconds, "step_s": seconds / steps}
    if peak:
        devices = 1 if mesh is None else mesh.size
        out["mfu"] = steps * flops / seconds / (devices * peak)
    return out


def _compiling(bar) -> float:
    log.info("compiling the train step…")
    bar.set_description("compiling the train step", refresh=True)
    return time.perf_counter()


def _compiled(bar, metrics, start: float) -> None:
    """Wait once for the first step, so the time it took (almost all compilation) can be said."""
    jax.block_until_ready(metrics["loss"])
    log.info("compiled and ran the first step in %.1f s", time.perf_counter() - start)
    bar.set_description("", refresh=False)


def _progress(total: int, initial: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, disable=not enabled, unit="step", dynamic_ncols=True)
