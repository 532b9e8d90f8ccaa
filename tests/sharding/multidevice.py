"""Run a worker module on 8 fake CPU devices in a fresh process and read back its measurements.

The flag ``--xla_force_host_platform_device_count`` only acts before JAX initialises its
backend, and the default test run imports JAX long before these tests, so every multi-device
check runs in a subprocess. A worker prints one line ``RESULT <json>``; the tests assert on it.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
DEVICES = 8
_OUTCOMES: dict[str, dict | RuntimeError] = {}  # by "module args"


def run_worker(module: str, timeout: float = 600.0, args: tuple[str, ...] = ()) -> dict:
    """The worker's measurements (``python -m module *args``); run once per test session, a failure
    is remembered too."""
    key = " ".join((module, *args))
    if key not in _OUTCOMES:
        try:
            _OUTCOMES[key] = _run(module, timeout, args)
        except (RuntimeError, subprocess.TimeoutExpired) as err:
            _OUTCOMES[key] = RuntimeError(str(err))
    outcome = _OUTCOMES[key]
    if isinstance(outcome, Exception):
        raise outcome
    return outcome


def _run(module: str, timeout: float, args: tuple[str, ...]) -> dict:
    env = dict(os.environ)
    # Cheaper LLVM passes: compiling these tiny programs is most of the tests' time. XLA_FLAGS
    # carries tests/conftest.py's --xla_backend_optimization_level=0 here too.
    fast_compile = "--xla_llvm_disable_expensive_passes=true"
    env["XLA_FLAGS"] = (f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={DEVICES} "
                        f"{fast_compile}").strip()
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"{module} failed (rc={proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def emit(results: dict) -> None:
    """Worker side: print the measurements for :func:`run_worker`."""
    print("RESULT " + json.dumps(results), flush=True)


def value_error(fn) -> str | None:
    """The message of the ValueError ``fn()`` raises, or None when it raises nothing."""
    try:
        fn()
    except ValueError as err:
        return str(err)
    return None
