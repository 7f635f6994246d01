"""Lower a Dynamo graph with one AOT trace per *distinct* decoder layer
(:func:`trace_by_layers`)."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

from dbo_compile.lowering import aot
from dbo_compile.lowering.aot import graph_module

log = logging.getLogger(__name__)

#: a module path that is an element of a ModuleList (``L['self'].layers.3``, ``...layers[3]``)
_LAYER_PATH = re.compile(r"(\.\d+|\[\d+\])$")


@dataclass
class _Segment:
    """A run of consecutive Dynamo nodes of one decoder layer (or of no layer).

    ``inputs``: the nodes outside it that it reads, in first-use order (placeholders and
    earlier segments' nodes); ``outputs``: its nodes read after it, in graph order."""

    nodes: list[fx.Node]
    inputs: list[fx.Node]
    outputs: list[fx.Node]


def layer_of(node: fx.Node) -> str | None:
    """The module path of the decoder layer (ModuleList element) a Dynamo node belongs to."""
    for path, *_ in (node.meta.get("nn_module_stack") or {}).values():
        if isinstance(path, str) and _LAYER_PATH.search(path):
            return path  # the outermost ModuleList element
    return None


def _segments(gm: fx.GraphModule) -> list[_Segment]:
    body = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    runs: list[list[fx.Node]] = []
    last: Any = object()
    for n in body:
        layer = layer_of(n)
        if layer != last or not runs:
            runs.append([])
            last = layer
        runs[-1].append(n)
    segments = []
    for run in runs:
        members = set(run)
        inputs: dict[fx.Node, None] = {}
        for n in run:
            for a in n.all_input_nodes:
                if a not in members:
                    inputs.setdefault(a)
        outputs = [n for n in run if any(u not in members for u in n.users)]
        segments.append(_Segment(run, list(inputs), outputs))
    return segments


def _structure(seg: _Segment) -> tuple:
    """What makes two segments the same program, up to their inputs: the ops, their targets,
    the constants and the wiring (a node by its position in the segment or among its inputs)."""
    index = {n: ("n", i) for i, n in enumerate(seg.nodes)}
    index.update({n: ("in", i) for i, n in enumerate(seg.inputs)})

    def norm(a: Any) -> Any:
        if isinstance(a, fx.Node):
            return index[a]
        if isinstance(a, (list, tuple)):
            return (type(a).__name__, tuple(norm(x) for x in a))
        if isinstance(a, dict):
            return ("dict", tuple((k, norm(v)) for k, v in a.items()))
        if isinstance(a, slice):
            return ("slice", norm(a.start), norm(a.stop), norm(a.step))
        if isinstance(a, torch.Tensor):
            return ("tensor", id(a))  # never equal to another segment's constant
        return (type(a).__name__, a)

    ops = tuple((n.op, n.target, norm(n.args), norm(n.kwargs)) for n in seg.nodes)
    outs = tuple(index[o] for o in seg.outputs)
    return ops, outs, tuple(n.op == "placeholder" for n in seg.inputs)


def _describe(value: Any) -> Any:
    """The properties of an input value a trace depends on (symbolic sizes as expressions);
    ``None`` for a value that is neither a tensor nor a SymInt."""
    if isinstance(value, torch.Tensor):
        return ("T", value.dtype, value.device.type, tuple(str(s) for s in value.shape),
                tuple(str(s) for s in value.stride()), str(value.storage_offset()))
    if isinstance(value, torch.SymInt):
        return ("S", str(value.node.expr))
    return None


def _fresh(value: Any, fake_mode: FakeTensorMode) -> Any:
    """A new fake tensor like ``value`` that aliases nothing (AOT would otherwise see two
    inputs share a storage and rewrite them)."""
    if not isinstance(value, torch.Tensor):
        return value
    with fake_mode:
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype,
                                   device=value.device)


