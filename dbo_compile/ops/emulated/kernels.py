"""The emulated dispatch and combine with Triton kernels (CUDA; on CPU tensors under the
interpreter): route + pack in one kernel, unpack in one, the combine's sum in one."""

from __future__ import annotations

import torch

from dbo_compile.ops._triton import triton_kernels
from dbo_compile.ops.comm.packing import meta_view, payload_layout
from dbo_compile.ops.emulated.link import LINK, Transfer
from dbo_compile.ops.emulated.routing import Issued, finish_now
from dbo_compile.ops.emulated.world import EmulatedWorld

__all__ = ["combine_triton", "combine_triton_issue", "dispatch_triton", "dispatch_triton_issue",
           "use_triton"]



@triton_kernels
def _kernels(triton, tl):

    @triton.jit
    def emulated_dispatch_route(ids_ptr, row_ptr, valid_ptr, T, E, EL, K: tl.constexpr,
                                K_P2: tl.constexpr, G: tl.constexpr, G_P2: tl.constexpr):
        """Token ``t``: each slot's row (as :func:`slot_rows`) and which of its ``G`` rows
        hold a slot."""
        t = tl.program_id(0).to(tl.int64)
        ks = tl.arange(0, K_P2)
        km = ks < K
        ids = tl.load(ids_ptr + t * K + ks, mask=km, other=-1)
        ok = (ids >= 0) & (ids < E) & km
        dest = tl.where(ok, ids // EL, -1)
        d_row = dest[:, None]
        d_col = dest[None, :]
        earlier = ks[None, :] < ks[:, None]
        dup = tl.max(((d_row == d_col) & earlier).to(tl.int32), axis=1)
        distinct = (dest >= 1) & (dup == 0)
        j = tl.sum(((d_col < d_row) & distinct[None, :]).to(tl.int32), axis=1)
        row = tl.where((dest >= 1) & (j < G - 1), 1 + j, 0)
        row = tl.where(ok, row, -1)
        tl.store(row_ptr + t * K + ks, row.to(tl.int32), mask=km)
        gs = tl.arange(0, G_P2)
        has = tl.max((row[None, :] == gs[:, None]).to(tl.int32), axis=1)
        tl.store(valid_ptr + t * G + gs, has.to(tl.int8), mask=gs < G)

    @triton.jit
    def emulated_dispatch_pack(x_ptr, ids_ptr, w_ptr, row_ptr, valid_ptr, pos_ptr,
                               out_x_ptr, out_ids_ptr, out_w_ptr, link_ptr, link_meta_ptr,
                               inv_ptr, count_ptr, H, stride_x, EL, cap, link_cols,
                               link_meta_row, K: tl.constexpr, K_P2: tl.constexpr,
                               G: tl.constexpr, BLOCK_H: tl.constexpr, COUNT: tl.constexpr):
        """Row ``(t, g)``: the local row and the fan-out rows that do not cross the link are
        written to the outputs; those that do, to link row ``pos`` (with ``inv[pos]``).
        ``COUNT``: fan-out rows that matter and those past the capacity are added to
        ``count[0]`` / ``count[1]``."""
        r = tl.program_id(0).to(tl.int64)
        t = r // G
        gg = r % G
        ks = tl.arange(0, K_P2)
        km = ks < K
        rows = tl.load(row_ptr + t * K + ks, mask=km, other=-1)
        mine = rows == gg
        valid = tl.load(valid_ptr + r) != 0
        ids = tl.load(ids_ptr + t * K + ks, mask=km, other=0)
        lid = tl.where(mine, ids % EL, -1)
        w = tl.where(mine, tl.load(w_ptr + t * K + ks, mask=km, other=0.0), 0.0)
        fan = (t * (G - 1) + gg - 1)
        pos = tl.load(pos_ptr + fan, mask=gg > 0, other=0)
        linked = (gg > 0) & valid & (pos < cap)
        cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        cm = cols < H
        if valid:
            xv = tl.load(x_ptr + t * stride_x + cols, mask=cm)
        else:
            xv = tl.zeros([BLOCK_H], dtype=out_x_ptr.dtype.element_ty)
        if COUNT:
            if (tl.program_id(1) == 0) & (gg > 0) & valid:
                tl.atomic_add(count_ptr, 1)
                if pos >= cap:
                    tl.atomic_add(count_ptr + 1, 1)
        if linked:
            tl.store(link_ptr + pos * link_cols + cols, xv, mask=cm)
            if tl.program_id(1) == 0:
                tl.store(link_meta_ptr + pos * link_meta_row + ks, lid.to(tl.float32), mask=km)
                tl.store(link_meta_ptr + pos * link_meta_row + K + ks, w, mask=km)
                tl.store(inv_ptr + pos, r)
        else:
            tl.store(out_x_ptr + r * H + cols, xv, mask=cm)
            if tl.program_id(1) == 0:
                tl.store(out_ids_ptr + r * K + ks, lid, mask=km)
                tl.store(out_w_ptr + r * K + ks, w, mask=km)

    @triton.jit
    def emulated_dispatch_unpack(link_ptr, link_meta_ptr, inv_ptr, out_x_ptr, out_ids_ptr,
                                 out_w_ptr, H, link_cols, link_meta_row, K: tl.constexpr,
                                 K_P2: tl.constexpr, BLOCK_H: tl.constexpr):
        """Link row ``i`` back to its receive row ``inv[i]`` (``-1``: an unused link row)."""
        i = tl.program_id(0).to(tl.int64)
        r = tl.load(inv_ptr + i)
        if r >= 0:
            cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
            cm = cols < H
            tl.store(out_x_ptr + r * H + cols, tl.load(link_ptr + i * link_cols + cols, mask=cm),
                     mask=cm)
            if tl.program_id(1) == 0:
                ks = tl.arange(0, K_P2)
                km = ks < K
                lid = tl.load(link_meta_ptr + i * link_meta_row + ks, mask=km, other=-1.0)
                w = tl.load(link_meta_ptr + i * link_meta_row + K + ks, mask=km, other=0.0)
                tl.store(out_ids_ptr + r * K + ks, lid.to(tl.int64), mask=km)
                tl.store(out_w_ptr + r * K + ks, w, mask=km)

    @triton.jit
    def emulated_combine_flag(y_ptr, valid_ptr, H, G: tl.constexpr, BLOCK_H: tl.constexpr):
        """Fan-out row ``f`` (token ``f // (G-1)``, row ``1 + f % (G-1)``): non-zero?"""
        f = tl.program_id(0).to(tl.int64)
        r = (f // (G - 1)) * G + 1 + f % (G - 1)
        acc = tl.zeros([BLOCK_H], dtype=tl.int32)
        for c0 in range(0, H, BLOCK_H):
            cols = c0 + tl.arange(0, BLOCK_H)
            v = tl.load(y_ptr + r * H + cols, mask=cols < H, other=0.0)
            acc = tl.maximum(acc, (v != 0).to(tl.int32))
        tl.store(valid_ptr + f, tl.max(acc, axis=0).to(tl.int8))

    @triton.jit
    def emulated_combine_pack(y_ptr, valid_ptr, pos_ptr, link_ptr, cap, H, G: tl.constexpr,
                              BLOCK_H: tl.constexpr):
        f = tl.program_id(0).to(tl.int64)
        pos = tl.load(pos_ptr + f)
        if (tl.load(valid_ptr + f) != 0) & (pos < cap):
            r = (f // (G - 1)) * G + 1 + f % (G - 1)
            cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
            cm = cols < H
            tl.store(link_ptr + pos * H + cols, tl.load(y_ptr + r * H + cols, mask=cm), mask=cm)

    @triton.jit
    def emulated_combine_sum(y_ptr, back_ptr, valid_ptr, pos_ptr, out_ptr, count_ptr, cap, H,
                             G: tl.constexpr, BLOCK_H: tl.constexpr, COUNT: tl.constexpr):
        """``out[t] = y[t, 0] + sum_j (row j from the link, or y[t, 1+j])``, in fp32 (counts
        as the pack kernel's, at ``count[2:4]``)."""
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        cm = cols < H
        acc = tl.load(y_ptr + t * G * H + cols, mask=cm, other=0.0).to(tl.float32)
        for j in tl.static_range(G - 1):
            f = t * (G - 1) + j
            pos = tl.load(pos_ptr + f)
            ok = tl.load(valid_ptr + f) != 0
            if COUNT:
                if (tl.program_id(1) == 0) & ok:
                    tl.atomic_add(count_ptr + 2, 1)
                    if pos >= cap:
                        tl.atomic_add(count_ptr + 3, 1)
            if ok & (pos < cap):
                v = tl.load(back_ptr + pos * H + cols, mask=cm, other=0.0)
            else:
                v = tl.load(y_ptr + (t * G + 1 + j) * H + cols, mask=cm, other=0.0)
            acc += v.to(tl.float32)
        tl.store(out_ptr + t * H + cols, acc.to(out_ptr.dtype.element_ty), mask=cm)

    return triton, {"route": emulated_dispatch_route, "pack": emulated_dispatch_pack,
                    "unpack": emulated_dispatch_unpack, "flag": emulated_combine_flag,
                    "cpack": emulated_combine_pack, "sum": emulated_combine_sum}


def dispatch_triton_issue(world: EmulatedWorld, x, topk_ids, topk_weights) -> Issued:
    """The dispatch with the Triton kernels (CUDA; on CPU tensors under the interpreter)."""
    triton, kern = _kernels()
    t, h = x.shape
    k = topk_ids.shape[1]
    g, f = world.rows_per_token, world.fanout
    dev = x.device
    meta_col, cols = payload_layout(h, x.dtype, k)
    if x.stride(1) != 1:
        x = x.contiguous()
    ids, wts = topk_ids.contiguous(), topk_weights.contiguous()
    n = t * g
    out_x = torch.empty((n, h), dtype=x.dtype, device=dev)
    out_ids = torch.empty((n, k), dtype=torch.int64, device=dev)
    out_w = torch.empty((n, k), dtype=torch.float32, device=dev)
    if n == 0:
        return (out_x, out_ids, out_w), _nothing
    row = torch.empty((t, k), dtype=torch.int32, device=dev)
    valid = torch.empty((t, g), dtype=torch.int8, device=dev)
    k_p2, g_p2 = triton.next_power_of_2(k), triton.next_power_of_2(g)
    kern["route"][(t,)](ids, row, valid, t, world.num_experts, world.local_experts, K=k,
                        K_P2=k_p2, G=g, G_P2=g_p2)
    cap = world.capacity(t)
    pos = torch.cumsum(valid[:, 1:].reshape(-1), 0, dtype=torch.int64) - 1
    counter = LINK.counter(dev)
    link = torch.empty((max(cap, 1), cols), dtype=x.dtype, device=dev)
    link_meta = meta_view(link, meta_col)
    if meta_col > h:
        link[:, h:meta_col].zero_()
    inv = torch.full((max(cap, 1),), -1, dtype=torch.int64, device=dev)
    block_h = min(1024, triton.next_power_of_2(h))
    grid = (n, triton.cdiv(h, block_h))
    kern["pack"][grid](x, ids, wts, row, valid, pos, out_x, out_ids, out_w, link, link_meta, inv,
                       counter if counter is not None else inv, h, x.stride(0),
                       world.local_experts, cap, cols, link_meta.stride(0), K=k, K_P2=k_p2, G=g,
                       BLOCK_H=block_h, COUNT=counter is not None)
    if cap == 0:
        return (out_x, out_ids, out_w), _nothing
    transfer = LINK.send(link[:cap], world)

    def finish() -> None:
        back = transfer.finish()
        kern["unpack"][(cap, triton.cdiv(h, block_h))](
            back, meta_view(back, meta_col), inv, out_x, out_ids, out_w, h, cols,
            link_meta.stride(0), K=k, K_P2=k_p2, BLOCK_H=block_h)

    return (out_x, out_ids, out_w), finish


def _nothing() -> None:
    pass


def combine_triton_issue(world: EmulatedWorld, y) -> Issued:
    """The combine with the Triton kernels (CUDA; on CPU tensors under the interpreter)."""
    triton, kern = _kernels()
    g, f = world.rows_per_token, world.fanout
    t, h = y.shape[0] // g, y.shape[1]
    dev = y.device
    y = y.contiguous()
    out = torch.empty((t, h), dtype=y.dtype, device=dev)
    if t == 0:
        return out, _nothing
    block_h = min(1024, triton.next_power_of_2(h))
    nf = t * f
    valid = torch.empty(nf, dtype=torch.int8, device=dev)
    if nf:
        kern["flag"][(nf,)](y, valid, h, G=g, BLOCK_H=block_h)
    cap = world.capacity(t)
    pos = torch.cumsum(valid, 0, dtype=torch.int64) - 1
    counter = LINK.counter(dev)
    transfer = Transfer(y)  # never read when nothing crosses the link
    if cap > 0 and nf:
        link = torch.empty((cap, h), dtype=y.dtype, device=dev)
        kern["cpack"][(nf, triton.cdiv(h, block_h))](y, valid, pos, link, cap, h, G=g,
                                                     BLOCK_H=block_h)
        transfer = LINK.send(link, world)

    def finish() -> None:
        back = transfer.finish()
        kern["sum"][(t, triton.cdiv(h, block_h))](
            y, back, valid, pos, out, counter if counter is not None else pos, cap, h, G=g,
            BLOCK_H=block_h, COUNT=counter is not None)

    return out, finish


def dispatch_triton(world: EmulatedWorld, x, topk_ids, topk_weights):
    """:func:`dispatch_torch` with the Triton kernels, issued and finished."""
    return finish_now(dispatch_triton_issue(world, x, topk_ids, topk_weights))


def combine_triton(world: EmulatedWorld, y):
    """:func:`combine_torch` with the Triton kernels, issued and finished."""
    return finish_now(combine_triton_issue(world, y))



def use_triton(t: torch.Tensor) -> bool:
    """Whether the Triton kernels run the calls on ``t`` (CUDA, Triton importable)."""
    return t.is_cuda and _kernels() is not None
