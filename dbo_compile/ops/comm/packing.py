"""The payload of the static-capacity rank-major layout (:mod:`dbo_compile.ops.comm`): the
argument checks of dispatch and combine, the dispatch payload row, the send buffer (torch ops
or one Triton kernel), the received rows split back into ``(x, ids, weights)``, and the
combine's sum over the source ranks. Public: every backend that moves payload rows (the
reference backends, the emulated world, a benchmark's no-comm stand-in) packs with these.

A dispatch payload row, in ``x``'s dtype::

    [ x[t] (H) | pad to a 4-byte boundary | K local expert ids, K weights (2K float32 bits) ]
"""

from __future__ import annotations

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from dbo_compile.errors import CommOpError
from dbo_compile.ops._triton import triton_kernels

__all__ = ["check_combine_args", "check_dispatch_args", "meta_view", "payload_layout",
           "send_buffers", "send_buffers_torch", "send_buffers_triton", "split_payload",
           "sum_sources"]


def check_dispatch_args(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
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


def check_combine_args(y: torch.Tensor, world_size: int) -> None:
    if y.dim() != 2:
        raise CommOpError(f"dbo.combine: y must be [W*num_tokens, hidden], got {tuple(y.shape)}")
    if world_size > 1 and y.shape[0] % world_size != 0:
        raise CommOpError(
            f"dbo.combine: y has {y.shape[0]} rows, not a multiple of the EP world size "
            f"{world_size}"
        )


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


def meta_view(payload: torch.Tensor, meta_col: int) -> torch.Tensor:
    """``[..., P]`` payload rows -> their ``[..., 2K]`` float32 metadata, a view."""
    return payload[..., meta_col:].view(torch.float32)


def send_buffers(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                  e_local: int, world_size: int) -> torch.Tensor:
    """Static-capacity send buffer ``[W, T, P]`` of dispatch payload rows in ``x.dtype``.

    Negative ids (masked slots) go to no rank. On CUDA with Triton one kernel writes it
    (:func:`send_buffers_triton`); elsewhere torch ops (:func:`send_buffers_torch`) give the
    same bits.
    """
    if x.is_cuda and x.numel() > 0 and topk_ids.shape[1] > 0 and _pack_kernel() is not None:
        return send_buffers_triton(x, topk_ids, topk_weights, e_local, world_size)
    return send_buffers_torch(x, topk_ids, topk_weights, e_local, world_size)


def send_buffers_torch(x, topk_ids, topk_weights, e_local, world_size):
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
    meta = meta_view(payload, meta_col)
    meta.copy_(torch.cat([torch.where(mask, local_ids, -1).to(torch.float32),
                          torch.where(mask, topk_weights.unsqueeze(0), 0.0)], dim=-1))
    return payload


@triton_kernels
def _pack_kernel(triton, tl):

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


def send_buffers_triton(x, topk_ids, topk_weights, e_local, world_size):
    triton, pack = _pack_kernel()
    t, h = x.shape
    k = topk_ids.shape[1]
    meta_col, cols = payload_layout(h, x.dtype, k)
    if x.stride(1) != 1:
        x = x.contiguous()
    payload = torch.empty((world_size, t, cols), dtype=x.dtype, device=x.device)
    if meta_col > h:
        payload[..., h:meta_col].zero_()
    meta = meta_view(payload, meta_col)
    block_h = min(1024, triton.next_power_of_2(h))
    pack[(world_size * t, triton.cdiv(h, block_h))](
        x, topk_ids.contiguous(), topk_weights.contiguous(), payload, meta, t, h, x.stride(0),
        cols, meta.stride(1), e_local, K=k, K_P2=triton.next_power_of_2(k), BLOCK_H=block_h)
    return payload


def split_payload(recv: torch.Tensor, hidden: int, top_k: int
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
    meta = meta_view(recv, meta_col)
    return (x, meta[:, :top_k].to(torch.int64),
            meta[:, top_k:].clone(memory_format=torch.contiguous_format))


def sum_sources(recv: torch.Tensor, world_size: int) -> torch.Tensor:
    """``[W*T, H] -> [T, H]``: sum over the W source ranks, accumulating in fp32."""
    acc_dtype = torch.float32 if recv.dtype in (torch.float16, torch.bfloat16) else recv.dtype
    # sum(dtype=) accumulates in fp32 without materialising an fp32 copy of recv
    summed = recv.view(world_size, -1, recv.shape[-1]).sum(dim=0, dtype=acc_dtype)
    return summed.to(recv.dtype)