def trace_by_layers(gm: fx.GraphModule, fakes: Sequence[Any],
                     fake_mode: FakeTensorMode) -> fx.GraphModule | None:
    """The lowered graph, AOT-traced once per *distinct* decoder layer (``None``: lower the
    whole graph, nothing repeats or a layer cannot be lowered alone).

    AOTAutograd costs time per node (two functional traces with symbolic shapes); a
    DeepSeek-V3-deep graph repeats one decoder layer 61 times. The Dynamo graph is cut into
    runs of consecutive nodes of one ModuleList element (``nn_module_stack``: ``layers.3``)
    and the runs between them; a run whose ops, constants and wiring equal an earlier one's
    and whose inputs have the same dtypes and symbolic sizes and strides is not traced again:
    the ATen nodes of the earlier run are copied with its inputs substituted (``meta["val"]``
    shared, as the ubatch copies of :mod:`dbo_compile.passes.split_ubatch` share theirs).

    Equivalent to one whole-graph trace where a run's functionalisation is local to it: a
    run may mutate only graph inputs that no other run reads (the KV cache of its own layer;
    the ``copy_`` back then sits at the run's end instead of the graph's, and
    :mod:`~dbo_compile.passes.reinplace` turns it back into the in-place write either way).
    Anything else makes this return ``None`` (logged at INFO, the whole graph is then traced
    once): a run that mutates another input, takes a value that is neither a tensor nor a
    SymInt from another run, makes a new symbol (a data-dependent size, which a copy must not
    share), whose traced graph does not have one placeholder per input and one output per
    value it hands on, or whose trace fails (the whole graph's trace then reports it).
    """
    if any(n.op in ("get_attr", "call_module") for n in gm.graph.nodes):
        return None
    segments = _segments(gm)
    structures = [_structure(s) for s in segments]
    if len(structures) == len(set(map(_hashable, structures))):
        return None  # nothing repeats: one trace of the whole graph is cheaper
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    segment_of = {n: i for i, seg in enumerate(segments) for n in seg.nodes}
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for i, (ph, fake) in enumerate(zip(placeholders, fakes)):
        env[ph] = graph.placeholder(f"arg{i}_1")
        env[ph].meta["val"] = fake
    root = torch.nn.Module()
    traced: list[tuple[tuple, tuple, fx.GraphModule]] = []  # (structure, inputs, aten graph)
    for k, (seg, structure) in enumerate(zip(segments, structures)):
        values = [env[a].meta.get("val") for a in seg.inputs]
        described = tuple(_describe(v) for v in values)
        aten = next((g for s, d, g in traced if d == described and s == structure), None)
        why = None
        if None in described:
            why = f"a value that is no tensor or SymInt enters the run at {seg.nodes[0].name}"
        elif aten is None:
            aten, why = _trace_segment(gm, seg, values, fake_mode)
            traced.append((structure, described, aten))
        why = why or _check_mutations(aten, seg, segment_of, k) or _stamp(
            graph, root, aten, [env[a] for a in seg.inputs], seg, env, k)
        if why:
            log.info("dbo: lowering the whole graph at once: %s", why)
            return None
    out = next(n for n in gm.graph.nodes if n.op == "output")
    graph.output(torch.fx.map_arg(out.args[0], lambda n: env[n]))
    log.debug("dbo: lowered %d runs of the graph with %d traces", len(segments), len(traced))
    return graph_module(root, graph)


def _hashable(structure: tuple) -> int:
    return hash(repr(structure))


