"""Dispatch / combine: the MoE expert-parallel (EP) all-to-all as traceable custom ops.

Both ops have **static shapes**: every rank sends a fixed capacity of ``T`` rows to every
destination rank (``T`` = the token dim of the ubatch, the worst case: all tokens routed to one
rank), so they never drop a token, need no ``.item()`` and are CUDA-graph capturable. The price is
bandwidth (``W * T`` rows per rank instead of ``~T * top_k``); a counted or DeepEP backend can
replace this later without changing the graph (see :func:`register_comm_backend`).

Layout (``W`` = EP world size, ``T`` = tokens per rank, ``H`` = hidden, ``K`` = top-k)::

    rank s, dispatch send buffer [W, T, P]   row (r, t) = payload of token t for rank r
    rank r, dispatch recv        [W*T, P]    row s*T + t = payload of token t of source rank s
    rank r, combine send         [W*T, H]    row s*T + t = expert output for token t of rank s
    rank s, combine recv         [W, T, H]   summed over the W expert ranks -> [T, H]

A **dispatch payload row** carries the token and its routing metadata in ``x``'s dtype, so that
one collective moves both (DeepEP sends them in one kernel too)::

    [ x[t] (H) | pad to a 4-byte boundary | K local expert ids, K weights (2K float32 bits) ]

``x[t]`` is zeros where token ``t`` has no expert on rank ``r``; an id is the local expert index
on rank ``r`` (exact in float32, ids < 2**24) or -1, its weight the routing weight or 0. The
collective copies bytes, so the float32 bits arrive unchanged (:func:`payload_layout`).

Experts are sharded contiguously: rank ``r`` owns global experts ``[r*E_local, (r+1)*E_local)``,
``E_local = num_experts // W``.

**All ranks of the group must call with the same ``T``** (the runtime pads every DP rank to the
DP group's max, see ``runtime``); a mismatch makes ``all_to_all_single`` fail or hang.

**Empty ubatch** (``T == 0``): the collectives are still issued (with zero-size buffers) so every
rank issues the same collectives in the same order. Gloo and NCCL both accept zero-size
``all_to_all_single`` (checked on Gloo, torch 2.13 CPU: fp32/bf16/fp16/int64), so no dummy row
is sent.

Each op issues exactly one ``all_to_all_single`` call, synchronously (``async_op=False``) on the
process group's stream.

**Two op pairs.** ``dbo.dispatch`` / ``dbo.combine`` are the rank-major contract above: a model
may compute anything on the received rows. ``dbo.moe_dispatch`` / ``dbo.moe_combine`` are the
MoE-layer contract every backend serves: the dispatch returns its backend's receive layout
(:class:`CommBackend` ``layout``) and a handle, ``dbo.grouped_experts`` consumes that layout as
it is (no re-pack), and the combine gets the routing, the dispatch's outputs and the handle
back (DeepEP needs them)::

    recv_x, recv_ids, recv_w, handle = torch.ops.dbo.moe_dispatch(x, ids, w, E, group)
    y = torch.ops.dbo.grouped_experts(recv_x, recv_ids, recv_w, w13, w2)
    out = torch.ops.dbo.moe_combine(y, ids, w, recv_ids, recv_w, handle, group)

=================  ==============================  =========================  ==================
layout             recv_x                          recv_ids / recv_w          handle
=================  ==============================  =========================  ==================
``rank_major``     ``[W*T, H]`` rows (above)       ``[W*T, K]`` local ids /   backend's (torch:
(torch, local,                                     weights                    ``[0]`` int32)
DeepEP normal)
``expert_major``   ``[E_local, W*cap, H]``: rows   ``[E_local]`` int32 valid  ``[E_local, W*cap]``
(DeepEP LL)        ``[0, count[e])`` of expert e   rows per expert /          int32 source token
                   valid, the rest undefined       ``[E_local, W]`` int64     of each row
                                                   ``(begin << 32) | count``
                                                   per source rank
=================  ==============================  =========================  ==================

With ``rank_major`` the experts weight their outputs and the combine sums over ranks; with
``expert_major`` the experts return unweighted rows in the same places and the combine weights
them by ``topk_weights`` (DeepEP low-latency semantics, ``docs/references.md``).

**What a backend declares for the scheduler** (``docs/design.md`` invariant 3): the
:class:`ResultPool` s its calls draw from (how many results may be alive, how many calls may be
between issue and receive), where its units run, and whether its wait phase does work (a
receive, :func:`comm_receive`). The scheduler honours the declaration or refuses to split.
"""

import contextlib
import dataclasses
import functools
import logging
import threading
import weakref
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.fx as fx
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.fx.experimental.symbolic_shapes import statically_known_true

from dbo_compile.errors import CommBackendError, CommOpError, DboError
from dbo_compile.ops._triton import import_triton
from dbo_compile.ops.registry import (
    BackendRegistry,
    OpInfo,
    bound_backend,
    comm_kind,
    is_getitem,
    is_wait,
    op_arg,
    parse_backend_spec,
    register_op,
)

log = logging.getLogger(__name__)

__all__ = [
    "EXPERT_MAJOR",
    "LEDGER",
    "RANK_MAJOR",
    "CommBackend",
    "CommBackendError",
    "CommLedger",
    "CommOpError",
    "ResultPool",
    "available_comm_backends",
    "abort_pending_receives",
    "comm_receive",
    "comm_options_for",
    "backend_for_group",
    "ep_group_name",
    "ep_size_of_rows",
    "ep_world_size",
    "get_comm_backend",
    "process_group_names",
    "register_comm_backend",
    "register_lazy_comm_backend",
    "result_key",
    "run_watched",
    "watching_results",
]


# --------------------------------------------------------------------------------------------
# Process-group helpers
# --------------------------------------------------------------------------------------------


