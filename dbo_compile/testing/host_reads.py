"""Count the host reads of device data a piece of host code makes, on any device (CPU too).

On CUDA every read of a device tensor's values on the host (``.tolist()``, ``.item()``,
``int(t)``, ``bool(t.any())``, ``torch.equal``, ``.cpu()``) waits for the GPU. On CPU nothing
waits, so such reads are invisible to timing; :func:`count_host_reads` finds them by data flow:
every tensor computed from a *source* (or written from one, e.g. ``dst.copy_(src)``) is tainted,
and every read of a tainted tensor's values is recorded. A copy to the CPU (``.cpu()``,
``.to("cpu")``) counts as one read and its result is host data (untainted, as on a GPU, where
it is a new tensor).

Example::

    with count_host_reads(*md.tensors().values()) as reads:
        runner(input_ids, positions, md, num_scheduled_tokens)
    assert reads.count == 0, reads.calls
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

__all__ = ["HostReads", "count_host_reads"]

T = torch.Tensor
#: functions that bring a tensor's values to the host (``.to``/``.cpu`` only towards the CPU).
_READS = {T.tolist, T.item, T.numpy, T.__bool__, T.__int__, T.__index__, T.__float__,
          T.__format__, T.__repr__, T.__str__, T.__contains__, T.__array__, torch.equal, T.equal,
          torch.allclose, T.allclose, torch.is_nonzero, T.is_nonzero}
_TRANSFERS = {T.cpu, T.to}


def _name(func: Any) -> str:
    return getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))


def _to_host(func: Any, args: tuple, kwargs: dict) -> bool:
    if func is T.cpu:
        return True
    dev = kwargs.get("device")
    for a in args[1:]:
        if isinstance(a, (str, torch.device)):
            dev = a
        elif isinstance(a, T):
            dev = a.device
    return dev is not None and torch.device(dev).type == "cpu"


def _in_place(func: Any) -> bool:
    name = _name(func).rsplit(".", 1)[-1]
    if name.startswith("__"):
        return name == "__setitem__" or (name.startswith("__i") and name[3:-2] in _INPLACE_OPS)
    return name.endswith("_")


_INPLACE_OPS = {"add", "sub", "mul", "truediv", "floordiv", "mod", "and", "or", "xor", "lshift",
                "rshift"}


class HostReads(TorchFunctionMode):
    """The reads found (see the module docstring).

    Attributes:
        calls: the name of each read function, in call order.
    """

    def __init__(self, sources: tuple[torch.Tensor, ...]):
        super().__init__()
        self._tainted: dict[int, torch.Tensor] = {}  # id -> tensor (kept alive: ids stay unique)
        self.calls: list[str] = []
        self._paused = 0
        for t in sources:
            self._taint(t)

    @property
    def count(self) -> int:
        return len(self.calls)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Reads inside the block are not recorded (e.g. a CPU stand-in of a graph replay,
        which on the GPU reads nothing to the host)."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def _taint(self, t: torch.Tensor) -> None:
        self._tainted[id(t)] = t

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves = pytree.tree_leaves((args, kwargs))
        hit = any(isinstance(a, T) and id(a) in self._tainted for a in leaves)
        transfer = hit and func in _TRANSFERS and _to_host(func, args, kwargs)
        if hit and not self._paused and (func in _READS or transfer):
            self.calls.append(_name(func))
        out = func(*args, **kwargs)
        if transfer:  # host data from here on (a new tensor, as a copy from a GPU would be)
            return out.clone() if out is args[0] else out
        if hit:
            for o in pytree.tree_leaves(out):
                if isinstance(o, T):
                    self._taint(o)
            if args and isinstance(args[0], T) and _in_place(func):
                self._taint(args[0])  # dst.copy_(src), dst[i] = src
        return out


@contextlib.contextmanager
def count_host_reads(*sources: torch.Tensor) -> Iterator[HostReads]:
    """Within the block, record every host read of a value computed from ``sources``.

    Yields:
        The :class:`HostReads` record (``count``, ``calls``, ``paused()``).
    """
    mode = HostReads(sources)
    with mode:
        yield mode
