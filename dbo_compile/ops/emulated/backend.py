"""The emulated comm backend: one registered instance per :class:`EmulatedWorld` (its spec,
:attr:`EmulatedWorld.name`), issuing its calls through the link and receiving them in its
receive phase; the plain name ``"emulated"``, configured per graph by the compiler
(:mod:`dbo_compile.ops.emulated`)."""

from __future__ import annotations

import collections
import dataclasses
import logging
from typing import Any

import torch
import torch.fx as fx

from dbo_compile.errors import CommBackendError, CommOpError
from dbo_compile.ops.comm import (
    CommBackend,
    ResultPool,
    get_comm_backend,
    result_key,
)
from dbo_compile.ops.comm.packing import check_dispatch_args
from dbo_compile.ops.emulated.kernels import (
    combine_triton_issue,
    dispatch_triton_issue,
    use_triton,
)
from dbo_compile.ops.emulated.link import SLOTS
from dbo_compile.ops.emulated.routing import Issued, combine_torch_issue, dispatch_torch_issue
from dbo_compile.ops.emulated.world import NAME, EmulatedWorld

log = logging.getLogger(__name__)

__all__ = ["EmulatedBackend", "emulated_backend", "is_emulated", "make_backend",
           "register_emulated"]


@dataclasses.dataclass(frozen=True)
class EmulatedBackend(CommBackend):
    """A registered instance of the emulated backend (:class:`CommBackend` plus its world).

    Its ``recv_rows_per_token`` is the world's ``G`` (the expert op's FLOP formula divides
    its rows by it, :func:`dbo_compile.ops.comm.ep_size_of_rows`).

    Attributes:
        world: the :class:`EmulatedWorld` it emulates.
    """

    world: EmulatedWorld | None = None


def _check_world(world: EmulatedWorld, x, topk_ids, num_experts) -> None:
    if num_experts != world.num_experts or topk_ids.shape[1] != world.top_k:
        raise CommOpError(
            f"dbo.dispatch with the emulated backend {world.name!r}: called with "
            f"num_experts={num_experts}, top_k={topk_ids.shape[1]}, but the backend was bound "
            f"for num_experts={world.num_experts}, top_k={world.top_k}; every dispatch of a "
            "graph must share them")


def _moved_bytes(world: EmulatedWorld):
    def moved_bytes(kind: str, node: fx.Node, size) -> int:
        """Bytes the comm node sends per direction at the cost model's reference sizes
        (``size``: symbolic size -> int): the link's static capacity."""
        x = node.args[0].meta.get("val")
        rows = size(x.shape[0])
        tokens = rows if kind == "dispatch" else rows // world.rows_per_token
        return world.link_bytes(kind, tokens, size(x.shape[1]), x.element_size())

    return moved_bytes


