"""Join the ubatch copies of each MoE layer's routed experts into one call on both ubatches' rows.

In decode the routed experts' grouped GEMM is bound by reading the expert weights: with ~100
rows per expert each ubatch's call costs nearly what the unsplit call costs, so a split step
reads every local expert weight twice per layer. Measured on 2x H200 (DeepSeek-V2-Lite shapes,
decode 1024 tokens/rank, ``benchmarks/kernel_summary.py``): 974 µs for the 8 grouped GEMMs of
the unsplit step, 1,837 µs for the 16 of the split step — more than half of what splitting adds
to the step's kernel time. Joining reads them once::

    before (per layer)                          after
    y_u0 = grouped_experts(x_u0, ids_u0,        x = cat([x_u0, x_u1]); ids = cat(...); w = cat(...)
                           w_u0, w13, w2)       y = grouped_experts(x, ids, w, w13, w2)
    y_u1 = grouped_experts(x_u1, ...)           y_u0, y_u1 = split_with_sizes(y, [n_u0, n_u1])

Only rank-major rows are joined: expert-major rows (``[E_local, W*cap, H]``, DeepEP
low-latency) live in one receive buffer per dispatch, and joining them would copy them.

Exact: the op is row-local along dim 0 (row ``n`` of ``y`` depends on row ``n`` of ``x``,
``ids`` and ``weights`` only), so the rows of the joined call are the rows of the two calls.
The joined nodes form one shared stage (``meta["dbo"]["ubatch"] = None``, ``"join"`` set) that
waits for both ubatches' dispatch and feeds both combines: the price is that the experts of a
layer start only when the later dispatch has landed. Whether the weight reads saved pay for
that wait depends on the bucket and the link; the runtime measures joined and unjoined
schedules (``DboConfig.join_experts``, :data:`dbo_compile.candidates.CANDIDATES`).
"""

from __future__ import annotations

import copy
import logging
import operator

import torch
import torch.fx as fx
from torch.fx.passes.tools_common import legalize_graph

import dbo_compile.ops  # noqa: F401  (registers the ops and their records)
from dbo_compile.errors import ScheduleError
from dbo_compile.lowering import graph_module
from dbo_compile.ops.registry import comm_kind, joinable_ops
from dbo_compile.passes.manager import CompileState, GraphPass
from dbo_compile.passes.meta import dbo_meta

log = logging.getLogger(__name__)

__all__ = ["PASS", "copy_split_graph", "join_experts"]

aten = torch.ops.aten


def copy_split_graph(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of the split graph whose nodes' ``meta["dbo"]`` dicts are their own (the schedule
    annotates them), sharing ``gm``'s attributes (weights are not copied)."""
    graph = fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    for n in graph.nodes:
        if "dbo" in n.meta:
            n.meta["dbo"] = copy.copy(n.meta["dbo"])
        if "custom" in n.meta:
            n.meta["custom"] = copy.copy(n.meta["custom"])
    return graph_module(gm, graph, class_name=type(gm).__name__)


def _out_of_order(graph: fx.Graph) -> bool:
    seen: set[fx.Node] = set()
    for n in graph.nodes:
        if any(a not in seen for a in n.all_input_nodes):
            return True
        seen.add(n)
    return False


def _fake_mode(vals):
    """The fake mode of the values themselves (not the active tracing context's)."""
    modes = {id(v.fake_mode): v.fake_mode for v in vals if hasattr(v, "fake_mode")}
    if len(modes) != 1:
        raise ScheduleError(f"join_experts: the joined values come from {len(modes)} fake "
                            "modes, expected one")
    return next(iter(modes.values()))


def _val(a):
    return a.meta.get("val") if isinstance(a, fx.Node) else a


