"""The masked FP8 cast of the ``deep_gemm`` experts backend (:mod:`dbo_compile.ops.deep_gemm`):
DeepSeek's per-token 1x128 block scales (``amax / 448``, amax clamped to 1e-4; the rule of
DeepGEMM's and DeepEP's casts) computed for the rows below each expert's count only.

The expert-major receive layout ``[E_local, M, K]`` (``M = W * cap``, DeepEP low-latency) holds
``counts[e]`` valid rows per expert; the rest of the buffer is undefined and no GEMM output row
past the counts is read. Casting every row (the torch reference :func:`per_token_cast_fp8`,
six passes over the whole buffer with fp32 temporaries) made the FP8 expert op 7.5x slower than
bf16 (issue 28, item 4). The Triton kernel reads the counts on the device (no host sync,
CUDA-graph capturable: a static grid of about 4096 programs, ``(expert, row program, scale
groups)``, each looping over the row blocks below its expert's count, so no program is spent
on the rows past it however large the capacity) and writes the valid rows' e4m3 values and
scales in the layout :func:`per_token_cast_fp8` produces, which DeepGEMM reads without a
transform:

    x      [E, M, K]   bf16 (or fp16 / fp32), row-major rows (stride(-1) == 1)
    counts [E]         int32, valid rows per expert (values past M count as M)
    q      [E, M, K]   float8_e4m3fn, contiguous
    scales [E, M, K/128] fp32, MN-major: strides (K/128 * M, 1, M)

Rows ``i >= counts[e]`` of ``q`` and ``scales`` are not written (left as allocated). A 2-D
``[M, K]`` with one count (``counts [1]``: the rows below it, as the contiguous layout's
``psum[-1]``) is the same with ``E = 1``.
"""

from __future__ import annotations

import torch

from dbo_compile.errors import ExpertsOpError
from dbo_compile.ops._triton import triton_kernels

__all__ = ["FP8_MAX", "fp8_cast_kernels", "per_token_cast_fp8", "per_token_cast_fp8_masked"]

#: the largest finite float8_e4m3fn
FP8_MAX = 448.0
#: columns per scale (DeepSeek's 1x128 activation blocks)
BLOCK_K = 128
#: rows of one tile, scale groups per program, programs of one launch (about)
_BLOCK_M = 16
_GROUPS_PER_PROGRAM = 4
_PROGRAMS = 4096


