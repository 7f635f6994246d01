"""``dbo.attention``: paged causal attention with a KV-cache write, flattened-token layout.

Implementations (same semantics, see :func:`attention`):

- **CUDA** (:func:`attention_cuda`, registered for the ``cuda`` device type): the KV write, then
  a fused Triton kernel (:func:`paged_attention_triton`, in the style of vLLM's unified
  attention). Its grid depends on shapes only: the query blocks (``BLOCK_M`` tokens each) are
  numbered ``0 .. T // BLOCK_M + R`` (request ``i`` owns the blocks from
  ``query_start_loc[i] // BLOCK_M + i``; a block finds its request by binary search and is
  skipped if it has no tokens); axis 0 has one program per block, or, where that exceeds
  :data:`PROGRAMS_PER_SM` programs per SM over the heads (a request dim padded to a CUDA-graph
  runner's capacity), that many programs, each looping over every ``P``-th block up to the last
  real request's (:func:`programs_per_head`); axis 1 the ``Hkv`` KV heads. A block computes its
  ``BLOCK_M`` tokens x the ``G = Hq / Hkv`` query heads that share its KV head, with an online
  softmax (fp32) over the context up to its last query's position, read ``TILE_N`` positions at
  a time through ``block_table``. No host sync: CUDA-graph
  capturable, and a captured graph serves new metadata of the same shapes. It runs where Triton
  imports, the head dim is a power of two in [16, 256] and q / cache are bf16, fp16 or fp32
  (:func:`_kernel_supports`); elsewhere the CUDA op runs the reference.
- **Reference** (:func:`paged_attention`, every other device, and the CUDA fallback): dense
  gather of each query's context through the block table, softmax in fp32. Tensor ops only (no
  ``.item()``, no branch on tensor values), so it is capturable too, but it materialises
  ``[chunk, max_blocks * block_size, Hkv, D]`` per chunk of queries in a Python loop.

Shapes (``T`` = token dim, ``R`` = requests, ``Hq``/``Hkv`` query/KV heads, ``D`` head dim)::

    q            [T, Hq, D]                       any float dtype
    k, v         [T, Hkv, D]                      cast to kv_cache.dtype when written
    kv_cache     [2, num_blocks, block_size, Hkv, D]   mutated: k/v of each token written
    slot_mapping [T] int64                        block * block_size + offset; -1 = padding
    query_start_loc [R+1] int32, seq_lens [R] int32, block_table [R, max_blocks] int32
    out          [T, Hq, D]                       q.dtype; rows >= query_start_loc[-1] are 0
"""

import functools
import logging
import math
from dataclasses import dataclass
from typing import Any

import torch

from dbo_compile.errors import AttentionOpError
from dbo_compile.ops._triton import triton_kernels
from dbo_compile.ops.registry import OpInfo, register_op

log = logging.getLogger(__name__)

__all__ = ["GATED_MIN_TOKENS", "GATE_DECODE", "GATE_NONE", "GATE_PREFILL", "PROGRAMS_PER_SM",
           "AttentionOpError", "KernelConfig", "attention", "attention_cuda",
           "check_attention_args", "launch_plan", "paged_attention",
           "paged_attention_triton", "programs_per_head", "write_kv"]

#: Upper bound on elements of one gathered context chunk ``[chunk, L, Hkv, D]`` (memory cap).
_GATHER_ELEMS = 1 << 24