def join_experts(gm: fx.GraphModule, num_ubatches: int) -> int:
    """Join the ubatch copies of every joinable call of ``gm`` in place (the ops whose registry
    record says ``joinable``: :func:`dbo_compile.ops.registry.joinable_ops`). The caller lints
    and recompiles ``gm`` (the pass pipeline does, once).

    Args:
        gm: the split graph (:func:`~dbo_compile.passes.split_ubatch.split_ubatch`), after
            :func:`~dbo_compile.passes.insert_yields.insert_yields`.
        num_ubatches: ubatch copies in ``gm``.

    Returns:
        The number of joined calls (one per MoE layer of the model).

    Raises:
        ScheduleError: a call does not have one copy per ubatch, its copies differ in an
            argument that is not a tensor or in their keyword arguments, or the joined values
            come from more than one fake mode.
    """
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    joinable = joinable_ops()
    groups: dict[str, list[fx.Node]] = {}
    for n in graph.nodes:
        if n.op == "call_function" and n.target in joinable:
            u = dbo_meta(n).get("ubatch")
            x = _val(n.args[0]) if n.args else None
            if isinstance(x, torch.Tensor) and x.dim() != 2:
                continue  # expert-major rows (DeepEP low-latency): one buffer per dispatch
            if u is not None:
                groups.setdefault(dbo_meta(n)["origin"], []).append(n)
    for origin, copies in groups.items():
        copies.sort(key=lambda n: dbo_meta(n)["ubatch"])
        if [dbo_meta(n)["ubatch"] for n in copies] != list(range(num_ubatches)):
            raise ScheduleError(f"join_experts: {origin} has copies for ubatches "
                                f"{[dbo_meta(n)['ubatch'] for n in copies]}, expected one per "
                                "ubatch")
        first = copies[0]
        per = [i for i, a in enumerate(first.args) if any(c.args[i] is not a for c in copies[1:])]
        for i in per:
            if not all(isinstance(c.args[i], fx.Node) and isinstance(_val(c.args[i]), torch.Tensor)
                       for c in copies):
                raise ScheduleError(f"join_experts: argument {i} of {origin} differs between "
                                    "ubatches and is not a tensor")
        if first.kwargs and any(c.kwargs != first.kwargs for c in copies):
            raise ScheduleError(f"join_experts: {origin} has per-ubatch keyword arguments")
        vals = [[_val(c.args[i]) for i in per] for c in copies]
        fake = _fake_mode(v for vs in vals for v in vs)
        last = max(copies, key=lambda n: order[n])

        def node(target, args, val, kwargs=None):
            n = graph.call_function(target, args, kwargs)
            n.meta["val"] = val
            dbo_meta(n).update(ubatch=None, join=origin, token_dim=0 if isinstance(
                val, torch.Tensor) else None)
            return n

        with graph.inserting_before(last):
            args = list(first.args)
            for j, i in enumerate(per):
                parts = [c.args[i] for c in copies]
                with fake:
                    val = torch.cat([vs[j] for vs in vals])
                args[i] = node(aten.cat.default, (parts, 0), val)
            # the copies' values are the parts of the joined value (row-local op)
            parts_val = [c.meta.get("val") for c in copies]
            with _fake_mode(parts_val):
                joined_val = torch.cat(parts_val)
            sizes_val = [vs[0].shape[0] for vs in vals]
            joined = node(first.target, tuple(args), joined_val, dict(first.kwargs))
            joined.meta["dbo"].update({k: v for k, v in first.meta.get("dbo", {}).items()
                                       if k not in ("ubatch", "origin", "token_dim")})
            sizes = [node(aten.sym_size.int, (c.args[per[0]], 0), s)
                     for c, s in zip(copies, sizes_val)]
            split = node(aten.split_with_sizes.default, (joined, sizes), parts_val)
            for u, c in enumerate(copies):
                item = node(operator.getitem, (split, u), parts_val[u])
                c.replace_all_uses_with(item)
        inputs = [c.args[i] for c in copies for i in per]
        for c in copies:
            graph.erase_node(c)
        # the copies' own views of their inputs (getitems of the dispatch's outputs) feed only
        # the joined call now (and the combines, which wait for the joined call anyway): run
        # them in its stage rather than as stages of their own
        views = {g for a in inputs if a.op == "call_function" and a.target is operator.getitem
                 for g in a.args[0].users if g.op == "call_function"
                 and g.target is operator.getitem}  # every output of the joined dispatches
        for a in sorted(views, key=lambda n: order.get(n, 0)):
            if all(dbo_meta(u).get("join") == origin or comm_kind(u) is not None
                   for u in a.users):
                dbo_meta(a)["join"] = origin
    if groups:
        if _out_of_order(graph):  # a copy's user came before the last copy: reorder
            legalize_graph(gm)
        log.info("dbo: joined the ubatch copies of %d routed-expert calls", len(groups))
    return len(groups)


def _run(gm: fx.GraphModule, st: CompileState) -> fx.GraphModule:
    """A copy of the split graph with its routed experts joined (the unjoined graph is
    scheduled too); ``st.joined_calls``: the calls joined (0: nothing to join)."""
    copied = copy_split_graph(gm)
    st.joined_calls = join_experts(copied, st.config.num_ubatches)
    return copied


#: optional: without it, no candidate is joined (as for a graph with nothing to join)
PASS = GraphPass("join_experts", _run, writes=("joined_calls",), optional=True)
