"""The ``deep_gemm`` experts backend: DeepGEMM's m-grouped GEMMs behind ``dbo.grouped_experts``.

``experts_backend="deep_gemm"``, options (``experts_backend_options``):

- ``fp8`` (default ``False``): FP8 e4m3 GEMMs with DeepSeek's block scales, 1x128 per token
  for the activations (quantised in the op, before each GEMM, the rows below the counts only:
  :mod:`dbo_compile.ops.fp8_cast`) and 128x128 per block for the
  weights (quantised once per weight tensor and kept); bf16 outputs. Accuracy against bf16:
  measured by ``benchmarks/bench_backends.py`` (README, GPU results).
- ``expected_m``: the rows per expert DeepGEMM's heuristic plans for (its kernel choice, and
  so what it JIT-compiles, depends on it); default: an eighth of the rows per expert of the
  expert-major layout (its static capacity, ``W * max_tokens``), 128 for the rank-major rows.
  Fixed per weight shape and layout, so a new token count never compiles a new kernel.

The two receive layouts (``dbo_compile.ops.experts``):

- **expert-major** (DeepEP low-latency ``[E_local, W*cap, H]`` + row counts): the *masked*
  grouped GEMM reads the dispatch's buffer as it is, ``masked_m`` = the counts: gate/up GEMM,
  SiLU-and-multiply on the valid rows only (a Triton kernel), down GEMM; the rows past the
  counts stay undefined (DeepGEMM stores whole tiles; the combine never reads them).
- **rank-major** (``[N, H]`` rows with ids and weights): the *contiguous* grouped GEMM with
  DeepGEMM's psum layout: the routed slots sorted by expert and gathered into segments that
  start at multiples of ``get_mk_alignment_for_contiguous_layout()`` (128 on SM90; DeepGEMM
  does not check it and computes a misaligned segment with the wrong expert), the ``[E]`` end
  offsets as the layout, then the weighted gather-sum back to rows. Static shapes (the rows
  are sized for the worst case, ``align(N*K) + 128*E``; DeepGEMM skips the blocks past each
  segment), no host sync, CUDA-graph capturable.

JIT: DeepGEMM compiles each (kernel, N, K, experts, config) with nvcc on first use (2.5–3.5 s
each on the H200, cached in ``$DG_JIT_CACHE_DIR``, default ``~/.deep_gemm``). The first call of
each weight shape and layout compiles; ``CudaGraphRunner.capture()``'s warm-up runs do it, and
an eager server should run one warm-up step per model before serving. Only SwiGLU without
biases is served (``supports``); other calls stay on ``"torch"``.

The package is ``deep_gemm`` (``pip install 'dbo_compile[deepgemm]'``: sgl-deep-gemm
0.1.5.post1 + apache-tvm-ffi 0.1.11 for torch 2.11 + CUDA 13; importing it asserts a CUDA
install), imported when the backend is asked for; an import failure is an
:class:`ExpertsOpError` naming the fallback.
"""

from __future__ import annotations

import logging
import time
import weakref
from typing import Any

import torch
import torch.nn.functional as F

from dbo_compile.errors import ExpertsOpError
from dbo_compile.ops.backends import AutoPreference, import_optional
from dbo_compile.ops.comm import EXPERT_MAJOR
from dbo_compile.ops.experts import ExpertsBackend, register_experts_backend
from dbo_compile.ops.experts_kernels import (
    PLAIN,
    ExpertFn,
    expert_kernels,
    gather_sum,
    sorted_slots,
    weighted_gather_sum_torch,
)
from dbo_compile.ops.fp8_cast import (
    FP8_MAX,
    fp8_cast_kernels,
    per_token_cast_fp8,
    per_token_cast_fp8_masked,
)

log = logging.getLogger(__name__)

__all__ = ["deep_gemm_backend", "per_block_cast_fp8", "per_token_cast_fp8"]

_INSTALL = ("pip install 'dbo_compile[deepgemm]' (sgl-deep-gemm 0.1.5.post1 and "
            "apache-tvm-ffi 0.1.11: torch 2.11, CUDA 13 with nvcc for its JIT, sm90 GPUs)")
#: rows per expert the contiguous GEMMs plan for by default (a fixed figure: DeepGEMM picks and
#: JIT-compiles its kernel from it, so it must not follow the step's token count)
_CONTIGUOUS_EXPECTED_M = 128


