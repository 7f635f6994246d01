"""A reference implementation of DeepGEMM's documented grouped-GEMM semantics in torch, for
CPU tests: injected as the module ``deep_gemm`` it lets the adapter
(:mod:`dbo_compile.ops.deep_gemm`) run on CPU. It follows sgl-deep-gemm 0.1.5.post1 (the
semantics read from its sources at 8d5d398 and seen on one H200, ``docs/references.md``):

- ``m_grouped_bf16_gemm_nt_masked(a [G, M, K], b [G, N, K], d [G, M, N], masked_m [G] int32,
  expected_m)``: ``d[g, :masked_m[g]] = a[g, :masked_m[g]] @ b[g].T``; the rows past the mask
  **may be overwritten with garbage** (the kernel stores whole tiles): here NaN.
- ``m_grouped_bf16_gemm_nt_contiguous(a [M, K], b [G, N, K], d [M, N], grouped_layout)``:
  with ``m_indices`` (``[M]``, the expert of each row, ``-1`` padding) the kernel reads the
  expert **at the first row of each 128-row tile only** (clamped to >= 0): a segment not
  aligned to 128 rows is silently computed with the wrong expert, as on the GPU; with
  ``use_psum_layout`` (``[G]`` end offsets, ``start_i = align(end_{i-1}, 128)``) rows
  ``[start_i, end_i)`` use expert ``i`` and every other row is garbage (NaN); offsets that
  do not follow the alignment are not checked either (silently wrong rows).
- FP8 (``m_grouped_fp8_fp4_gemm_nt_masked`` / ``..._contiguous``, SM90 recipe ``(1, 128,
  128)``): ``a = (a_fp8 e4m3, sfa fp32 [.., M, K/128])`` per-token 1x128 scales, ``b = (b_fp8,
  sfb fp32 [G, N/128, K/128])`` 128x128 block scales, dequantised and multiplied in fp32. The
  name ``m_grouped_fp8_gemm_nt_masked`` does not exist in this DeepGEMM (AttributeError), as
  in the wheel.
- the shape and dtype asserts of its host code (K-major ``a``/``b``, ``stride(0) == M*K`` of a
  masked ``a``, int32 contiguous layouts, bf16 ``d``, ``expected_m > 0``).

Calls are counted per kernel name in :data:`CALLS`.
"""

from __future__ import annotations

import collections

import torch

__version__ = "0.1.5.post1 (reference)"
ALIGNMENT = 128
CALLS: collections.Counter = collections.Counter()


def get_mk_alignment_for_contiguous_layout() -> int:
    return ALIGNMENT


get_m_alignment_for_contiguous_layout = get_mk_alignment_for_contiguous_layout


def _k_major(t: torch.Tensor) -> None:
    assert t.stride(-1) == 1, f"not K-major: strides {t.stride()}"


def _gemm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a.float() @ b.float().transpose(-2, -1)