def make_backend(world: EmulatedWorld) -> EmulatedBackend:
    """The backend instance of ``world`` (the registry configures it from the spec
    :attr:`EmulatedWorld.name`: :func:`dbo_compile.ops.emulated.binding.configure`)."""
    #: the calls issued with defer_receive and not yet received: (result key, finish)
    pending: collections.deque = collections.deque()

    def issue(issued: Issued, defer: bool) -> Any:
        result, finish = issued
        if defer:
            pending.append((result_key(result), finish))
        else:
            finish()
        return result

    def check_in_flight() -> None:
        if len(pending) >= SLOTS:
            raise CommBackendError(
                f"emulated backend {world.name!r}: {len(pending)} calls are in flight (issued "
                "with defer_receive and not received) and another is issued; the link holds "
                f"{SLOTS} (the backend's pool: in_flight={SLOTS}); receive one first")

    def dispatch(x, topk_ids, topk_weights, num_experts, group_name, defer_receive=False):
        check_dispatch_args(x, topk_ids, topk_weights, num_experts, world.world_size)
        _check_world(world, x, topk_ids, num_experts)
        if topk_ids.device.type == "cpu" and topk_ids.numel():
            top = int(topk_ids.max())  # one process: raising hangs no other rank
            if top >= num_experts:
                raise CommOpError(f"dbo.dispatch: topk_ids holds expert id {top} but "
                                  f"num_experts={num_experts}; ids must be < num_experts")
        check_in_flight()
        if use_triton(x) and x.shape[0]:
            return issue(dispatch_triton_issue(world, x, topk_ids, topk_weights), defer_receive)
        return issue(dispatch_torch_issue(world, x, topk_ids, topk_weights), defer_receive)

    def combine(y, group_name, defer_receive=False):  # y is read until the receive
        _check_combine(world, y)
        check_in_flight()
        if use_triton(y) and y.shape[0]:
            return issue(combine_triton_issue(world, y), defer_receive)
        return issue(combine_torch_issue(world, y), defer_receive)

    def receive(value: Any) -> None:
        """The receive phase of a call issued with ``defer_receive``: the current stream
        waits for its rows back and unpacks them (dispatch) or sums them (combine) into the
        result ``value`` (what the call returned). A combine's input ``y`` must stay as it
        was until then (its local rows are summed here; a compiled graph never writes it);
        a dispatch copied what it sends at its issue. Calls may be received in any order."""
        key = result_key(value)
        for i, (k, finish) in enumerate(pending):
            if k is key:
                del pending[i]
                finish()
                return
        raise CommBackendError(
            f"emulated backend {world.name!r}: a receive of a value no call in flight returned "
            f"({len(pending)} in flight); receive each call issued with defer_receive once")

    def abort() -> None:
        """Receive, in order, what a failed step issued and did not receive."""
        while pending:
            log.warning("dbo: emulated backend: receiving a call the aborted step left in flight")
            pending.popleft()[1]()

    def dispatch_fake(x, topk_ids, topk_weights, num_experts, group_name):
        check_dispatch_args(x, topk_ids, topk_weights, num_experts, world.world_size)
        _check_world(world, x, topk_ids, num_experts)
        n = x.shape[0] * world.rows_per_token
        return (x.new_empty((n, x.shape[1])), topk_ids.new_empty((n, topk_ids.shape[1])),
                topk_weights.new_empty((n, topk_weights.shape[1])))

    def combine_fake(y, group_name):
        _check_combine(world, y)
        return y.new_empty((y.shape[0] // world.rows_per_token, y.shape[1]))

    return EmulatedBackend(
        world.name, dispatch, combine,
        f"emulated EP-{world.world_size} world on one device (rank 0; {world.link_gbps:g} GB/s "
        f"link through pinned host memory)", dispatch_fake, combine_fake,
        pools=(ResultPool("link", in_flight=SLOTS),), receive=receive, abort=abort,
        moved_bytes=_moved_bytes(world), recv_rows_per_token=world.rows_per_token,
        world=world)


def _check_combine(world: EmulatedWorld, y) -> None:
    g = world.rows_per_token
    if y.dim() != 2:
        raise CommOpError(f"dbo.combine: y must be [rows, hidden], got {tuple(y.shape)}")
    if not isinstance(y.shape[0], torch.SymInt) and y.shape[0] % g:
        raise CommOpError(
            f"dbo.combine with the emulated backend: y has {y.shape[0]} rows, not a multiple "
            f"of its {g} receive rows per token (combine the rows of a dispatch of the same "
            "backend)")


def register_emulated(world: EmulatedWorld) -> str:
    """The spec of the instance for ``world``, configured in the registry (idempotent)."""
    get_comm_backend(world.name)
    return world.name


def is_emulated(name: str) -> bool:
    """``name`` is the emulated backend (``"emulated"``) or one of its instances."""
    return name == NAME or name.startswith(NAME + ":")


def emulated_backend(name: str) -> EmulatedBackend | None:
    """The registered instance ``name``, or ``None`` for a name that is none."""
    if not is_emulated(name) or name == NAME:
        return None
    backend = get_comm_backend(name)
    return backend if isinstance(backend, EmulatedBackend) else None

