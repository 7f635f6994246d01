"""Analytical cost of a node: a roofline over FLOPs and bytes, plus a launch cost.

Sizes are evaluated at a reference token count (``DboConfig.cost_model_tokens`` per rank,
divided evenly over the ubatches), so the estimate, and the schedule derived from it, depend on
(graph, config) only: every rank computes the same schedule (../shared/DESIGN.md invariant 2).

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
from dbo_compile.passes.comm_ops import comm_kind, is_getitem
from dbo_compile.passes.meta import dbo_meta

_FREE = {"view", "_unsafe_view", "reshape", "unsqueeze", "squeeze", "expand", "t", "permute",
         "transpose", "alias", "detach", "slice", "select", "split", "split_with_sizes",
         "sym_size", "sym_numel", "_reshape_alias", "as_strided", "unbind", "chunk"}


def _ep_size_of(x: Any) -> int:
    """EP world size of the dispatch that produced ``x`` (``getitem`` of ``dbo.dispatch``);
    1 when it cannot be told (no dispatch, unresolvable group)."""
    src = x.args[0] if isinstance(x, fx.Node) and is_getitem(x) else None
    if isinstance(src, fx.Node) and comm_kind(src) == "dispatch":
        try:
            from dbo_compile.ops.comm import ep_world_size

            return max(1, int(ep_world_size(src.args[4])))
        except Exception:  # noqa: BLE001 - a cost estimate never fails the compile
            return 1
    return 1


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
        if name == "grouped_experts" and isinstance(out, torch.Tensor):
            # SwiGLU (3 GEMMs of I x H) on the slots routed to this rank: N*K / W of them
            x, ids, _w, _w13, w2 = (a.meta.get("val") if isinstance(a, fx.Node) else a
                                    for a in node.args[:5])
            rows, k = (self._int(s) for s in ids.shape)
            hidden, inter = self._int(x.shape[1]), self._int(w2.shape[2])
            return 6.0 * rows * k * inter * hidden / _ep_size_of(node.args[0])
        if name == "attention" and isinstance(out, torch.Tensor):
            # 2 matmuls over an assumed context of 4 * the ubatch's tokens
            tokens, heads, dim = (self._int(s) for s in out.shape)
            return 4.0 * tokens * heads * dim * max(64, 4 * tokens)
        return 0.0

    def node_cost_us(self, node: fx.Node) -> float:
        """Estimated time of ``node`` alone, in µs (0 for views and bookkeeping)."""
        cfg = self.config
        if node.op != "call_function" or is_getitem(node) or dbo_meta(node).get("phase") == "wait":
            return 0.0
        kind = comm_kind(node)
        if kind is not None:
            moved = self.nbytes(node.meta.get("val"))
            return cfg.comm_latency_us + moved / (cfg.link_gbps * 1e3)
        name = getattr(node.target, "_opname", "")
        if name in _FREE:
            return 0.0
        moved = self.nbytes(node.meta.get("val")) + sum(
            self.nbytes(a.meta.get("val")) for a in node.all_input_nodes)
        flops = self.flops(node)
        return cfg.launch_us + max(flops / (cfg.peak_tflops * 1e6), moved / (cfg.hbm_gbps * 1e3))
