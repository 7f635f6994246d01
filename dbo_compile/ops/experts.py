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

Kernels (:mod:`dbo_compile.ops.experts_kernels`): on CUDA (bf16, sm90+) the grouped
algorithm, sorted (``torch._grouped_mm``) or fused (:mod:`dbo_compile.ops.fused_moe`) per
shape as measured once at its first eager call (:func:`_prefer_fused`; the backend's option
``path``: ``experts_backend="torch", experts_backend_options={"path": "fused"}``);
elsewhere the reference per-expert loop.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import torch
import torch.fx as fx

from dbo_compile.errors import ExpertsOpError
from dbo_compile.ops import fused_moe
from dbo_compile.ops.comm import ep_size_of_rows
from dbo_compile.ops.experts_kernels import (
    ACTIVATIONS,
    PLAIN,
    ExpertFn,
    check_experts_args,
    expert_kernels,
    experts_loop,
    gather_sum,
    grouped_fused,
    grouped_reference,
    grouped_triton,
)
from dbo_compile.ops.backends import AutoPreference, BackendRegistry
from dbo_compile.ops.registry import OpInfo, register_op
from dbo_compile.timing import graph_median_us

__all__ = ["ACTIVATIONS", "EXPERTS_PATHS", "ExpertFn", "ExpertsBackend", "ExpertsOpError",
           "available_experts_backends", "check_experts_args", "experts_loop",
           "auto_experts_choices", "experts_options_for", "experts_path_choices",
           "experts_record", "gather_sum", "get_experts_backend",
           "grouped_experts", "grouped_fused", "grouped_reference", "grouped_triton",
           "register_experts_backend", "register_lazy_experts_backend"]

#: the two CUDA paths of rank-major SwiGLU calls, by the names the path choice uses
_grouped_fused, _grouped_triton = grouped_fused, grouped_triton


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
    if expert_kernels() is None:  # without Triton: the same algorithm with torch ops
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
        check_options=_check_torch_options, auto=AutoPreference(1, op_default=True))


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
        auto: where ``experts_backend="auto"`` picks it
            (:class:`~dbo_compile.ops.backends.AutoPreference`); ``None``: only by name.
    """

    name: str
    run: Callable[..., torch.Tensor]
    description: str = ""
    configure: Callable[..., "ExpertsBackend"] | None = None
    supports: Callable[[dict], str | None] | None = None
    check_options: Callable[..., None] | None = None
    auto: AutoPreference | None = None


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


def experts_record(name: str) -> ExpertsBackend:
    """The registered record of the experts backend ``name`` (not configured), importing its
    module first if it is lazy.

    Raises:
        ExpertsOpError: ``name`` is unknown or its module cannot be imported.
    """
    return _REGISTRY.record(name)


def auto_experts_choices() -> list[tuple[str, AutoPreference]]:
    """``(name, AutoPreference)`` of the experts backends ``experts_backend="auto"`` may
    choose, in the order it tries them.

    Raises:
        ExpertsOpError: a lazy backend's module cannot be imported.
    """
    return _REGISTRY.auto_choices()


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
    check_experts_args(x, ids, weights, w13, w2, fn)
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
    check_experts_args(x, ids, weights, w13, w2, ExpertFn(activation, b13, b2, alpha, limit))
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
