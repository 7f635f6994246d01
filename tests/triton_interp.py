"""Run a snippet under Triton's CPU interpreter (``TRITON_INTERPRET=1``) in a subprocess.

The interpreter is chosen when a kernel is decorated, so the snippet must import the kernels
in a fresh process. Tests that use this skip when Triton is not installed (the CPU CI has no
Triton; the GPU machine runs the same kernels compiled).
"""

import os
import subprocess
import sys

import pytest


def run_interpreted(code: str, timeout: float = 600) -> str:
    """Run ``code`` with the Triton interpreter; return its stdout, fail the test on error."""
    pytest.importorskip("triton")
    tests = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [tests, env.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout
