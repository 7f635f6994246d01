"""``dbo::grouped_experts``: the local routed experts of an EP rank as one row-local op.

``torch.ops.dbo.grouped_experts(x, ids, weights, w13, w2, backend="", activation="silu",
b13=None, b2=None, alpha=1.702, limit=7.0) -> y``, in either receive layout of
``dbo.moe_dispatch`` (``dbo_compile.ops.comm``), told apart by ``x.dim()``:

- **rank-major** (``x [N, H]``, ``N = W * T`` rows; torch, local, DeepEP normal):
  ``ids [N, K]`` int64 local expert id per slot in ``[-1, E_local)``, ``weights [N, K]`` fp32
  routing weights; returns ``y [N, H]``: ``y[n] = sum_k weights[n, k] * f_{ids[n, k]}(x[n])``
  over the **local slots**, accumulated in fp32; rows with no local slot are zeros. A slot is
  local when ``0 <= id < E_local`` (``E_local = w13.shape[0]``); any other id contributes
  nothing, whatever its weight: ``-1`` (the dispatch's "expert not on this rank",
  ``dbo_compile.ops.comm``), another negative id, or an id ``>= E_local`` (another rank's
  expert: a routing bug upstream or a bad input). Every path (the loop, the sorted and the
  fused CUDA paths, ``deep_gemm``) applies the rule, in its kernels too (no read out of
  bounds, also in a captured CUDA graph; no host read).
- **expert-major** (``x [E_local, M, H]``; DeepEP low-latency): ``ids [E_local]`` int32, the
  valid rows of each expert (rows ``[0, ids[e])`` of ``x[e]``; the others are undefined and
  never read), ``weights`` unused (the dispatch's row ranges); returns ``y [E_local, M, H]``,
  ``y[e, i] = f_e(x[e, i])`` unweighted for the valid rows (the combine weights them), the
  other rows undefined.

The expert ``f_e`` (weights ``w13 [E_local, 2I, H]``, ``w2 [E_local, H, I]``, any strides):
``h = x @ w13[e].T (+ b13[e])``, ``a = act(h)``, ``f_e(x) = a @ w2[e].T (+ b2[e])``, with
``activation="silu"``: ``silu(h[:, :I]) * h[:, I:]`` (SwiGLU: Qwen3-MoE, Mixtral, DeepSeek);
``"gpt_oss"``: GPT-OSS's clamped GLU over interleaved columns, ``gate = h[:, ::2].clamp(max=
limit)``, ``up = h[:, 1::2].clamp(-limit, limit)``, ``(up + 1) * gate * sigmoid(alpha *
gate)`` (transformers ``GptOssExperts._apply_gate``).

Row ``n`` of ``y`` depends only on row ``n`` of ``x``/``ids``/``weights`` (rank-major), so the
op is declared row-local along the token dim (the split pass may cut it anywhere); the
expert-major rows carry no token dim.

Kernels:

- CUDA (static shapes, no host sync, CUDA-graph capturable): narrow expert keys per slot
  (slots not on this rank sort last), a stable sort of the keys, the expert offsets by binary
  search over the sorted keys, a Triton gather of the routed rows in sorted order (rows of
  slots on other ranks are not copied) that also writes the inverse permutation, two
  ``torch._grouped_mm`` calls (the grouped GEMM of the field: one launch for all local experts,
  rows past the last expert's offset are not computed) with a Triton SiLU-and-multiply between
  them (rows past the last routed slot skipped), then a weighted gather-sum back to rows — a
  Triton kernel that reads each local slot's output row once and writes ``y`` once. 10 kernel
  launches besides the sort's (without Triton: the same algorithm in torch ops). Small calls
  (decode) take the **fused** path instead where it is faster (:mod:`dbo_compile.ops.
  fused_moe`: an align kernel, two Triton grouped GEMMs reading the rows through the sorted
  slot list with SiLU in the first one's epilogue, the same gather-sum; 4 launches), measured
  once per shape at its first eager call (:func:`_prefer_fused`; the backend's option
  ``path``: ``experts_backend="torch", experts_backend_options={"path": "fused"}``).
  Another activation or biases: the same algorithm with torch ops between the grouped GEMMs.
  Expert-major rows: the valid rows compacted (offsets from the counts), the two grouped GEMMs,
  the rows written back in place (torch ops; ``deep_gemm``'s masked GEMM reads the layout as
  it is, :mod:`dbo_compile.ops.deep_gemm`).
- CPU, other dtypes than bf16, GPUs before sm90 (where ``torch._grouped_mm`` has no fused
  kernel and its fallback syncs with the host): the reference per-expert loop (every expert on
  every row, masked), exact and capturable; :func:`grouped_reference` runs the CUDA algorithm
  with torch ops on any device for tests.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.nn.functional as F

from dbo_compile.errors import ExpertsOpError
from dbo_compile.ops import fused_moe
from dbo_compile.ops._triton import import_triton
from dbo_compile.ops.comm import ep_size_of_rows
from dbo_compile.ops.registry import BackendRegistry, OpInfo, register_op
from dbo_compile.timing import graph_median_us

__all__ = ["ACTIVATIONS", "EXPERTS_PATHS", "ExpertFn", "ExpertsBackend", "ExpertsOpError",
           "available_experts_backends", "experts_loop", "experts_options_for",
           "experts_path_choices", "gather_sum", "get_experts_backend", "grouped_experts",
           "grouped_reference", "register_experts_backend", "register_lazy_experts_backend"]

#: the experts' activations (module docstring)
ACTIVATIONS = ("silu", "gpt_oss")


@dataclasses.dataclass(frozen=True)
class ExpertFn:
    """The expert MLP besides its weights: activation and biases (module docstring).

    Attributes:
        activation: one of :data:`ACTIVATIONS`.
        b13: ``[E_local, 2I]`` bias of the gate/up projection, or ``None``.
        b2: ``[E_local, H]`` bias of the down projection, or ``None``.
        alpha, limit: the ``"gpt_oss"`` activation's constants.
    """

    activation: str = "silu"
    b13: torch.Tensor | None = None
    b2: torch.Tensor | None = None
    alpha: float = 1.702
    limit: float = 7.0

    @property
    def plain(self) -> bool:
        """SwiGLU without biases (what the fused kernels and DeepGEMM compute)."""
        return self.activation == "silu" and self.b13 is None and self.b2 is None

    def act(self, h: torch.Tensor) -> torch.Tensor:
        """``[..., 2I] -> [..., I]`` in ``h.dtype``."""
        if self.activation == "silu":
            inter = h.shape[-1] // 2
            return F.silu(h[..., :inter]) * h[..., inter:]
        gate = h[..., ::2].clamp(max=self.limit)
        up = h[..., 1::2].clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


PLAIN = ExpertFn()


def _check(x, ids, weights, w13, w2, fn: ExpertFn = PLAIN) -> None:
    if x.dim() == 3:  # expert-major rows
        if ids.dim() != 1 or ids.shape[0] != x.shape[0] or ids.dtype != torch.int32:
            raise ExpertsOpError(
                f"dbo.grouped_experts: expert-major x {tuple(x.shape)} needs ids = the valid "
                f"rows per expert, [E_local={x.shape[0]}] int32; got {tuple(ids.shape)} "
                f"{ids.dtype}")
        if w13.dim() == 3 and w13.shape[0] != x.shape[0]:
            raise ExpertsOpError(f"dbo.grouped_experts: x has {x.shape[0]} experts' rows but "
                                 f"w13 {tuple(w13.shape)} holds {w13.shape[0]} experts")
    elif (x.dim() != 2 or ids.dim() != 2 or weights.shape != ids.shape
          or ids.shape[0] != x.shape[0]):
        raise ExpertsOpError(
            f"dbo.grouped_experts: expected x [N, H], ids/weights [N, K] (or expert-major x "
            f"[E, M, H] with ids [E]); got x {tuple(x.shape)}, ids {tuple(ids.shape)}, weights "
            f"{tuple(weights.shape)}")
    elif ids.dtype != torch.int64 or weights.dtype != torch.float32:
        raise ExpertsOpError(f"dbo.grouped_experts: ids must be int64 and weights float32, got "
                             f"{ids.dtype} / {weights.dtype}")
    hidden = x.shape[-1]
    if (w13.dim() != 3 or w2.dim() != 3 or w13.shape[0] != w2.shape[0]
            or w13.shape[2] != hidden or w2.shape[1] != hidden
            or w13.shape[1] != 2 * w2.shape[2]):
        raise ExpertsOpError(
            f"dbo.grouped_experts: expected w13 [E, 2I, H] and w2 [E, H, I] with H = "
            f"{hidden}; got {tuple(w13.shape)} and {tuple(w2.shape)}")
    if fn.activation not in ACTIVATIONS:
        raise ExpertsOpError(f"dbo.grouped_experts: activation={fn.activation!r}; choose one of "
                             f"{ACTIVATIONS}")
    for name, b, want in (("b13", fn.b13, (w13.shape[0], w13.shape[1])),
                          ("b2", fn.b2, (w2.shape[0], hidden))):
        if b is not None and tuple(b.shape) != want:
            raise ExpertsOpError(f"dbo.grouped_experts: {name} must be {list(want)}, got "
                                 f"{tuple(b.shape)}")


def _mlp(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, e: int, fn: ExpertFn
         ) -> torch.Tensor:
    """Expert ``e`` on rows ``x [N, H]`` -> ``[N, H]`` (x.dtype)."""
    h = F.linear(x, w13[e], None if fn.b13 is None else fn.b13[e])
    return F.linear(fn.act(h), w2[e], None if fn.b2 is None else fn.b2[e])


def experts_loop(x, ids, weights, w13, w2, fn: ExpertFn = PLAIN) -> torch.Tensor:
    """Reference: every local expert on every row, weighted by the row's slots for it
    (rank-major), or on its own rows, masked past its count (expert-major)."""
    if x.dim() == 3:
        valid = torch.arange(x.shape[1], device=x.device).unsqueeze(0) < ids.unsqueeze(1)
        outs = [torch.where(valid[e].unsqueeze(-1), _mlp(x[e], w13, w2, e, fn), 0)
                for e in range(x.shape[0])]
        return torch.stack(outs).to(x.dtype) if outs else torch.empty_like(x)
    y = torch.zeros_like(x, dtype=torch.float32)
    for e in range(w13.shape[0]):
        mine = ids == e
        # weights of other experts' slots and outputs of rows without a slot of e never enter
        # the sum (as in the grouped path), even when they are inf / NaN
        w_e = torch.where(mine, weights, 0.0).sum(dim=-1, keepdim=True)  # [N, 1] fp32
        out = _mlp(x, w13, w2, e, fn).to(torch.float32)
        y = y + torch.where(mine.any(dim=-1, keepdim=True), w_e * out, 0.0)
    return y.to(x.dtype)


def _narrow_key_dtype(num_experts: int) -> torch.dtype:
    # sort narrow keys: CUB's radix sort makes one pass per 8 key bits (int64: 8 passes, int16:
    # 2); profiled on H200, the int64 sort was the third-largest cost of a split step
    return torch.int16 if num_experts < 2**15 else torch.int32


def _expert_offsets(sorted_keys: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``offs[e]`` = number of slots of experts ``0..e``: ``[E]`` int32 from the sorted keys.

    One binary search per expert over the sorted keys (2 kernels) instead of a zeroed count
    buffer, a scatter-add and a cumulative sum (5 kernels).
    """
    experts = torch.arange(num_experts, dtype=sorted_keys.dtype, device=sorted_keys.device)
    return torch.searchsorted(sorted_keys, experts, right=True, out_int32=True)


