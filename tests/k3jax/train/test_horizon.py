"""The run length is an argument of the train step, not a constant in it (issue 27 item 8): a resume
that changes only ``steps`` runs the same compiled program (the persistent compilation cache
serves it) and follows the new horizon's learning rates.

The schedule formulas equal optax's bit for bit; one jitted schedule serves every run length.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from k3jax.train.config import ScheduleConfig
from k3jax.train.schedule import learning_rate, make_horizon, make_schedule
from tests.tolerances import SCHEDULE_PEAK_ATOL

ROOT = Path(__file__).resolve().parents[3]
PEAK = 3e-4


def _optax(cfg: ScheduleConfig, total: int):
    warmup = min(max(1, round(cfg.warmup_fraction * total)), total)
    final = cfg.final_lr_ratio * PEAK
    if cfg.kind == "cosine":
        return optax.warmup_cosine_decay_schedule(0.0, PEAK, warmup, max(total, warmup + 1), final)
    decay = max(1, round(cfg.decay_fraction * total))
    stable = max(0, total - warmup - decay)
    return optax.join_schedules([optax.linear_schedule(0.0, PEAK, warmup), optax.constant_schedule(PEAK),
                                 optax.linear_schedule(PEAK, final, decay)], [warmup, warmup + stable])


@pytest.mark.parametrize("kind", ["cosine", "wsd"])
def test_schedule_equals_optax_bitwise(kind):
    for total in (1, 7, 250):
        for warmup_fraction in (0.0, 0.3):
            cfg = ScheduleConfig(kind=kind, warmup_fraction=warmup_fraction, final_lr_ratio=0.1)
            steps = jnp.arange(total + 3)
            got, want = make_schedule(cfg, PEAK, total)(steps), _optax(cfg, total)(steps)
            assert np.array_equal(np.asarray(got), np.asarray(want)), (total, warmup_fraction)


@pytest.mark.parametrize("kind", ["cosine", "wsd"])
def test_one_compiled_schedule_serves_every_run_length(kind):
    cfg = ScheduleConfig(kind=kind, warmup_fraction=0.1)
    lr = jax.jit(lambda horizon, step: learning_rate(cfg, PEAK, horizon, step))
    steps = jnp.arange(60)
    for total in (3, 10, 57):
        np.testing.assert_allclose(np.asarray(lr(make_horizon(cfg, total), steps)),
                                   np.asarray(make_schedule(cfg, PEAK, total)(steps)), rtol=0,
                                   atol=SCHEDULE_PEAK_ATOL * PEAK)
    assert lr._cache_size() == 1


@pytest.mark.slow  # compiles the micro train step once (~2 min on 2 busy cores)
def test_resume_with_new_steps_reuses_the_compiled_step(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-m", "tests.k3jax.train.horizon_worker", str(tmp_path)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.split("RESULT ", 1)[1])
    first, resumed = out["first"], out["resumed"]
    assert first["cache"] == ["miss"]  # compiled (and written to the persistent cache) once
    assert resumed["cache"] == ["hit"]  # steps 2 -> 5: the same program, loaded, not compiled
    cfg = ScheduleConfig(**resumed["schedule"])
    new, old = make_schedule(cfg, resumed["peak"], 5), make_schedule(cfg, resumed["peak"], 2)
    # metrics logged at step d carry the LR of optimizer step d - 1 (computed jitted)
    for phase, schedule, done in ((resumed, new, (3, 4, 5)), (first, old, (1, 2))):
        assert sorted(int(d) for d in phase["lr"]) == list(done)
        got = np.array([phase["lr"][str(d)] for d in done], np.float32)
        np.testing.assert_allclose(got, np.asarray(schedule(jnp.asarray(done) - 1)), rtol=0,
                                   atol=SCHEDULE_PEAK_ATOL * resumed["peak"])
    assert float(new(2)) != float(old(2))