def per_token_cast_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., M, K]`` -> ``(e4m3 [..., M, K], scales fp32 [..., M, K/128])``, one scale per
    row and 128 columns, ``amax / 448`` (amax clamped to 1e-4); the scales are MN-major
    (strides ``(..., 1, M)``: the TMA-aligned layout DeepGEMM reads without a transform, for
    ``M % 4 == 0``). Every row (the reference of :func:`per_token_cast_fp8_masked`)."""
    *lead, m, k = x.shape
    blocks = x.float().unflatten(-1, (k // BLOCK_K, BLOCK_K))
    amax = blocks.abs().amax(-1).clamp(min=1e-4)
    scales = torch.empty((*lead, k // BLOCK_K, m), dtype=torch.float32, device=x.device)
    scales = scales.transpose(-2, -1)
    scales.copy_(amax / FP8_MAX)
    q = (blocks / scales.unsqueeze(-1)).flatten(-2).to(torch.float8_e4m3fn)
    return q, scales


@triton_kernels
def fp8_cast_kernels(triton, tl):
    """``(triton, kernel)``: the masked cast (module docstring)."""

    @triton.jit
    def fp8_cast_masked_kernel(x_ptr, q_ptr, s_ptr, counts_ptr, M, K, NUM_GROUPS, stride_e,
                               stride_m, ITERS: tl.constexpr, BM: tl.constexpr,
                               GPP: tl.constexpr, BLOCK: tl.constexpr, FP8_MAX: tl.constexpr):
        """Expert ``program_id(0)``; row blocks ``program_id(1) + j * num_programs(1)``, ``j <
        ITERS``, those below its count (``BM`` rows each: the grid is static and the blocks
        past the count cost one compare each); scale groups ``program_id(2) * GPP ...``
        (``GPP`` of ``BLOCK`` columns). ``ITERS`` is a constexpr: Triton's interpreter runs no
        loop with a run-time bound."""
        e = tl.program_id(0).to(tl.int64)
        n = tl.minimum(tl.load(counts_ptr + e), M)
        c = tl.arange(0, BLOCK)
        for j in range(ITERS):
            rb = (tl.program_id(1) + j * tl.num_programs(1)).to(tl.int64)
            if rb * BM < n:
                i = rb * BM + tl.arange(0, BM)
                rm = i < n
                for gi in tl.static_range(GPP):
                    g = tl.program_id(2) * GPP + gi
                    if g < NUM_GROUPS:  # a scalar branch: no scalar int1 in the masks
                        m = rm[:, None] & (c[None, :] < BLOCK)
                        cols = g.to(tl.int64) * BLOCK + c[None, :]
                        v = tl.load(x_ptr + e * stride_e + i[:, None] * stride_m + cols,
                                    mask=m, other=0.0).to(tl.float32)
                        amax = tl.maximum(tl.max(tl.abs(v), axis=1), 1e-4)
                        scale = tl.math.div_rn(amax, FP8_MAX)  # IEEE division, as torch's
                        q = tl.math.div_rn(v, scale[:, None])
                        tl.store(q_ptr + (e * M + i[:, None]) * K + cols,
                                 q.to(q_ptr.dtype.element_ty), mask=m)
                        tl.store(s_ptr + (e * NUM_GROUPS + g) * M + i, scale, mask=rm)

    return triton, fp8_cast_masked_kernel


def per_token_cast_fp8_masked(x: torch.Tensor, counts: torch.Tensor,
                              out: tuple[torch.Tensor, torch.Tensor] | None = None
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of ``x`` below the counts cast to e4m3 with 1x128 scales (module docstring:
    shapes, dtypes, the layout), by one Triton kernel launch.

    Args:
        x: ``[E, M, K]`` (or ``[M, K]``), the token dim ``M``; ``K`` a multiple of 128;
            its last dim contiguous.
        counts: ``[E]`` int32 (``[1]`` for a 2-D ``x``), on ``x``'s device.
        out: ``(q, scales)`` to write into (3-D, of the shapes and strides returned), or
            ``None``: new tensors.

    Returns:
        ``(q, scales)``: ``q`` float8_e4m3fn of ``x``'s shape, ``scales`` fp32 ``[..., M,
        K/128]`` MN-major; rows past the counts not written.

    Raises:
        ExpertsOpError: ``K`` is not a multiple of 128, the counts do not match ``x``, or
            Triton is not installed, or ``out`` does not match.
    """
    built = fp8_cast_kernels()
    if built is None:
        raise ExpertsOpError("the masked FP8 cast needs Triton (pip install triton); the "
                             "reference per_token_cast_fp8 casts every row")
    squeeze = x.dim() == 2
    x3 = x.unsqueeze(0) if squeeze else x
    if x3.dim() != 3:
        raise ExpertsOpError(f"masked FP8 cast: x must be [E, M, K] or [M, K], got "
                             f"{tuple(x.shape)}")
    e, m, k = x3.shape
    if k % BLOCK_K:
        raise ExpertsOpError(f"masked FP8 cast: K={k} is not a multiple of {BLOCK_K} (one "
                             f"scale per {BLOCK_K} columns); the FP8 experts need hidden and "
                             "intermediate sizes that are multiples of 128 (fp8=False runs bf16)")
    if counts.dtype != torch.int32 or counts.numel() != e or counts.device != x.device:
        raise ExpertsOpError(f"masked FP8 cast: counts must be int32 [{e}] on {x.device}, got "
                             f"{counts.dtype} {tuple(counts.shape)} on {counts.device}")
    if k and x3.stride(2) != 1:
        x3 = x3.contiguous()
    groups = k // BLOCK_K
    if out is None:
        q = torch.empty((e, m, k), dtype=torch.float8_e4m3fn, device=x.device)
        scales = torch.empty((e, groups, m), dtype=torch.float32, device=x.device).transpose(1, 2)
    else:
        q, scales = out
        if (q.shape != (e, m, k) or q.dtype != torch.float8_e4m3fn or not q.is_contiguous()
                or scales.shape != (e, m, groups) or scales.dtype != torch.float32
                or scales.stride() != (groups * m, 1, m)):
            raise ExpertsOpError(
                f"masked FP8 cast: out must be (e4m3 [{e}, {m}, {k}] contiguous, fp32 [{e}, "
                f"{m}, {groups}] with strides {(groups * m, 1, m)}), got {q.dtype} "
                f"{tuple(q.shape)}, {scales.dtype} {tuple(scales.shape)} {scales.stride()}")
    if e * m and groups:
        triton, kernel = built
        chunks = triton.cdiv(groups, _GROUPS_PER_PROGRAM)
        # row programs per expert: ~_PROGRAMS in all, each looping over the valid row blocks
        blocks = triton.cdiv(m, _BLOCK_M)
        rows = max(1, min(blocks, _PROGRAMS // (e * chunks)))
        iters = triton.next_power_of_2(triton.cdiv(blocks, rows))  # few distinct compiles
        kernel[(e, rows, chunks)](
            x3, q, scales, counts.contiguous(), m, k, groups, x3.stride(0), x3.stride(1),
            ITERS=iters, BM=_BLOCK_M, GPP=_GROUPS_PER_PROGRAM, BLOCK=BLOCK_K, FP8_MAX=FP8_MAX)
    if squeeze:
        return q[0], scales[0]
    return q, scales