def _sorted_slots(ids: torch.Tensor, num_experts: int, with_keys: bool = False):
    """Slots sorted by expert: ``(order, rows, offs, valid)`` (and the sorted keys, the expert
    of each sorted slot, ``num_experts`` for slots not here); slots not local (id outside
    ``[0, num_experts)``, module docstring) sort last."""
    flat = ids.reshape(-1)
    valid = (flat >= 0) & (flat < num_experts)
    key = torch.where(valid, flat, num_experts).to(_narrow_key_dtype(num_experts))
    sorted_keys, order = torch.sort(key, stable=True)
    offs = _expert_offsets(sorted_keys, num_experts)
    rows = torch.div(order, ids.shape[1], rounding_mode="floor")
    if with_keys:
        return order, rows, offs, valid, sorted_keys
    return order, rows, offs, valid


def _gate_up(x, rows, offs, w13) -> torch.Tensor:
    """Per sorted slot, its expert's gate and up projections ``[N*K, 2I]`` (rows past
    ``offs[-1]`` are not computed and hold garbage)."""
    return torch._grouped_mm(x.index_select(0, rows), w13.transpose(-2, -1), offs=offs)


def _expert_outputs(x, rows, offs, w13, w2, fn: ExpertFn = PLAIN,
                    keys: torch.Tensor | None = None) -> torch.Tensor:
    """Per sorted slot, the output of its expert: ``[N*K, H]`` (rows past ``offs[-1]`` are not
    computed and hold garbage). ``keys``: the expert of each sorted slot (needed for biases)."""
    h = _gate_up(x, rows, offs, w13)
    experts = None if keys is None else keys.long().clamp(max=w13.shape[0] - 1)
    if fn.b13 is not None:
        h = h + fn.b13.index_select(0, experts)
    o = torch._grouped_mm(fn.act(h), w2.transpose(-2, -1), offs=offs)
    if fn.b2 is not None:
        o = o + fn.b2.index_select(0, experts)
    return o


