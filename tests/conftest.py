"""Process setup for the whole suite, run before any test module imports JAX's CPU backend."""

import os

# XLA:CPU's intra-op thread pool (sized by PJRT_NPROC when the CPU client is created, else one
# thread per usable core) also runs host callbacks of the Mosaic GPU interpreter, and a barrier
# wait is a callback that blocks its pool thread until another warpgroup arrives. When the
# blocked callbacks (at most one per warpgroup, plus the kernel's own thread_map callback) fill
# the pool, the arriving warpgroup's work stays queued behind them: a deadlock, the interpreter's
# threads parked in tsl::BlockUntilReady (2-warpgroup KDA scans on a 1-thread pool: 7 of 8 runs).
# 8 threads keep free ones even for the 3-warpgroup MoE kernels (4 blocked callbacks).
os.environ.setdefault("PJRT_NPROC", str(max(8, os.cpu_count() or 1)))

# libtpu (the `tpu` extra) compiles for TPU slices on this host (tests/k3jax/plan): no GCE metadata
# server to ask, and several test processes may load it at once (its lockfile guards real chips).
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

# One persistent compilation cache for the test processes and every process they start (the 8-device
# workers, the notebook's kernel, the command-line tools), set through JAX's environment variables
# before anything imports JAX: a second `make test` loads most executables instead of compiling them.
# The command-line tools' own cache (K3JAX_COMPILE_CACHE) points at it too, so tests leave
# ~/.cache/k3jax/jax_cache alone. K3JAX_TEST_JAX_CACHE names the folder; an empty one times a cold run.
TEST_JAX_CACHE = os.environ.setdefault("K3JAX_TEST_JAX_CACHE", "/tmp/k3jax_test_jax_cache")
os.environ["JAX_COMPILATION_CACHE_DIR"] = TEST_JAX_CACHE
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")  # every compile; see docs/testing.md
os.environ["K3JAX_COMPILE_CACHE"] = TEST_JAX_CACHE

# XLA:CPU's LLVM at -O0 for the test processes and every process they start: compiling is most of a
# cold run (a micro train step: 30 s of compiling at the default -O2, 14 s at -O0; cold `make test`
# 23.9 -> 13.5 min), and the test programs are small, so the unoptimised machine code costs little
# at run time. Results move by a few ulps against -O2 (LLVM fuses and vectorises differently: the
# micro step's float32 gradients, |g| <= 0.22, by <= 8e-8), far inside every tolerance; a bitwise
# test compares two programs compiled alike. An explicit --xla_backend_optimization_level wins.
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_backend_optimization_level" not in _flags:
    os.environ["XLA_FLAGS"] = f"{_flags} --xla_backend_optimization_level=0".strip()

# The jaxtyping annotations of k3jax, pallas_kernels and sharding are checked at run time under pytest
# (shapes, dtypes, the argument's name in the error): the import hook instruments these packages as
# they are first imported (after this file), so a wrongly shaped argument fails at the call instead of
# deep inside XLA. K3JAX_TYPECHECK=0 switches the checks off. Outside pytest nothing is instrumented.
TYPECHECK = os.environ.get("K3JAX_TYPECHECK", "1") != "0"
if TYPECHECK:
    import warnings

    from beartype.roar import BeartypeDecorHintPep585DeprecationWarning
    from jaxtyping import install_import_hook

    warnings.filterwarnings("ignore", category=BeartypeDecorHintPep585DeprecationWarning)
    # PEP 484's numeric tower: an int is a valid ``float`` argument (``margin_range=(-1, 1)``).
    install_import_hook(["k3jax", "pallas_kernels", "sharding"],
                        "beartype.beartype(conf=beartype.BeartypeConf(is_pep484_tower=True))")

import jaxtyping  # noqa: E402
import pytest  # noqa: E402

from tests import process_memory, xdist_recovery  # noqa: E402


# A worker that crashes costs a rerun of its test, not a hung run (tests/xdist_recovery.py).
@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    return xdist_recovery.make_scheduler(config, log)


@pytest.hookimpl(optionalhook=True)
def pytest_handlecrashitem(crashitem, report, sched):
    xdist_recovery.handle_crash(crashitem, report, sched)


def pytest_report_teststatus(report, config):
    return xdist_recovery.teststatus(report)


def pytest_terminal_summary(terminalreporter):
    xdist_recovery.summary(terminalreporter)


# A worker that held every module's programs reached Linux's vm.max_map_count and died in XLA (tests/process_memory.py).
@pytest.fixture(autouse=True, scope="module")
def _release_executables():
    yield
    process_memory.release_executables()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """``@pytest.mark.unchecked`` tests assert an op's own ``ValueError`` for malformed input (what
    users get), which the annotation check would pre-empt with a ``TypeCheckError``."""
    if not TYPECHECK or item.get_closest_marker("unchecked") is None:
        return (yield)
    jaxtyping.config.update("jaxtyping_disable", True)
    try:
        return (yield)
    finally:
        jaxtyping.config.update("jaxtyping_disable", False)
