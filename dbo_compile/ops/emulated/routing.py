"""The emulated dispatch and combine with torch ops (every device; the Triton kernels of
:mod:`.kernels` compute the same bits on CUDA): each slot's row, the rows packed through the
link and put back (:mod:`dbo_compile.ops.emulated`, "Layout")."""

from __future__ import annotations

from typing import Any, Callable

import torch

from dbo_compile.ops.comm.packing import meta_view, payload_layout
from dbo_compile.ops.emulated.link import LINK
from dbo_compile.ops.emulated.world import EmulatedWorld

__all__ = ["Issued", "combine_torch", "combine_torch_issue", "dispatch_torch",
           "dispatch_torch_issue", "finish_now", "slot_rows"]



def slot_rows(ids: torch.Tensor, world: EmulatedWorld) -> torch.Tensor:
    """``[T, K]`` int64: the row of each slot within its token's ``G`` rows (0 = local, ``1+j``
    = the token's ``j``-th remote rank in ascending order, ``-1`` = no expert: a negative or
    ``>= E`` id). A slot whose remote rank is past the fan-out (none when ``K <= W - 1``) goes
    to the local row."""
    e, el = world.num_experts, world.local_experts
    ok = (ids >= 0) & (ids < e)
    dest = torch.where(ok, torch.div(ids, el, rounding_mode="floor"), -1)
    remote = dest >= 1
    k = ids.shape[1]
    same = dest.unsqueeze(2) == dest.unsqueeze(1)  # [T, K, K']
    earlier = torch.ones(k, k, dtype=torch.bool, device=ids.device).tril(-1)
    first = ~(same & earlier).any(-1)  # the slot is its rank's first
    distinct = remote & first
    less = dest.unsqueeze(1) < dest.unsqueeze(2)  # [T, K(k), K(k')]: dest[k'] < dest[k]
    j = (less & distinct.unsqueeze(1)).sum(-1)
    row = torch.where(remote & (j < world.fanout), 1 + j, 0)
    return torch.where(ok, row, -1)


def _positions(valid: torch.Tensor, cap: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-major link positions of the rows that matter: ``(pos, sent)`` (``sent``: the row
    is within the capacity)."""
    pos = torch.cumsum(valid.to(torch.int64), 0) - 1
    return pos, valid & (pos < cap)


def _count(device: torch.device, offset: int, valid: torch.Tensor, sent: torch.Tensor) -> None:
    c = LINK.counter(device)
    if c is not None:
        c[offset:offset + 2] += torch.stack([valid.sum(), (valid & ~sent).sum()])


def _through_link(world: EmulatedWorld, fan: torch.Tensor, valid: torch.Tensor, cap: int,
                  counter: int) -> Callable[[], torch.Tensor]:
    """Send the fan-out rows ``fan [N, C]`` that matter (``valid``), packed into the link's
    ``cap`` rows; the returned ``finish()`` waits for them and gives ``fan`` with those rows
    put back in place from the link (rows past ``cap`` keep their device-side values).
    Counted at ``counter`` of the stats."""
    pos, sent = _positions(valid, cap)
    _count(fan.device, counter, valid, sent)
    if cap == 0 or fan.shape[0] == 0:
        return lambda: fan
    link = torch.zeros((cap + 1, fan.shape[1]), dtype=fan.dtype, device=fan.device)
    link.index_copy_(0, torch.where(sent, pos, cap), fan)  # row cap: the unsent rows
    transfer = LINK.send(link[:cap], world)

    def finish() -> torch.Tensor:
        got = transfer.finish().index_select(0, torch.where(sent, pos, 0))
        return torch.where(sent.unsqueeze(-1), got, fan)

    return finish


#: an op's issue: ``(result, finish)``; ``finish()`` completes ``result`` in place on the
#: current stream (the op's receive phase, :meth:`EmulatedBackend` ``receive``)
Issued = tuple[Any, Callable[[], None]]


def finish_now(issued: Issued) -> Any:
    """An op issued and finished at once: its result."""
    result, finish = issued
    finish()
    return result


def dispatch_torch_issue(world: EmulatedWorld, x, topk_ids, topk_weights) -> Issued:
    t, h = x.shape
    k = topk_ids.shape[1]
    g = world.rows_per_token
    el = world.local_experts
    meta_col, cols = payload_layout(h, x.dtype, k)
    row = slot_rows(topk_ids, world)  # [T, K]
    mine = row.unsqueeze(1) == torch.arange(g, device=x.device).view(1, g, 1)  # [T, G, K]
    valid = mine.any(-1)  # [T, G]
    lid = torch.remainder(topk_ids, el)
    payload = torch.zeros((t, g, cols), dtype=x.dtype, device=x.device)
    payload[..., :h] = torch.where(valid.unsqueeze(-1), x.unsqueeze(1),
                                   torch.zeros((), dtype=x.dtype, device=x.device))
    meta_view(payload, meta_col).copy_(torch.cat([
        torch.where(mine, lid.unsqueeze(1), -1).to(torch.float32),
        torch.where(mine, topk_weights.unsqueeze(1), 0.0)], dim=-1))
    fan_back = _through_link(world, payload[:, 1:].reshape(t * world.fanout, cols),
                             valid[:, 1:].reshape(-1), world.capacity(t), 0)
    out = (x.new_empty((t * g, h)), topk_ids.new_empty((t * g, k), dtype=torch.int64),
           torch.empty((t * g, k), dtype=torch.float32, device=x.device))

    def finish() -> None:
        fan = fan_back()
        recv = torch.cat([payload[:, :1], fan.view(t, world.fanout, cols)], dim=1)
        recv = recv.view(t * g, cols)
        meta = meta_view(recv, meta_col)
        out[0].copy_(recv[:, :h])
        out[1].copy_(meta[:, :k])
        out[2].copy_(meta[:, k:])

    return out, finish


def combine_torch_issue(world: EmulatedWorld, y) -> Issued:
    g = world.rows_per_token
    t, h = y.shape[0] // g, y.shape[1]
    y = y.contiguous()
    grouped = y.view(t, g, h)
    fan = grouped[:, 1:].reshape(t * world.fanout, h)
    fan_back = _through_link(world, fan, (fan != 0).any(-1), world.capacity(t), 2)
    out = y.new_empty((t, h))

    def finish() -> None:
        acc = torch.float32 if y.dtype in (torch.float16, torch.bfloat16) else y.dtype
        total = grouped[:, 0].to(acc)
        back = fan_back().view(t, world.fanout, h)
        for j in range(world.fanout):  # in the Triton kernel's order: the same bits
            total = total + back[:, j].to(acc)
        out.copy_(total)

    return out, finish


def dispatch_torch(world: EmulatedWorld, x, topk_ids, topk_weights):
    """The dispatch with torch ops, issued and finished: ``(recv_x [T*G, H], recv_ids [T*G,
    K] int64, recv_weights [T*G, K] fp32)`` (module docstring)."""
    return finish_now(dispatch_torch_issue(world, x, topk_ids, topk_weights))


def combine_torch(world: EmulatedWorld, y):
    """The combine with torch ops, issued and finished: ``[T, H]`` of ``y.dtype``."""
    return finish_now(combine_torch_issue(world, y))