def _slot_positions(order, valid, weights):
    """``(pos, w)``: each slot's row in the sorted order (the inverse permutation of
    ``order``) and its routing weight, 0 for slots not on this rank; both ``[N*K]``."""
    pos = torch.empty_like(order)
    pos.scatter_(0, order, torch.arange(order.numel(), device=order.device))
    return pos, torch.where(valid, weights.reshape(-1), 0.0).contiguous()


def _weighted_gather_sum_torch(o, pos, w, valid, out_dtype):
    n, k = pos.shape
    og = o.index_select(0, pos.reshape(-1)).view(n, k, -1)
    og = og.masked_fill(~valid.view(n, k, 1), 0)  # never multiply garbage rows (may be inf/nan)
    y = torch.bmm(w.view(n, 1, k).to(torch.float32), og.to(torch.float32))
    return y.view(n, -1).to(out_dtype)


def grouped_reference(x, ids, weights, w13, w2, fn: ExpertFn = PLAIN) -> torch.Tensor:
    """The CUDA algorithm (sort, grouped GEMM, weighted gather-sum) with torch ops only; for
    expert-major rows, :func:`_grouped_expert_major`."""
    _check(x, ids, weights, w13, w2, fn)
    if x.dim() == 3:
        return _grouped_expert_major(x, ids, w13, w2, fn)
    n, k = ids.shape
    if n == 0:
        return torch.zeros_like(x)
    if fn.plain:
        order, rows, offs, valid = _sorted_slots(ids, w13.shape[0])
        o = _expert_outputs(x, rows, offs, w13, w2)
    else:
        order, rows, offs, valid, keys = _sorted_slots(ids, w13.shape[0], with_keys=True)
        o = _expert_outputs(x, rows, offs, w13, w2, fn, keys)
    pos, w = _slot_positions(order, valid, weights)
    return _weighted_gather_sum_torch(o, pos.view(n, k), w.view(n, k), valid, x.dtype)


