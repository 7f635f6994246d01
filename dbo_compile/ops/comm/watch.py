"""What the comm ops record while they run: the step transaction's ledger of posted
collectives (:data:`LEDGER`), and the check of undeclared result reuse at a program's first
call (:func:`watching_results`, :func:`run_watched`)."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import weakref
from typing import Any, Callable, Iterator

import torch

from dbo_compile.errors import CommBackendError, DboError
from dbo_compile.ops.comm.contract import CommBackend

__all__ = ["LEDGER", "CommLedger", "check_results", "posting", "run_watched", "watching",
           "watching_results"]


class CommLedger(threading.local):
    """Per thread, while a step transaction holds it open
    (:mod:`dbo_compile.runtime.step_txn`): how many collectives this rank's ops have posted in
    the step, and whether one failed after it may have been posted (``broken``).

    Backend contract (:class:`CommBackend`): a backend raises a
    :class:`~dbo_compile.errors.DboError` (``CommOpError``) only *before* posting its
    collective; any other exception from it counts as a transport failure, after which the
    step's remaining collectives cannot be completed (``broken``). Counted on the host when the
    op runs: under CUDA-graph capture once, at capture time (no transaction is open then)."""

    active: bool = False
    posted: int = 0
    broken: bool = False


LEDGER = CommLedger()


class posting:
    """Counts one posted collective in :data:`LEDGER` when the backend call returns."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type, exc, tb) -> bool:
        if LEDGER.active:
            if exc is None:
                LEDGER.posted += 1
            elif not isinstance(exc, DboError):
                LEDGER.broken = True
        return False


# --------------------------------------------------------------------------------------------
# Undeclared result reuse: checked at a program's first call
# --------------------------------------------------------------------------------------------


class _ResultWatch(threading.local):
    """Per thread, while :func:`watching_results` is open: the storages of the comm results
    seen so far (``id(storage) ->`` :class:`_Seen`), the calls made, and per declared pool
    (``(backend, group, pool)``) the calls drawn from it."""

    def __init__(self) -> None:
        self.depth = 0
        self.calls = 0
        self.seen: dict[int, _Seen] = {}
        self.pool_calls: dict[tuple[str, str, str], int] = {}


@dataclasses.dataclass(frozen=True)
class _Seen:
    """A comm result's storage, weakly (alive while anything holds it: a view of the result,
    or the backend's workspace), what returned it and its call's place in its ``live`` pool
    (``None``: no such pool)."""

    ref: weakref.ref
    what: str
    pool: tuple[str, str, str] | None
    index: int


_WATCH = _ResultWatch()
#: programs (split or unsplit, any callable) whose first call passed the watch
_WATCHED: weakref.WeakSet = weakref.WeakSet()


@contextlib.contextmanager
def watching_results() -> Iterator[None]:
    """Check every comm call made inside (this thread, any backend) for undeclared reuse of its
    result memory (:func:`check_results`); re-entrant, forgets what it saw when the outermost
    exits. The programs open it around their first call (:func:`run_watched`), so that the
    warm-up of :class:`~dbo_compile.runtime.cudagraph_runner.CudaGraphRunner` and the first eager step
    check, and no later call pays for it. Reads no device value (fine inside a capture)."""
    _WATCH.depth += 1
    try:
        yield
    finally:
        _WATCH.depth -= 1
        if _WATCH.depth == 0:
            _WATCH.seen.clear()
            _WATCH.pool_calls.clear()
            _WATCH.calls = 0


def run_watched(program: Callable[..., Any], *args: Any) -> Any:
    """``program(*args)``, its first call (per program object, e.g. an unsplit GraphModule)
    under :func:`watching_results`; later calls cost a set lookup.

    Raises:
        CommBackendError: a comm backend of the program reuses result memory without declaring
            it (:func:`check_results`); the program stays unchecked (its next call checks).
    """
    if program in _WATCHED:
        return program(*args)
    with watching_results():
        out = program(*args)
    _WATCHED.add(program)
    return out


def check_results(impl: CommBackend, op: str, kind: str, group_name: str, result: Any) -> None:
    """Under :func:`watching_results`: refuse a result of ``impl`` that lies in the storage of
    an earlier call's result while that storage is still alive (not freed and reallocated: the
    same storage object), unless ``impl`` declares it: a :class:`ResultPool` with ``live = S``
    for ``kind``, and the earlier call is of the same pool and at least ``S`` of its calls
    earlier (the overwrite the scheduler orders after the earlier result's readers). A backend
    returning views of workspaces it reuses (DeepEP low-latency style) without that
    declaration, or with a larger ``S`` than it has workspaces, lets the scheduler read the
    earlier result after the later call overwrote it: a wrong answer, without an error.

    Raises:
        CommBackendError: naming the backend, both calls and the declaration to make.
    """
    pool = impl.pool_of(kind)
    live = pool.live if pool is not None else None
    key = None if live is None else (impl.name, group_name, pool.name)
    index = 0
    if key is not None:
        index = _WATCH.pool_calls[key] = _WATCH.pool_calls.get(key, -1) + 1
    _WATCH.calls += 1
    this = f"{op} call #{_WATCH.calls} of backend {impl.name!r}"
    mine: dict[int, _Seen] = {}
    for i, t in enumerate(result if isinstance(result, (tuple, list)) else (result,)):
        if not isinstance(t, torch.Tensor) or t.untyped_storage().nbytes() == 0:
            continue
        storage = t.untyped_storage()
        seen = _WATCH.seen.get(id(storage))
        if seen is not None and seen.ref() is storage and not (
                key is not None and seen.pool == key and index - seen.index >= live):
            if key is not None and seen.pool == key:
                why = (f"it declares ResultPool({pool.name!r}, live={live}) for {kind!r}, but "
                       f"this call reuses the storage of the pool's call {index - seen.index} "
                       "calls earlier; declare live= the number of buffers it rotates")
            else:
                why = ("the backend reuses its result buffers across calls (views of rotating "
                       "workspaces) without a ResultPool with live= that covers both calls")
            raise CommBackendError(
                f"comm backend {impl.name!r}: result {i} of {this} lies in the storage of "
                f"{seen.what}, which is still alive: {why}, so the scheduler may let a reader "
                "of the earlier result run after this call overwrote it (a wrong answer). "
                "Declare the reuse in its record, register_comm_backend(CommBackend(..., "
                "pools=(ResultPool('workspaces', live=S),))) with S the number of buffers it "
                "rotates, or return tensors of their own (e.g. .clone()) from dispatch and "
                "combine")
        mine[id(storage)] = _Seen(weakref.ref(storage), f"result {i} of {this}", key, index)
    _WATCH.seen.update(mine)



def watching() -> bool:
    """Whether :func:`watching_results` is open on this thread (the ops then call
    :func:`check_results` on what a backend returned)."""
    return _WATCH.depth > 0

