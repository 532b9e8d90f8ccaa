"""Resume is exact: 20 steps straight == 10 steps, SIGKILL, resume, 10 more (bitwise on CPU),
with the same data order."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[3]


def _worker(mode, ckpt, out):
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    return subprocess.Popen([sys.executable, "-m", "tests.k3jax.train.resume_worker", mode, str(ckpt), str(out)],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc):
    out, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err[-3000:]


def test_kill_and_resume_is_bitwise_identical(tmp_path):
    straight = _worker("straight", tmp_path / "ck_straight", tmp_path / "straight")
    _finish(straight)
    victim = _worker("stop_at_10", tmp_path / "ck", tmp_path / "killed")
    for line in victim.stdout:
        if line.strip() == "READY":
            break
    else:
        raise AssertionError(f"worker never reached step 10: {victim.stderr.read()[-3000:]}")
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait(timeout=60)
    assert victim.returncode == -signal.SIGKILL
    _finish(_worker("resume", tmp_path / "ck", tmp_path / "resumed"))

    order = lambda d: (tmp_path / d / "batches.txt").read_text().split()
    assert len(order("killed")) == 10 and order("straight") == order("killed") + order("resumed")
    a, b = np.load(tmp_path / "straight" / "state.npz"), np.load(tmp_path / "resumed" / "state.npz")
    assert sorted(a.files) == sorted(b.files)
    for key in a.files:
        assert np.array_equal(a[key], b[key]), key
    assert int(b[".step"]) == 20
