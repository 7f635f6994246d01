"""The example's command line: arguments the model would reject are usage errors (exit 2,
argparse's ``error:`` line), never one traceback per spawned rank."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "examples", "deepseek_moe.py")


@pytest.mark.parametrize("args, why", [(["--world-size", "3"], "not divisible by the EP world size 3"),
                                       (["--layers", "0"], "num_layers must be > 0")])
def test_bad_arguments_are_usage_errors(args, why):
    p = subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True,
                       timeout=300, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    print(args, p.returncode, p.stderr.strip().splitlines()[-1])
    assert p.returncode == 2
    assert "error:" in p.stderr and why in p.stderr
    assert "Traceback" not in p.stdout + p.stderr