def ep_group_name(group: dist.ProcessGroup | None) -> str:
    """Name under which the ops find the EP process group.

    Args:
        group: the EP process group, or ``None``.

    Returns:
        ``group.group_name``; ``""`` (local, no collective) for ``None`` or a group of world
        size 1.
    """
    if group is None or group.size() == 1:
        return ""
    return group.group_name


def process_group_names() -> list[str]:
    """The names of the process groups registered in this process (for messages)."""
    try:
        return sorted(str(n) for n in dist.distributed_c10d._world.pg_names.values())
    except Exception:  # noqa: BLE001 - a private table; only a message depends on it
        return []


#: what a model without the EP group its comm ops name can do (CommBackendError messages)
_NO_GROUP_FIX = ("build the model with an EP process group of this process "
                 "(DeepseekMoEModel(..., ep_group=group) after torch.distributed."
                 "init_process_group), or without one (ep_group=None: one EP rank, "
                 "comm_backend='local' or 'auto')")


def _resolve_group(group_name: str) -> dist.ProcessGroup:
    """The process group named ``group_name``.

    Raises:
        CommBackendError: no process group of this process has that name (``""`` included:
            the name of no group), naming the registered ones and what to build instead.
    """
    try:
        return _resolve_process_group(group_name)
    except Exception as e:  # noqa: BLE001 - torch raises RuntimeError / KeyError / ValueError
        raise CommBackendError(
            f"the comm op's EP group {group_name!r} is no process group of this process "
            f"({type(e).__name__}; registered: {process_group_names()}): {_NO_GROUP_FIX}"
        ) from None


def ep_world_size(group_name: str) -> int:
    """World size ``W`` of the EP group named ``group_name`` (1 for ``""``).

    Raises:
        CommBackendError: ``group_name`` names no process group of this process.
    """
    if group_name == "":
        return 1
    return _resolve_group(group_name).size()


def backend_for_group(group_name: str, backend: str = "") -> str:
    """The comm backend the ops use: ``backend`` when given (the op's ``backend`` argument, bound
    by the compiler from ``DboConfig.comm_backend``), else ``"local"`` for the group ``""`` and
    ``"torch"`` for any other."""
    if backend:
        return backend
    return "local" if group_name == "" else "torch"


# --------------------------------------------------------------------------------------------
# Backend registry
# --------------------------------------------------------------------------------------------


#: receive layouts of ``dbo.moe_dispatch`` (module docstring)
RANK_MAJOR, EXPERT_MAJOR = "rank_major", "expert_major"


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
      :func:`comm_receive`, ran). DeepEP low-latency: ``F = 1``, the receive hook of op ``n``
      must be enqueued before op ``n + 1`` is issued, else the ranks hang (DeepEP
      ``buffer.py`` and the figure of its README; seen on one H200: D0, D1, hook(D0) hung).

    ``None`` means no limit. A schedule that cannot honour the limits (e.g. joined experts that
    read three results at once with ``live=2``) is refused: the graph is compiled unsplit with
    the reason. Reuse a backend does not declare (a result in the storage of an earlier call's
    live result, other than call ``k - S`` or before of its ``live = S`` pool) is refused at
    each program's first call (:func:`watching_results`), with the declaration to make.

    A backend raises a :class:`~dbo_compile.errors.DboError` (e.g. ``CommOpError``) only
    before it posts its collective: a rank whose step fails then issues the collective again
    with a null payload (its peers wait in it); any other exception means the transport
    failed (:class:`CommLedger`).

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