def _dequant_a(a: tuple) -> torch.Tensor:
    data, sf = a
    assert data.dtype == torch.float8_e4m3fn and sf.dtype == torch.float32, (data.dtype, sf.dtype)
    assert sf.shape == (*data.shape[:-1], data.shape[-1] // 128), (tuple(sf.shape), data.shape)
    return (data.float().unflatten(-1, (-1, 128)) * sf.unsqueeze(-1)).flatten(-2)


def _dequant_b(b: tuple) -> torch.Tensor:
    data, sf = b
    g, n, k = data.shape
    assert data.dtype == torch.float8_e4m3fn and sf.dtype == torch.float32
    assert sf.shape == (g, -(-n // 128), k // 128), (tuple(sf.shape), data.shape)
    scale = sf.repeat_interleave(128, 1)[:, :n].repeat_interleave(128, 2)
    return data.float() * scale


def _masked(a: torch.Tensor, b: torch.Tensor, d: torch.Tensor, masked_m: torch.Tensor,
            expected_m: int) -> None:
    g, m, k = a.shape
    assert b.shape[0] == g and b.shape[2] == k and tuple(d.shape) == (g, m, b.shape[1])
    assert d.dtype == torch.bfloat16 and masked_m.dtype == torch.int32
    assert masked_m.is_contiguous() and masked_m.numel() == g and expected_m > 0
    d.fill_(float("nan"))
    for e in range(g):
        rows = int(masked_m[e])
        d[e, :rows] = _gemm(a[e, :rows], b[e]).to(d.dtype)


def m_grouped_bf16_gemm_nt_masked(a, b, d, masked_m, expected_m, compiled_dims="nk"):
    CALLS["bf16_masked"] += 1
    assert a.dtype == b.dtype == torch.bfloat16
    _k_major(a)
    _k_major(b)
    assert a.stride(0) == a.shape[1] * a.shape[2], "a must be [G, M, K] with stride(0) == M*K"
    _masked(a, b, d, masked_m, expected_m)


bf16_m_grouped_gemm_nt_masked = m_grouped_bf16_gemm_nt_masked


def m_grouped_fp8_fp4_gemm_nt_masked(a, b, d, masked_m, expected_m, recipe=None, recipe_a=None,
                                     recipe_b=None, compiled_dims="nk",
                                     disable_ue8m0_cast=False):
    CALLS["fp8_masked"] += 1
    _k_major(a[0])
    _k_major(b[0])
    _masked(_dequant_a(a), _dequant_b(b), d, masked_m, expected_m)


fp8_m_grouped_gemm_nt_masked = m_grouped_fp8_fp4_gemm_nt_masked


def _contiguous(a: torch.Tensor, b: torch.Tensor, d: torch.Tensor, layout: torch.Tensor,
                use_psum_layout: bool) -> None:
    m, k = a.shape
    g = b.shape[0]
    assert b.shape[2] == k and tuple(d.shape) == (m, b.shape[1]) and d.dtype == torch.bfloat16
    assert layout.dtype == torch.int32 and layout.is_contiguous()
    d.fill_(float("nan"))
    if use_psum_layout:
        assert layout.shape == (g,)
        start = 0
        for e in range(g):
            end = int(layout[e])  # an end before the aligned start: no rows (nothing checks)
            d[start:max(start, end)] = _gemm(a[start:max(start, end)], b[e]).to(d.dtype)
            start = -(-end // ALIGNMENT) * ALIGNMENT
        return
    assert layout.shape == (m,)
    for t in range(0, m, ALIGNMENT):  # the expert of a tile is read at its first row
        e = max(0, int(layout[t]))
        d[t:t + ALIGNMENT] = _gemm(a[t:t + ALIGNMENT], b[e]).to(d.dtype)


def m_grouped_bf16_gemm_nt_contiguous(a, b, d, grouped_layout, compiled_dims="nk",
                                      use_psum_layout=False, ensure_zero_padding=True,
                                      expected_m_for_psum_layout=None):
    CALLS["bf16_contiguous"] += 1
    assert a.dtype == b.dtype == torch.bfloat16
    assert expected_m_for_psum_layout is None or use_psum_layout
    _k_major(a)
    _contiguous(a, b, d, grouped_layout, use_psum_layout)


def m_grouped_fp8_fp4_gemm_nt_contiguous(a, b, d, grouped_layout, recipe=None, recipe_a=None,
                                         recipe_b=None, compiled_dims="nk",
                                         disable_ue8m0_cast=False, use_psum_layout=False,
                                         ensure_zero_padding=True,
                                         expected_m_for_psum_layout=None):
    CALLS["fp8_contiguous"] += 1
    assert expected_m_for_psum_layout is None or use_psum_layout
    _k_major(a[0])
    _k_major(b[0])
    _contiguous(_dequant_a(a), _dequant_b(b), d, grouped_layout, use_psum_layout)


m_grouped_fp8_gemm_nt_contiguous = m_grouped_fp8_fp4_gemm_nt_contiguous
