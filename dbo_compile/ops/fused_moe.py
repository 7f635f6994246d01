"""The routed experts of small steps in three Triton kernels (the ``grouped`` CUDA path's
decode kernels, :func:`dbo_compile.ops.experts.grouped_experts` picks them).

At decode a step's routed experts see a few dozen rows each; there the sorted path (slot keys,
CUB's radix sort, the offsets, a gather, two ``torch._grouped_mm`` with SiLU between them, the
weighted gather-sum: 14 kernels) is launch- and latency-bound, and a split step pays it twice
(one H200, emulated EP-8 decode 256, 4 layers: ~260 µs in the sort's kernels and 604 µs in
the grouped GEMMs of a split program's 2,387 µs of kernel time; each grouped GEMM took ~38 µs
at 96 and at 192 rows per expert, i.e. its 88 tiles read the weights at a fraction of HBM
bandwidth; ``benchmarks/results/kernels_emulated_ep8_decode256_h200_2026-12-01.json``). This module does the
same work the way vLLM's ``fused_moe`` Triton kernel does (``moe_align_block_size``, then
grouped GEMMs that read their rows through the sorted slot list):

1. **align** (grid ``E``): program ``e`` counts every expert's slots (a histogram of the ids),
   places its expert's tiles after the padded counts of the experts before it (each expert's
   rows padded to ``BLOCK_M``, so that a tile has one expert), and writes the sorted slot list
   (padding rows: the sentinel ``N*K``), each slot's sorted position (the inverse permutation
   the gather-sum reads) and the expert of each tile (``-1`` past the last one). Stable: slots
   of one expert keep their order.
2. **gate/up + SiLU** (grid ``tiles x cdiv(I, BLOCK_N)``): ``x`` rows gathered through the slot
   list (``slot // K``), both halves of ``w13[e]`` in one program, ``silu(gate) * up`` from the
   fp32 accumulators, stored bf16 at the sorted rows (no ``[rows, 2I]`` intermediate, no
   separate gather or activation kernel).
3. **down** (grid ``tiles x cdiv(H, BLOCK_N)``): ``a @ w2[e].T`` per tile, bf16.

The weighted gather-sum after them is :mod:`dbo_compile.ops.experts`' ``wgs`` kernel (that
module also chooses between the paths). Four launches per call instead of 14; static shapes
(the grids are bounded by ``N*K`` slots), no host sync, CUDA-graph capturable. The tile shape
is :data:`DEFAULT_CONFIG` unless a call passes another (``benchmarks/bench_experts.py
--sweep``). The align kernel reads all ``N*K`` ids once per expert, so the path serves calls
up to :data:`MAX_SLOTS` slots (the caller keeps the sorted path beyond).

Numerics: the same products as the sorted path, accumulated in fp32; the gate/up values go
into SiLU unrounded (the sorted path rounds them to bf16 first).
"""

from __future__ import annotations

import dataclasses

import torch

from dbo_compile.errors import ExpertsOpError
from dbo_compile.ops._triton import triton_kernels

__all__ = ["DEFAULT_CONFIG", "FusedConfig", "MAX_SLOTS", "align", "expert_outputs", "supports"]

#: the largest ``N*K`` the fused path serves (its align kernel reads all ids once per expert)
MAX_SLOTS = 65536


@dataclasses.dataclass(frozen=True)
class FusedConfig:
    """Tile shape of the fused experts' GEMMs.

    Attributes:
        block_m: rows per tile (each expert's rows are padded to a multiple); >= 16.
        block_n: output columns per program (of ``I`` for gate/up, of ``H`` for down); >= 16.
        block_k: reduction step; >= 16.
        num_warps, num_stages: Triton launch options.
    """

    block_m: int = 64
    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ExpertsOpError(f"fused experts config: {name}={v} must be a power of two "
                                     f">= 16 (tl.dot's tile)")