@dataclasses.dataclass(frozen=True)
class CommBackend:
    """One implementation of dispatch / combine, and what the compiler must know of it.

    The backend of a compiled graph's comm ops is chosen by ``DboConfig.comm_backend`` (and
    ``comm_backend_options``) and bound into the graph (the ops' ``backend`` argument, a spec
    such as ``"deep_ep:max_tokens=256,mode=low_latency"``) before lowering, so that the fake
    shapes, the cost model, the scheduler and the DP vote's fingerprint all see it.

    Attributes:
        name: registry key (``"torch"``, ``"local"``, ``"deep_ep"``, ...).
        dispatch: ``handle=False``: ``(x, topk_ids, topk_weights, num_experts, group_name) ->
            (recv_x, recv_ids, recv_weights)`` in the rank-major layout; ``handle=True``: the
            same arguments and ``defer_receive`` (bool: the wait phase, ``receive``, will be
            called later; otherwise the call completes the op), returning the four tensors of
            ``dbo.moe_dispatch``.
        combine: ``handle=False``: ``(y, group_name) -> out``; ``handle=True``: ``(y,
            topk_ids, topk_weights, recv_ids, recv_weights, handle, group_name,
            defer_receive) -> out``. A ``handle=False`` backend with a ``receive`` phase
            (the emulated link) takes ``defer_receive=`` as a keyword in both, ``False`` by
            default (``dbo.dispatch`` / ``dbo.combine`` never defer).
        description: one line for logs and errors.
        dispatch_fake / combine_fake: the shapes of the results from the (fake) inputs, same
            signatures; ``None``: the rank-major layout of :func:`dispatch` (``[W*T, ...]``
            receive rows, ``W`` the group's world size) and ``[T, H]`` combined rows.
        layout: the receive layout of ``dbo.moe_dispatch`` (:data:`RANK_MAJOR`,
            :data:`EXPERT_MAJOR`; module docstring).
        handle: the backend serves ``dbo.moe_dispatch`` / ``dbo.moe_combine`` with a handle of
            its own (the signatures above); such a backend cannot serve ``dbo.dispatch`` /
            ``dbo.combine``, whose combine gets no handle.
        pools: the :class:`ResultPool` s its calls draw from (the scheduler honours them).
        receive: ``receive(result)``: the wait phase's work (DeepEP low-latency: call the
            receive hook of the call that returned ``result``); ``None``: the issue completes
            the op on its stream and the wait is only an event.
        stream: where its issue and receive units run: ``"comm"`` (the comm stream, joined to
            the compute stream by events) or ``"compute"`` (DeepEP low-latency: its send runs
            on the current stream and its receive hook on the send's stream; on the compute
            stream the receive follows the other ubatch's compute, so that no receive kernel
            holds SMs while the transfer is in flight).
        configure: ``configure(**options) -> CommBackend``: the backend with the spec's
            options, its package checked (raises ``CommBackendError`` naming what is missing
            and the fallback); ``None``: no options.
        check_options: ``check_options(**options)``: raises ``CommBackendError`` for a bad
            option value without importing the package the backend wraps; its keyword
            parameters are the options the backend takes (``comm_backend="auto"`` deals
            ``comm_backend_options`` to the backends it may choose by them); ``None``: the
            options are checked by ``configure``.
        supports: ``supports(facts) -> reason | None``: why it cannot serve a comm op with
            these facts (``op``: ``"moe"`` or ``"rank_major"``, ``hidden``, ``dtype``,
            ``top_k``, ``num_experts``, ``world_size``, ``device``), ``None`` if it can; the
            compiler asks before binding it (``comm_backend="auto"`` picks another backend,
            an explicit choice raises ``CommBackendError`` with the reason). ``None``: serves
            everything.
        moved_bytes: ``moved_bytes(kind, node, size) -> bytes`` the op moves per rank, for
            the cost model (``size`` evaluates a symbolic size); ``None``: the bytes of its
            outputs (right for the static-capacity rank-major layout).
        abort: ``abort()``: receive, in order, the calls issued and not received, after a step
            that failed between an issue and its receive (the next issue would otherwise
            break the in-flight rule); ``None``: nothing to do.
        bind: ``bind(facts) -> spec``: for a backend whose options depend on the graph (DeepEP
            ``mode="auto"``: the EP group's size picks the mode), the spec the compiler binds
            instead, given the facts of the graph's comm ops (``supports``'s); ``None``: this
            backend's own spec.
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
    configure: Callable[..., "CommBackend"] | None = None
    supports: Callable[[dict], str | None] | None = None
    moved_bytes: Callable[..., int] | None = None
    bind: Callable[[list[dict]], str] | None = None
    abort: Callable[[], None] | None = None
    check_options: Callable[..., None] | None = None

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

    def pool_of(self, kind: str) -> ResultPool | None:
        """The pool a call of ``kind`` (``"dispatch"`` / ``"combine"``) draws from, if any."""
        return next((p for p in self.pools if kind in p.kinds), None)

    def declaration(self) -> dict[str, Any]:
        """What the scheduler honours, as data (recorded in the schedule and its fingerprint)."""
        return {"layout": self.layout, "stream": self.stream, "receive": self.receive is not None,
                "pools": [dataclasses.asdict(p) for p in self.pools]}


_REGISTRY: BackendRegistry[CommBackend] = BackendRegistry("comm backend", CommBackendError,
                                                         fallback="torch")


def register_comm_backend(backend: CommBackend) -> None:
    """Register (or replace) a comm backend under ``backend.name``."""
    _REGISTRY.register(backend.name, backend)


def register_lazy_comm_backend(name: str, module: str) -> None:
    """Register a backend whose module is imported only when :func:`get_comm_backend` asks for it.

    The module must call :func:`register_comm_backend` with a backend named ``name`` on import.
    """
    _REGISTRY.register_lazy(name, module)


def available_comm_backends() -> list[str]:
    """Names of the registered backends (loaded or lazy), sorted."""
    return _REGISTRY.names()


def get_comm_backend(name: str) -> CommBackend:
    """The backend of the spec ``name`` (``"torch"``, ``"deep_ep:mode=low_latency"``),
    importing its module first if it is lazy, configured with the spec's options.

    Raises:
        CommBackendError: ``name`` is unknown, its module (or the package it wraps, e.g.
            ``deep_ep``) cannot be imported, or an option is unknown or bad.
    """
    return _REGISTRY.get(name)


def comm_options_for(names: Any, options: Any) -> dict[str, dict[str, Any]]:
    """``options`` dealt to the comm backends ``names``, each value checked by the backend
    that takes it, whether its package imports or not
    (:meth:`~dbo_compile.ops.registry.BackendRegistry.options_for`).

    Raises:
        CommBackendError: an unknown backend, an option none of them takes, or a bad value.
    """
    return _REGISTRY.options_for(names, options)


def clear_configured_comm_backends() -> None:
    """Forget configured backends (rebuilt when next asked for; tests swapping ``deep_ep``)."""
    _REGISTRY.clear_configured()


def abort_pending_receives() -> None:
    """After a step that failed inside the split program: every backend receives what it
    issued and did not receive (``CommBackend.abort``), so that the next step starts with
    nothing in flight. Called by the step transaction (``runtime/step_txn.py``)."""
    for backend in _REGISTRY.instances():
        if backend.abort is not None:
            try:
                backend.abort()
            except Exception as e:  # noqa: BLE001 - the step's own error is the one to raise
                log.error("dbo: comm backend %r: receiving the aborted step's calls failed: %s",
                          backend.name, e)


def comm_backend_name(spec: str) -> str:
    """The registry name of a backend spec (``"deep_ep:mode=low_latency"`` -> ``"deep_ep"``)."""
    return parse_backend_spec(spec)[0]


# --------------------------------------------------------------------------------------------
# Reference implementation (shared by "local" and "torch")
# --------------------------------------------------------------------------------------------


def _check_dispatch_args(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                         num_experts: int, world_size: int) -> int:
    """Validate shapes/dtypes; return ``E_local``. Uses shapes only (fake-tensor safe)."""
    if x.dim() != 2:
        raise CommOpError(f"dbo.dispatch: x must be [num_tokens, hidden], got {tuple(x.shape)}")
    if topk_ids.dim() != 2 or topk_weights.dim() != 2:
        raise CommOpError(
            f"dbo.dispatch: topk_ids/topk_weights must be [num_tokens, top_k], got "
            f"{tuple(topk_ids.shape)} / {tuple(topk_weights.shape)}"
        )
    # compare sizes without guarding: under fake tensors a symbolic token dim compared with a
    # fixed one would specialise it; only sizes known to differ are an error here (the token-dim
    # pass reports the symbolic mismatch with its reason)
    pairs = list(zip(topk_ids.shape, topk_weights.shape)) + [(topk_ids.shape[0], x.shape[0])]
    if any(statically_known_true(a != b) for a, b in pairs):
        raise CommOpError(
            f"dbo.dispatch: topk_ids {tuple(topk_ids.shape)} and topk_weights "
            f"{tuple(topk_weights.shape)} must both be [num_tokens={x.shape[0]}, top_k]")
    if not x.dtype.is_floating_point:
        raise CommOpError(f"dbo.dispatch: x must be a floating-point tensor, got {x.dtype}")
    if topk_ids.dtype != torch.int64 or topk_weights.dtype != torch.float32:
        raise CommOpError(
            f"dbo.dispatch: topk_ids must be int64 and topk_weights float32, got "
            f"{topk_ids.dtype} / {topk_weights.dtype}"
        )
    if num_experts <= 0 or num_experts % world_size != 0:
        raise CommOpError(
            f"dbo.dispatch: num_experts={num_experts} is not a positive multiple of the EP world "
            f"size {world_size}; choose an EP size that divides the expert count"
        )
    if num_experts >= 2**24:
        raise CommOpError(f"dbo.dispatch: num_experts={num_experts} >= 2**24 is not supported")
    return num_experts // world_size


def payload_layout(hidden: int, dtype: torch.dtype, top_k: int) -> tuple[int, int]:
    """Columns of a dispatch payload row in ``dtype`` (see the module docstring).

    Returns:
        ``(meta_col, row_cols)``: the routing metadata (``2 * top_k`` float32) starts at column
        ``meta_col >= hidden`` (byte offset a multiple of 4) and a row has ``row_cols`` columns,
        its bytes a multiple of 4, so that the metadata can be viewed as float32 in place.
    """
    size = dtype.itemsize
    meta_bytes = 8 * top_k
    meta_col = -(-hidden * size // 4) * 4 // size
    return meta_col, meta_col + -(-meta_bytes // size)


def _meta_view(payload: torch.Tensor, meta_col: int) -> torch.Tensor:
    """``[..., P]`` payload rows -> their ``[..., 2K]`` float32 metadata, a view."""
    return payload[..., meta_col:].view(torch.float32)


def _send_buffers(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                  e_local: int, world_size: int) -> torch.Tensor:
    """Static-capacity send buffer ``[W, T, P]`` of dispatch payload rows in ``x.dtype``.

    Negative ids (masked slots) go to no rank. On CUDA with Triton one kernel writes it
    (:func:`_send_buffers_triton`); elsewhere torch ops (:func:`_send_buffers_torch`) give the
    same bits.
    """
    if x.is_cuda and x.numel() > 0 and topk_ids.shape[1] > 0 and _pack_kernel() is not None:
        return _send_buffers_triton(x, topk_ids, topk_weights, e_local, world_size)
    return _send_buffers_torch(x, topk_ids, topk_weights, e_local, world_size)


def _send_buffers_torch(x, topk_ids, topk_weights, e_local, world_size):
    t, h = x.shape
    meta_col, cols = payload_layout(h, x.dtype, topk_ids.shape[1])
    ranks = torch.arange(world_size, device=x.device, dtype=torch.int64).view(-1, 1, 1)
    dest = torch.div(topk_ids, e_local, rounding_mode="floor")  # [T, K]
    mask = (dest.unsqueeze(0) == ranks) & (topk_ids.unsqueeze(0) >= 0)  # [W, T, K]
    routed = mask.any(dim=-1, keepdim=True)  # [W, T, 1]
    payload = torch.zeros((world_size, t, cols), dtype=x.dtype, device=x.device)
    payload[..., :h] = torch.where(routed, x.unsqueeze(0), torch.zeros((), dtype=x.dtype,
                                                                       device=x.device))
    local_ids = topk_ids.unsqueeze(0) - ranks * e_local  # [W, T, K]
    meta = _meta_view(payload, meta_col)
    meta.copy_(torch.cat([torch.where(mask, local_ids, -1).to(torch.float32),
                          torch.where(mask, topk_weights.unsqueeze(0), 0.0)], dim=-1))
    return payload


@functools.cache
def _pack_kernel():
    mods = import_triton()
    if mods is None:
        return None
    triton, tl = mods

    @triton.jit
    def pack_kernel(x_ptr, ids_ptr, w_ptr, out_ptr, meta_ptr, T, H, stride_x, row_cols,
                    meta_row, e_local, K: tl.constexpr, K_P2: tl.constexpr,
                    BLOCK_H: tl.constexpr):
        """Program ``(r*T + t, c)``: payload row ``t`` for rank ``r``, columns block ``c`` of
        ``x``; column block 0 also writes the row's ``[2K]`` float32 routing metadata through
        ``meta_ptr`` (the same buffer seen as float32, ``meta_row`` floats per row, already
        offset to the metadata column)."""
        pid = tl.program_id(0).to(tl.int64)
        r = pid // T
        t = pid % T
        ks = tl.arange(0, K_P2)
        km = ks < K
        ids = tl.load(ids_ptr + t * K + ks, mask=km, other=-1)
        local = ids - r * e_local
        mine = (ids >= 0) & (local >= 0) & (local < e_local)
        cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        cm = cols < H
        if tl.max(mine.to(tl.int32), axis=0) > 0:
            row = tl.load(x_ptr + t * stride_x + cols, mask=cm)
        else:
            row = tl.zeros([BLOCK_H], dtype=out_ptr.dtype.element_ty)
        tl.store(out_ptr + pid * row_cols + cols, row, mask=cm)
        if tl.program_id(1) == 0:
            w = tl.load(w_ptr + t * K + ks, mask=km, other=0.0)
            tl.store(meta_ptr + pid * meta_row + ks, tl.where(mine, local, -1).to(tl.float32),
                     mask=km)
            tl.store(meta_ptr + pid * meta_row + K + ks, tl.where(mine, w, 0.0), mask=km)

    return triton, pack_kernel


def _send_buffers_triton(x, topk_ids, topk_weights, e_local, world_size):
    triton, pack = _pack_kernel()
    t, h = x.shape
    k = topk_ids.shape[1]
    meta_col, cols = payload_layout(h, x.dtype, k)
    if x.stride(1) != 1:
        x = x.contiguous()
    payload = torch.empty((world_size, t, cols), dtype=x.dtype, device=x.device)
    if meta_col > h:
        payload[..., h:meta_col].zero_()
    meta = _meta_view(payload, meta_col)
    block_h = min(1024, triton.next_power_of_2(h))
    pack[(world_size * t, triton.cdiv(h, block_h))](
        x, topk_ids.contiguous(), topk_weights.contiguous(), payload, meta, t, h, x.stride(0),
        cols, meta.stride(1), e_local, K=k, K_P2=triton.next_power_of_2(k), BLOCK_H=block_h)
    return payload


def _split_payload(recv: torch.Tensor, hidden: int, top_k: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Received payload rows ``[N, P]`` -> ``(x [N, H], ids [N, K] int64, weights [N, K]
    float32)``, each in fresh contiguous storage (offset 0, even when empty), as the fake
    implementation promises."""
    meta_col, cols = payload_layout(hidden, recv.dtype, top_k)
    if cols == hidden:  # top_k == 0 and no padding: the payload is x itself
        x = recv
    else:
        x = torch.empty((recv.shape[0], hidden), dtype=recv.dtype, device=recv.device)
        x.copy_(recv[:, :hidden])
    meta = _meta_view(recv, meta_col)
    return (x, meta[:, :top_k].to(torch.int64),
            meta[:, top_k:].clone(memory_format=torch.contiguous_format))


