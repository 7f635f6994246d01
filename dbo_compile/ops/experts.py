"""``dbo::grouped_experts``: the local routed experts of an EP rank as one row-local op.

``torch.ops.dbo.grouped_experts(x, ids, weights, w13, w2) -> y``

- ``x [N, H]`` (bf16/fp16/fp32): the rows the dispatch delivered (N = W * T static capacity).
- ``ids [N, K]`` int64: local expert id per slot in ``[-1, E_local)``, ``-1`` = the slot's
  expert is not on this rank (not checked on the device: larger ids are undefined behaviour).
- ``weights [N, K]`` fp32: routing weight per slot.
- ``w13 [E_local, 2I, H]`` (gate and up projections stacked), ``w2 [E_local, H, I]``.
- returns ``y [N, H]`` in ``x.dtype``: ``y[n] = sum_k weights[n, k] * SwiGLU_{ids[n, k]}(x[n])``,
  accumulated in fp32; rows with no local slot are zeros.

Row ``n`` of ``y`` depends only on row ``n`` of ``x``/``ids``/``weights``, so the op is declared
row-local along the token dim (the split pass may cut it anywhere).

Kernels:

- CUDA (static shapes, no host sync, CUDA-graph capturable): narrow expert keys per slot
  (slots not on this rank sort last), a stable sort of the keys, the expert offsets by binary
  search over the sorted keys, a Triton gather of the routed rows in sorted order (rows of
  slots on other ranks are not copied) that also writes the inverse permutation, two
  ``torch._grouped_mm`` calls (the grouped GEMM of the field: one launch for all local experts,
  rows past the last expert's offset are not computed) with a Triton SiLU-and-multiply between
  them (rows past the last routed slot skipped), then a weighted gather-sum back to rows — a
  Triton kernel that reads each local slot's output row once and writes ``y`` once. 10 kernel
  launches besides the sort's (without Triton: the same algorithm in torch ops).
- CPU, other dtypes than bf16, GPUs before sm90 (where ``torch._grouped_mm`` has no fused
  kernel and its fallback syncs with the host): the reference per-expert loop (every expert on
  every row, masked), exact and capturable; :func:`grouped_reference` runs the CUDA algorithm with torch ops on any device
  for tests.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import torch
import torch.fx as fx
import torch.nn.functional as F

from dbo_compile.errors import ExpertsOpError
from dbo_compile.ops._triton import import_triton
from dbo_compile.ops.comm import ep_size_of_rows
from dbo_compile.ops.registry import BackendRegistry, OpInfo, register_op

__all__ = ["ExpertsBackend", "ExpertsOpError", "available_experts_backends", "experts_loop",
           "get_experts_backend", "grouped_experts", "grouped_reference",
           "register_experts_backend", "register_lazy_experts_backend"]


def _check(x, ids, weights, w13, w2) -> None:
    if x.dim() != 2 or ids.dim() != 2 or weights.shape != ids.shape or ids.shape[0] != x.shape[0]:
        raise ExpertsOpError(
            f"dbo.grouped_experts: expected x [N, H], ids/weights [N, K]; got x {tuple(x.shape)}, "
            f"ids {tuple(ids.shape)}, weights {tuple(weights.shape)}")
    if ids.dtype != torch.int64 or weights.dtype != torch.float32:
        raise ExpertsOpError(f"dbo.grouped_experts: ids must be int64 and weights float32, got "
                             f"{ids.dtype} / {weights.dtype}")
    if (w13.dim() != 3 or w2.dim() != 3 or w13.shape[0] != w2.shape[0]
            or w13.shape[2] != x.shape[1] or w2.shape[1] != x.shape[1]
            or w13.shape[1] != 2 * w2.shape[2]):
        raise ExpertsOpError(
            f"dbo.grouped_experts: expected w13 [E, 2I, H] and w2 [E, H, I] with H = "
            f"{x.shape[1]}; got {tuple(w13.shape)} and {tuple(w2.shape)}")


def experts_loop(x, ids, weights, w13, w2) -> torch.Tensor:
    """Reference: every local expert on every row, weighted by the row's slots for it."""
    y = torch.zeros_like(x, dtype=torch.float32)
    for e in range(w13.shape[0]):
        mine = ids == e
        # weights of other experts' slots and outputs of rows without a slot of e never enter
        # the sum (as in the grouped path), even when they are inf / NaN
        w_e = torch.where(mine, weights, 0.0).sum(dim=-1, keepdim=True)  # [N, 1] fp32
        gate, up = F.linear(x, w13[e]).chunk(2, dim=-1)
        out = F.linear(F.silu(gate) * up, w2[e]).to(torch.float32)
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


