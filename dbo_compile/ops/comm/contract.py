"""The comm-backend contract: what a backend of dispatch / combine is, and what it declares for
the compiler and the runtime.

A backend comes in one of two forms, by how its combine finds the rows back:

- **rank-major** (:class:`RankMajorBackend`; ``handle=False``: torch, local, emulated): the
  dispatch returns its receive rows and their routing, the combine gets the expert outputs
  alone. It serves both op pairs (``dbo.dispatch`` / ``dbo.combine`` and
  ``dbo.moe_dispatch`` / ``dbo.moe_combine``; the latter with an empty handle)::

      dispatch(x, topk_ids, topk_weights, num_experts, group_name, *, defer_receive=False)
          -> (recv_x, recv_ids, recv_weights)
      combine(y, group_name, *, defer_receive=False) -> out

- **handle-based** (:class:`HandleBackend`; ``handle=True``: DeepEP): the dispatch returns a
  handle of its own, which the combine gets back with the routing (DeepEP-style); it serves
  ``dbo.moe_dispatch`` / ``dbo.moe_combine`` only::

      dispatch(x, topk_ids, topk_weights, num_experts, group_name, defer_receive)
          -> (recv_x, recv_ids, recv_weights, handle)
      combine(y, topk_ids, topk_weights, recv_ids, recv_weights, handle, group_name,
              defer_receive) -> out

Both forms declare the same attributes and optional parts (:class:`CommBackendProtocol`):
an optional part is ``None`` where the backend has none, and ``None`` means the documented
default. The compiler (binding, fake shapes, the cost model, the scheduler), the ops and the
runtime read a backend through these declarations only. :class:`CommBackend` is the record
form every registered backend takes (``register_comm_backend(CommBackend(name, dispatch,
combine, description, ...))``); a backend written as a class fills one with its bound methods.

The receive layouts (``layout``) and the payload rows are described in
:mod:`dbo_compile.ops.comm`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Protocol

import torch
import torch.fx as fx

from dbo_compile.errors import CommBackendError
from dbo_compile.ops.backends import AutoPreference

__all__ = ["EXPERT_MAJOR", "RANK_MAJOR", "CommBackend", "CommBackendProtocol", "HandleBackend",
           "RankMajorBackend", "ResultPool"]

#: receive layouts of ``dbo.moe_dispatch`` (:mod:`dbo_compile.ops.comm`)
RANK_MAJOR, EXPERT_MAJOR = "rank_major", "expert_major"

Tensor = torch.Tensor


@dataclasses.dataclass(frozen=True)
class ResultPool:
    """A resource the calls of a comm backend draw from, which the scheduler honours.

    The calls of one backend (one spec) on one EP group that draw from a pool are numbered in
    issue order, over the step's whole program (every ubatch and layer). Call ``k``:

    - ``live = S``: overwrites the results of call ``k - S`` (a backend returning views of
      ``S`` rotating receive buffers). Every unit that reads a result of call ``k - S``
      (through views) runs before call ``k`` is issued: the scheduler adds the edge
      reader -> call ``k`` (an event edge where they are on different streams).
    - ``in_flight = F``: is issued only after call ``k - F`` was received (its wait phase,
      :func:`~dbo_compile.ops.comm.comm_receive`, ran). DeepEP low-latency: ``F = 1``, the
      receive hook of op ``n`` must be enqueued before op ``n + 1`` is issued, else the ranks
      hang (DeepEP ``buffer.py`` and the figure of its README; seen on one H200: D0, D1,
      hook(D0) hung).

    ``None`` means no limit. A schedule that cannot honour the limits (e.g. joined experts that
    read three results at once with ``live=2``) is refused: the graph is compiled unsplit with
    the reason. Reuse a backend does not declare (a result in the storage of an earlier call's
    live result, other than call ``k - S`` or before of its ``live = S`` pool) is refused at
    each program's first call (:func:`~dbo_compile.ops.comm.watching_results`), with the
    declaration to make.

    A backend raises a :class:`~dbo_compile.errors.DboError` (e.g. ``CommOpError``) only
    before it posts its collective: a rank whose step fails then issues the collective again
    with a null payload (its peers wait in it); any other exception means the transport
    failed (:class:`~dbo_compile.ops.comm.CommLedger`).

    Attributes:
        name: the pool's name within the backend.
        kinds: the comm kinds drawing from it (``"dispatch"``, ``"combine"``).
        live: results alive at once, or ``None``.
        in_flight: calls between issue and receive at once, or ``None``.
    """

    name: str
    kinds: tuple[str, ...] = ("dispatch", "combine")
    live: int | None = None
    in_flight: int | None = None

    def __post_init__(self) -> None:
        for attr in ("live", "in_flight"):
            value = getattr(self, attr)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise CommBackendError(f"ResultPool {self.name!r}: {attr}={value!r} must be None "
                                       "or an int >= 1")


# -- the signatures of the two forms ----------------------------------------------------------


class RankMajorDispatch(Protocol):
    """A rank-major dispatch: ``x [T, H]`` float, ``topk_ids [T, K]`` int64 global expert ids
    (negative: a masked slot), ``topk_weights [T, K]`` fp32 -> ``(recv_x [R, H], recv_ids
    [R, K] int64 local ids or -1, recv_weights [R, K] fp32)``, ``R`` receive rows (``W * T``
    for the static-capacity layout, ``recv_rows_per_token * T`` where declared).
    ``defer_receive`` is given only to a backend with a ``receive`` phase (a backend without
    one may leave the parameter out): ``True``, the call issues the op and its ``receive``
    completes the results later; ``False``, the call completes it."""

    def __call__(self, x: Tensor, topk_ids: Tensor, topk_weights: Tensor, num_experts: int,
                 group_name: str, *, defer_receive: bool = False
                 ) -> tuple[Tensor, Tensor, Tensor]: ...


class RankMajorCombine(Protocol):
    """A rank-major combine: ``y [R, H]`` (the dispatch's receive rows, weighted by the experts)
    -> ``out [T, H]`` of ``y.dtype``, each token's rows summed; ``defer_receive`` as the
    dispatch's."""

    def __call__(self, y: Tensor, group_name: str, *, defer_receive: bool = False
                 ) -> Tensor: ...


class HandleDispatch(Protocol):
    """A handle-based dispatch: the rank-major dispatch's arguments and ``defer_receive``
    (always given) -> ``(recv_x, recv_ids, recv_weights, handle)`` in the backend's
    ``layout`` (:mod:`dbo_compile.ops.comm`)."""

    def __call__(self, x: Tensor, topk_ids: Tensor, topk_weights: Tensor, num_experts: int,
                 group_name: str, defer_receive: bool
                 ) -> tuple[Tensor, Tensor, Tensor, Tensor]: ...


class HandleCombine(Protocol):
    """A handle-based combine: the expert outputs, the routing the dispatch sent, the
    dispatch's outputs and handle -> ``out [T, H]``."""

    def __call__(self, y: Tensor, topk_ids: Tensor, topk_weights: Tensor, recv_ids: Tensor,
                 recv_weights: Tensor, handle: Tensor, group_name: str, defer_receive: bool
                 ) -> Tensor: ...


#: ``moved_bytes(kind, node, size) -> bytes`` a comm node moves per rank (``size`` evaluates a
#: symbolic size at the cost model's reference token counts)
MovedBytes = Callable[[str, fx.Node, Callable[[Any], int]], int]


class CommBackendProtocol(Protocol):
    """What every comm backend declares (both forms); the optional parts are ``None`` where the
    backend has none, with the default said here.

    Attributes:
        name: registry key (``"torch"``, ``"local"``, ``"deep_ep"``, ...).
        description: one line for logs and errors.
        layout: the receive layout of ``dbo.moe_dispatch``: :data:`RANK_MAJOR` or
            :data:`EXPERT_MAJOR` (the latter needs ``handle``).
        handle: the form: ``True``, handle-based (:class:`HandleBackend`); ``False``,
            rank-major (:class:`RankMajorBackend`).
        pools: the :class:`ResultPool` s its calls draw from (the scheduler honours them);
            ``()``: no limit.
        stream: where its issue and receive units run: ``"comm"`` (the comm stream, joined to
            the compute stream by events) or ``"compute"`` (DeepEP low-latency: its send runs
            on the current stream and its receive hook on the send's stream; on the compute
            stream the receive follows the other ubatch's compute, so that no receive kernel
            holds SMs while the transfer is in flight).
        recv_rows_per_token: receive rows of its dispatch per token (the emulated world: ``1 +
            min(K, W - 1)``), which the expert op's FLOP formula divides by
            (:func:`~dbo_compile.ops.comm.ep_size_of_rows`); ``None``: the EP world size ``W``
            (the static-capacity ``[W*T]`` layout).
        auto: where ``comm_backend="auto"`` picks it
            (:class:`~dbo_compile.ops.backends.AutoPreference`); ``None``: only by name.
        dispatch_fake / combine_fake: the shapes of the results from the (fake) inputs, the
            signatures of ``dispatch`` / ``combine``; ``None`` (rank-major only): the
            static-capacity layout (``[W*T, ...]`` receive rows, ``W`` the group's world size)
            and ``[T, H]`` combined rows.
        receive: ``receive(result)``: the wait phase's work for the call that returned
            ``result`` (DeepEP low-latency: its receive hook); the compiler then makes the
            wait a schedule unit of its own and sets ``defer_receive``. ``None``: the issue
            completes the op on its stream and the wait is only an event.
        abort: ``abort()``: receive, in order, the calls issued and not received, after a step
            that failed between an issue and its receive (the next issue would otherwise
            break the in-flight rule); ``None``: nothing to do.
        supports: ``supports(facts) -> reason | None``: why it cannot serve a comm op with
            these facts, ``None`` if it can. Facts: ``op`` (``"moe"`` or ``"rank_major"``),
            ``kind`` (``"dispatch"`` / ``"combine"``), ``node`` (its name), ``fx`` (the FX
            node of Dynamo's graph), ``hidden``, ``dtype``,
            ``top_k``, ``num_experts``, ``device``, and its group: ``group_name``,
            ``world_size`` (the group rules: ``local`` serves one rank, ``torch`` needs a
            group); a combine's are its dispatch's. The compiler asks before binding it
            (``"auto"`` picks another backend, an explicit choice raises
            ``CommBackendError`` with the reason). ``None``: serves everything.
        moved_bytes: ``moved_bytes(kind, node, size) -> bytes`` the op moves per rank, for the
            cost model; ``None``: the bytes of its outputs (right for the static-capacity
            rank-major layout).
        bind: ``bind(facts) -> spec``: for a backend whose configuration depends on the graph
            (DeepEP ``mode="auto"``: the EP group's size picks the mode; the emulated world:
            the graph's expert count and top-k), the spec the compiler binds instead, given
            the facts of every comm op it binds (``supports``'s, and ``model_backend``: the
            spec the model named in the op, ``""`` if none); raises ``CommBackendError`` for
            a graph it cannot serve. ``None``: this backend's own spec.
        rebind: the compiler binds this backend (named by the config) also over the comm ops
            whose model named an instance of it (the emulated world: a model built for it
            names its instance with the default link figures; the config's options win).
            ``False``: a model's choice is kept.
        configure: ``configure(**options) -> backend``: the backend with a spec's options, its
            package checked (raises ``CommBackendError`` naming what is missing and the
            fallback); ``None``: no options.
        check_options: ``check_options(**options)``: raises ``CommBackendError`` for a bad
            option value without importing the package the backend wraps; its keyword
            parameters are the options the backend takes (``comm_backend="auto"`` deals
            ``comm_backend_options`` to the backends it may choose by them); ``None``: the
            options are checked by ``configure``.
    """

    name: str
    description: str
    layout: str
    handle: bool
    pools: tuple[ResultPool, ...]
    stream: str
    recv_rows_per_token: int | None
    auto: AutoPreference | None
    receive: Callable[[Any], None] | None
    abort: Callable[[], None] | None
    supports: Callable[[dict[str, Any]], str | None] | None
    moved_bytes: MovedBytes | None
    bind: Callable[[list[dict[str, Any]]], str] | None
    rebind: bool
    configure: Callable[..., CommBackendProtocol] | None
    check_options: Callable[..., None] | None

    def pool_of(self, kind: str) -> ResultPool | None:
        """The pool a call of ``kind`` (``"dispatch"`` / ``"combine"``) draws from, if any."""
        ...

    def declaration(self) -> dict[str, Any]:
        """What the scheduler honours, as data (recorded in the schedule and its fingerprint)."""
        ...


class RankMajorBackend(CommBackendProtocol, Protocol):
    """A rank-major backend (``handle=False``, ``layout=RANK_MAJOR``): serves every comm op."""

    dispatch: RankMajorDispatch
    combine: RankMajorCombine
    dispatch_fake: RankMajorDispatch | None
    combine_fake: RankMajorCombine | None


class HandleBackend(CommBackendProtocol, Protocol):
    """A handle-based backend (``handle=True``): serves ``dbo.moe_dispatch`` /
    ``dbo.moe_combine``; its fake shapes are its own (``dispatch_fake`` / ``combine_fake``,
    required)."""

    dispatch: HandleDispatch
    combine: HandleCombine
    dispatch_fake: HandleDispatch
    combine_fake: HandleCombine


@dataclasses.dataclass(frozen=True)
class CommBackend:
    """The record form of a comm backend: one implementation of dispatch / combine and what
    the compiler must know of it. It satisfies :class:`RankMajorBackend` (``handle=False``)
    or :class:`HandleBackend` (``handle=True``); the attributes are
    :class:`CommBackendProtocol`'s, the defaults there.

    The backend of a compiled graph's comm ops is chosen by ``DboConfig.comm_backend`` (and
    ``comm_backend_options``) and bound into the graph (the ops' ``backend`` argument, a spec
    such as ``"deep_ep:max_tokens=256,mode=low_latency"``) before lowering, so that the fake
    shapes, the cost model, the scheduler and the DP vote's fingerprint all see it.

    Raises:
        CommBackendError: a ``layout`` or ``stream`` not of the contract, the expert-major
            layout without ``handle``, or a handle-based record without its fake shapes.
    """

    name: str
    dispatch: Callable[..., tuple[torch.Tensor, ...]]
    combine: Callable[..., torch.Tensor]
    description: str = ""
    dispatch_fake: Callable[..., tuple[torch.Tensor, ...]] | None = None
    combine_fake: Callable[..., torch.Tensor] | None = None
    layout: str = RANK_MAJOR
    handle: bool = False
    pools: tuple[ResultPool, ...] = ()
    receive: Callable[[Any], None] | None = None
    stream: str = "comm"
    configure: Callable[..., CommBackend] | None = None
    supports: Callable[[dict[str, Any]], str | None] | None = None
    moved_bytes: MovedBytes | None = None
    bind: Callable[[list[dict[str, Any]]], str] | None = None
    abort: Callable[[], None] | None = None
    check_options: Callable[..., None] | None = None
    recv_rows_per_token: int | None = None
    auto: AutoPreference | None = None
    rebind: bool = False

    def __post_init__(self) -> None:
        if self.layout not in (RANK_MAJOR, EXPERT_MAJOR):
            raise CommBackendError(f"CommBackend {self.name!r}: layout={self.layout!r}, choose "
                                   f"{RANK_MAJOR!r} or {EXPERT_MAJOR!r}")
        if self.layout == EXPERT_MAJOR and not self.handle:
            raise CommBackendError(f"CommBackend {self.name!r}: the expert-major layout needs "
                                   "handle=True (its combine gets the routing back)")
        if self.stream not in ("comm", "compute"):
            raise CommBackendError(f"CommBackend {self.name!r}: stream={self.stream!r}, choose "
                                   "'comm' or 'compute'")
        if self.handle and (self.dispatch_fake is None or self.combine_fake is None):
            raise CommBackendError(f"CommBackend {self.name!r}: a handle-based backend declares "
                                   "its fake shapes (dispatch_fake and combine_fake): the "
                                   "rank-major default does not hold for its layout")

    def pool_of(self, kind: str) -> ResultPool | None:
        """The pool a call of ``kind`` (``"dispatch"`` / ``"combine"``) draws from, if any."""
        return next((p for p in self.pools if kind in p.kinds), None)

    def declaration(self) -> dict[str, Any]:
        """What the scheduler honours, as data (recorded in the schedule and its fingerprint)."""
        return {"layout": self.layout, "stream": self.stream, "receive": self.receive is not None,
                "pools": [dataclasses.asdict(p) for p in self.pools]}