def _check_ids_on_host(topk_ids: torch.Tensor, num_experts: int, world_size: int) -> None:
    """Ids ``>= num_experts`` are routed nowhere (the slot is dropped, like a masked one).
    Where reading them costs no device sync (CPU tensors) they are refused with world size 1
    and logged as an error otherwise: raising on one EP rank before the collective would
    leave the other ranks waiting in it. On CUDA they are not checked."""
    if topk_ids.device.type == "cpu" and topk_ids.numel():
        top = int(topk_ids.max())
        if top >= num_experts:
            msg = (f"dbo.dispatch: topk_ids holds expert id {top} but num_experts="
                   f"{num_experts}; ids must be < num_experts (negative = masked slot)")
            if world_size == 1:
                raise CommOpError(msg)
            log.error("%s; with %d EP ranks the slot is dropped (raising on this rank alone "
                      "would hang the others in the all-to-all)", msg, world_size)


def _local_dispatch(x, topk_ids, topk_weights, num_experts, group_name):
    e_local = _check_dispatch_args(x, topk_ids, topk_weights, num_experts, 1)
    _check_ids_on_host(topk_ids, num_experts, 1)
    payload = _send_buffers(x, topk_ids, topk_weights, e_local, 1)
    return _split_payload(payload.view(-1, payload.shape[-1]), x.shape[1], topk_ids.shape[1])


