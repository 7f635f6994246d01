"""The kernels of ``dbo.grouped_experts`` (:mod:`dbo_compile.ops.experts`: the op, its
contract and its backends): the expert MLP, the argument check, the reference loop, the
grouped algorithm with torch ops and with Triton kernels around torch's grouped GEMM.

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
  once per shape at its first eager call (the path choice of :mod:`dbo_compile.ops.experts`;
  the backend's option ``path``: ``experts_backend="torch", experts_backend_options={"path":
  "fused"}``).
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

import torch
import torch.nn.functional as F

from dbo_compile.errors import ExpertsOpError
from dbo_compile.ops import fused_moe
from dbo_compile.ops._triton import triton_kernels

__all__ = ["ACTIVATIONS", "PLAIN", "ExpertFn", "check_experts_args", "expert_kernels",
           "expert_offsets", "experts_loop", "gather_sum", "grouped_fused", "grouped_reference",
           "grouped_triton", "sorted_slots", "weighted_gather_sum_torch"]

#: the experts' activations (:mod:`dbo_compile.ops.experts`)
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


def check_experts_args(x, ids, weights, w13, w2, fn: ExpertFn = PLAIN) -> None:
    """The shapes and dtypes of a ``dbo.grouped_experts`` call (:mod:`dbo_compile.ops.experts`:
    rank-major ``x [N, H]`` with ``ids`` / ``weights [N, K]`` int64 / fp32, or expert-major
    ``x [E_local, M, H]`` with ``ids [E_local]`` int32; ``w13 [E, 2I, H]``, ``w2 [E, H, I]``)
    and of ``fn``'s activation and biases. Reads shapes only (fake-tensor safe).

    Raises:
        ExpertsOpError: what does not match, with the shapes found.
    """
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


def expert_offsets(sorted_keys: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``offs[e]`` = number of slots of experts ``0..e``: ``[E]`` int32 from the sorted keys.

    One binary search per expert over the sorted keys (2 kernels) instead of a zeroed count
    buffer, a scatter-add and a cumulative sum (5 kernels).
    """
    experts = torch.arange(num_experts, dtype=sorted_keys.dtype, device=sorted_keys.device)
    return torch.searchsorted(sorted_keys, experts, right=True, out_int32=True)


def sorted_slots(ids: torch.Tensor, num_experts: int, with_keys: bool = False):
    """Slots sorted by expert: ``(order, rows, offs, valid)`` (and the sorted keys, the expert
    of each sorted slot, ``num_experts`` for slots not here); slots not local (id outside
    ``[0, num_experts)``, module docstring) sort last."""
    flat = ids.reshape(-1)
    valid = (flat >= 0) & (flat < num_experts)
    key = torch.where(valid, flat, num_experts).to(_narrow_key_dtype(num_experts))
    sorted_keys, order = torch.sort(key, stable=True)
    offs = expert_offsets(sorted_keys, num_experts)
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


def weighted_gather_sum_torch(o, pos, w, valid, out_dtype):
    n, k = pos.shape
    og = o.index_select(0, pos.reshape(-1)).view(n, k, -1)
    og = og.masked_fill(~valid.view(n, k, 1), 0)  # never multiply garbage rows (may be inf/nan)
    y = torch.bmm(w.view(n, 1, k).to(torch.float32), og.to(torch.float32))
    return y.view(n, -1).to(out_dtype)


def grouped_reference(x, ids, weights, w13, w2, fn: ExpertFn = PLAIN) -> torch.Tensor:
    """The CUDA algorithm (sort, grouped GEMM, weighted gather-sum) with torch ops only; for
    expert-major rows, :func:`_grouped_expert_major`."""
    check_experts_args(x, ids, weights, w13, w2, fn)
    if x.dim() == 3:
        return _grouped_expert_major(x, ids, w13, w2, fn)
    n, k = ids.shape
    if n == 0:
        return torch.zeros_like(x)
    if fn.plain:
        order, rows, offs, valid = sorted_slots(ids, w13.shape[0])
        o = _expert_outputs(x, rows, offs, w13, w2)
    else:
        order, rows, offs, valid, keys = sorted_slots(ids, w13.shape[0], with_keys=True)
        o = _expert_outputs(x, rows, offs, w13, w2, fn, keys)
    pos, w = _slot_positions(order, valid, weights)
    return weighted_gather_sum_torch(o, pos.view(n, k), w.view(n, k), valid, x.dtype)


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


@triton_kernels
def expert_kernels(triton, tl):

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


def grouped_triton(x, ids, weights, w13, w2) -> torch.Tensor:
    """The grouped algorithm with Triton kernels around torch's sort and grouped GEMMs.

    Per call: slot keys (1 kernel), a stable sort of the narrow keys (CUB), expert offsets (2),
    the gather of the routed rows in sorted order with the inverse permutation (1, rows of
    slots on other ranks are not copied), gate/up grouped GEMM (2 launches: its argument setup
    and the GEMM), SiLU-and-multiply (1), down grouped GEMM (2), weighted gather-sum (1).
    """
    triton, kern = expert_kernels()
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
    offs = expert_offsets(sorted_keys, e)
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
    triton, kern = expert_kernels()
    n, k = ids.shape
    hidden = x.shape[1]
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    block_h = min(1024, triton.next_power_of_2(hidden))
    kern["wgs"][(n, triton.cdiv(hidden, block_h))](o, pos, ids.contiguous(), weights.contiguous(),
                                                   y, hidden, num_experts, K=k, BLOCK_H=block_h)
    return y


def grouped_fused(x, ids, weights, w13, w2,
                   config: fused_moe.FusedConfig | None = None) -> torch.Tensor:
    """The grouped algorithm by the fused kernels (:mod:`dbo_compile.ops.fused_moe`: align,
    gate/up + SiLU, down) and the weighted gather-sum; ``grouped_experts``' contract."""
    if ids.shape[0] == 0:
        return torch.zeros_like(x)
    o, pos = fused_moe.expert_outputs(x, ids, w13, w2, config)
    return gather_sum(o, pos, ids, weights, x, w13.shape[0])
