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
"""

import dataclasses
import functools
import importlib
import logging
import threading
from typing import Callable

import torch
import torch.distributed as dist
import torch.fx as fx
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.fx.experimental.symbolic_shapes import statically_known_true

from dbo_compile.errors import CommBackendError, CommOpError, DboError
from dbo_compile.ops._triton import import_triton
from dbo_compile.ops.registry import OpInfo, comm_kind, is_getitem, register_op

log = logging.getLogger(__name__)

__all__ = [
    "LEDGER",
    "CommBackend",
    "CommBackendError",
    "CommLedger",
    "CommOpError",
    "available_comm_backends",
    "backend_for_group",
    "ep_group_name",
    "ep_size_of_rows",
    "ep_world_size",
    "get_comm_backend",
    "register_comm_backend",
    "register_lazy_comm_backend",
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


def _resolve_group(group_name: str) -> dist.ProcessGroup:
    return _resolve_process_group(group_name)


def ep_world_size(group_name: str) -> int:
    """World size ``W`` of the EP group named ``group_name`` (1 for ``""``)."""
    if group_name == "":
        return 1
    return _resolve_group(group_name).size()


def backend_for_group(group_name: str) -> str:
    """The comm backend the ops use for ``group_name``: ``"local"`` for ``""``, else ``"torch"``."""
    return "local" if group_name == "" else "torch"


# --------------------------------------------------------------------------------------------
# Backend registry
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CommBackend:
    """One implementation of dispatch / combine.

    A backend raises a :class:`~dbo_compile.errors.DboError` (e.g. ``CommOpError``) only
    before it posts its collective: a rank whose step fails then issues the collective again
    with a null payload (its peers wait in it); any other exception means the transport
    failed (:class:`CommLedger`).

    Attributes:
        name: registry key (``"torch"``, ``"local"``, ``"deep_ep"``, ...).
        dispatch: ``(x, topk_ids, topk_weights, num_experts, group_name) -> (recv_x, recv_ids,
            recv_weights)`` with the shapes of ``torch.ops.dbo.dispatch``.
        combine: ``(y, group_name) -> out`` with the shapes of ``torch.ops.dbo.combine``.
        description: one line for logs and errors.
    """

    name: str
    dispatch: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    combine: Callable[..., torch.Tensor]
    description: str = ""


_BACKENDS: dict[str, CommBackend] = {}
#: name -> module path; the module is imported on first use and must call register_comm_backend.
_LAZY_BACKENDS: dict[str, str] = {}


def register_comm_backend(backend: CommBackend) -> None:
    """Register (or replace) a comm backend under ``backend.name``."""
    _BACKENDS[backend.name] = backend
    _LAZY_BACKENDS.pop(backend.name, None)


def register_lazy_comm_backend(name: str, module: str) -> None:
    """Register a backend whose module is imported only when :func:`get_comm_backend` asks for it.

    The module must call :func:`register_comm_backend` with a backend named ``name`` on import.
    """
    if name not in _BACKENDS:
        _LAZY_BACKENDS[name] = module


def available_comm_backends() -> list[str]:
    """Names of the registered backends (loaded or lazy), sorted."""
    return sorted(set(_BACKENDS) | set(_LAZY_BACKENDS))


def get_comm_backend(name: str) -> CommBackend:
    """The backend registered as ``name``, importing its module first if it is lazy.

    Raises:
        CommBackendError: ``name`` is unknown, or its module (or the package it wraps, e.g.
            ``deep_ep``) cannot be imported.
    """
    if name in _BACKENDS:
        return _BACKENDS[name]
    if name not in _LAZY_BACKENDS:
        raise CommBackendError(
            f"unknown comm backend {name!r}; registered: {available_comm_backends()}"
        )
    module = _LAZY_BACKENDS[name]
    try:
        importlib.import_module(module)
    except ImportError as e:
        raise CommBackendError(
            f"comm backend {name!r} cannot be loaded: importing {module!r} failed ({e}). "
            f"Install its package (e.g. `pip install dbo_compile[deepep]`) or use 'torch'."
        ) from e
    if name not in _BACKENDS:
        raise CommBackendError(f"module {module!r} did not register comm backend {name!r}")
    return _BACKENDS[name]


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


register_comm_backend(CommBackend(
    "local", _local_dispatch, _local_combine, "world size 1: no collective"))
register_comm_backend(CommBackend(
    "torch", _torch_dispatch, _torch_combine,
    "static-capacity all_to_all_single over a torch.distributed process group (NCCL/Gloo)"))
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
# Custom ops
# --------------------------------------------------------------------------------------------


@torch.library.custom_op("dbo::dispatch", mutates_args=())
def dispatch(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
             num_experts: int, group_name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """MoE dispatch: send each token to the EP ranks that own its top-k experts.

    Args:
        x: ``[T, H]`` activations (any float dtype); ``T`` is the token dim, equal on all ranks.
        topk_ids: ``[T, K]`` int64 global expert ids ``< num_experts`` (negative = masked
            slot, routed nowhere; larger ids are dropped too: refused on CPU with one EP
            rank, logged as an error on CPU with several, unchecked on CUDA).
        topk_weights: ``[T, K]`` float32 routing weights.
        num_experts: global expert count ``E``; must be divisible by the EP world size ``W``.
        group_name: EP process group name (:func:`ep_group_name`); ``""`` = local, ``W = 1``.

    Returns:
        ``(recv_x [W*T, H] x.dtype, recv_topk_ids [W*T, K] int64, recv_topk_weights [W*T, K]
        float32)``, rank-major: row ``r*T + t`` is token ``t`` of source rank ``r``. Ids are the
        local expert index ``0..E_local-1`` for slots owned by this rank and ``-1`` otherwise
        (weight 0); rows not routed here are zeros with all ids ``-1``.

    Raises:
        CommOpError: bad shapes/dtypes (``x`` not floating point), an id ``>= num_experts``
            (CPU, ``W = 1``) or ``num_experts % W != 0``.
    """
    backend = get_comm_backend(backend_for_group(group_name))
    with _posting():
        return backend.dispatch(x, topk_ids, topk_weights, num_experts, group_name)


@dispatch.register_fake
def _dispatch_fake(x, topk_ids, topk_weights, num_experts, group_name):
    w = ep_world_size(group_name)
    _check_dispatch_args(x, topk_ids, topk_weights, num_experts, w)
    n, h = x.shape
    k = topk_ids.shape[1]
    return (x.new_empty((w * n, h)), topk_ids.new_empty((w * n, k)),
            topk_weights.new_empty((w * n, k)))


@torch.library.custom_op("dbo::combine", mutates_args=())
def combine(y: torch.Tensor, group_name: str) -> torch.Tensor:
    """MoE combine: return expert outputs to the token's rank and sum them.

    Args:
        y: ``[W*T, H]`` expert outputs in the dispatch receive layout (row ``r*T + t`` belongs
            to token ``t`` of rank ``r``), already multiplied by the top-k weights.
        group_name: the EP process group name used for the matching dispatch.

    Returns:
        ``[T, H]`` of ``y.dtype``: ``out[t] = sum_r recv[r*T + t]`` (accumulated in fp32 for
        fp16/bf16).

    Raises:
        CommOpError: ``y`` is not 2-D or its rows are not a multiple of ``W``.
    """
    backend = get_comm_backend(backend_for_group(group_name))
    with _posting():
        return backend.combine(y, group_name)


def _check_combine_args(y: torch.Tensor, world_size: int) -> None:
    if y.dim() != 2:
        raise CommOpError(f"dbo.combine: y must be [W*num_tokens, hidden], got {tuple(y.shape)}")
    if world_size > 1 and y.shape[0] % world_size != 0:
        raise CommOpError(
            f"dbo.combine: y has {y.shape[0]} rows, not a multiple of the EP world size "
            f"{world_size}"
        )


@combine.register_fake
def _combine_fake(y, group_name):
    w = ep_world_size(group_name)
    _check_combine_args(y, w)
    return y.new_empty((y.shape[0] // w, y.shape[1]))


register_op(OpInfo(torch.ops.dbo.dispatch.default, comm="dispatch",
                   token_args=((0, "x"), (1, "topk_ids"), (2, "topk_weights")), row_local=True,
                   group_arg=(4, "group_name"),
                   # null call: no token routed anywhere (id -1, weight 0)
                   null_fill=(0.0, -1, 0.0)))
register_op(OpInfo(torch.ops.dbo.combine.default, comm="combine", row_local=True,
                   group_arg=(1, "group_name"), null_fill=(0.0,)))


def ep_size_of_rows(x: fx.Node) -> int:
    """EP world size of the dispatch whose received rows the FX node ``x`` is (a ``getitem``
    of ``dbo.dispatch``); 1 when it cannot be told (no dispatch, unresolvable group)."""
    src = x.args[0] if isinstance(x, fx.Node) and is_getitem(x) else None
    if isinstance(src, fx.Node) and comm_kind(src) == "dispatch":
        try:
            return max(1, int(ep_world_size(src.args[4])))
        except Exception:  # noqa: BLE001 - a cost estimate never fails the compile
            return 1
    return 1