def _local_combine(y, group_name):
    _check_combine_args(y, 1)
    return y.clone()


def _torch_dispatch(x, topk_ids, topk_weights, num_experts, group_name):
    group = _resolve_group(group_name)
    w = group.size()
    e_local = _check_dispatch_args(x, topk_ids, topk_weights, num_experts, w)
    _check_ids_on_host(topk_ids, num_experts, w)
    send = _send_buffers(x, topk_ids, topk_weights, e_local, w)
    send = send.view(-1, send.shape[-1])
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return _split_payload(recv, x.shape[1], topk_ids.shape[1])


def _torch_combine(y, group_name):
    group = _resolve_group(group_name)
    w = group.size()
    _check_combine_args(y, w)
    y = y.contiguous()
    recv = torch.empty_like(y)
    dist.all_to_all_single(recv, y, group=group)
    return _sum_sources(recv, w)


def _sum_sources(recv: torch.Tensor, world_size: int) -> torch.Tensor:
    """``[W*T, H] -> [T, H]``: sum over the W source ranks, accumulating in fp32."""
    acc_dtype = torch.float32 if recv.dtype in (torch.float16, torch.bfloat16) else recv.dtype
    # sum(dtype=) accumulates in fp32 without materialising an fp32 copy of recv
    summed = recv.view(world_size, -1, recv.shape[-1]).sum(dim=0, dtype=acc_dtype)
    return summed.to(recv.dtype)