def check_attention_args(q, k, v, kv_cache, slot_mapping, query_start_loc, seq_lens,
                         block_table) -> None:
    """The shapes and dtypes of a ``dbo.attention`` call (:func:`attention`'s arguments).
    Reads shapes only (fake-tensor safe).

    Raises:
        AttentionOpError: what does not match, with the shapes found.
    """
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise AttentionOpError(
            f"dbo.attention: q/k/v must be [num_tokens, heads, head_dim], got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        )
    t, hq, d = q.shape
    if k.shape != v.shape or k.shape[0] != t or k.shape[2] != d:
        raise AttentionOpError(
            f"dbo.attention: k {tuple(k.shape)} / v {tuple(v.shape)} do not match q {tuple(q.shape)}"
        )
    hkv = k.shape[1]
    if hkv == 0 or hq % hkv != 0:
        raise AttentionOpError(f"dbo.attention: Hq={hq} is not a multiple of Hkv={hkv} (GQA)")
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or tuple(kv_cache.shape[3:]) != (hkv, d):
        raise AttentionOpError(
            f"dbo.attention: kv_cache has shape {tuple(kv_cache.shape)}, expected "
            f"[2, num_blocks, block_size, {hkv}, {d}]"
        )
    check_metadata_shapes(t, slot_mapping, query_start_loc, seq_lens, block_table)


def check_metadata_shapes(num_tokens: Any, slot_mapping: torch.Tensor,
                          query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                          block_table: torch.Tensor) -> None:
    """The shapes the attention metadata must have for ``num_tokens`` query rows: ``slot_mapping``
    int64 ``[T]``, ``seq_lens [R]``, ``query_start_loc [R + 1]``, ``block_table [R, W]``, int32
    or int64 request fields.

    A decoder layer that is a compile region calls it before entering the region
    (:meth:`~dbo_compile.models.deepseek.DecoderLayer.forward`): under Dynamo the comparisons
    make the metadata's sizes expressions of the token and request symbols before the region
    is traced, which Dynamo's reuse of a region's trace needs (a relation first found inside
    the region leaves the stamped-out calls a symbol the graph no longer has).

    Raises:
        AttentionOpError: a shape, rank or dtype that disagrees.
    """
    t = num_tokens
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != t or slot_mapping.dtype != torch.int64:
        raise AttentionOpError(
            f"dbo.attention: slot_mapping must be int64 [{t}], got {slot_mapping.dtype} "
            f"{tuple(slot_mapping.shape)}"
        )
    r = seq_lens.shape[0]
    if (query_start_loc.dim() != 1 or query_start_loc.shape[0] != r + 1 or block_table.dim() != 2
            or block_table.shape[0] != r):
        raise AttentionOpError(
            f"dbo.attention: query_start_loc {tuple(query_start_loc.shape)}, seq_lens "
            f"{tuple(seq_lens.shape)}, block_table {tuple(block_table.shape)} disagree on num_reqs"
        )
    for name, x in (("query_start_loc", query_start_loc), ("seq_lens", seq_lens),
                    ("block_table", block_table)):
        if x.dtype not in (torch.int32, torch.int64):
            raise AttentionOpError(f"dbo.attention: {name} must be int32, got {x.dtype}")


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write k/v rows ``[T, Hkv, D]`` to their cache slots without a host sync; slot -1 rows
    (padding) are not written.

    On CUDA with Triton one kernel does it (:func:`_write_kv_triton`); elsewhere torch ops
    (:func:`_write_kv_torch`), with the same result.

    Raises:
        AttentionOpError: ``kv_cache`` is not contiguous.
    """
    if k.shape[0] == 0:
        return
    if not kv_cache.is_contiguous():
        raise AttentionOpError("dbo.attention: kv_cache must be contiguous")
    if kv_cache.is_cuda and _write_kv_kernel() is not None:
        _write_kv_triton(kv_cache, k, v, slot_mapping)
    else:
        _write_kv_torch(kv_cache, k, v, slot_mapping)


def _write_kv_torch(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    slot_mapping: torch.Tensor) -> None:
    """:func:`write_kv` in torch ops (an index_put cannot skip rows without a host sync).

    Padding rows are redirected to the slot of the last real row and write that row's values
    (duplicate indices then carry identical values, so the result is deterministic); if no row
    is real, they rewrite slot 0 with its own contents.
    """
    t = k.shape[0]
    _, nb, bs, hkv, d = kv_cache.shape
    flat = kv_cache.view(2, nb * bs, hkv, d)
    valid = slot_mapping >= 0
    rows = torch.arange(t, device=k.device)
    last = torch.where(valid, rows, -1).amax()
    has_valid = last >= 0
    last = last.clamp(min=0)
    src = torch.where(valid, rows, last)
    idx = torch.where(has_valid, slot_mapping[src], torch.zeros_like(slot_mapping))
    for i, x in enumerate((k, v)):
        new = x[src].to(kv_cache.dtype)
        new = torch.where(has_valid, new, flat[i, idx])
        flat[i].index_put_((idx,), new)


@triton_kernels
def _write_kv_kernel(triton, tl):
    """``(triton, kernel)`` of the KV-cache write, or None without Triton."""

    @triton.jit
    def write_kv_kernel(k_ptr, v_ptr, cache_ptr, slot_ptr, stride_kt, stride_kh, stride_vt,
                        stride_vh, plane, D: tl.constexpr, ROW: tl.constexpr,
                        BLOCK: tl.constexpr):
        """Program ``(t, c)``: columns block ``c`` of token ``t``'s ``Hkv * D`` k and v values
        into cache slot ``slot_mapping[t]`` (row ``slot`` of each ``[slots, Hkv * D]`` plane);
        padding rows (slot < 0) write nothing."""
        t = tl.program_id(0).to(tl.int64)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot >= 0:
            cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
            m = cols < ROW
            h = cols // D
            d = cols % D
            kk = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=m)
            vv = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=m)
            out_ty = cache_ptr.dtype.element_ty
            tl.store(cache_ptr + slot * ROW + cols, kk.to(out_ty), mask=m)
            tl.store(cache_ptr + plane + slot * ROW + cols, vv.to(out_ty), mask=m)

    return triton, write_kv_kernel


def _write_kv_triton(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     slot_mapping: torch.Tensor) -> None:
    """:func:`write_kv` as one Triton kernel: one program per token row and column block;
    k / v may be strided views (a fused qkv projection's slices) with unit stride in ``D``."""
    triton, kernel = _write_kv_kernel()
    t, hkv, d = k.shape
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    row = hkv * d
    block = min(1024, triton.next_power_of_2(row))
    kernel[(t, triton.cdiv(row, block))](
        k, v, kv_cache, slot_mapping.contiguous(), k.stride(0), k.stride(1), v.stride(0),
        v.stride(1), kv_cache[0].numel(), D=d, ROW=row, BLOCK=block)


def paged_attention(q, kv_cache, query_start_loc, seq_lens, block_table, scale) -> torch.Tensor:
    """The reference attention over the paged cache (module docstring): ``out [T, Hq, D]``
    of ``q.dtype``, softmax in fp32, rows past ``query_start_loc[-1]`` zero."""
    t, hq, d = q.shape
    r = seq_lens.shape[0]
    if t == 0 or r == 0:
        return torch.zeros_like(q)
    _, nb, bs, hkv, _ = kv_cache.shape
    g = hq // hkv
    flat = kv_cache.reshape(2, nb * bs, hkv, d)
    qsl = query_start_loc.to(torch.int64)
    seq = seq_lens.to(torch.int64)
    # entries past a request's own blocks may hold anything (a serving engine's stale rows):
    # clamp into the pool; the causal mask keeps their keys and values out
    bt = block_table.to(torch.int64).clamp(min=0, max=nb - 1)
    ctx_len = bt.shape[1] * bs
    kpos = torch.arange(ctx_len, device=q.device)
    rows = torch.arange(t, device=q.device)
    # request of each token row; rows past query_start_loc[-1] are padding
    req = torch.searchsorted(qsl[1:].contiguous(), rows, right=True).clamp(max=r - 1)
    valid_row = rows < qsl[-1]
    start = qsl[req]
    qlen = qsl[req + 1] - start
    pos = seq[req] - qlen + (rows - start)  # absolute position of each query
    # padding rows attend to everything (finite softmax), then are zeroed
    mask = (kpos.unsqueeze(0) <= pos.unsqueeze(1)) | ~valid_row.unsqueeze(1)  # [T, L]
    slots = bt[req][:, kpos // bs] * bs + kpos % bs  # [T, L]
    out = torch.empty((t, hkv, g, d), dtype=torch.float32, device=q.device)
    qf = q.to(torch.float32).view(t, hkv, g, d)
    chunk = max(1, _GATHER_ELEMS // max(1, ctx_len * hkv * d))
    for c0 in range(0, t, chunk):
        c1 = min(t, c0 + chunk)
        m = mask[c0:c1]
        keys = flat[0][slots[c0:c1]].to(torch.float32)  # [c, L, Hkv, D]
        vals = flat[1][slots[c0:c1]].to(torch.float32)
        vals = torch.where(m[:, :, None, None], vals, 0.0)  # garbage in unused slots stays out
        s = torch.einsum("thgd,tlhd->thgl", qf[c0:c1], keys) * scale
        s = s.masked_fill(~m[:, None, None, :], float("-inf"))
        p = torch.softmax(s, dim=-1)
        out[c0:c1] = torch.einsum("thgl,tlhd->thgd", p, vals)
    out = torch.where(valid_row[:, None, None, None], out, 0.0)
    return out.view(t, hq, d).to(q.dtype)


# ----------------------------------------------------------------------------- Triton kernel
#: head dims the kernel takes (tl.dot needs >= 16; above 256 the tiles leave no registers)
_HEAD_DIMS = (16, 32, 64, 128, 256)
_KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_LOG2E = math.log2(math.e)


@dataclass(frozen=True)
class KernelConfig:
    """Tile shape and launch options of :func:`paged_attention_triton`.

    Attributes:
        block_m: query tokens per program (its tile has ``block_m * next_pow2(G)`` rows; at
            least 16 for ``tl.dot`` on GPU).
        tile_n: context positions per iteration (power of two >= 16; may span several pages).
        num_warps: warps per program.
        num_stages: software-pipelining stages of the context loop.
        programs: query-block programs per KV head (grid axis 0), each looping over every
            ``programs``-th block; ``None``: :func:`programs_per_head`'s choice from the device.
    """

    block_m: int
    tile_n: int
    num_warps: int = 4
    num_stages: int = 2
    programs: int | None = None

    def __post_init__(self) -> None:
        for name, value, low in (("block_m", self.block_m, 1), ("tile_n", self.tile_n, 16)):
            if value < low or value & (value - 1):
                raise AttentionOpError(
                    f"dbo.attention kernel config: {name}={value} must be a power of two >= "
                    f"{low} (Triton's tl.arange and tl.dot need it)")
        if self.programs is not None and self.programs < 1:
            raise AttentionOpError(
                f"dbo.attention kernel config: programs={self.programs} must be >= 1 (or None "
                f"for the device's choice)")


#: Programs per SM the grid stops growing at (over all KV heads), so that a request dim padded
#: to the CUDA-graph runner's capacity no longer launches a program per padding request and
#: head: V3's prefill of 1,024 tokens padded to 1,024 requests launched 139,264 programs, 2,176
#: with work (475 µs against 207 unpadded; one H100, 2026-12-07). Below the cap every block has
#: a program of its own, as the hardware balances best: with 32 (one H100, 2026-12-08) that
#: prefill took 435 µs, but V2-Lite's decode of 1,024 requests padded to 2,048, ~4 blocks of
#: uneven context per program, 3,017 µs against 2,926 the day before.
PROGRAMS_PER_SM = 128


def programs_per_head(config: KernelConfig, num_tokens: int, num_reqs: int, hkv: int,
                      num_sms: int) -> int:
    """Grid axis 0 of :func:`paged_attention_triton`: ``config.programs`` if set, else
    ``ceil(num_sms * PROGRAMS_PER_SM / hkv)``; never more than the ``T // BLOCK_M + R`` query
    blocks (one program per block then, as a grid without the loop)."""
    blocks = num_tokens // config.block_m + num_reqs
    share = config.programs or -(-num_sms * PROGRAMS_PER_SM // max(1, hkv))
    return max(1, min(blocks, share))


#: :func:`launch_plan`'s gates: a launch runs always, only where the step's real tokens exceed
#: twice its real requests (prefill-like), or only where they do not (decode-like)
GATE_NONE, GATE_PREFILL, GATE_DECODE = 0, 1, 2
#: token dim from which a decode-shaped call gets the gated 64-row launch too (the runner's
#: ubatch of a 2,048-token prefill bucket); its idle launch in a decode step of that size is
#: one wave of programs that return after a search of ``query_start_loc``
GATED_MIN_TOKENS = 1024


def launch_plan(num_tokens: int, num_reqs: int, g_pad: int, dtype: torch.dtype,
                config: KernelConfig | None = None) -> list[tuple[KernelConfig, int]]:
    """The launches of :func:`paged_attention_triton`: ``[(config, gate)]``.

    Shapes that look like prefill (``T > 2 R``) get one 64-row launch. Shapes that look like
    decode (about one token per request) get a 16-row launch, gated to run only where the
    step's real tokens are at most twice its real requests, and, from
    :data:`GATED_MIN_TOKENS` tokens on, a 64-row launch gated the other way: the CUDA-graph
    runner pads the request dim to its capacity, so a prefill step it replays looks like
    decode by its shapes and would
    otherwise run 16-row tiles (V3 heads, prefill of 1,024 tokens with the request dim padded
    to 1,024, on one H100: 381 µs with 64-row tiles against 475 with 16-row ones, 2026-12-07).
    The gate is read on the GPU (from ``query_start_loc``): the launch that does not fit the
    step returns at once, and one graph serves both kinds of step. Below
    :data:`GATED_MIN_TOKENS` the 16-row launch runs alone, ungated (a decode step's second,
    idle launch would cost a few µs of a short step). ``config``: that one launch, ungated.

    A second launch splitting one step's requests by length was tried (one H100, 2026-12-07)
    and lost: the V3 EP-32 prefill 2048 step got 1.6 ms slower, the padding requests'
    programs (then one per padding request and head), which it doubled, costing more than
    the wider tiles saved; the grid is capped since (:func:`programs_per_head`)."""
    if config is not None:
        return [(config, GATE_NONE)]
    prefill, decode = _tile(64, g_pad, dtype), _tile(16, g_pad, dtype)
    if num_tokens > 2 * num_reqs:
        return [(prefill, GATE_NONE)]
    if num_tokens < GATED_MIN_TOKENS:
        return [(decode, GATE_NONE)]
    return [(prefill, GATE_PREFILL), (decode, GATE_DECODE)]


def _tile(rows: int, g_pad: int, dtype: torch.dtype) -> KernelConfig:
    """``rows`` rows of ``g_pad`` heads per token; 32-key tiles for fp32 (its tiles double in
    bytes), else 64."""
    return KernelConfig(block_m=max(1, rows // g_pad), tile_n=32 if dtype == torch.float32 else 64)


@triton_kernels
def _triton_kernel(triton, tl):
    """``(triton, kernel, interpreted)``, or None without Triton. Built on first use, so that
    importing the package does not import Triton. ``interpreted``: the process runs Triton's
    interpreter (``TRITON_INTERPRET=1`` before triton was imported; kernels take CPU tensors)."""

    # num_reqs changes every step: one compiled variant for all values (no ==1 / %16 variants)
    @triton.jit(do_not_specialize=["num_reqs", "bt_width", "num_blocks"])
    def paged_attention_kernel(
            out_ptr, q_ptr, k_ptr, v_ptr, qsl_ptr, seq_lens_ptr, bt_ptr,
            scale_log2, num_reqs, bt_width, num_blocks,
            stride_qt, stride_qh, stride_ot, stride_oh,
            stride_kb, stride_ks, stride_kh, stride_bt,
            G: tl.constexpr, G_PAD: tl.constexpr, BLOCK_M: tl.constexpr, TILE_N: tl.constexpr,
            HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, DOT_FP32: tl.constexpr,
            TILE_GATE: tl.constexpr):
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        kvh = tl.program_id(1)
        # Request i owns query blocks [qsl[i] // BLOCK_M + i, qsl[i+1] // BLOCK_M + i + 1), at
        # least cdiv(q_i, BLOCK_M) of them, so T // BLOCK_M + R blocks cover every request.
        # Requests from r_real on (the first with qsl == T_real) are empty (the request dim
        # padded to the CUDA-graph runner's capacity): the blocks end at T_real // BLOCK_M +
        # r_real, and this program takes every nprog-th of them.
        # (Inlined: Triton's interpreter cannot call a jit function defined in this closure.)
        t_real = tl.load(qsl_ptr + num_reqs)
        lo = pid * 0
        hi = lo + num_reqs
        while lo < hi:
            mid = (lo + hi) // 2
            if tl.load(qsl_ptr + mid) < t_real:
                lo = mid + 1
            else:
                hi = mid
        r_real = lo
        # launch_plan's gate: this launch's tile fits prefill-like or decode-like steps only
        if TILE_GATE == 1:
            if t_real <= 2 * r_real:
                return
        if TILE_GATE == 2:
            if t_real > 2 * r_real:
                return
        # rows of a block: BLOCK_M tokens x G_PAD heads (token-major); rows of padding heads or
        # of tokens past the request are computed on zeros and not stored
        ROWS: tl.constexpr = BLOCK_M * G_PAD
        rows = tl.arange(0, ROWS)
        hig = rows % G_PAD
        head = kvh * G + hig
        offs_d = tl.arange(0, HEAD_DIM)
        kv_ty = k_ptr.dtype.element_ty
        for qblock in range(pid, t_real // BLOCK_M + r_real, nprog):
            # the request: the last i whose first query block qsl[i] // BLOCK_M + i <= qblock
            lo = qblock * 0
            hi = lo + r_real
            while lo < hi:
                mid = (lo + hi) // 2
                if tl.load(qsl_ptr + mid) // BLOCK_M + mid <= qblock:
                    lo = mid + 1
                else:
                    hi = mid
            req = lo - 1
            q_start = tl.load(qsl_ptr + req)
            q_len = tl.load(qsl_ptr + req + 1) - q_start
            local = qblock - (q_start // BLOCK_M + req)  # this block's index in the request
            if local * BLOCK_M < q_len:
                seq_len = tl.load(seq_lens_ptr + req)
                ctx_len = seq_len - q_len

                tok = local * BLOCK_M + rows // G_PAD
                row_ok = (tok < q_len) & (hig < G)
                q_off = (q_start + tok).to(tl.int64) * stride_qt + head * stride_qh
                q = tl.load(q_ptr + q_off[:, None] + offs_d[None, :], mask=row_ok[:, None],
                            other=0.0).to(kv_ty)
                qpos = ctx_len + tok  # absolute position of each row's query

                # causal: nothing past this block's last query; key 0 is visible to every
                # row, so the running max is finite after the first tile
                kv_end = tl.minimum(seq_len, ctx_len + (local + 1) * BLOCK_M)
                m_i = tl.full([ROWS], float("-inf"), tl.float32)
                l_i = tl.zeros([ROWS], tl.float32)
                acc = tl.zeros([ROWS, HEAD_DIM], tl.float32)
                bt_row = bt_ptr + req.to(tl.int64) * stride_bt
                for n0 in range(0, kv_end, TILE_N):
                    kpos = n0 + tl.arange(0, TILE_N)
                    # keys past the block table's width do not exist (as in the reference); a
                    # block id outside the pool is clamped into it: bad metadata never reads
                    # out of bounds
                    k_ok = (kpos < kv_end) & (kpos // BLOCK_SIZE < bt_width)
                    blk = tl.load(bt_row + kpos // BLOCK_SIZE, mask=k_ok, other=0)
                    blk = tl.minimum(tl.maximum(blk, 0), num_blocks - 1)
                    base = (blk.to(tl.int64) * stride_kb + (kpos % BLOCK_SIZE) * stride_ks
                            + kvh * stride_kh)
                    k = tl.load(k_ptr + base[None, :] + offs_d[:, None], mask=k_ok[None, :],
                                other=0.0)
                    v = tl.load(v_ptr + base[:, None] + offs_d[None, :], mask=k_ok[:, None],
                                other=0.0)
                    if DOT_FP32:
                        s = tl.dot(q.to(tl.float32), k.to(tl.float32),
                                   input_precision="ieee")
                    else:
                        s = tl.dot(q, k)
                    s = s * scale_log2
                    s = tl.where((kpos[None, :] <= qpos[:, None]) & k_ok[None, :], s,
                                 float("-inf"))
                    m_new = tl.maximum(m_i, tl.max(s, 1))
                    alpha = tl.exp2(m_i - m_new)
                    p = tl.exp2(s - m_new[:, None])
                    l_i = l_i * alpha + tl.sum(p, 1)
                    p_kv = p.to(kv_ty)  # P as the 16-bit dot reads it (no-op for fp32 caches)
                    if DOT_FP32:
                        pv = tl.dot(p_kv.to(tl.float32), v.to(tl.float32),
                                    input_precision="ieee")
                    else:
                        pv = tl.dot(p_kv, v)
                    acc = acc * alpha[:, None] + pv
                    m_i = m_new
                out = acc / l_i[:, None]
                o_off = (q_start + tok).to(tl.int64) * stride_ot + head * stride_oh
                tl.store(out_ptr + o_off[:, None] + offs_d[None, :],
                         out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])

    # Triton's interpreter (TRITON_INTERPRET=1, tests on CPU) multiplies bf16 operands of
    # tl.dot as raw integer bit patterns (Triton 3.9): there the dots run in fp32
    interpreted = type(paged_attention_kernel).__name__ == "InterpretedFunction"
    return triton, paged_attention_kernel, interpreted


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    """The device's SM count (132, an H100's, for CPU tensors: Triton's interpreter)."""
    if device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


def _kernel_supports(head_dim: int, q_dtype: torch.dtype, cache_dtype: torch.dtype) -> bool:
    """Whether the kernel is defined for these: head dim a power of two in [16, 256], q and
    cache bf16 / fp16 / fp32."""
    return head_dim in _HEAD_DIMS and q_dtype in _KERNEL_DTYPES and cache_dtype in _KERNEL_DTYPES


def _fused_ok(q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """The CUDA op's choice: the kernel for CUDA tensors it supports when Triton imports."""
    return (q.is_cuda and _kernel_supports(q.shape[-1], q.dtype, kv_cache.dtype)
            and _triton_kernel() is not None)


def paged_attention_triton(q, kv_cache, query_start_loc, seq_lens, block_table, scale, *,
                           config: KernelConfig | None = None) -> torch.Tensor:
    """The attention of :func:`attention` (no KV write) by the Triton kernel.

    Args:
        q: ``[T, Hq, D]`` bf16/fp16/fp32, ``D`` in ``_HEAD_DIMS``; cast to the cache dtype for
            the dot products (fp32 caches: exact fp32 dots, no TF32).
        kv_cache: ``[2, num_blocks, block_size, Hkv, D]`` bf16/fp16/fp32 (contiguous in ``D``),
            already holding this step's K/V.
        query_start_loc, seq_lens, block_table: as :func:`attention` (int32 or int64).
            Block-table entries past a request's ``cdiv(seq_lens[i], block_size)`` blocks are
            never read; keys past the table's width count as absent and block ids outside the
            pool are clamped into it (as in the reference: bad metadata gives a wrong answer for
            that request, never an out-of-bounds read).
        scale: softmax scale.
        config: tile shape, one launch (default :func:`launch_plan`'s: one launch, or two
            whose tile the step's real tokens and requests pick on the GPU).

    Returns:
        ``[T, Hq, D]`` of ``q.dtype``, softmax and accumulation in fp32; rows
        ``>= query_start_loc[-1]`` are 0.

    Raises:
        AttentionOpError: Triton is not installed, the head dim / dtypes are not supported, or
            the cache is not contiguous in ``D``.
    """
    t, hq, d = q.shape
    r = seq_lens.shape[0]
    built = _triton_kernel()
    if built is None or not _kernel_supports(d, q.dtype, kv_cache.dtype):
        raise AttentionOpError(
            f"dbo.attention: no Triton kernel for head_dim={d}, q {q.dtype}, cache "
            f"{kv_cache.dtype} (Triton {'missing' if built is None else 'present'}; needs head_dim "
            f"in {_HEAD_DIMS} and dtypes in {_KERNEL_DTYPES})")
    out = torch.zeros((t, hq, d), dtype=q.dtype, device=q.device)
    if t == 0 or r == 0:
        return out
    triton, kernel, interpreted = built
    hkv, bs = kv_cache.shape[3], kv_cache.shape[2]
    g = hq // hkv
    g_pad = triton.next_power_of_2(g)
    if kv_cache.stride(-1) != 1:
        raise AttentionOpError("dbo.attention: kv_cache must be contiguous in the head dim")
    q = q if q.stride(-1) == 1 else q.contiguous()
    block_table = block_table if block_table.stride(-1) == 1 else block_table.contiguous()
    qsl, seq_lens = query_start_loc.contiguous(), seq_lens.contiguous()
    # Triton's interpreter would multiply bf16 bit patterns as integers: fp32 dots there
    dot_fp32 = kv_cache.dtype == torch.float32 or (interpreted and kv_cache.dtype == torch.bfloat16)
    for cfg, gate in launch_plan(t, r, g_pad, kv_cache.dtype, config):
        grid = (programs_per_head(cfg, t, r, hkv, _num_sms(q.device)), hkv)
        kernel[grid](
            out, q, kv_cache[0], kv_cache[1], qsl, seq_lens, block_table,
            scale * _LOG2E, r, block_table.shape[1], kv_cache.shape[1],
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3), block_table.stride(0),
            G=g, G_PAD=g_pad, BLOCK_M=cfg.block_m, TILE_N=cfg.tile_n, HEAD_DIM=d,
            BLOCK_SIZE=bs, DOT_FP32=dot_fp32, TILE_GATE=gate, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages)
    return out


@torch.library.custom_op("dbo::attention", mutates_args=("kv_cache",))
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
              slot_mapping: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
              block_table: torch.Tensor, scale: float) -> torch.Tensor:
    """Write this step's K/V into the paged cache, then paged causal attention.

    Request ``i`` owns query rows ``query_start_loc[i]:query_start_loc[i+1]`` (``q_i`` rows);
    they are the last ``q_i`` positions of its ``seq_lens[i]``-token sequence, so query ``j``
    sits at position ``seq_lens[i] - q_i + j`` and attends to cache positions ``0..`` that
    position, read through ``block_table[i]`` (position ``p`` -> slot
    ``block_table[i, p // block_size] * block_size + p % block_size``). Works for prefill,
    decode and chunked prefill mixed in one step, GQA (``Hq`` a multiple of ``Hkv``),
    ``T == 0`` and ``R == 0``.

    On CUDA the attention is the fused Triton kernel where Triton imports, ``D`` is a power of
    two in [16, 256] and q / cache are bf16, fp16 or fp32; otherwise (other head dims or dtypes,
    no Triton, other devices) the reference gather. Both are CUDA-graph capturable (see the
    module docstring).

    Args:
        q: ``[T, Hq, D]`` queries (``T`` = token dim, padding rows included), any float dtype.
        k: ``[T, Hkv, D]`` keys of this step's tokens.
        v: ``[T, Hkv, D]`` values of this step's tokens.
        kv_cache: ``[2, num_blocks, block_size, Hkv, D]``, contiguous; ``[0]`` keys, ``[1]``
            values. Mutated in place.
        slot_mapping: ``[T]`` int64 cache slot of each token, ``-1`` = padding (not written).
        query_start_loc: ``[R+1]`` int32 cumulative query lengths, ``[0] == 0``.
        seq_lens: ``[R]`` int32 sequence length of each request including this step's tokens.
        block_table: ``[R, max_blocks]`` int32 cache blocks of each request.
        scale: softmax scale (usually ``D ** -0.5``).

    Returns:
        ``[T, Hq, D]`` of ``q.dtype`` (softmax in fp32); rows ``>= query_start_loc[-1]`` are 0.

    Raises:
        AttentionOpError: inconsistent shapes or dtypes.
    """
    check_attention_args(q, k, v, kv_cache, slot_mapping, query_start_loc, seq_lens, block_table)
    write_kv(kv_cache, k, v, slot_mapping)
    return paged_attention(q, kv_cache, query_start_loc, seq_lens, block_table, scale)


@attention.register_kernel("cuda")
def attention_cuda(q, k, v, kv_cache, slot_mapping, query_start_loc, seq_lens, block_table,
                   scale):
    """``dbo.attention`` on CUDA: the KV write, then the Triton kernel where :func:`_fused_ok`
    (else the reference)."""
    check_attention_args(q, k, v, kv_cache, slot_mapping, query_start_loc, seq_lens, block_table)
    write_kv(kv_cache, k, v, slot_mapping)
    if _fused_ok(q, kv_cache):
        return paged_attention_triton(q, kv_cache, query_start_loc, seq_lens, block_table, scale)
    return paged_attention(q, kv_cache, query_start_loc, seq_lens, block_table, scale)


@attention.register_fake
def _attention_fake(q, k, v, kv_cache, slot_mapping, query_start_loc, seq_lens, block_table,
                    scale):
    check_attention_args(q, k, v, kv_cache, slot_mapping, query_start_loc, seq_lens, block_table)
    return torch.empty_like(q)


def _attention_flops(node: torch.fx.Node, size) -> float:
    """Two matmuls per query over an assumed context of 4x the ubatch's tokens (at least 64):
    the cost model knows no context length at compile time."""
    out = node.meta.get("val")
    if not isinstance(out, torch.Tensor):
        return 0.0
    tokens, heads, dim = (size(s) for s in out.shape)
    return 4.0 * tokens * heads * dim * max(64, 4 * tokens)


register_op(OpInfo(
    torch.ops.dbo.attention.default,
    token_args=((0, "q"), (1, "k"), (2, "v"), (4, "slot_mapping")),
    # row t reads the KV cache the other rows of its request wrote: the split orders every
    # ubatch's KV writes before the next ubatch's reads (docs/design.md, invariant 3)
    row_local=True, flops=_attention_flops,
    # [2, num_blocks, block_size, Hkv, D]: the prefix-read veto's block size
    kv_cache_arg=(3, "kv_cache", 2)))
