"""Checkpoints with orbax: one step directory holds the train state (params, optimizer state,
balancer biases, counters), the data iterator's position and the config.

- Saves are async (``CheckpointManager``; the arrays are copied off the device, then written in
  the background); orbax writes into a temporary directory and renames it when complete, so a
  save cut short (crash, SIGKILL) never appears as a step.
- Kept: the newest ``keep_last`` plus the ``keep_best`` lowest-loss checkpoints.
- Integrity: a *fingerprint* (per leaf, the wrapping uint32 sum of the raw bits — exact whatever
  the sharding or reduction order) is stored beside the arrays. A restore checks the newest step
  whole (orbax's step record and our metadata parse, every array reads, the contents match the
  fingerprint, the data state reads); a step that fails is renamed ``<step>.corrupt-<reason>``
  with a ``reason.txt``, reported in one warning line, and the next older step is tried. The
  corrupt step therefore never blocks the next save of its step number, and is kept for a look.
  This one restore path serves ``k3jax.train``, ``k3jax.generate`` and ``--init-from``.
- A checkpoint written for a different state (model shape, optimizer) is a user error, raised as
  ``ValueError`` before any array is read.
- Restore onto any mesh: the target is an abstract state whose leaves carry the shardings wanted.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers as ocm

from k3jax.train.config import CheckpointConfig, to_dict

ITEMS = ("state", "data", "meta")
STEP_METADATA = "_CHECKPOINT_METADATA"  # orbax's per-step record (time, metrics for keep_best)
# Loggers that print a traceback per unreadable array when orbax reads a corrupt step.
NOISY_LOGGERS = ("absl", "orbax", "asyncio", "jax._src.array")
log = logging.getLogger(__name__)


class CheckpointMismatchError(ValueError):
    """The checkpoint holds a state of another shape than the one asked for."""


def _bits(x: jax.Array) -> jax.Array:
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    width = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}[x.dtype.itemsize]
    bits = jax.lax.bitcast_convert_type(x, width)
    return bits.astype(jnp.uint32) if x.dtype.itemsize <= 4 else (bits ^ (bits >> 32)).astype(jnp.uint32)


@jax.jit
def _fingerprint_arrays(tree):
    return jax.tree.map(lambda x: jnp.sum(_bits(x), dtype=jnp.uint32), tree)


def fingerprint(tree: Any) -> dict[str, int]:
    """``{leaf path: wrapping uint32 sum of its bits}``: identical for identical contents on any mesh."""
    sums = jax.device_get(_fingerprint_arrays(tree))
    return {jax.tree_util.keystr(p): int(v) for p, v in jax.tree_util.tree_flatten_with_path(sums)[0]}


def _shapes(tree: Any) -> dict[str, list]:
    return {jax.tree_util.keystr(p): [list(x.shape), str(np.dtype(x.dtype))]
            for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


class Checkpointer:
    """Save / restore for one run directory."""

    def __init__(self, cfg: CheckpointConfig, run_config: Any = None, *, read_only: bool = False):
        if cfg.dir is None:
            raise ValueError("checkpoint.dir must be set to save or restore checkpoints")
        self.cfg, self.dir = cfg, Path(cfg.dir).absolute()
        self.run_config = None if run_config is None else to_dict(run_config)
        policies = [ocm.LatestN(n=cfg.keep_last)]
        if cfg.keep_best:
            policies.append(ocm.BestN(get_metric_fn=lambda m: m["loss"], reverse=True, n=cfg.keep_best,
                                      keep_checkpoints_without_metrics=False))
        options = ocp.CheckpointManagerOptions(
            preservation_policy=ocm.AnyPreservationPolicy(policies), create=not read_only,
            enable_async_checkpointing=cfg.async_save, cleanup_tmp_directories=not read_only,
            read_only=read_only)
        with quiet_orbax():  # it reads every step's record; a corrupt one is reported by `restore`
            self.manager = ocp.CheckpointManager(self.dir, item_names=ITEMS, options=options)

    def all_steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def save(self, step: int, state: Any, data_state: dict | None, loss: float | None = None) -> None:
        """Start saving ``state`` at ``step`` (returns once the arrays are off the device)."""
        meta = {"step": int(step), "shapes": _shapes(state), "fingerprint": fingerprint(state),
                "config": self.run_config}
        metrics = None if loss is None or not np.isfinite(loss) else {"loss": float(loss)}
        args = ocp.args.Composite(state=ocp.args.StandardSave(state),
                                  data=ocp.args.JsonSave(data_state or {}), meta=ocp.args.JsonSave(meta))
        self.manager.save(int(step), args=args, metrics=metrics, force=True)

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()

    def restore(self, target: Any, step: int | None = None, *,
                partial: bool = False) -> tuple[Any, dict, int] | None:
        """``(state, data_state, step)`` from the newest good checkpoint (or ``step``), else None.

        ``target``: the abstract state (``ShapeDtypeStruct`` leaves, with shardings for a mesh), or
        a function of the step's metadata returning it (when the shapes come from the checkpoint's
        own config, as in ``k3jax.generate``). ``partial``: ``target`` names a subset of the saved
        leaves (e.g. only the parameters) and only those are read and checked. A step that fails
        any check is moved aside (`quarantine`) and the next older one is tried; a checkpoint of
        another model is a `CheckpointMismatchError`, never a fallback.
        """
        steps = [step] if step is not None else self.all_steps()[::-1]
        for s in steps:
            try:
                return self._load(s, target, partial)
            except CorruptStepError as err:
                self.quarantine(s, err.reason, err.detail)
        return None

    def _load(self, step: int, target: Any, partial: bool) -> tuple[Any, dict, int]:
        """One step, checked whole: metadata readable, arrays readable, contents = fingerprint."""
        step_dir = self.dir / str(step)
        _read_json(step_dir / STEP_METADATA, "step-metadata")
        meta = _read_json(step_dir / "meta" / "metadata", "metadata")
        for key in ("shapes", "fingerprint"):
            if not isinstance(meta, dict) or not isinstance(meta.get(key), dict):
                raise CorruptStepError("metadata", f"meta/metadata has no {key!r} table")
        if callable(target):
            target = target(meta)
        self._check_compatible(step, meta, target, partial)
        if partial:
            restore_args = ocp.checkpoint_utils.construct_restore_args(target)
            state_args = ocp.args.PyTreeRestore(item=target, restore_args=restore_args, partial_restore=True)
        else:
            state_args = ocp.args.StandardRestore(target)
        state = self._restore_item(step, "state", state_args, "arrays")
        bad = _first_difference(fingerprint(state), meta["fingerprint"], subset=partial)
        if bad:
            raise CorruptStepError("fingerprint", f"the contents of {bad} differ from the fingerprint saved with them")
        data = self._restore_item(step, "data", ocp.args.JsonRestore(), "data-state")
        return state, data, step

    def _restore_item(self, step: int, item: str, args: Any, reason: str) -> Any:
        with quiet_orbax():
            try:
                return self.manager.restore(step, args=ocp.args.Composite(**{item: args}))[item]
            except Exception as err:  # noqa: BLE001 - corrupt files surface as many exception types
                raise CorruptStepError(reason, summarise(err)) from None

    def quarantine(self, step: int, reason: str, detail: str) -> Path | None:
        """Move step ``step`` aside to ``<step>.corrupt-<reason>`` (with a ``reason.txt``), so that it
        is never restored again and never blocks the next save of that step; one warning line."""
        src = self.dir / str(step)
        dst = src.with_name(f"{step}.corrupt-{reason}")
        n = 1
        while dst.exists():
            n += 1
            dst = src.with_name(f"{step}.corrupt-{reason}-{n}")
        if jax.process_index() != 0:  # one process renames; every process skips the step
            dst, where = None, "moved aside by process 0"
        else:
            try:
                src.rename(dst)
                (dst / "reason.txt").write_text(f"{reason}: {detail}\n")
                where = f"moved to {dst.name}"
            except OSError as err:
                dst, where = None, f"could not be moved aside ({err.strerror})"
        self.manager.reload()
        log.warning("checkpoint step %d in %s is corrupt (%s: %s); %s; falling back to an older step",
                    step, self.dir, reason, detail, where)
        return dst

    def _check_compatible(self, step: int, meta: dict, target: Any, partial: bool = False) -> None:
        want = {_norm(k): v for k, v in _shapes(target).items()}
        have = {_norm(k): v for k, v in meta["shapes"].items()}
        if partial:
            have = {k: v for k, v in have.items() if k in want}
        if want == have:
            return
        missing = sorted(set(want) - set(have))[:3]
        extra = sorted(set(have) - set(want))[:3]
        differ = [f"{k}: checkpoint {have[k]} vs model {want[k]}" for k in want if k in have and have[k] != want[k]][:3]
        model_diff = _config_diff((meta.get("config") or {}).get("model"), (self.run_config or {}).get("model"))
        raise CheckpointMismatchError(
            f"checkpoint step {step} in {self.dir} holds a different train state than this run "
            f"(model config differences: {model_diff or 'none found'}; leaves only in this run: {missing}; "
            f"only in the checkpoint: {extra}; shape differences: {differ}). "
            "Use a fresh checkpoint.dir or the config the checkpoint was written with.")


class CorruptStepError(Exception):
    """A step directory that cannot be restored as saved; ``reason`` is a short slug for its new name."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