def _local_supports(facts: dict) -> str | None:
    """``local`` computes one EP rank's share alone: over a group of several ranks it would
    route every expert to this rank, whose weights hold only its own."""
    if facts.get("world_size", 1) != 1:
        return (f"it runs no collective (one EP rank), and {facts.get('node', 'the op')} runs "
                f"over the EP group {facts.get('group_name')!r} of {facts['world_size']} ranks, "
                "whose experts are spread over them (the torch backend serves it; or build the "
                "model without a group, ep_group=None)")
    return None


def _torch_supports(facts: dict) -> str | None:
    """``torch`` runs ``all_to_all_single`` over the op's process group: it needs one."""
    if facts.get("group_name", "") == "":
        return (f"it runs all_to_all_single over the op's EP process group, and "
                f"{facts.get('node', 'the op')} names none (group_name ''): the model was built "
                "without an EP group (one EP rank: the local backend serves it; for expert "
                "parallelism build the model with its group, DeepseekMoEModel(..., "
                "ep_group=group))")
    return None


register_comm_backend(CommBackend(
    "local", _local_dispatch, _local_combine, "world size 1: no collective",
    supports=_local_supports))
register_comm_backend(CommBackend(
    "torch", _torch_dispatch, _torch_combine,
    "static-capacity all_to_all_single over a torch.distributed process group (NCCL/Gloo)",
    supports=_torch_supports))
register_lazy_comm_backend("deep_ep", "dbo_compile.ops.deep_ep")


# --------------------------------------------------------------------------------------------
# The ledger of posted collectives (the step transaction's)
# --------------------------------------------------------------------------------------------


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


