"""Analytical cost of a node: a roofline over FLOPs and bytes, plus a launch cost, optionally
calibrated by measurement.

Sizes are evaluated at a reference token count (``DboConfig.cost_model_tokens`` per rank,
divided evenly over the ubatches), so the estimate, and the schedule derived from it, depend on
(graph, config) only: every rank computes the same schedule (``docs/design.md``, invariant 2).
FLOPs: ATen matmuls by rule here, our ops by the formula of their registry record
(:mod:`dbo_compile.ops.registry`).

Units: µs. Figures: ``peak_tflops`` and ``hbm_gbps`` for compute, ``link_gbps`` and
``comm_latency_us`` for dispatch/combine (bytes sent + received, or, for a backend that
declares ``comm_bytes`` such as the emulated one, the bytes it sends per direction).

**Calibrated** (``DboConfig.calibration``: a JSON file that ``benchmarks/calibrate.py``
fits to stage times measured on a machine): every compute node belongs to a class
(:func:`node_class`: ``gemm`` dense matmuls, ``experts`` the routed experts op, ``attention``,
``other`` element-wise / reductions / copies) and costs, with its class's fitted figures
(:class:`Figures`)::

    t = launch_us + max(flops / tflops, bytes / gbps) + rows * us_per_row

``bytes`` there leaves out inputs an op writes in place (the KV cache: an attention kernel reads
the context it needs, not the whole cache), ``rows`` is the node's dim 0 at the reference
count. The comm ops keep the config's link figures (the candidates' link divisors act on them).
:func:`node_features` gives the inputs of the formula, so that a fit (and a prediction at
another token count) needs no graph.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import sympy
import torch
import torch.fx as fx

from dbo_compile.config import DboConfig
from dbo_compile.errors import DboConfigError
from dbo_compile.ops.comm import comm_backend_of
from dbo_compile.ops.registry import comm_kind, is_getitem, op_info
from dbo_compile.passes.meta import dbo_meta

__all__ = ["CLASSES", "DEFAULT_DEVICE_SMS", "CostModel", "Figures", "hold_fraction", "node_class",
           "predict_us"]

_FREE = {"view", "_unsafe_view", "reshape", "unsqueeze", "squeeze", "expand", "t", "permute",
         "transpose", "alias", "detach", "slice", "select", "split", "split_with_sizes",
         "sym_size", "sym_numel", "_reshape_alias", "as_strided", "unbind", "chunk"}
_GEMMS = ("mm", "addmm", "bmm", "baddbmm", "_grouped_mm")
#: the node classes of the calibrated model, and ``comm``; ``fused``: a run of ``other`` nodes
#: as Inductor fuses them (``passes/calibrate.py``: ``fuse_runs``), which a per-node estimate
#: never meets (a calibration with ``"fusion": "runs"`` leaves ``other`` nodes to the roofline)
CLASSES = ("gemm", "experts", "attention", "other", "fused", "comm")
#: the SM count of the hold model where ``DboConfig.device_sms`` is unset (H100 / H200 SXM)
DEFAULT_DEVICE_SMS = 132


def hold_fraction(config: DboConfig) -> float:
    """The share of the device's SMs each transfer of the comm backend holds while it lasts:
    the comm backend option ``hold_sms`` (the emulated backend's; DeepEP's normal-mode kernels
    hold 20-24 SMs, :mod:`dbo_compile.ops.emulated.hold`) over ``device_sms`` (unset:
    :data:`DEFAULT_DEVICE_SMS`); 0 without ``hold_sms``. The scheduler's timeline slows the
    compute beside a transfer by it (:class:`~dbo_compile.schedule.Timeline`).

    Raises:
        DboConfigError: ``hold_sms`` is not below the device's SMs (nothing would be left
            to compute on).
    """
    held = dict(config.comm_backend_options).get("hold_sms") or 0
    if not held or isinstance(held, bool) or not isinstance(held, int) or held < 0:
        return 0.0  # none, or a value the backend refuses at bind time (CommBackendError)
    sms = config.device_sms if config.device_sms is not None else DEFAULT_DEVICE_SMS
    if held >= sms:
        raise DboConfigError(f"comm_backend_options hold_sms={held} with device_sms={sms}: a "
                             f"transfer would hold every SM; hold fewer than {sms} SMs, or set "
                             "device_sms to this device's SM count")
    return held / sms


@dataclasses.dataclass(frozen=True)
class Figures:
    """The figures of one node class: ``t = launch_us + max(flops / tflops, bytes / gbps) +
    rows * us_per_row`` (µs; ``None`` drops the term)."""

    tflops: float | None = None
    gbps: float | None = None
    launch_us: float = 0.0
    us_per_row: float = 0.0

    def cost_us(self, flops: float, nbytes: float, rows: float) -> float:
        ft = flops / (self.tflops * 1e6) if self.tflops else 0.0
        bt = nbytes / (self.gbps * 1e3) if self.gbps else 0.0
        return self.launch_us + max(ft, bt) + rows * self.us_per_row


def predict_us(figures: dict[str, Figures], features: list[tuple[str, float, float, float]]
               ) -> float:
    """Sum of the calibrated costs of ``features`` (``(class, flops, bytes, rows)`` per node, as
    :meth:`CostModel.node_features` gives them)."""
    return sum(figures[c].cost_us(f, b, r) for c, f, b, r in features if c in figures)


def node_class(node: fx.Node) -> str | None:
    """The calibrated model's class of ``node`` (``None``: free, a view or bookkeeping)."""
    if node.op != "call_function" or is_getitem(node) or dbo_meta(node).get("phase") == "wait":
        return None
    if comm_kind(node) is not None:
        return "comm"
    name = getattr(node.target, "_opname", "")
    if name in _FREE:
        return None
    if name in _GEMMS:
        return "gemm"
    info = op_info(node.target)
    if info is not None and info.op is torch.ops.dbo.grouped_experts.default:
        return "experts"
    if info is not None and info.op is torch.ops.dbo.attention.default:
        return "attention"
    return "other"