def _deep_gemm() -> Any:
    """The ``deep_gemm`` package (optional), or ``ExpertsOpError`` naming what to do."""
    return import_optional("deep_gemm", ExpertsOpError, "experts backend 'deep_gemm'",
                           _INSTALL, "experts_backend")


# --------------------------------------------------------------------------------------------
# FP8 casts (DeepSeek's block scales; the rule of DeepGEMM's and DeepEP's casts)
# --------------------------------------------------------------------------------------------


def per_block_cast_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [G, N, K]`` -> ``(e4m3 [G, N, K], scales fp32 [G, N/128, K/128])``, one scale per
    128x128 block (``N``, ``K`` multiples of 128)."""
    g, n, k = w.shape
    blocks = w.float().view(g, n // 128, 128, k // 128, 128)
    amax = blocks.abs().amax(dim=(2, 4)).clamp(min=1e-4)
    scales = amax / FP8_MAX
    q = (blocks / scales[:, :, None, :, None]).view(g, n, k).to(torch.float8_e4m3fn)
    return q, scales.contiguous()


# --------------------------------------------------------------------------------------------
# Kernels around the GEMMs
# --------------------------------------------------------------------------------------------


def _silu_mul_masked(h: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``h [E, M, 2I]`` -> ``[E, M, I]``, computed for the rows below each expert's count."""
    e, m, two_i = h.shape
    inter = two_i // 2
    a = torch.empty((e, m, inter), dtype=h.dtype, device=h.device)
    built = expert_kernels() if h.is_cuda else None
    if built is None:  # CPU (the reference DeepGEMM): every row
        a.copy_(F.silu(h[..., :inter]) * h[..., inter:])
        return a
    triton, kern = built
    block = min(1024, triton.next_power_of_2(inter))
    kern["silu_mul"][(e * m, triton.cdiv(inter, block))](h, a, counts, m, inter, BLOCK=block)
    return a


def _silu_mul_rows(h: torch.Tensor, n_valid: torch.Tensor) -> torch.Tensor:
    """``h [M, 2I]`` -> ``[M, I]``, the rows below ``n_valid`` (a one-element tensor)."""
    rows, two_i = h.shape
    inter = two_i // 2
    built = expert_kernels() if h.is_cuda else None
    if built is None:
        return F.silu(h[:, :inter]) * h[:, inter:]
    triton, kern = built
    a = torch.empty((rows, inter), dtype=h.dtype, device=h.device)
    block = min(1024, triton.next_power_of_2(inter))
    kern["silu_mul"][(rows, triton.cdiv(inter, block))](h, a, n_valid, max(rows, 1), inter,
                                                         BLOCK=block)
    return a


# --------------------------------------------------------------------------------------------
# The backend
# --------------------------------------------------------------------------------------------


