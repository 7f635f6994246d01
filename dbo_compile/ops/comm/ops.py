"""The comm ops (``dbo.dispatch`` / ``dbo.combine``, ``dbo.moe_dispatch`` /
``dbo.moe_combine``), their fake shapes and records, the receive phase (:func:`comm_receive`),
and what the compiler asks of a comm node (its backend spec, its receive rows per token)."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from dbo_compile.errors import CommBackendError
from dbo_compile.ops.comm.contract import CommBackend
from dbo_compile.ops.comm.groups import backend_for_group, ep_world_size
from dbo_compile.ops.comm.packing import check_combine_args, check_dispatch_args
from dbo_compile.ops.comm.register import get_comm_backend
from dbo_compile.ops.comm.watch import check_results, posting, watching
from dbo_compile.ops.registry import (
    OpInfo,
    bound_backend,
    comm_kind,
    is_getitem,
    is_wait,
    op_arg,
    register_op,
)

__all__ = ["combine", "comm_backend_of", "comm_receive", "comm_spec_of", "dispatch",
           "ep_size_of_rows", "moe_combine", "moe_dispatch", "result_key"]


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
    with posting():
        out = impl.dispatch(x, topk_ids, topk_weights, num_experts, group_name)
    if watching():
        check_results(impl, "dbo.dispatch", "dispatch", group_name, out)
    return out


def _rank_major_dispatch_fake(x, topk_ids, topk_weights, num_experts, group_name):
    w = ep_world_size(group_name)
    check_dispatch_args(x, topk_ids, topk_weights, num_experts, w)
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
    with posting():
        out = impl.combine(y, group_name)
    if watching():
        check_results(impl, "dbo.combine", "combine", group_name, out)
    return out


@combine.register_fake
def _combine_fake(y, group_name, backend=""):
    impl = _rank_major_backend(group_name, backend, "dbo.combine")
    if impl.combine_fake is not None:
        return impl.combine_fake(y, group_name)
    w = ep_world_size(group_name)
    check_combine_args(y, w)
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
    with posting():
        if impl.handle:
            out = impl.dispatch(x, topk_ids, topk_weights, num_experts, group_name,
                                defer_receive)
        else:
            more = {"defer_receive": defer_receive} if impl.receive is not None else {}
            out = (*impl.dispatch(x, topk_ids, topk_weights, num_experts, group_name, **more),
                   _empty_handle(x))
    if watching():
        check_results(impl, "dbo.moe_dispatch", "dispatch", group_name, out)
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
    with posting():
        if impl.handle:
            out = impl.combine(y, topk_ids, topk_weights, recv_ids, recv_weights, handle,
                               group_name, defer_receive)
        else:
            more = {"defer_receive": defer_receive} if impl.receive is not None else {}
            out = impl.combine(y, group_name, **more)
    if watching():
        check_results(impl, "dbo.moe_combine", "combine", group_name, out)
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
    check_combine_args(y, ep_world_size(group_name))
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
            rows = backend.recv_rows_per_token
            return max(1, int(rows if rows is not None else ep_world_size(src.args[4])))
        except Exception:  # noqa: BLE001 - a cost estimate never fails the compile
            return 1
    return 1