def _read_json(path: Path, reason: str) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CorruptStepError(reason, f"{path.parent.name}/{path.name} is missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CorruptStepError(reason, f"{path.parent.name}/{path.name} is unreadable ({err})") from None


@contextlib.contextmanager
def quiet_orbax():
    """Silence orbax's per-array error logs (with tracebacks) while a step is being checked: its
    failure is reported once, as one line, by the caller."""
    loggers = [logging.getLogger(name) for name in NOISY_LOGGERS]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def summarise(err: BaseException, limit: int = 300) -> str:
    """The first line of an orbax / TensorStore error without its spec dump, at most ``limit`` chars."""
    text = (str(err).strip().splitlines() or [type(err).__name__])[0]
    text = re.sub(r"\s*\[tensorstore_spec=.*", "", text).strip() or type(err).__name__
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _norm(key: str) -> str:
    """A leaf path in one spelling whether the tree was a dataclass (``.params``) or a dict (``['params']``)."""
    return re.sub(r"\.(\w+)", r"['\1']", key)


def _first_difference(got: dict, saved: dict, subset: bool = False) -> str | None:
    got = {_norm(k): v for k, v in got.items()}
    saved = {_norm(k): v for k, v in saved.items()}
    keys = set(got) if subset else set(got) | set(saved)
    for key in sorted(keys):
        if got.get(key) != saved.get(key):
            return key
    return None


def _config_diff(saved: Any, current: Any, prefix: str = "") -> list[str]:
    if isinstance(saved, dict) and isinstance(current, dict):
        out = []
        for k in sorted(set(saved) | set(current)):
            out += _config_diff(saved.get(k), current.get(k), f"{prefix}{k}.")
        return out
    return [] if saved == current else [f"{prefix.rstrip('.')}={saved!r} (checkpoint) vs {current!r}"]

