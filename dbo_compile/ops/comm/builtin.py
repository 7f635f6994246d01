"""The reference comm backends: ``local`` (one EP rank, no collective) and ``torch``
(static-capacity ``all_to_all_single`` over the EP process group: NCCL on GPU, Gloo on CPU),
both rank-major over the payload rows of :mod:`~dbo_compile.ops.comm.packing`; and the lazy
registration of ``deep_ep``."""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from dbo_compile.errors import CommOpError
from dbo_compile.ops.backends import AutoPreference
from dbo_compile.ops.comm.contract import CommBackend
from dbo_compile.ops.comm.groups import resolve_group
from dbo_compile.ops.comm.packing import (
    check_combine_args,
    check_dispatch_args,
    send_buffers,
    split_payload,
    sum_sources,
)
from dbo_compile.ops.comm.register import register_comm_backend, register_lazy_comm_backend

log = logging.getLogger(__name__)

__all__ = ["check_ids_on_host"]


def check_ids_on_host(topk_ids: torch.Tensor, num_experts: int, world_size: int) -> None:
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
    e_local = check_dispatch_args(x, topk_ids, topk_weights, num_experts, 1)
    check_ids_on_host(topk_ids, num_experts, 1)
    payload = send_buffers(x, topk_ids, topk_weights, e_local, 1)
    return split_payload(payload.view(-1, payload.shape[-1]), x.shape[1], topk_ids.shape[1])


def _local_combine(y, group_name):
    check_combine_args(y, 1)
    return y.clone()


def _torch_dispatch(x, topk_ids, topk_weights, num_experts, group_name):
    group = resolve_group(group_name)
    w = group.size()
    e_local = check_dispatch_args(x, topk_ids, topk_weights, num_experts, w)
    check_ids_on_host(topk_ids, num_experts, w)
    send = send_buffers(x, topk_ids, topk_weights, e_local, w)
    send = send.view(-1, send.shape[-1])
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return split_payload(recv, x.shape[1], topk_ids.shape[1])


def _torch_combine(y, group_name):
    group = resolve_group(group_name)
    w = group.size()
    check_combine_args(y, w)
    y = y.contiguous()
    recv = torch.empty_like(y)
    dist.all_to_all_single(recv, y, group=group)
    return sum_sources(recv, w)



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
    supports=_local_supports, auto=AutoPreference(1, op_default=True)))
register_comm_backend(CommBackend(
    "torch", _torch_dispatch, _torch_combine,
    "static-capacity all_to_all_single over a torch.distributed process group (NCCL/Gloo)",
    supports=_torch_supports, auto=AutoPreference(1, op_default=True)))
register_lazy_comm_backend("deep_ep", "dbo_compile.ops.deep_ep")

