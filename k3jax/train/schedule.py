"""Learning-rate schedules: warmup-stable-decay (WSD) and cosine, both with a linear warmup.

K3 trains with cosine decay after 1 % warmup (SPEC §7); WSD (Hu et al., MiniCPM, arXiv 2404.06395)
is the alternative that lets a run be extended or branched from the stable phase [ours: both].
"""

import optax

from k3jax.train.config import ScheduleConfig


def make_schedule(cfg: ScheduleConfig, peak_lr: float, total_steps: int) -> optax.Schedule:
    """`step -> lr` for `total_steps` optimizer steps peaking at `peak_lr`.

    Warmup is `max(1, round(warmup_fraction · total_steps))` steps from 0 (so step 0 never takes a
    full-size update on a fresh optimizer); the schedule ends at `final_lr_ratio · peak_lr`.
    """
    if total_steps < 1:
        raise ValueError(f"total_steps={total_steps} must be >= 1")
    if peak_lr <= 0:
        raise ValueError(f"peak_lr={peak_lr} must be > 0")
    warmup = max(1, round(cfg.warmup_fraction * total_steps))
    warmup = min(warmup, total_steps)
    final = cfg.final_lr_ratio * peak_lr
    if cfg.kind == "cosine":
        return optax.warmup_cosine_decay_schedule(
            init_value=0.0, peak_value=peak_lr, warmup_steps=warmup,
            decay_steps=max(total_steps, warmup + 1), end_value=final)
    decay = max(1, round(cfg.decay_fraction * total_steps))
    stable = max(0, total_steps - warmup - decay)
    return optax.join_schedules(
        [optax.linear_schedule(0.0, peak_lr, warmup),
         optax.constant_schedule(peak_lr),
         optax.linear_schedule(peak_lr, final, decay)],
        boundaries=[warmup, warmup + stable])