class _DeepGemm:
    """A configured ``deep_gemm`` backend (module docstring)."""

    def __init__(self, fp8: bool, expected_m: int | None):
        self.dg = _deep_gemm()
        self.fp8, self.expected_m = fp8, expected_m
        #: key -> (weakref to the weight's storage, e4m3, scales)
        self._weights: dict[tuple, tuple[Any, torch.Tensor, torch.Tensor]] = {}
        self._compiled: set[tuple] = set()

    # -- weights (FP8: quantised once, kept) ---------------------------------------------
    def _b(self, w: torch.Tensor) -> Any:
        """``w``, or with FP8 its cast, kept per weight tensor: keyed by address, version,
        shape, strides, and valid while the storage it was cast from lives. A weight freed and
        another allocated at its address (same shape, version 0: the caching allocator reuses
        blocks) is cast again; keyed by address alone, the op computed with the freed weight's
        cast (issue 28: bench_experts --fp8-cast, 1.51 relative error at v2lite-ep8 T=1024)."""
        if not self.fp8:
            return w
        key = (w.data_ptr(), w._version, tuple(w.shape), w.stride(), w.device)
        hit = self._weights.get(key)
        if hit is None or hit[0]() is None:
            dead = [k for k, (ref, _, _) in self._weights.items() if ref() is None]
            for k in dead:
                del self._weights[k]
            if len(self._weights) > 512:  # weights replaced many times: start over
                self._weights.clear()
            hit = (weakref.ref(w.untyped_storage()), *per_block_cast_fp8(w))
            self._weights[key] = hit
        return hit[1], hit[2]

    def _a(self, x: torch.Tensor, counts: torch.Tensor) -> Any:
        """The GEMM's ``a``: ``x`` (bf16), or with FP8 its rows below ``counts`` cast (the
        masked Triton cast on CUDA, :mod:`dbo_compile.ops.fp8_cast`; every row on CPU)."""
        if not self.fp8:
            return x
        if x.is_cuda and fp8_cast_kernels() is not None:
            return per_token_cast_fp8_masked(x, counts)
        return per_token_cast_fp8(x)

    def _timed(self, what: tuple, fn: Any, *args: Any, **kwargs: Any) -> None:
        """``fn(*args)``, logging the first call of each kernel shape (DeepGEMM's JIT)."""
        if what in self._compiled:
            fn(*args, **kwargs)
            return
        t0 = time.perf_counter()
        fn(*args, **kwargs)
        self._compiled.add(what)
        log.info("dbo: deep_gemm: first call of %s took %.2f s (JIT compile on first use)",
                 what, time.perf_counter() - t0)

    # -- expert-major rows: masked GEMMs --------------------------------------------------
    def _masked(self, x, counts, w13, w2) -> torch.Tensor:
        e, m, hidden = x.shape
        inter = w2.shape[2]
        expected = self.expected_m or max(1, m // 8)
        gemm = (self.dg.m_grouped_fp8_fp4_gemm_nt_masked if self.fp8
                else self.dg.m_grouped_bf16_gemm_nt_masked)
        x = x.contiguous()
        counts = counts.contiguous()
        h = torch.empty((e, m, 2 * inter), dtype=torch.bfloat16, device=x.device)
        self._timed(("masked", self.fp8, e, 2 * inter, hidden, expected), gemm,
                    self._a(x, counts), self._b(w13), h, counts, expected)
        a = _silu_mul_masked(h, counts)
        y = torch.empty((e, m, hidden), dtype=torch.bfloat16, device=x.device)
        self._timed(("masked", self.fp8, e, hidden, inter, expected), gemm,
                    self._a(a, counts), self._b(w2), y, counts, expected)
        return y

    # -- rank-major rows: contiguous GEMMs with the psum layout ---------------------------
    def _contiguous(self, x, ids, weights, w13, w2) -> torch.Tensor:
        n, k = ids.shape
        e, hidden, inter = w13.shape[0], x.shape[1], w2.shape[2]
        if n == 0:
            return torch.zeros_like(x)
        align = int(self.dg.get_mk_alignment_for_contiguous_layout())
        order, rows, offs, valid, keys = sorted_slots(ids, e, with_keys=True)
        counts = torch.diff(offs, prepend=offs.new_zeros(1))
        aligned = (counts + align - 1) // align * align
        starts = torch.cumsum(aligned, 0, dtype=torch.int32) - aligned
        psum = (starts + counts).to(torch.int32)  # DeepGEMM's [E] end offsets
        slots = n * k
        m_pad = -(-slots // align) * align + e * align  # the worst case, static
        expert = keys.long().clamp(max=e - 1)
        i = torch.arange(slots, device=x.device)
        dst = starts.index_select(0, expert) + (i - (offs - counts).index_select(0, expert))
        dst = torch.where(keys < e, dst, m_pad)  # slots not on this rank: a spare row
        a = torch.empty((m_pad + 1, hidden), dtype=x.dtype, device=x.device)
        a.index_copy_(0, dst, x.index_select(0, rows))
        a = a[:m_pad]
        expected = self.expected_m or _CONTIGUOUS_EXPECTED_M  # fixed: no JIT per token count
        gemm = (self.dg.m_grouped_fp8_fp4_gemm_nt_contiguous if self.fp8
                else self.dg.m_grouped_bf16_gemm_nt_contiguous)
        h = torch.empty((m_pad, 2 * inter), dtype=torch.bfloat16, device=x.device)
        self._timed(("contiguous", self.fp8, e, 2 * inter, hidden), gemm,
                    self._a(a, psum[-1:]), self._b(w13), h, psum, use_psum_layout=True,
                    expected_m_for_psum_layout=expected)
        act = _silu_mul_rows(h, psum[-1:])
        o = torch.empty((m_pad, hidden), dtype=torch.bfloat16, device=x.device)
        self._timed(("contiguous", self.fp8, e, hidden, inter), gemm,
                    self._a(act, psum[-1:]), self._b(w2), o, psum, use_psum_layout=True,
                    expected_m_for_psum_layout=expected)
        pos = torch.empty_like(order)
        pos.scatter_(0, order, dst)  # each slot's row in the segments
        if x.is_cuda and expert_kernels() is not None:
            return gather_sum(o, pos, ids, weights, x, e)  # reads the local slots only
        w = torch.where(valid, weights.reshape(-1), 0.0)
        return weighted_gather_sum_torch(o, pos.view(n, k).clamp(max=m_pad - 1),
                                          w.view(n, k), valid, x.dtype)

    def run(self, x, ids, weights, w13, w2, fn: ExpertFn = PLAIN) -> torch.Tensor:
        if not fn.plain:
            raise ExpertsOpError("experts backend 'deep_gemm' runs SwiGLU without biases; "
                                 f"this call has activation={fn.activation!r} or biases (the "
                                 "compiler keeps such calls on 'torch')")
        if x.dim() == 3:
            return self._masked(x, ids, w13, w2)
        return self._contiguous(x, ids, weights, w13, w2)

    def supports(self, facts: dict) -> str | None:
        if facts.get("activation", "silu") != "silu" or facts.get("bias"):
            return "it runs SwiGLU without biases (GPT-OSS's clamped GLU with biases is not)"
        if facts.get("dtype", torch.bfloat16) != torch.bfloat16 or facts.get(
                "weight_dtype", torch.bfloat16) != torch.bfloat16:
            return f"it needs bf16 rows and weights, got {facts.get('dtype')}"
        dims = [facts.get("hidden", 128), facts.get("intermediate", 128)]
        unit = 128 if self.fp8 else 64  # SM90: K % 64; FP8 block scales: 128
        if any(d % unit for d in dims):
            return f"hidden and intermediate sizes must be multiples of {unit}, got {dims}"
        return None


def _check_options(fp8: bool = False, expected_m: int | None = None) -> None:
    """The options' values (module docstring), checked without importing ``deep_gemm``."""
    if not isinstance(fp8, bool):
        raise ExpertsOpError(f"experts backend 'deep_gemm': fp8={fp8!r} must be a bool")
    if expected_m is not None and (isinstance(expected_m, bool) or not isinstance(expected_m, int)
                                   or expected_m < 1):
        raise ExpertsOpError(f"experts backend 'deep_gemm': expected_m={expected_m!r} must be "
                             "an int >= 1")


def _configure(fp8: bool = False, expected_m: int | None = None, **unknown: Any
               ) -> ExpertsBackend:
    if unknown:
        raise ExpertsOpError(f"experts backend 'deep_gemm': unknown option(s) {sorted(unknown)};"
                             " valid: fp8, expected_m")
    _check_options(fp8, expected_m)
    impl = _DeepGemm(fp8, expected_m)
    what = "FP8 (1x128 / 128x128 block scales)" if fp8 else "bf16"
    return ExpertsBackend("deep_gemm", impl.run,
                          f"DeepGEMM m-grouped {what}: masked (expert-major), contiguous "
                          "(rank-major)", supports=impl.supports)


def deep_gemm_backend() -> ExpertsBackend:
    """The registry entry (options: :func:`_configure`)."""
    def unconfigured(*args: Any, **kwargs: Any) -> Any:
        raise ExpertsOpError("internal: the deep_gemm backend is used through its spec")

    return ExpertsBackend("deep_gemm", unconfigured, "DeepGEMM m-grouped GEMMs",
                          configure=_configure, check_options=_check_options,
                          auto=AutoPreference(0, only=_auto_where))


def _auto_where(facts: dict[str, Any]) -> str | None:
    """``experts_backend="auto"`` picks DeepGEMM for the expert-major rows (its masked grouped
    GEMM); on the rank-major rows ``torch._grouped_mm`` is as good."""
    if facts.get("layout") == EXPERT_MAJOR:
        return None
    return ("for the rank-major rows (torch._grouped_mm; experts_backend='deep_gemm' runs its "
            "contiguous grouped GEMM there)")


register_experts_backend(deep_gemm_backend())