def _sorted_slots(ids: torch.Tensor, num_experts: int):
    """Slots sorted by expert: ``(order, rows, offs, valid)``; slots with id < 0 sort last."""
    flat = ids.reshape(-1)
    valid = flat >= 0
    key = torch.where(valid, flat, num_experts).to(_narrow_key_dtype(num_experts))
    sorted_keys, order = torch.sort(key, stable=True)
    offs = _expert_offsets(sorted_keys, num_experts)
    rows = torch.div(order, ids.shape[1], rounding_mode="floor")
    return order, rows, offs, valid


def _gate_up(x, rows, offs, w13) -> torch.Tensor:
    """Per sorted slot, its expert's gate and up projections ``[N*K, 2I]`` (rows past
    ``offs[-1]`` are not computed and hold garbage)."""
    return torch._grouped_mm(x.index_select(0, rows), w13.transpose(-2, -1), offs=offs)


def _expert_outputs(x, rows, offs, w13, w2) -> torch.Tensor:
    """Per sorted slot, the SwiGLU output of its expert: ``[N*K, H]`` (rows past ``offs[-1]``
    are not computed and hold garbage)."""
    h = _gate_up(x, rows, offs, w13)
    inter = w2.shape[2]
    a = F.silu(h[:, :inter]) * h[:, inter:]
    return torch._grouped_mm(a, w2.transpose(-2, -1), offs=offs)


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


def grouped_reference(x, ids, weights, w13, w2) -> torch.Tensor:
    """The CUDA algorithm (sort, grouped GEMM, weighted gather-sum) with torch ops only."""
    _check(x, ids, weights, w13, w2)
    n, k = ids.shape
    if n == 0:
        return torch.zeros_like(x)
    order, rows, offs, valid = _sorted_slots(ids, w13.shape[0])
    o = _expert_outputs(x, rows, offs, w13, w2)
    pos, w = _slot_positions(order, valid, weights)
    return _weighted_gather_sum_torch(o, pos.view(n, k), w.view(n, k), valid, x.dtype)


