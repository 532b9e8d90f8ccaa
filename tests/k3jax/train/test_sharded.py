"""A train step sharded over 8 fake CPU devices (data, expert, fsdp axes by the rule tables) equals the
single-device step. Runs in a subprocess because the device count is fixed when jax starts."""

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.tolerances import F32_RTOL

ROOT = Path(__file__).resolve().parents[3]


def test_sharded_step_matches_single_device():
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-m", "tests.k3jax.train.sharded_worker"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["devices"] == 8 and out["sharded_leaves"] > 0 and "expert" in out["w1_spec"]
    assert abs(out["loss_sharded"] - out["loss_single"]) < F32_RTOL * abs(out["loss_single"])
    # every leaf's gradient, float32 compute: only the reduction order differs across shards.
    # (Muon updates are not compared: Newton-Schulz lifts tiny singular directions to O(1).)
    assert out["grads_rel"] < F32_RTOL, out["worst"]
