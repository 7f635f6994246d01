"""Run benchmark scripts as programs from a test (the tests import no benchmark script).

:func:`run_scripts` runs each ``(script, argv)`` as ``python script argv...`` would (the
script's folder first on ``sys.path``, ``__name__ == "__main__"``, its exit status from
``SystemExit``) in one fresh interpreter (``sys.executable``) for the whole list, so that a test
of many command lines pays for one ``import torch``, not one per command line.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_DRIVER = r"""
import contextlib, io, json, os, runpy, sys, traceback
out = []
for script, argv in json.loads(sys.argv[1]):
    sys.argv = [script, *argv]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    stdout, stderr, code = io.StringIO(), io.StringIO(), 0
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:
            traceback.print_exc()
            code = 1
    sys.path.pop(0)
    out.append({"returncode": code, "stdout": stdout.getvalue(), "stderr": stderr.getvalue()})
print("RESULTS " + json.dumps(out))
"""


@dataclasses.dataclass
class Ran:
    """One script's run: its exit status and what it printed."""

    returncode: int
    stdout: str
    stderr: str


def run_scripts(runs: list[tuple[str, list[str]]], cwd: str = ROOT,
                timeout: float = 300) -> list[Ran]:
    """Each ``(script path, argv)`` of ``runs``, in order, in one subprocess; the package is
    the checkout's (``PYTHONPATH``)."""
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-c", _DRIVER, json.dumps(runs)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")), None)
    assert line, f"rc={proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return [Ran(**r) for r in json.loads(line[len("RESULTS "):])]
