"""Checkpoints with orbax: one step directory holds the train state (params, optimizer state,
balancer biases, counters), the data iterator's position and the config.

- Saves are async (``CheckpointManager``; the arrays are copied off the device, then written in
  the background); orbax writes into a temporary directory and renames it when complete, so a
  save cut short (crash, SIGKILL) never appears as a step.
- Kept: the newest ``keep_last`` plus the ``keep_best`` lowest-loss checkpoints.
- Integrity: a *fingerprint* (per leaf, the wrapping uint32 sum of the raw bits — exact whatever
  the sharding or reduction order) is stored beside the arrays; a restore whose arrays, metadata or
  fingerprint do not check out is reported with a warning and the previous checkpoint is used.
- A checkpoint written for a different state (model shape, optimizer) is a user error, raised as
  ``ValueError`` before any array is read.
- Restore onto any mesh: the target is an abstract state whose leaves carry the shardings wanted.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers as ocm

from k3jax.train.config import CheckpointConfig, to_dict

ITEMS = ("state", "data", "meta")


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

    def __init__(self, cfg: CheckpointConfig, run_config: Any = None):
        if cfg.dir is None:
            raise ValueError("checkpoint.dir must be set to save or restore checkpoints")
        self.cfg, self.dir = cfg, Path(cfg.dir).absolute()
        self.run_config = None if run_config is None else to_dict(run_config)
        policies = [ocm.LatestN(n=cfg.keep_last)]
        if cfg.keep_best:
            policies.append(ocm.BestN(get_metric_fn=lambda m: m["loss"], reverse=True, n=cfg.keep_best,
                                      keep_checkpoints_without_metrics=False))
        options = ocp.CheckpointManagerOptions(
            preservation_policy=ocm.AnyPreservationPolicy(policies), create=True,
            enable_async_checkpointing=cfg.async_save, cleanup_tmp_directories=True)
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

    def restore(self, target: Any, step: int | None = None) -> tuple[Any, dict, int] | None:
        """``(state, data_state, step)`` from the newest good checkpoint (or ``step``), else None.

        ``target``: the abstract state (``ShapeDtypeStruct`` leaves, with shardings for a mesh).
        """
        steps = [step] if step is not None else self.all_steps()[::-1]
        for s in steps:
            try:
                meta = self._read_meta(s)
            except Exception as err:  # noqa: BLE001 - any unreadable metadata means a bad checkpoint
                self._bad(s, f"metadata unreadable: {err}")
                continue
            self._check_compatible(s, meta, target)
            try:
                out = self.manager.restore(s, args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(target), data=ocp.args.JsonRestore()))
                state, data = out["state"], out["data"]
                bad = _first_difference(fingerprint(state), meta["fingerprint"])
                if bad:
                    raise ValueError(f"content fingerprint differs at {bad}")
            except Exception as err:  # noqa: BLE001 - corrupt arrays surface as many exception types
                self._bad(s, str(err).splitlines()[0][:300])
                continue
            return state, data, s
        return None

    def _bad(self, step: int, why: str) -> None:
        warnings.warn(f"checkpoint step {step} in {self.dir} is partial or corrupt ({why}); "
                      "falling back to the previous checkpoint", RuntimeWarning, stacklevel=3)

    def _read_meta(self, step: int) -> dict:
        path = self.dir / str(step) / "meta" / "metadata"
        if not path.exists():
            candidates = list((self.dir / str(step) / "meta").glob("*"))
            if not candidates:
                raise FileNotFoundError(f"{self.dir / str(step) / 'meta'} has no files")
            path = candidates[0]
        return json.loads(path.read_text())

    def _check_compatible(self, step: int, meta: dict, target: Any) -> None:
        want, have = _shapes(target), meta["shapes"]
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


def _first_difference(a: dict, b: dict) -> str | None:
    for key in sorted(set(a) | set(b)):
        if a.get(key) != b.get(key):
            return key
    return None


def _config_diff(saved: Any, current: Any, prefix: str = "") -> list[str]:
    if isinstance(saved, dict) and isinstance(current, dict):
        out = []
        for k in sorted(set(saved) | set(current)):
            out += _config_diff(saved.get(k), current.get(k), f"{prefix}{k}.")
        return out
    return [] if saved == current else [f"{prefix.rstrip('.')}={saved!r} (checkpoint) vs {current!r}"]

