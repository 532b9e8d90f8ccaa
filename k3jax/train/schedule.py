"""Learning-rate schedules: warmup-stable-decay (WSD) and cosine, both with a linear warmup.

K3 trains with cosine decay after 1 % warmup (SPEC §7); WSD (Hu et al., MiniCPM, arXiv 2404.06395)
is the alternative that lets a run be extended or branched from the stable phase [ours: both].

The run's length enters only through its ``Horizon`` (three step counts), which the train step
takes as a traced argument: a resume that changes only ``steps`` runs the same compiled program
(the same HLO, so the persistent compilation cache serves it) with the new schedule. The
formulas are optax's ``warmup_cosine_decay_schedule`` and ``join_schedules`` of linear and
constant pieces, written for traced boundaries (optax's check them in Python).
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.train.config import ScheduleConfig


class Horizon(NamedTuple):
    """The schedule's boundaries for one run length, int32 scalars (arrays or tracers).

    ``warmup``: steps of linear warmup from 0. ``decay_start``: where the final decay begins (cosine:
    right after warmup; WSD: after the stable phase). ``total``: where the schedule reaches its end
    value (cosine: its ``decay_steps``)."""

    warmup: jax.Array
    decay_start: jax.Array
    total: jax.Array


def make_horizon(cfg: ScheduleConfig, total_steps: int) -> Horizon:
    """The boundaries for `total_steps` optimizer steps (host integers, rounded as Python rounds).

    Warmup is `max(1, round(warmup_fraction · total_steps))` steps (so step 0 never takes a full-size
    update on a fresh optimizer); WSD decays over `max(1, round(decay_fraction · total_steps))`."""
    if total_steps < 1:
        raise ValueError(f"total_steps={total_steps} must be >= 1")
    warmup = min(max(1, round(cfg.warmup_fraction * total_steps)), total_steps)
    if cfg.kind == "cosine":
        decay_start, total = warmup, max(total_steps, warmup + 1)
    else:
        decay = max(1, round(cfg.decay_fraction * total_steps))
        decay_start = warmup + max(0, total_steps - warmup - decay)
        total = decay_start + decay
    return Horizon(*(np.asarray(v, np.int32) for v in (warmup, decay_start, total)))


def learning_rate(cfg: ScheduleConfig, peak_lr: float, horizon: Horizon, step: int | jax.Array) -> jax.Array:
    """The learning rate at optimizer step ``step`` (fp32), ending at ``final_lr_ratio · peak_lr``."""
    if peak_lr <= 0:
        raise ValueError(f"peak_lr={peak_lr} must be > 0")
    warmup, decay_start, total = (jnp.asarray(v, jnp.int32) for v in horizon)
    final = cfg.final_lr_ratio * peak_lr
    # optax.linear_schedule(0, peak_lr, warmup)
    ramp = peak_lr - peak_lr * (1 - jnp.clip(step, 0, warmup) / warmup)
    if cfg.kind == "cosine":  # optax.cosine_decay_schedule(peak_lr, total - warmup, final / peak_lr)
        alpha, length = final / peak_lr, (total - warmup).astype(jnp.float32)
        count = jnp.minimum(step - warmup, length)
        decayed = peak_lr * ((1 - alpha) * (0.5 * (1 + jnp.cos(jnp.pi * count / length))) + alpha)
        return jnp.where(step < warmup, ramp, decayed)
    # WSD: the ramp, then peak_lr, then optax.linear_schedule(peak_lr, final, total - decay_start)
    length = total - decay_start
    down = (peak_lr - final) * (1 - jnp.clip(step - decay_start, 0, length) / length) + final
    return jnp.where(step < warmup, ramp, jnp.where(step < decay_start, jnp.asarray(peak_lr, jnp.float32), down))


def make_schedule(cfg: ScheduleConfig, peak_lr: float, total_steps: int):
    """`step -> lr` for `total_steps` optimizer steps peaking at `peak_lr` (`learning_rate` at a
    fixed `make_horizon`)."""
    if peak_lr <= 0:
        raise ValueError(f"peak_lr={peak_lr} must be > 0")
    horizon = make_horizon(cfg, total_steps)
    return lambda step: learning_rate(cfg, peak_lr, horizon, step)