@functools.cache
def _triton_kernel():
    mods = import_triton()
    if mods is None:
        return None
    triton, tl = mods

    @triton.jit
    def slot_key_kernel(ids_ptr, key_ptr, n, E, BLOCK: tl.constexpr):
        """``key = ids`` as a narrow int, slots not on this rank (id < 0) -> ``E`` (sort last)."""
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        i = tl.load(ids_ptr + offs, mask=m, other=0)
        tl.store(key_ptr + offs, tl.where(i >= 0, i, E).to(key_ptr.dtype.element_ty), mask=m)

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
    def wgs_kernel(o_ptr, pos_ptr, ids_ptr, w_ptr, y_ptr, H, K: tl.constexpr,
                   BLOCK_H: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)  # t * H overflows int32 past 2**31 elements
        cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        m = cols < H
        acc = tl.zeros([BLOCK_H], dtype=tl.float32)
        for j in tl.static_range(K):
            if tl.load(ids_ptr + t * K + j) >= 0:  # slots on another rank: rows never read
                w = tl.load(w_ptr + t * K + j)
                p = tl.load(pos_ptr + t * K + j).to(tl.int64)
                acc += w * tl.load(o_ptr + p * H + cols, mask=m, other=0.0).to(tl.float32)
        tl.store(y_ptr + t * H + cols, acc.to(y_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def silu_mul_kernel(h_ptr, a_ptr, n_valid_ptr, inter, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        # rows past the last routed slot are never read downstream: no traffic for them
        if row < tl.load(n_valid_ptr):
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
    kern["silu_mul"][(nk, triton.cdiv(inter, block))](h, act, offs[-1:], inter, BLOCK=block)
    o = torch._grouped_mm(act, w2.transpose(-2, -1), offs=offs)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # row-major, whatever x's strides
    kern["wgs"][(n, triton.cdiv(hidden, block_h))](o, pos, ids, weights, y, hidden, K=k,
                                                   BLOCK_H=block_h)
    return y


def _grouped_cuda(x, ids, weights, w13, w2) -> torch.Tensor:
    if _triton_kernel() is None:  # without Triton: the same algorithm with torch ops
        return grouped_reference(x, ids, weights, w13, w2)
    if ids.shape[0] == 0:
        return torch.zeros_like(x)
    return _grouped_triton(x, ids, weights, w13, w2)


def _grouped_torch(x, ids, weights, w13, w2) -> torch.Tensor:
    """The ``"torch"`` experts backend: the grouped algorithm where it has fused kernels, the
    reference loop elsewhere (see the module docstring)."""
    if _grouped_ok(x, w13, w2):
        return _grouped_cuda(x, ids, weights, w13, w2)
    return experts_loop(x, ids, weights, w13, w2)


@dataclasses.dataclass(frozen=True)
class ExpertsBackend:
    """One implementation of ``dbo.grouped_experts`` (same signature and semantics).

    Attributes:
        name: registry key (``"torch"``, ``"deep_gemm"``, ...).
        run: ``(x, ids, weights, w13, w2) -> y``.
        description: one line for logs and errors.
    """

    name: str
    run: Callable[..., torch.Tensor]
    description: str = ""


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
    """The experts backend ``name`` (``""``: ``"torch"``), importing its module if lazy.

    Raises:
        ExpertsOpError: ``name`` is unknown, or its module cannot be imported.
    """
    return _REGISTRY.get(name or "torch")


register_experts_backend(ExpertsBackend(
    "torch", _grouped_torch, "torch._grouped_mm + Triton on CUDA (bf16, sm90+), a loop elsewhere"))


@torch.library.custom_op("dbo::grouped_experts", mutates_args=())
def grouped_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                    w13: torch.Tensor, w2: torch.Tensor, backend: str = "") -> torch.Tensor:
    """See the module docstring; ``backend``: the experts backend (:func:`get_experts_backend`,
    ``""``: ``"torch"``), bound by the compiler from ``DboConfig.experts_backend``.

    Raises:
        ExpertsOpError: bad shapes or dtypes, or an unknown backend.
    """
    _check(x, ids, weights, w13, w2)
    return get_experts_backend(backend).run(x, ids, weights, w13, w2)


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
    return x.shape[1] % 8 == 0 and w2.shape[2] % 8 == 0


@grouped_experts.register_fake
def _(x, ids, weights, w13, w2, backend=""):
    _check(x, ids, weights, w13, w2)
    return torch.empty_like(x)


def _grouped_experts_flops(node: fx.Node, size) -> float:
    """SwiGLU (3 GEMMs of I x H) on the slots routed to this rank: ``N*K / W`` of them."""
    x, ids, _w, _w13, w2 = (a.meta.get("val") if isinstance(a, fx.Node) else a for a in node.args[:5])
    rows, k = (size(s) for s in ids.shape)
    hidden, inter = size(x.shape[1]), size(w2.shape[2])
    return 6.0 * rows * k * inter * hidden / ep_size_of_rows(node.args[0])


register_op(OpInfo(
    torch.ops.dbo.grouped_experts.default,
    token_args=((0, "x"), (1, "ids"), (2, "weights")),
    row_local=True,
    # in decode the grouped GEMM is bound by reading the expert weights: one call on both
    # ubatches' rows reads them once (dbo_compile.passes.join_experts)
    joinable=True, flops=_grouped_experts_flops, backend="experts"))
