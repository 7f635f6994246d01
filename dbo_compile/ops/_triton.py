"""Triton, imported once for the op kernels, or ``None`` where it is not installed (the ops
then run their torch reference paths)."""

from __future__ import annotations

import functools
from typing import Any


@functools.cache
def import_triton() -> tuple[Any, Any] | None:
    """``(triton, triton.language)``, or ``None`` when Triton does not import."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None
    return triton, tl
