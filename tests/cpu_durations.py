"""``--cpu-durations=N``: the N tests that cost the most CPU time (0: all), and the run's total.

Wall time (``--durations``) says little on a shared machine; CPU time does not depend on the
machine's other jobs. A test's CPU time is the ``getrusage`` delta over its setup, call and
teardown: this process (``RUSAGE_SELF``) plus the children it waited for (``RUSAGE_CHILDREN``:
the spawned Gloo ranks, the subprocesses of the example and benchmark tests) plus the
multiprocessing fork server's own and reaped children's CPU time (the ranks it forked:
:func:`~dbo_compile.testing.run_multirank` without CUDA), read from ``/proc``. A module- or
session-scoped fixture counts for the first test that uses it. Under ``pytest-xdist`` each
worker measures its own tests and sends the figures with the test's report.
"""

from __future__ import annotations

import os
import resource
import time
from collections import defaultdict
from multiprocessing import forkserver

import pytest

_KEY = "cpu_durations"


def _forkserver_cpu() -> float:
    """The fork server's user+system CPU s and its reaped children's (0 if none runs)."""
    pid = getattr(forkserver._forkserver, "_forkserver_pid", None)
    if pid is None:
        return 0.0
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    # fields[0] is field 3 (state): utime, stime, cutime, cstime are fields 14-17
    return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def _cpu() -> tuple[float, float]:
    """(this process's user+system CPU s, its children's: waited ones and the fork server's)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, kids.ru_utime + kids.ru_stime + _forkserver_cpu()


class CpuDurations:
    """The plugin ``conftest.py`` registers when ``--cpu-durations`` is given."""

    def __init__(self, top: int) -> None:
        self.top = top
        self._start: dict[str, tuple[float, float, float]] = {}
        self.rows: dict[str, tuple[float, float, float]] = {}  # nodeid -> (self, children, wall)

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_protocol(self, item, nextitem):
        self._start[item.nodeid] = (*_cpu(), time.perf_counter())

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        outcome = yield
        report = outcome.get_result()
        start = self._start.get(item.nodeid)
        if call.when == "teardown" and start is not None:
            own, kids = _cpu()
            report.user_properties.append(
                (_KEY, (own - start[0], kids - start[1], time.perf_counter() - start[2])))

    def pytest_runtest_logreport(self, report):
        if report.when != "teardown":
            return
        for key, value in report.user_properties:
            if key == _KEY:
                self.rows[report.nodeid] = tuple(value)

    def pytest_terminal_summary(self, terminalreporter):
        tr = terminalreporter
        if not self.rows:
            return
        own = sum(r[0] for r in self.rows.values())
        kids = sum(r[1] for r in self.rows.values())
        wall = sum(r[2] for r in self.rows.values())
        rows = sorted(self.rows.items(), key=lambda kv: kv[1][0] + kv[1][1], reverse=True)
        if self.top > 0:
            rows = rows[: self.top]
        tr.write_sep("=", f"cpu durations ({'all' if self.top <= 0 else f'top {self.top}'})")
        tr.write_line(f"{'cpu s':>8} {'self s':>8} {'child s':>8} {'wall s':>8}  test")
        for nodeid, (s, c, w) in rows:
            tr.write_line(f"{s + c:8.2f} {s:8.2f} {c:8.2f} {w:8.2f}  {nodeid}")
        per_file: dict[str, float] = defaultdict(float)
        for nodeid, (s, c, _) in self.rows.items():
            per_file[nodeid.split("::")[0]] += s + c
        tr.write_sep("-", "cpu s per file")
        for path, cpu in sorted(per_file.items(), key=lambda kv: kv[1], reverse=True):
            tr.write_line(f"{cpu:8.2f}  {path}")
        tr.write_line(
            f"cpu total {own + kids:.1f} s (tests' processes {own:.1f} s, their children "
            f"{kids:.1f} s) over {len(self.rows)} tests; sum of test wall times {wall:.1f} s")
