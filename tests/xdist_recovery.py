"""``--dist loadscope`` that survives a crashed worker (pytest-xdist 3.8.0, the newest release).

Stop 70's CI run: one ``make test`` worker died of a segfault inside XLA (two threads of the Mosaic GPU
interpreter were compiling), xdist printed ``F``, ran 67 more tests, then nothing happened until CI's
time limit killed the run. Two faults of xdist 3.8.0's ``LoadScopeScheduling`` make a crash hang:

- it puts the dead worker's *whole* workload back on the queue, finished modules included
  (pytest-dev/pytest-xdist#1378, #1323). A finished module later goes to a worker as an empty list of
  tests; the worker, which runs a test only once it holds the next one (or the order to stop), waits
  for a test that never comes, and the controller, which hands out work only when a test completes,
  waits with it;
- a replacement worker is handed one module, so one of a single test waits the same way (#1327).

:class:`CrashSafeLoadScope` requeues only unfinished modules and starts a replacement with two modules,
as the first schedule starts every worker. A test whose worker died in it runs once more, on another
worker, reported ``R`` (``rerun``) with its crash listed at the end of the run; a second crash
fails it. A one-off crash inside XLA then costs a worker restart, not the run; a test that crashes the
interpreter every time still fails. ``tests/conftest.py`` installs all this for ``make test``.
"""

from __future__ import annotations

from xdist.dsession import get_default_max_worker_restart
from xdist.scheduler import LoadScopeScheduling

RERUNS: list[str] = []  # the controller's record, in order, of tests rerun after a crash


class CrashSafeLoadScope(LoadScopeScheduling):
    """xdist's module-at-a-time scheduling, with a crashed worker's unfinished work rescheduled."""

    def __init__(self, config, log=None):
        super().__init__(config, log)
        self.crashes: dict[str, int] = {}  # test -> how many workers died in it
        self.max_restarts = get_default_max_worker_restart(config)  # None: no limit

    def rerun(self, test: str) -> bool:
        """Whether ``test``, whose worker just died in it, runs again: after its first crash, and only
        while xdist will start another worker (``--max-worker-restart``, 4 per worker by default)."""
        restarts_left = self.max_restarts is None or sum(self.crashes.values()) <= self.max_restarts
        return self.crashes.get(test) == 1 and restarts_left

    def remove_node(self, node) -> str | None:
        """Forget ``node``; after a crash return the test it died in and requeue what it left."""
        workload = self.assigned_work.pop(node)
        unfinished = {scope: unit for scope, unit in workload.items() if not all(unit.values())}
        if not unfinished:
            return None  # a worker that finished its work and shut down
        crashed = next(test for unit in unfinished.values() for test, done in unit.items() if not done)
        self.crashes[crashed] = self.crashes.get(crashed, 0) + 1
        if not self.rerun(crashed):
            unfinished[self._split_scope(crashed)][crashed] = True  # failed by xdist's report
        self.workqueue.update((scope, unit) for scope, unit in unfinished.items() if not all(unit.values()))
        for other in self.assigned_work:
            self._reschedule(other)
        return crashed

    def schedule(self) -> None:
        """The first schedule, or a replacement worker's: either way each worker starts with two
        modules where there are two, since a worker runs a test only once it holds the next."""
        replacing = self.collection is not None
        super().schedule()
        if replacing:
            for node in self.nodes:
                self._reschedule(node)


def make_scheduler(config, log):
    """The scheduler for ``config``'s ``--dist`` mode: ours for ``loadscope``, xdist's own otherwise."""
    return CrashSafeLoadScope(config, log) if config.getvalue("dist") == "loadscope" else None


def handle_crash(crashitem: str, report, sched) -> None:
    """xdist's report of a crash: ``rerun``, not ``failed``, when the test will run again."""
    if isinstance(sched, CrashSafeLoadScope) and sched.rerun(crashitem):
        report.outcome = "rerun"
        RERUNS.append(f"{crashitem}: {report.longrepr}")


def teststatus(report):
    """The progress letter and word of a rerun test; None for every other report."""
    if report.outcome == "rerun":
        return "rerun", "R", ("RERUN", {"yellow": True})
    return None


def summary(terminalreporter) -> None:
    """List the tests rerun after a crash, so that a crash never passes unseen."""
    if RERUNS:
        terminalreporter.write_sep("=", "rerun after their worker crashed", yellow=True)
        for line in RERUNS:
            terminalreporter.write_line(line)