class _posting:
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
    result memory (:func:`_check_results`); re-entrant, forgets what it saw when the outermost
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
            it (:func:`_check_results`); the program stays unchecked (its next call checks).
    """
    if program in _WATCHED:
        return program(*args)
    with watching_results():
        out = program(*args)
    _WATCHED.add(program)
    return out


def _check_results(impl: CommBackend, op: str, kind: str, group_name: str, result: Any) -> None:
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


# --------------------------------------------------------------------------------------------
# Custom ops
# --------------------------------------------------------------------------------------------


def _rank_major_backend(group_name: str, backend: str, op: str) -> CommBackend:
    impl = get_comm_backend(backend_for_group(group_name, backend))
    if impl.handle:
        raise CommBackendError(
            f"{op}: comm backend {impl.name!r} has the {impl.layout} layout with a dispatch "
            "handle, which dbo.dispatch / dbo.combine (the rank-major contract) cannot carry; "
            "write the MoE layer with dbo.moe_dispatch / dbo.grouped_experts / dbo.moe_combine "
            "(dbo_compile.models.deepseek.MoE does) or use comm_backend='torch'")
    return impl


@torch.library.custom_op("dbo::dispatch", mutates_args=())
def dispatch(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
             num_experts: int, group_name: str, backend: str = ""
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """MoE dispatch: send each token to the EP ranks that own its top-k experts.

    Args:
        x: ``[T, H]`` activations (any float dtype); ``T`` is the token dim, equal on all ranks.
        topk_ids: ``[T, K]`` int64 global expert ids ``< num_experts`` (negative = masked
            slot, routed nowhere; larger ids are dropped too: refused on CPU with one EP
            rank, logged as an error on CPU with several, unchecked on CUDA).
        topk_weights: ``[T, K]`` float32 routing weights.
        num_experts: global expert count ``E``; must be divisible by the EP world size ``W``.
        group_name: EP process group name (:func:`ep_group_name`); ``""`` = local, ``W = 1``.
        backend: the comm backend (:func:`get_comm_backend`); ``""``: the group's default
            (:func:`backend_for_group`). The compiler binds it from ``DboConfig.comm_backend``.

    Returns:
        ``(recv_x [W*T, H] x.dtype, recv_topk_ids [W*T, K] int64, recv_topk_weights [W*T, K]
        float32)``, rank-major: row ``r*T + t`` is token ``t`` of source rank ``r``. Ids are the
        local expert index ``0..E_local-1`` for slots owned by this rank and ``-1`` otherwise
        (weight 0); rows not routed here are zeros with all ids ``-1``.

    Raises:
        CommOpError: bad shapes/dtypes (``x`` not floating point), an id ``>= num_experts``
            (CPU, ``W = 1``) or ``num_experts % W != 0``.
        CommBackendError: ``backend`` is unknown, cannot be loaded, or has a layout of its own
            (it serves :func:`moe_dispatch` only).
    """
    impl = _rank_major_backend(group_name, backend, "dbo.dispatch")
    with _posting():
        out = impl.dispatch(x, topk_ids, topk_weights, num_experts, group_name)
    if _WATCH.depth:
        _check_results(impl, "dbo.dispatch", "dispatch", group_name, out)
    return out


def _rank_major_dispatch_fake(x, topk_ids, topk_weights, num_experts, group_name):
    w = ep_world_size(group_name)
    _check_dispatch_args(x, topk_ids, topk_weights, num_experts, w)
    n, h = x.shape
    k = topk_ids.shape[1]
    return (x.new_empty((w * n, h)), topk_ids.new_empty((w * n, k)),
            topk_weights.new_empty((w * n, k)))


@dispatch.register_fake
def _dispatch_fake(x, topk_ids, topk_weights, num_experts, group_name, backend=""):
    impl = _rank_major_backend(group_name, backend, "dbo.dispatch")
    if impl.dispatch_fake is not None:
        return impl.dispatch_fake(x, topk_ids, topk_weights, num_experts, group_name)
    return _rank_major_dispatch_fake(x, topk_ids, topk_weights, num_experts, group_name)


@torch.library.custom_op("dbo::combine", mutates_args=())
def combine(y: torch.Tensor, group_name: str, backend: str = "") -> torch.Tensor:
    """MoE combine: return expert outputs to the token's rank and sum them.

    Args:
        y: ``[W*T, H]`` expert outputs in the dispatch receive layout (row ``r*T + t`` belongs
            to token ``t`` of rank ``r``), already multiplied by the top-k weights.
        group_name: the EP process group name used for the matching dispatch.
        backend: as :func:`dispatch`'s (the same as the matching dispatch).

    Returns:
        ``[T, H]`` of ``y.dtype``: ``out[t] = sum_r recv[r*T + t]`` (accumulated in fp32 for
        fp16/bf16).

    Raises:
        CommOpError: ``y`` is not 2-D or its rows are not a multiple of ``W``.
        CommBackendError: ``backend`` is unknown, cannot be loaded, or serves
            :func:`moe_combine` only.
    """
    impl = _rank_major_backend(group_name, backend, "dbo.combine")
    with _posting():
        out = impl.combine(y, group_name)
    if _WATCH.depth:
        _check_results(impl, "dbo.combine", "combine", group_name, out)
    return out


def _check_combine_args(y: torch.Tensor, world_size: int) -> None:
    if y.dim() != 2:
        raise CommOpError(f"dbo.combine: y must be [W*num_tokens, hidden], got {tuple(y.shape)}")
    if world_size > 1 and y.shape[0] % world_size != 0:
        raise CommOpError(
            f"dbo.combine: y has {y.shape[0]} rows, not a multiple of the EP world size "
            f"{world_size}"
        )


@combine.register_fake
def _combine_fake(y, group_name, backend=""):
    impl = _rank_major_backend(group_name, backend, "dbo.combine")
    if impl.combine_fake is not None:
        return impl.combine_fake(y, group_name)
    w = ep_world_size(group_name)
    _check_combine_args(y, w)
    return y.new_empty((y.shape[0] // w, y.shape[1]))


def _empty_handle(x: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=torch.int32, device=x.device)


@torch.library.custom_op("dbo::moe_dispatch", mutates_args=())
def moe_dispatch(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 num_experts: int, group_name: str, backend: str = "",
                 defer_receive: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """MoE dispatch in the backend's own receive layout, for :func:`grouped_experts
    <dbo_compile.ops.experts.grouped_experts>` and :func:`moe_combine` (module docstring).

    Args:
        x, topk_ids, topk_weights, num_experts, group_name, backend: as :func:`dispatch`'s.
        defer_receive: set by the compiler (``passes/insert_yields.py``) when the backend has a
            receive phase and the schedule calls it later (:func:`comm_receive`); ``False``:
            the call completes the op.

    Returns:
        ``(recv_x, recv_ids, recv_weights, handle)`` in the backend's ``layout``: rank-major
        (torch, local: as :func:`dispatch`, handle ``[0]`` int32) or expert-major (DeepEP
        low-latency: ``recv_x [E_local, W*cap, H]``, ``recv_ids [E_local]`` int32 valid rows
        per local expert, ``recv_weights [E_local, W]`` int64 per-source-rank row ranges,
        ``handle [E_local, W*cap]`` int32 source token of each row).

    Raises:
        CommOpError: bad shapes/dtypes, or shapes the backend cannot serve.
        CommBackendError: ``backend`` is unknown or cannot be loaded.
    """
    impl = get_comm_backend(backend_for_group(group_name, backend))
    with _posting():
        if impl.handle:
            out = impl.dispatch(x, topk_ids, topk_weights, num_experts, group_name,
                                defer_receive)
        else:
            more = {"defer_receive": defer_receive} if impl.receive is not None else {}
            out = (*impl.dispatch(x, topk_ids, topk_weights, num_experts, group_name, **more),
                   _empty_handle(x))
    if _WATCH.depth:
        _check_results(impl, "dbo.moe_dispatch", "dispatch", group_name, out)
    return out


@moe_dispatch.register_fake
def _moe_dispatch_fake(x, topk_ids, topk_weights, num_experts, group_name, backend="",
                       defer_receive=False):
    impl = get_comm_backend(backend_for_group(group_name, backend))
    if impl.handle:
        return impl.dispatch_fake(x, topk_ids, topk_weights, num_experts, group_name,
                                  defer_receive)
    fake = impl.dispatch_fake or _rank_major_dispatch_fake
    return (*fake(x, topk_ids, topk_weights, num_experts, group_name), _empty_handle(x))


@torch.library.custom_op("dbo::moe_combine", mutates_args=())
def moe_combine(y: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                recv_ids: torch.Tensor, recv_weights: torch.Tensor, handle: torch.Tensor,
                group_name: str, backend: str = "", defer_receive: bool = False) -> torch.Tensor:
    """MoE combine of :func:`moe_dispatch`'s layout: the expert outputs back to their tokens.

    Args:
        y: the expert outputs in the dispatch's receive layout (``dbo.grouped_experts``'s
            output): rank-major ``[W*T, H]``, weighted; expert-major ``[E_local, W*cap, H]``,
            unweighted.
        topk_ids, topk_weights: ``[T, K]``, the tensors the matching dispatch sent.
        recv_ids, recv_weights, handle: the matching dispatch's outputs.
        group_name, backend, defer_receive: as :func:`moe_dispatch`'s.

    Returns:
        ``[T, H]`` of ``y.dtype``: rank-major, ``sum_r y[r*T + t]``; expert-major,
        ``sum_k topk_weights[t, k] * y[e_k, row(t, e_k)]`` over the slots with an expert
        (fp32 accumulation).

    Raises:
        CommOpError: bad shapes.
        CommBackendError: ``backend`` is unknown or cannot be loaded.
    """
    impl = get_comm_backend(backend_for_group(group_name, backend))
    with _posting():
        if impl.handle:
            out = impl.combine(y, topk_ids, topk_weights, recv_ids, recv_weights, handle,
                               group_name, defer_receive)
        else:
            more = {"defer_receive": defer_receive} if impl.receive is not None else {}
            out = impl.combine(y, group_name, **more)
    if _WATCH.depth:
        _check_results(impl, "dbo.moe_combine", "combine", group_name, out)
    return out


@moe_combine.register_fake
def _moe_combine_fake(y, topk_ids, topk_weights, recv_ids, recv_weights, handle, group_name,
                      backend="", defer_receive=False):
    impl = get_comm_backend(backend_for_group(group_name, backend))
    if impl.handle:
        return impl.combine_fake(y, topk_ids, topk_weights, recv_ids, recv_weights, handle,
                                 group_name, defer_receive)
    if impl.combine_fake is not None:
        return impl.combine_fake(y, group_name)
    _check_combine_args(y, ep_world_size(group_name))
    return y.new_empty((topk_ids.shape[0], y.shape[1]))


def result_key(value: Any) -> Any:
    """The tensor a call in flight is known by until its receive: the first of the results
    (``recv_x`` of a dispatch), or the result itself (a combine's ``out``). ``value`` is what
    the call returned, as :func:`comm_receive` gets it (a tuple, a list or one tensor)."""
    return value[0] if isinstance(value, (tuple, list)) else value


def comm_receive(value: Any, backend: str) -> Any:
    """The receive phase of a comm op whose backend has one (``CommBackend.receive``: DeepEP
    low-latency's receive hook), inserted by :mod:`dbo_compile.passes.insert_yields` as the
    op's wait and scheduled as a unit of its own; returns ``value`` (the op's outputs, now
    filled).

    Args:
        value: what the issuing op returned.
        backend: the op's backend spec (:func:`backend_for_group` of its arguments).

    Raises:
        CommBackendError: the backend has no receive phase, or ``value`` is no call it has
            in flight (DeepEP low-latency also refuses one that is not the oldest: the
            schedule broke its in-flight rule, raised before the receive is launched, which
            would hang; the emulated link receives in any order).
    """
    impl = get_comm_backend(backend)
    if impl.receive is None:
        raise CommBackendError(f"comm backend {impl.name!r} has no receive phase")
    impl.receive(value)
    return value


register_op(OpInfo(torch.ops.dbo.dispatch.default, comm="dispatch",
                   token_args=((0, "x"), (1, "topk_ids"), (2, "topk_weights")), row_local=True,
                   backend="comm", group_arg=(4, "group_name"),
                   # null call: no token routed anywhere (id -1, weight 0)
                   null_fill=(0.0, -1, 0.0)))
register_op(OpInfo(torch.ops.dbo.combine.default, comm="combine", row_local=True,
                   backend="comm", group_arg=(1, "group_name"), null_fill=(0.0,)))
register_op(OpInfo(torch.ops.dbo.moe_dispatch.default, comm="dispatch",
                   token_args=((0, "x"), (1, "topk_ids"), (2, "topk_weights")), row_local=True,
                   backend="comm", group_arg=(4, "group_name"), null_fill=(0.0, -1, 0.0)))
# a null moe_combine is valid for backends whose combine reads y alone (no dispatch handle:
# the drain is built only for those, passes/pipeline.py)
register_op(OpInfo(torch.ops.dbo.moe_combine.default, comm="combine",
                   token_args=((1, "topk_ids"), (2, "topk_weights")), row_local=True,
                   backend="comm", group_arg=(6, "group_name"),
                   null_fill=(0.0, -1, 0.0, -1, 0.0, 0)))
register_op(OpInfo(comm_receive, wait=True, receive=True, row_local=True))


def comm_spec_of(node: fx.Node) -> str | None:
    """The backend spec a call of one of our comm ops (an FX node) runs with:
    :func:`backend_for_group` of its ``group_name`` and ``backend`` arguments; ``None`` for a
    node that is not one of our comm ops (a user's ``all_to_all_single``)."""
    target = node.target
    if not (isinstance(target, torch._ops.OpOverload) and target.namespace == "dbo"
            and comm_kind(node) is not None):
        return None
    return backend_for_group(op_arg(node, "group_name", ""), bound_backend(node))


def comm_backend_of(node: fx.Node) -> CommBackend | None:
    """The :class:`CommBackend` of a call of one of our comm ops, or ``None``."""
    spec = comm_spec_of(node)
    return None if spec is None else get_comm_backend(spec)


def ep_size_of_rows(x: fx.Node) -> int:
    """Receive rows per token of the dispatch whose received rows the FX node ``x`` is (a
    ``getitem`` of ``dbo.dispatch`` or of its wait in a split graph, or the ``cat`` of such rows
    that :mod:`dbo_compile.passes.join_experts` makes): its backend's ``recv_rows_per_token`` where
    it declares one, else the EP world size (the rank-major ``[W*T]`` layout); 1 when it cannot
    be told (no dispatch, unresolvable group)."""
    if isinstance(x, fx.Node) and x.target is torch.ops.aten.cat.default and x.args[0]:
        x = x.args[0][0]  # the joined rows: every part has the same layout
    src = x.args[0] if isinstance(x, fx.Node) and is_getitem(x) else None
    while isinstance(src, fx.Node) and is_wait(src):  # the split graph's wait of the dispatch
        src = src.args[0]
    if isinstance(src, fx.Node) and comm_kind(src) == "dispatch":
        try:
            backend = get_comm_backend(backend_for_group(src.args[4], bound_backend(src)))
            rows = getattr(backend, "recv_rows_per_token", None)
            return max(1, int(rows if rows is not None else ep_world_size(src.args[4])))
        except Exception:  # noqa: BLE001 - a cost estimate never fails the compile
            return 1
    return 1
