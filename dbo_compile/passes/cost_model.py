"""Analytical cost of a node: a roofline over FLOPs and bytes, plus a launch cost.

Sizes are evaluated at a reference token count (``DboConfig.cost_model_tokens`` per rank,
divided evenly over the ubatches), so the estimate, and the schedule derived from it, depend on
(graph, config) only: every rank computes the same schedule (``docs/design.md``, invariant 2).
FLOPs: ATen matmuls by rule here, our ops by the formula of their registry record
(:mod:`dbo_compile.ops.registry`).

Units: µs. Figures: ``peak_tflops`` and ``hbm_gbps`` for compute, ``link_gbps`` and
``comm_latency_us`` for dispatch/combine (per rank, bytes sent + received).
"""

from __future__ import annotations

import math
from typing import Any

import sympy
import torch
import torch.fx as fx

from dbo_compile.config import DboConfig
from dbo_compile.ops.comm import comm_backend_of
from dbo_compile.ops.registry import comm_kind, is_getitem, op_info
from dbo_compile.passes.meta import dbo_meta

_FREE = {"view", "_unsafe_view", "reshape", "unsqueeze", "squeeze", "expand", "t", "permute",
         "transpose", "alias", "detach", "slice", "select", "split", "split_with_sizes",
         "sym_size", "sym_numel", "_reshape_alias", "as_strided", "unbind", "chunk"}


class CostModel:
    """Estimate node costs in µs.

    Args:
        config: the hardware figures and the reference token count.
        token_symbols: symbols substituted by the reference per-ubatch counts.
        num_ubatches: the reference count per ubatch is ``cost_model_tokens // num_ubatches``.
    """

    def __init__(self, config: DboConfig, token_symbols: frozenset, num_ubatches: int):
        self.config = config
        tokens = max(1, config.cost_model_tokens // num_ubatches)
        self.subs = {s: tokens for s in token_symbols}
        self._values: dict[Any, int] = {}  # expr -> its value at the reference counts

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
        if name in ("mm", "addmm", "bmm", "baddbmm", "_grouped_mm") and isinstance(out, torch.Tensor):
            mat = [v for v in vals if isinstance(v, torch.Tensor) and v.dim() >= 2]
            k = self._int(mat[0].shape[-1]) if mat else 1
            return 2.0 * self.numel(out) * k
        info = op_info(node.target)
        if info is not None and info.flops is not None and isinstance(out, torch.Tensor):
            return info.flops(node, self._int)
        return 0.0

    def node_cost_us(self, node: fx.Node) -> float:
        """Estimated time of ``node`` alone, in µs (0 for views and bookkeeping)."""
        cfg = self.config
        if node.op != "call_function" or is_getitem(node) or dbo_meta(node).get("phase") == "wait":
            return 0.0
        kind = comm_kind(node)
        if kind is not None:
            backend = comm_backend_of(node)
            if backend is not None and backend.moved_bytes is not None:
                moved = backend.moved_bytes(kind, node, self._int)
            else:  # the static-capacity rank-major layout moves its outputs' bytes
                moved = self.nbytes(node.meta.get("val"))
            return cfg.comm_latency_us + moved / (cfg.link_gbps * 1e3)
        name = getattr(node.target, "_opname", "")
        if name in _FREE:
            return 0.0
        moved = self.nbytes(node.meta.get("val")) + sum(
            self.nbytes(a.meta.get("val")) for a in node.all_input_nodes)
        flops = self.flops(node)
        return cfg.launch_us + max(flops / (cfg.peak_tflops * 1e6), moved / (cfg.hbm_gbps * 1e3))
