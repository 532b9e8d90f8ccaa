"""Run a k3jax command line in a fresh process, as a user would, and check the error convention."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_cli(args: list[str], cwd: Path = ROOT, timeout: int = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    """``python ARGS`` from the repository (or ``cwd``) with the CPU backend; text stdout/stderr."""
    full_env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", **(env or {}))
    full_env.pop("K3JAX_DEBUG", None)
    return subprocess.run([sys.executable, *args], cwd=cwd, env=full_env, capture_output=True, text=True,
                          timeout=timeout)


def assert_one_error_line(proc: subprocess.CompletedProcess, *fragments: str) -> str:
    """rc 2, nothing on stdout, and stderr exactly one ``error: …`` line holding every fragment."""
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert proc.stdout == "", proc.stdout[-2000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-3000:]
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]
