"""What the scripts that measure another checkout of the package share.

``capture_time.py --compare REV`` and ``bench_runner_host.py --against DIR`` run this tree's
script over another tree's ``dbo_compile`` (on ``PYTHONPATH``), so they reach the package's
parts by names that may have moved between versions ("a|b": the first that the measured tree
has). Standard library only, and no import of the package at import time: this module must
load under any version of it.
"""

from __future__ import annotations

import importlib
import os
import sys
from types import ModuleType

__all__ = ["first_attr", "first_module", "moe_harness"]


def first_module(names: list[str]) -> ModuleType | None:
    """The first of the modules ``names`` that the measured tree has (``None``: none of them)."""
    for name in names:
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError:
            continue
    return None


def first_attr(owner: object, names: str) -> object | None:
    """The first of the attributes ``"a|b"`` that ``owner`` has (``None``: none of them, or no
    ``owner``), e.g. a class under its name before and after a rename."""
    if owner is None:
        return None
    return next((getattr(owner, n) for n in names.split("|") if hasattr(owner, n)), None)


def moe_harness() -> ModuleType:
    """The benchmarks' MoE model and stand-in kernels of the measured tree:
    ``dbo_compile.testing.moe``, or in a tree from before it moved into the package, that
    tree's own ``benchmarks/moe_harness.py``."""
    found = first_module(["dbo_compile.testing.moe"])
    if found is not None:
        return found
    package = importlib.import_module("dbo_compile")
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(package.__file__)),
                                    "benchmarks"))
    return importlib.import_module("moe_harness")