def _grouped_expert_major(x, counts, w13, w2, fn: ExpertFn = PLAIN) -> torch.Tensor:
    """Expert-major rows with torch's grouped GEMM: the valid rows compacted in expert order
    (offsets = the running sum of ``counts``), gate/up and down grouped GEMMs, the outputs
    written back to their rows (the others left undefined). Static shapes, no host sync."""
    e, m, hidden = x.shape
    if e * m == 0:
        return torch.empty_like(x)
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    r = torch.arange(e * m, device=x.device)
    expert = torch.searchsorted(offs, r.to(torch.int32), right=True).clamp(max=e - 1)
    starts = offs - counts
    src = expert * m + (r - starts.index_select(0, expert))
    valid = r < offs[-1]
    src = torch.where(valid, src, e * m)  # rows past the last valid one: a spare row
    flat = torch.cat([x.reshape(e * m, hidden), x.new_zeros(1, hidden)])
    o = _expert_outputs(flat, src, offs, w13, w2, fn, expert)
    y = torch.empty((e * m + 1, hidden), dtype=x.dtype, device=x.device)
    y.index_copy_(0, src, o.to(x.dtype))
    return y[: e * m].view(e, m, hidden)


@functools.cache
def _triton_kernel():
    mods = import_triton()
    if mods is None:
        return None
    triton, tl = mods

    @triton.jit
    def slot_key_kernel(ids_ptr, key_ptr, n, E, BLOCK: tl.constexpr):
        """``key = ids`` as a narrow int, slots not on this rank (id outside ``[0, E)``) ->
        ``E`` (sort last)."""
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        i = tl.load(ids_ptr + offs, mask=m, other=0)
        key = tl.where((i >= 0) & (i < E), i, E)
        tl.store(key_ptr + offs, key.to(key_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def gather_sorted_kernel(x_ptr, order_ptr, skey_ptr, xs_ptr, pos_ptr, H, E, stride_x,
                             K: tl.constexpr, BLOCK_H: tl.constexpr):
        """Sorted slot ``i`` of a local expert: ``xs[i] = x[order[i] // K]`` and
        ``pos[order[i]] = i``; slots not on this rank (sorted last) are skipped."""
        i = tl.program_id(0).to(tl.int64)
        if tl.load(skey_ptr + i) < E:
            s = tl.load(order_ptr + i)
            cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
            m = cols < H
            row = tl.load(x_ptr + (s // K) * stride_x + cols, mask=m)
            tl.store(xs_ptr + i * H + cols, row, mask=m)
            if tl.program_id(1) == 0:
                tl.store(pos_ptr + s, i.to(tl.int32))

    @triton.jit
    def wgs_kernel(o_ptr, pos_ptr, ids_ptr, w_ptr, y_ptr, H, E, K: tl.constexpr,
                   BLOCK_H: tl.constexpr):
        """``y[t] = sum_j w[t, j] * o[pos[t, j]]`` over the local slots (id in ``[0, E)``);
        the positions of the others are never read (undefined)."""
        t = tl.program_id(0).to(tl.int64)  # t * H overflows int32 past 2**31 elements
        cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        m = cols < H
        acc = tl.zeros([BLOCK_H], dtype=tl.float32)
        for j in tl.static_range(K):
            i = tl.load(ids_ptr + t * K + j)
            if (i >= 0) & (i < E):  # slots on another rank: rows never read
                w = tl.load(w_ptr + t * K + j)
                p = tl.load(pos_ptr + t * K + j).to(tl.int64)
                acc += w * tl.load(o_ptr + p * H + cols, mask=m, other=0.0).to(tl.float32)
        tl.store(y_ptr + t * H + cols, acc.to(y_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def silu_mul_kernel(h_ptr, a_ptr, counts_ptr, M, inter, BLOCK: tl.constexpr):
        """``a = silu(gate) * up`` of row ``e*M + i`` of ``h`` if ``i < counts[e]``: the rows
        of the expert-major layout below each expert's count; with ``M`` >= the rows and one
        count, the rows below it (rows past the last routed slot are never read downstream:
        no traffic for them)."""
        row = tl.program_id(0).to(tl.int64)
        if row % M < tl.load(counts_ptr + row // M):
            cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
            m = cols < inter
            gate = tl.load(h_ptr + row * 2 * inter + cols, mask=m, other=0.0).to(tl.float32)
            up = tl.load(h_ptr + row * 2 * inter + inter + cols, mask=m, other=0.0)
            act = gate / (1.0 + tl.exp(-gate)) * up.to(tl.float32)
            tl.store(a_ptr + row * inter + cols, act.to(a_ptr.dtype.element_ty), mask=m)

    kernels = {"slot_key": slot_key_kernel, "gather_sorted": gather_sorted_kernel,
               "wgs": wgs_kernel, "silu_mul": silu_mul_kernel}
    return triton, kernels


def _grouped_triton(x, ids, weights, w13, w2) -> torch.Tensor:
    """The grouped algorithm with Triton kernels around torch's sort and grouped GEMMs.

    Per call: slot keys (1 kernel), a stable sort of the narrow keys (CUB), expert offsets (2),
    the gather of the routed rows in sorted order with the inverse permutation (1, rows of
    slots on other ranks are not copied), gate/up grouped GEMM (2 launches: its argument setup
    and the GEMM), SiLU-and-multiply (1), down grouped GEMM (2), weighted gather-sum (1).
    """
    triton, kern = _triton_kernel()
    n, k = ids.shape
    e, hidden, inter = w13.shape[0], x.shape[1], w2.shape[2]
    ids = ids.contiguous()
    weights = weights.contiguous()
    if x.stride(1) != 1:
        x = x.contiguous()
    nk = n * k
    key = torch.empty(nk, dtype=_narrow_key_dtype(e), device=x.device)
    kern["slot_key"][(triton.cdiv(nk, 1024),)](ids, key, nk, e, BLOCK=1024)
    sorted_keys, order = torch.sort(key, stable=True)
    offs = _expert_offsets(sorted_keys, e)
    xs = torch.empty(nk, hidden, dtype=x.dtype, device=x.device)
    pos = torch.empty(nk, dtype=torch.int32, device=x.device)
    block_h = min(1024, triton.next_power_of_2(hidden))
    kern["gather_sorted"][(nk, triton.cdiv(hidden, block_h))](
        x, order, sorted_keys, xs, pos, hidden, e, x.stride(0), K=k, BLOCK_H=block_h)
    h = torch._grouped_mm(xs, w13.transpose(-2, -1), offs=offs)
    act = torch.empty(nk, inter, dtype=h.dtype, device=h.device)
    block = min(1024, triton.next_power_of_2(inter))
    kern["silu_mul"][(nk, triton.cdiv(inter, block))](h, act, offs[-1:], nk, inter,
                                                        BLOCK=block)
    o = torch._grouped_mm(act, w2.transpose(-2, -1), offs=offs)
    return gather_sum(o, pos, ids, weights, x, e)


def gather_sum(o: torch.Tensor, pos: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
               x: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``y [N, H]`` (``x``'s shape and dtype, row-major whatever ``x``'s strides): ``y[n] =
    sum_k weights[n, k] * o[pos[n*K + k]]`` over the local slots (``0 <= ids < num_experts``;
    the other slots' ``pos`` are never read), fp32 accumulation, by the Triton ``wgs`` kernel;
    it writes every row (zeros without a slot)."""
    triton, kern = _triton_kernel()
    n, k = ids.shape
    hidden = x.shape[1]
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    block_h = min(1024, triton.next_power_of_2(hidden))
    kern["wgs"][(n, triton.cdiv(hidden, block_h))](o, pos, ids.contiguous(), weights.contiguous(),
                                                   y, hidden, num_experts, K=k, BLOCK_H=block_h)
    return y


def _grouped_fused(x, ids, weights, w13, w2,
                   config: fused_moe.FusedConfig | None = None) -> torch.Tensor:
    """The grouped algorithm by the fused kernels (:mod:`dbo_compile.ops.fused_moe`: align,
    gate/up + SiLU, down) and the weighted gather-sum; ``grouped_experts``' contract."""
    if ids.shape[0] == 0:
        return torch.zeros_like(x)
    o, pos = fused_moe.expert_outputs(x, ids, w13, w2, config)
    return gather_sum(o, pos, ids, weights, x, w13.shape[0])


#: without a measurement (a call first seen inside a CUDA-graph capture): the fused path up to
#: this many slots. One H200 (``benchmarks/bench_experts.py``, 2026-12-01): the fused path won
#: up to 3,072 local slots and lost from 4,096 in every shape (V2-Lite EP 1 and emulated EP 8,
#: V3 emulated EP 8); ``N*K`` >= the local slots, so this errs towards the sorted path
STATIC_FUSED_SLOTS = 3072
#: the ``torch`` backend's ``path`` option (``experts_backend_options={"path": ...}``):
#: ``auto`` (measure once per shape), ``fused``, ``sorted``
EXPERTS_PATHS = ("auto", "fused", "sorted")
#: per call shape (device, dtype, x, ids, w13, w2 shapes): the measured µs of both paths
_PATH_TIMES: dict[tuple, dict[str, float]] = {}


def _prefer_fused(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                  w13: torch.Tensor, w2: torch.Tensor, path: str = "auto") -> bool:
    """Whether this call takes the fused path: within ``fused_moe.supports``, and (``path=
    "auto"``) faster; ``"fused"`` takes it wherever it serves, ``"sorted"`` never.

    Which path is faster depends on the local rows per expert, which only the data has (the
    fused path wins at a few dozen rows per expert, the sorted path's CUTLASS grouped GEMM at
    hundreds). So the first call of each shape outside a CUDA-graph capture (the runner's
    warm-up, an eager step) times both paths on its own inputs (each captured in a CUDA graph
    and replayed; :func:`experts_path_choices` keeps the figures) and the choice is kept for
    the shape; a shape first seen inside a capture gets the static rule (``ids.numel() <=
    STATIC_FUSED_SLOTS``). The measurement synchronises with the host once per shape, outside
    any capture (as Triton's autotuner does at a kernel's first call).
    """
    if path == "sorted" or not fused_moe.supports(x, ids, w13, w2):
        return False
    if path == "fused":
        return True
    key = (x.device, x.dtype, tuple(x.shape), tuple(ids.shape), tuple(w13.shape),
           tuple(w2.shape))
    times = _PATH_TIMES.get(key)
    if times is None:
        if not x.is_cuda or torch.cuda.is_current_stream_capturing():
            return ids.numel() <= STATIC_FUSED_SLOTS
        times = _PATH_TIMES[key] = _path_times(x, ids, weights, w13, w2)
    return times["fused_us"] < times["sorted_us"]


def _path_times(x, ids, weights, w13, w2, reps: int = 5) -> dict[str, float]:
    """``{"fused_us", "sorted_us"}``: both paths timed as the step runs them, in a CUDA graph
    (``reps`` calls captured, the median of 3 replays; the first call, outside the capture,
    compiles the Triton kernels): eager timing would charge the sorted path's 14 host
    launches, which a graph replay does not pay."""

    def timed(fn) -> float:
        return graph_median_us(fn, 3, reps=reps)[0]

    return {"fused_us": timed(lambda: _grouped_fused(x, ids, weights, w13, w2)),
            "sorted_us": timed(lambda: _grouped_triton(x, ids, weights, w13, w2))}


def experts_path_choices() -> dict[str, dict[str, float]]:
    """The shapes measured so far in this process: ``"x [N, H] <dtype> ids [N, K] w13 [E, 2I,
    H]"`` -> ``{"fused_us", "sorted_us"}`` (µs per call in a CUDA graph, rounded to 0.1)."""
    return {f"x {list(a)} {str(t).removeprefix('torch.')} ids {list(b)} w13 {list(c)}":
            {k: round(v, 1) for k, v in times.items()}
            for (_, t, a, b, c, _), times in _PATH_TIMES.items()}


def _grouped_cuda(x, ids, weights, w13, w2, path: str = "auto") -> torch.Tensor:
    if _triton_kernel() is None:  # without Triton: the same algorithm with torch ops
        return grouped_reference(x, ids, weights, w13, w2)
    if ids.shape[0] == 0:
        return torch.zeros_like(x)
    if _prefer_fused(x, ids, weights, w13, w2, path):  # small calls: 4 kernels, not 14
        return _grouped_fused(x, ids, weights, w13, w2)
    return _grouped_triton(x, ids, weights, w13, w2)


def _grouped_torch(x, ids, weights, w13, w2, fn: ExpertFn = PLAIN,
                   path: str = "auto") -> torch.Tensor:
    """The ``"torch"`` experts backend: the grouped algorithm where it has fused kernels, the
    reference loop elsewhere (see the module docstring); ``path``: its option (``auto``,
    ``fused``, ``sorted``: the CUDA path of rank-major SwiGLU calls, :func:`_prefer_fused`)."""
    if not _grouped_ok(x, w13, w2):
        return experts_loop(x, ids, weights, w13, w2, fn)
    if x.dim() == 3 or not fn.plain:
        return grouped_reference(x, ids, weights, w13, w2, fn)
    return _grouped_cuda(x, ids, weights, w13, w2, path)


def _configure_torch(path: str = "auto", **unknown: Any) -> ExpertsBackend:
    """The ``torch`` backend with its options (``experts_backend_options={"path": "fused"}``:
    spec ``"torch:path=fused"``).

    Raises:
        ExpertsOpError: an unknown option, or ``path`` not one of :data:`EXPERTS_PATHS`.
    """
    if unknown:
        raise ExpertsOpError(f"experts backend 'torch': unknown option(s) {sorted(unknown)}; "
                             f"it takes path (one of {', '.join(EXPERTS_PATHS)})")
    _check_torch_options(path)
    return _torch_backend(path)


def _check_torch_options(path: str = "auto") -> None:
    if path not in EXPERTS_PATHS:
        raise ExpertsOpError(f"experts backend 'torch': path={path!r}; expected one of "
                             f"{', '.join(EXPERTS_PATHS)}")


def _torch_backend(path: str = "auto") -> ExpertsBackend:
    return ExpertsBackend(
        "torch", functools.partial(_grouped_torch, path=path),
        "torch._grouped_mm or fused Triton grouped GEMMs on CUDA (bf16, sm90+), a loop elsewhere"
        + ("" if path == "auto" else f"; path={path}"), configure=_configure_torch,
        check_options=_check_torch_options)


@dataclasses.dataclass(frozen=True)
class ExpertsBackend:
    """One implementation of ``dbo.grouped_experts`` (same signature and semantics).

    Attributes:
        name: registry key (``"torch"``, ``"deep_gemm"``, ...).
        run: ``(x, ids, weights, w13, w2) -> y``, and ``fn=`` (:class:`ExpertFn`) when the
            call has another activation or biases.
        description: one line for logs and errors.
        configure: ``configure(**options) -> ExpertsBackend`` (its package checked; raises
            ``ExpertsOpError`` naming what is missing and the fallback); ``None``: no options.
        supports: ``supports(facts) -> reason | None``: why it cannot serve a call with these
            facts (``layout``, ``dtype``, ``device``, ``activation``, ``bias``, ``hidden``,
            ``intermediate``, ``num_experts``); asked by the compiler before binding it.
        check_options: ``check_options(**options)``: raises ``ExpertsOpError`` for a bad
            option value without importing the package the backend wraps; its keyword
            parameters are the options the backend takes (as ``CommBackend.check_options``).
    """

    name: str
    run: Callable[..., torch.Tensor]
    description: str = ""
    configure: Callable[..., "ExpertsBackend"] | None = None
    supports: Callable[[dict], str | None] | None = None
    check_options: Callable[..., None] | None = None


_REGISTRY: BackendRegistry[ExpertsBackend] = BackendRegistry("experts backend", ExpertsOpError,
                                                            fallback="torch")


def register_experts_backend(backend: ExpertsBackend) -> None:
    """Register (or replace) an experts backend under ``backend.name``."""
    _REGISTRY.register(backend.name, backend)


def register_lazy_experts_backend(name: str, module: str) -> None:
    """Register a backend whose module is imported only when it is asked for."""
    _REGISTRY.register_lazy(name, module)


def available_experts_backends() -> list[str]:
    """Names of the registered experts backends (loaded or lazy), sorted."""
    return _REGISTRY.names()


def get_experts_backend(name: str) -> ExpertsBackend:
    """The experts backend of the spec ``name`` (``""``: ``"torch"``; ``"deep_gemm:fp8=true"``),
    importing its module if lazy, configured with the spec's options.

    Raises:
        ExpertsOpError: ``name`` is unknown, its module (or the package it wraps) cannot be
            imported, or an option is unknown or bad.
    """
    return _REGISTRY.get(name or "torch")


def experts_options_for(names: Any, options: Any) -> dict[str, dict[str, Any]]:
    """``options`` dealt to the experts backends ``names``, each value checked by the backend
    that takes it, whether its package imports or not (as :func:`~dbo_compile.ops.comm.
    comm_options_for`).

    Raises:
        ExpertsOpError: an unknown backend, an option none of them takes, or a bad value.
    """
    return _REGISTRY.options_for(names, options)


def clear_configured_experts_backends() -> None:
    """Forget configured backends (rebuilt when next asked for; tests swapping ``deep_gemm``)."""
    _REGISTRY.clear_configured()


register_experts_backend(_torch_backend())
register_lazy_experts_backend("deep_gemm", "dbo_compile.ops.deep_gemm")


@torch.library.custom_op("dbo::grouped_experts", mutates_args=())
def grouped_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                    w13: torch.Tensor, w2: torch.Tensor, backend: str = "",
                    activation: str = "silu", b13: torch.Tensor | None = None,
                    b2: torch.Tensor | None = None, alpha: float = 1.702,
                    limit: float = 7.0) -> torch.Tensor:
    """See the module docstring; ``backend``: the experts backend (:func:`get_experts_backend`,
    ``""``: ``"torch"``), bound by the compiler from ``DboConfig.experts_backend``.

    Raises:
        ExpertsOpError: bad shapes or dtypes, or an unknown backend.
    """
    fn = ExpertFn(activation, b13, b2, alpha, limit)
    _check(x, ids, weights, w13, w2, fn)
    impl = get_experts_backend(backend)
    if fn.plain:
        return impl.run(x, ids, weights, w13, w2)
    return impl.run(x, ids, weights, w13, w2, fn=fn)


def _grouped_ok(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """The grouped path: CUDA, bf16, sm90+, dims multiples of 8. torch._grouped_mm has a
    fused kernel only there; its fallback reads the expert offsets on the host (a sync that
    breaks CUDA-graph capture), so anything else runs the loop."""
    if x.device.type != "cuda" or x.dtype != torch.bfloat16 or not hasattr(torch, "_grouped_mm"):
        return False
    if w13.dtype != torch.bfloat16 or w2.dtype != torch.bfloat16:
        return False
    if torch.cuda.get_device_capability(x.device)[0] < 9:
        return False
    return x.shape[-1] % 8 == 0 and w2.shape[2] % 8 == 0


@grouped_experts.register_fake
def _(x, ids, weights, w13, w2, backend="", activation="silu", b13=None, b2=None, alpha=1.702,
      limit=7.0):
    _check(x, ids, weights, w13, w2, ExpertFn(activation, b13, b2, alpha, limit))
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


def _grouped_experts_flops(node: fx.Node, size) -> float:
    """SwiGLU (3 GEMMs of I x H) on the slots routed to this rank: ``N*K / W`` of them
    (expert-major rows: the ``T*K`` slots the dispatch sent, as many arrive on average)."""
    x, ids, _w, _w13, w2 = (a.meta.get("val") if isinstance(a, fx.Node) else a for a in node.args[:5])
    hidden, inter = size(x.shape[-1]), size(w2.shape[2])
    if x.dim() == 3:
        src = node.args[0].args[0] if isinstance(node.args[0], fx.Node) and node.args[0].args else None
        sent = src.args[1].meta.get("val") if isinstance(src, fx.Node) and src.args and isinstance(
            src.args[1], fx.Node) else None
        slots = size(sent.shape[0]) * size(sent.shape[1]) if sent is not None else size(x.shape[1])
        return 6.0 * slots * inter * hidden
    rows, k = (size(s) for s in ids.shape)
    return 6.0 * rows * k * inter * hidden / ep_size_of_rows(node.args[0])


register_op(OpInfo(
    torch.ops.dbo.grouped_experts.default,
    token_args=((0, "x"), (1, "ids"), (2, "weights")),
    row_local=True,
    # in decode the grouped GEMM is bound by reading the expert weights: one call on both
    # ubatches' rows reads them once (dbo_compile.passes.join_experts)
    joinable=True, flops=_grouped_experts_flops, backend="experts"))