class CostModel:
    """Estimate node costs in µs.

    Args:
        config: the hardware figures, the reference token count, and the calibration.
        token_symbols: symbols substituted by the reference per-ubatch counts.
        num_ubatches: the reference count per ubatch is ``cost_model_tokens // num_ubatches``.
    """

    def __init__(self, config: DboConfig, token_symbols: frozenset, num_ubatches: int):
        self.config = config
        tokens = max(1, config.cost_model_tokens // num_ubatches)
        self.subs = {s: tokens for s in token_symbols}
        self._values: dict[Any, int] = {}  # expr -> its value at the reference counts
        cal = config.calibration_data()
        self.figures: dict[str, Figures] | None = None
        if cal is not None:
            # compute classes only: the comm ops keep the config's link figures
            self.figures = {c: Figures(**v) for c, v in cal["figures"].items()
                            if c in CLASSES and c != "comm"}

    def _int(self, s: Any) -> int:
        if isinstance(s, torch.SymInt):
            expr = s.node.expr
            if expr in self._values:  # sympy's subs dominates a schedule's time: once per expr
                return self._values[expr]
            val = expr.subs(self.subs) if isinstance(expr, sympy.Basic) else expr
            try:
                self._values[expr] = int(val)
                return self._values[expr]
            except TypeError:  # an unknown symbol: fall back to the trace hint
                hint = s.node.hint
                return int(hint) if hint is not None else 1
        return int(s)

    def numel(self, t: torch.Tensor) -> int:
        return math.prod(self._int(s) for s in t.shape)

    def nbytes(self, val: Any) -> int:
        if isinstance(val, torch.Tensor):
            return self.numel(val) * val.element_size()
        if isinstance(val, (list, tuple)):
            return sum(self.nbytes(v) for v in val)
        return 0

    def flops(self, node: fx.Node) -> float:
        name = getattr(node.target, "_opname", "")
        vals = [a.meta.get("val") for a in node.all_input_nodes]
        out = node.meta.get("val")
        if name in _GEMMS and isinstance(out, torch.Tensor):
            mat = [v for v in vals if isinstance(v, torch.Tensor) and v.dim() >= 2]
            k = self._int(mat[0].shape[-1]) if mat else 1
            return 2.0 * self.numel(out) * k
        info = op_info(node.target)
        if info is not None and info.flops is not None and isinstance(out, torch.Tensor):
            return info.flops(node, self._int)
        return 0.0

    def comm_bytes(self, node: fx.Node) -> int:
        """Bytes the comm node moves per rank: its backend's ``moved_bytes`` where it declares
        one (DeepEP, the emulated link: the routed volume), else its results' bytes (the
        static-capacity rank-major layout)."""
        try:
            backend = comm_backend_of(node)
        except Exception:  # noqa: BLE001 - a cost estimate never fails the compile
            backend = None
        if backend is not None and backend.moved_bytes is not None:
            return backend.moved_bytes(comm_kind(node), node, self._int)
        return self.nbytes(node.meta.get("val"))

    def node_features(self, node: fx.Node) -> tuple[str, float, float, float] | None:
        """``(class, flops, bytes, rows)`` of ``node`` at the reference counts (the calibrated
        formula's inputs; ``None`` for a free node). Comm: ``bytes`` is what it moves over the
        link (:meth:`comm_bytes`), ``rows`` the kB of its inputs and results (the device-side
        packing)."""
        cls = node_class(node)
        if cls is None:
            return None
        out = node.meta.get("val")
        rows = float(self._int(out.shape[0])) if isinstance(out, torch.Tensor) and out.dim() else 0.0
        mutated = set(dbo_meta(node).get("mutates", []))
        moved = self.nbytes(out) + sum(self.nbytes(a.meta.get("val")) for a in node.all_input_nodes
                                       if a.name not in mutated)
        if cls == "comm":  # rows: the kB its backend packs and unpacks on the device
            return cls, 0.0, float(self.comm_bytes(node)), moved / 1e3
        return cls, self.flops(node), float(moved), rows

    def node_cost_us(self, node: fx.Node) -> float:
        """Estimated time of ``node`` alone, in µs (0 for views and bookkeeping)."""
        cfg = self.config
        if node.op != "call_function" or is_getitem(node) or dbo_meta(node).get("phase") == "wait":
            return 0.0
        kind = comm_kind(node)
        if kind is not None:
            return cfg.comm_latency_us + self.comm_bytes(node) / (cfg.link_gbps * 1e3)
        name = getattr(node.target, "_opname", "")
        if name in _FREE:
            return 0.0
        if self.figures is not None:
            cls, flops, nbytes, rows = self.node_features(node)
            if cls in self.figures:
                return self.figures[cls].cost_us(flops, nbytes, rows)
        moved = self.nbytes(node.meta.get("val")) + sum(
            self.nbytes(a.meta.get("val")) for a in node.all_input_nodes)
        flops = self.flops(node)
        return cfg.launch_us + max(flops / (cfg.peak_tflops * 1e6), moved / (cfg.hbm_gbps * 1e3))
