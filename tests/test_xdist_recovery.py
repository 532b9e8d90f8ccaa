"""A worker that crashes under ``make test``'s ``-n 2 --dist loadscope`` costs a rerun, not the run.

Each run below kills one worker (SIGSEGV, as XLA did in stop 70's CI) in the second test of a module,
after the other modules have finished: xdist 3.8.0's own scheduler then hangs forever; ours reruns the
test once on another worker, fails it if it crashes again, and runs every other test once.
"""

import os
import pathlib
import signal
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]

CONFTEST = """
import os
if os.environ["SCHEDULER"] == "crash_safe":
    from tests.conftest import (pytest_handlecrashitem, pytest_report_teststatus, pytest_terminal_summary,
                                pytest_xdist_make_scheduler)
"""

CRASHING = """
import os, pathlib, signal, time

def test_before():
    time.sleep(1)

def test_crash():
    once = pathlib.Path("crashed_once")
    if os.environ["CRASH"] == "always" or not once.exists():
        once.touch()
        os.kill(os.getpid(), signal.SIGSEGV)

def test_after():
    pass
"""


def _suite(tmp_path: pathlib.Path) -> pathlib.Path:
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_crash.py").write_text(CRASHING)
    for name in "abcde":
        (tmp_path / f"test_{name}.py").write_text("".join(f"def test_{i}():\n    pass\n" for i in range(3)))
    (tmp_path / "test_single.py").write_text("def test_single():\n    pass\n")
    return tmp_path


def _run(folder: pathlib.Path, scheduler: str, crash: str, timeout: float, *args: str) -> tuple[int | None, str]:
    """(exit status or None when it ran past ``timeout``, its output)."""
    env = dict(os.environ, SCHEDULER=scheduler, CRASH=crash, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2",
                             "--dist", "loadscope", *args], cwd=folder, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the controller and both workers
        out, _ = proc.communicate()
        return None, out


def test_a_one_off_crash_costs_a_rerun(tmp_path):
    code, out = _run(_suite(tmp_path), "crash_safe", crash="once", timeout=300)
    assert code == 0, out
    assert "19 passed, 1 rerun" in out, out
    assert "rerun after their worker crashed" in out and "crashed while running 'test_crash.py::test_crash'" in out


def test_a_test_that_always_crashes_fails_and_the_run_ends(tmp_path):
    code, out = _run(_suite(tmp_path), "crash_safe", crash="always", timeout=300)
    assert code == 1, out
    assert "1 failed, 18 passed, 1 rerun" in out, out  # test_after ran too
    assert "FAILED test_crash.py::test_crash - worker" in out, out


def test_no_rerun_when_xdist_may_not_restart_a_worker(tmp_path):
    code, out = _run(_suite(tmp_path), "crash_safe", "once", 300, "--max-worker-restart=0")
    assert code == 1, out
    assert "FAILED test_crash.py::test_crash - worker" in out and "1 rerun" not in out, out
    assert "1 failed, 17 passed" in out, out  # xdist stops the run at the crash: test_after never ran


def test_xdist_own_scheduler_hangs_after_the_crash(tmp_path):
    """The scenario above is one that xdist 3.8.0 gets wrong: if this fails, xdist has fixed #1378 and
    its own scheduler may do (keep the rerun)."""
    code, out = _run(_suite(tmp_path), "xdist", crash="always", timeout=30)
    assert "node down" in out, out  # the crash happened, and then the run never ended
    assert code is None, out
