"""Triton, imported once for the op kernels, or ``None`` where it is not installed (the ops
then run their torch reference paths).

Every op module builds its kernels through :func:`triton_kernels`, the one place that imports
Triton::

    @triton_kernels
    def _pack_kernel(triton, tl):
        @triton.jit
        def pack_kernel(...): ...
        return triton, pack_kernel

    built = _pack_kernel()  # (triton, pack_kernel), built on the first call; None: no Triton
"""

from __future__ import annotations

import functools
from typing import Any, Callable, TypeVar

T = TypeVar("T")


@functools.cache
def import_triton() -> tuple[Any, Any] | None:
    """``(triton, triton.language)``, or ``None`` when Triton does not import."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None
    return triton, tl


def triton_kernels(build: Callable[[Any, Any], T]) -> Callable[[], T | None]:
    """Decorate a kernel builder ``build(triton, tl)`` (it defines ``@triton.jit`` kernels and
    returns them): the decorated function takes no argument, builds the kernels on its first
    call (so that importing the package does not import Triton) and returns what ``build``
    returned, the same object on every call; ``None`` where Triton does not import."""

    @functools.cache
    def kernels() -> T | None:
        mods = import_triton()
        return None if mods is None else build(*mods)

    return functools.wraps(build)(kernels)