def _trace_segment(gm: fx.GraphModule, seg: _Segment, values: list[Any],
                   fake_mode: FakeTensorMode) -> tuple[fx.GraphModule | None, str | None]:
    """The ATen graph of one run, or ``(None, why)`` where it cannot stand for its copies."""
    sub = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for a in seg.inputs:
        env[a] = sub.placeholder(a.name)
        env[a].meta = dict(a.meta)
    for n in seg.nodes:
        env[n] = sub.node_copy(n, lambda x: env[x])
    sub.output(tuple(env[o] for o in seg.outputs))
    inputs = [v if a.op == "placeholder" else _fresh(v, fake_mode)
              for a, v in zip(seg.inputs, values)]
    where = f"the run at {seg.nodes[0].name}"
    try:
        aten = aot.trace(fx.GraphModule(gm, sub), inputs)
    except Exception as e:  # noqa: BLE001 - the whole graph's trace reports a real failure
        return None, f"tracing {where} alone failed ({type(e).__name__}: {e})"
    phs = [n for n in aten.graph.nodes if n.op == "placeholder"]
    outs = next(n for n in aten.graph.nodes if n.op == "output").args[0]
    if len(phs) != len(seg.inputs) or len(outs) != len(seg.outputs):
        return None, (f"the trace of {where} has {len(phs)} inputs and {len(outs)} outputs, "
                      f"not {len(seg.inputs)} and {len(seg.outputs)}")
    known = set()
    for v in inputs:
        known |= _symbols(v)
    if any(not _symbols(n.meta.get("val")) <= known for n in aten.graph.nodes):
        return None, f"{where} makes a new symbol (a data-dependent size)"
    return aten, None


def _symbols(value: Any) -> set:
    """The free symbols of a value's sizes and strides (a SymInt's own)."""
    if isinstance(value, (list, tuple)):
        return set().union(*(_symbols(v) for v in value)) if value else set()
    if isinstance(value, torch.SymInt):
        return set(value.node.expr.free_symbols)
    if isinstance(value, torch.Tensor):
        return set().union(*(_symbols(s) for s in (*value.shape, *value.stride())))
    return set()


def _mutated_inputs(aten: fx.GraphModule) -> list[int]:
    """Positions of the placeholders an op of ``aten`` writes (the ``copy_`` back of an input
    mutation, or any other op whose schema writes its first argument)."""
    phs = {n: i for i, n in enumerate(n for n in aten.graph.nodes if n.op == "placeholder")}
    out = []
    for n in aten.graph.nodes:
        schema = getattr(n.target, "_schema", None)
        if n.op != "call_function" or schema is None or not n.args or n.args[0] not in phs:
            continue
        first = schema.arguments[0] if schema.arguments else None
        if first is not None and first.alias_info is not None and first.alias_info.is_write:
            out.append(phs[n.args[0]])
    return out


def _check_mutations(aten: fx.GraphModule, seg: _Segment, segment_of: dict[fx.Node, int],
                     k: int) -> str | None:
    """Why the run's input mutations are not local to it, or ``None``."""
    for i in _mutated_inputs(aten):
        a = seg.inputs[i]
        if a.op != "placeholder" or any(segment_of.get(u, -1) != k for u in a.users):
            return f"the run at {seg.nodes[0].name} mutates {a.name}, which another run reads too"
    return None


def _stamp(graph: fx.Graph, root: torch.nn.Module, aten: fx.GraphModule, inputs: list[fx.Node],
           seg: _Segment, env: dict[fx.Node, fx.Node], k: int) -> str | None:
    """Copy ``aten``'s nodes into ``graph`` over ``inputs``; map ``seg``'s outputs in ``env``.
    Returns why not, or ``None``."""
    local: dict[fx.Node, fx.Node] = {}
    phs = [n for n in aten.graph.nodes if n.op == "placeholder"]
    local.update(zip(phs, inputs))
    for n in aten.graph.nodes:
        if n.op == "placeholder":
            continue
        if n.op == "output":
            for o, v in zip(seg.outputs, n.args[0]):
                if not isinstance(v, fx.Node):
                    return f"the run at {seg.nodes[0].name} hands on a constant"
                env[o] = local[v]
            continue
        if n.op == "get_attr":  # a constant AOT lifted out of the run
            name = f"_run{k}_{n.target.replace('.', '_')}"
            setattr(root, name, getattr(aten, n.target))
            local[n] = graph.get_attr(name)
            local[n].meta = dict(n.meta)
            continue
        local[n] = graph.node_copy(n, lambda x: local[x])
    return None