#: the tile shape of both GEMMs: within 8 % of the sweep's fastest of 24 shapes at every shape
#: measured, within 2 % at V2-Lite's emulated EP-8 128-1024 tokens (one H200,
#: ``benchmarks/bench_experts.py --sweep``, 2026-12-01; the repeats' spread is ~1-2 %)
DEFAULT_CONFIG = FusedConfig()


def supports(x: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether the fused path serves this call: CUDA (or Triton's interpreter), rank-major
    rows, 16-bit or fp32 activations and weights of one dtype, at most :data:`MAX_SLOTS`
    slots, Triton importable."""
    kernels = _kernels()
    return (kernels is not None and (x.is_cuda or kernels[2])
            and x.dim() == 2 and ids.numel() <= MAX_SLOTS and x.dtype == w13.dtype == w2.dtype
            and x.dtype in (torch.bfloat16, torch.float16, torch.float32))


@triton_kernels
def _kernels(triton, tl):

    @triton.jit
    def moe_align_kernel(ids_ptr, sorted_ptr, pos_ptr, tile_expert_ptr, nk, E, num_tiles,
                         BLOCK_M: tl.constexpr, BINS: tl.constexpr, BLOCK: tl.constexpr):
        e = tl.program_id(0)
        lanes = tl.arange(0, BLOCK)
        # pass 1: every expert's count (slots elsewhere, id outside [0, E), fall in bin E)
        counts = tl.zeros([BINS], tl.int32)
        for s0 in range(0, nk, BLOCK):
            offs = s0 + lanes
            k = tl.load(ids_ptr + offs, mask=offs < nk, other=-1)
            k = tl.where((k >= 0) & (k < E), k, E).to(tl.int32)
            counts += tl.histogram(k, BINS)
        bins = tl.arange(0, BINS)
        padded = tl.where(bins < E, (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M, 0)
        start = tl.sum(tl.where(bins < e, padded, 0), 0)
        mine = tl.sum(tl.where(bins == e, counts, 0), 0)
        mine_padded = tl.sum(tl.where(bins == e, padded, 0), 0)
        # the expert of each of its tiles; program 0 marks the tiles past the last expert's
        t_lanes = tl.arange(0, BLOCK)
        for t0 in range(0, mine_padded // BLOCK_M, BLOCK):
            t = t0 + t_lanes
            tl.store(tile_expert_ptr + start // BLOCK_M + t, e + t * 0,
                     mask=t < mine_padded // BLOCK_M)
        if e == 0:
            total_tiles = tl.sum(padded, 0) // BLOCK_M
            for t0 in range(0, num_tiles, BLOCK):
                t = t0 + t_lanes
                tl.store(tile_expert_ptr + t, t * 0 - 1, mask=(t >= total_tiles) & (t < num_tiles))
        # pass 2: the expert's slots in order, at start + rank
        seen = start * 0
        for s0 in range(0, nk, BLOCK):
            offs = s0 + lanes
            k = tl.load(ids_ptr + offs, mask=offs < nk, other=-1)
            hit = k == e
            rank = seen + tl.cumsum(hit.to(tl.int32), 0) - 1
            p = start + rank
            tl.store(sorted_ptr + p, offs.to(tl.int32), mask=hit)
            tl.store(pos_ptr + offs, p.to(tl.int32), mask=hit)
            seen += tl.sum(hit.to(tl.int32), 0)
        # padding rows of its last tile: the sentinel slot (never loaded, never stored)
        pad = tl.arange(0, BLOCK_M)
        tl.store(sorted_ptr + start + mine + pad, nk + pad * 0, mask=mine + pad < mine_padded)

    @triton.jit
    def moe_gate_up_kernel(x_ptr, w_ptr, a_ptr, sorted_ptr, tile_expert_ptr, nk, H, I,
                           stride_xm, stride_we, stride_wn, stride_wk,
                           K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr, DOT_FP32: tl.constexpr):
        pid_m = tl.program_id(0)
        e = tl.load(tile_expert_ptr + pid_m)
        if e < 0:
            return
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        slot = tl.load(sorted_ptr + rows)
        ok = slot < nk
        tok = tl.where(ok, slot // K, 0).to(tl.int64)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < I
        kk = tl.arange(0, BLOCK_K)
        a_ptrs = x_ptr + tok[:, None] * stride_xm + kk[None, :]
        w_base = w_ptr + e.to(tl.int64) * stride_we + kk[:, None] * stride_wk
        g_ptrs = w_base + n[None, :] * stride_wn
        u_ptrs = w_base + (n + I)[None, :] * stride_wn
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, H, BLOCK_K):
            k_ok = kk + k0 < H
            a = tl.load(a_ptrs, mask=ok[:, None] & k_ok[None, :], other=0.0)
            g = tl.load(g_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            u = tl.load(u_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            if DOT_FP32:
                a, g, u = a.to(tl.float32), g.to(tl.float32), u.to(tl.float32)
            acc_g = tl.dot(a, g, acc_g)
            acc_u = tl.dot(a, u, acc_u)
            a_ptrs += BLOCK_K
            g_ptrs += BLOCK_K * stride_wk
            u_ptrs += BLOCK_K * stride_wk
        act = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
        tl.store(a_ptr + rows.to(tl.int64)[:, None] * I + n[None, :],
                 act.to(a_ptr.dtype.element_ty), mask=ok[:, None] & n_ok[None, :])

    @triton.jit
    def moe_down_kernel(a_ptr, w_ptr, o_ptr, sorted_ptr, tile_expert_ptr, nk, H, I,
                        stride_we, stride_wn, stride_wk,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        DOT_FP32: tl.constexpr):
        pid_m = tl.program_id(0)
        e = tl.load(tile_expert_ptr + pid_m)
        if e < 0:
            return
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        ok = tl.load(sorted_ptr + rows) < nk
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < H
        kk = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + rows.to(tl.int64)[:, None] * I + kk[None, :]
        w_ptrs = (w_ptr + e.to(tl.int64) * stride_we + kk[:, None] * stride_wk
                  + n[None, :] * stride_wn)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, I, BLOCK_K):
            k_ok = kk + k0 < I
            a = tl.load(a_ptrs, mask=ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            if DOT_FP32:
                a, w = a.to(tl.float32), w.to(tl.float32)
            acc = tl.dot(a, w, acc)
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K * stride_wk
        tl.store(o_ptr + rows.to(tl.int64)[:, None] * H + n[None, :],
                 acc.to(o_ptr.dtype.element_ty), mask=ok[:, None] & n_ok[None, :])

    interpreted = type(moe_align_kernel).__name__ == "InterpretedFunction"
    return triton, {"align": moe_align_kernel, "gate_up": moe_gate_up_kernel,
                    "down": moe_down_kernel}, interpreted


def align(ids: torch.Tensor, num_experts: int, block_m: int):
    """``(sorted_slots, pos, tile_expert)`` of the slots ``ids [N, K]`` (int; an id outside
    ``[0, num_experts)``, e.g. ``-1``, is not here) over ``num_experts`` experts, each expert's
    rows padded to ``block_m``:
    ``sorted_slots [P]`` int32 (slot index ``n*K + k``; padding rows ``N*K``), ``pos [N*K]``
    int32 (the sorted row of each local slot; others undefined), ``tile_expert [P /
    block_m]`` int32 (``-1`` past the last tile), ``P`` the static bound ``N*K + E*(block_m -
    1)`` rounded up to ``block_m``."""
    triton, kern, _ = _kernels()
    nk = ids.numel()
    tiles = triton.cdiv(nk + num_experts * (block_m - 1), block_m)
    sorted_slots = torch.empty(tiles * block_m, dtype=torch.int32, device=ids.device)
    pos = torch.empty(nk, dtype=torch.int32, device=ids.device)
    tile_expert = torch.empty(tiles, dtype=torch.int32, device=ids.device)
    if num_experts == 0:  # no program would mark the tiles unused
        tile_expert.fill_(-1)
        return sorted_slots, pos, tile_expert
    bins = triton.next_power_of_2(num_experts + 1)
    block = max(128, min(1024, 16384 // bins))
    kern["align"][(num_experts,)](ids.contiguous(), sorted_slots, pos, tile_expert, nk,
                                  num_experts, tiles, BLOCK_M=block_m, BINS=bins, BLOCK=block)
    return sorted_slots, pos, tile_expert


def expert_outputs(x: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                   config: FusedConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each local slot's expert output, unweighted, by the align and the two GEMM kernels.

    Args:
        x: ``[N, H]`` rows (the token dim ``N``), bf16/fp16/fp32, unit stride in ``H``.
        ids: ``[N, K]`` int local expert per slot; an id outside ``[0, E)`` (``-1``: not on
            this rank) is no slot here (:mod:`dbo_compile.ops.experts`' rule).
        w13: ``[E, 2I, H]``, w2: ``[E, H, I]`` (any strides), the dtype of ``x``; SwiGLU, no
            biases.
        config: tile shape (default :data:`DEFAULT_CONFIG`).

    Returns:
        ``(o, pos)``: ``o [P, H]`` of ``x.dtype``, row ``pos[n*K + k]`` = ``f_{ids[n, k]}(x[n])``
        (fp32 accumulation) for the local slots, the other rows undefined; ``pos [N*K]`` int32
        (undefined where the id is outside ``[0, E)``). The caller weights and sums
        (:func:`dbo_compile.ops.experts.gather_sum`).

    Raises:
        ExpertsOpError: Triton is missing, the call is outside :func:`supports`, or the
            shapes disagree (``ids`` not ``[N, K]`` int, ``w13``/``w2`` not ``[E, 2I, H]`` /
            ``[E, H, I]`` with ``x``'s ``H``).
    """
    if (ids.dim() != 2 or ids.shape[0] != x.shape[0] or ids.is_floating_point()
            or w13.dim() != 3 or w2.dim() != 3 or w13.shape[0] != w2.shape[0]
            or w13.shape[2] != x.shape[-1] or w2.shape[1] != x.shape[-1]
            or w13.shape[1] != 2 * w2.shape[2]):
        raise ExpertsOpError(
            f"fused experts: expected x [N, H], ids [N, K] int, w13 [E, 2I, H], w2 [E, H, I]; "
            f"got x {tuple(x.shape)}, ids {tuple(ids.shape)} {ids.dtype}, w13 "
            f"{tuple(w13.shape)}, w2 {tuple(w2.shape)}")
    if not supports(x, ids, w13, w2):
        raise ExpertsOpError(
            f"fused experts: cannot serve x {tuple(x.shape)} {x.dtype}, {ids.numel()} slots "
            f"(max {MAX_SLOTS}), w13 {w13.dtype}, w2 {w2.dtype} (Triton "
            f"{'missing' if _kernels() is None else 'present'}); use the sorted path")
    triton, kern, interpreted = _kernels()
    k = ids.shape[1]
    e, hidden, inter = w13.shape[0], x.shape[1], w2.shape[2]
    if x.stride(1) != 1:
        x = x.contiguous()
    ids = ids.contiguous()
    cfg = config or DEFAULT_CONFIG
    sorted_slots, pos, tile_expert = align(ids, e, cfg.block_m)
    rows = sorted_slots.numel()
    tiles = tile_expert.numel()
    dot_fp32 = x.dtype == torch.float32 or interpreted
    act = torch.empty(rows, inter, dtype=x.dtype, device=x.device)
    kern["gate_up"][(tiles, triton.cdiv(inter, cfg.block_n))](
        x, w13, act, sorted_slots, tile_expert, ids.numel(), hidden, inter,
        x.stride(0), w13.stride(0), w13.stride(1), w13.stride(2),
        K=k, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, DOT_FP32=dot_fp32,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    o = torch.empty(rows, hidden, dtype=x.dtype, device=x.device)
    kern["down"][(tiles, triton.cdiv(hidden, cfg.block_n))](
        act, w2, o, sorted_slots, tile_expert, ids.numel(), hidden, inter,
        w2.stride(0), w2.stride(1), w2.stride(2),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, DOT_FP32=dot_fp32,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return o, pos
