"""Clone the graph body into one copy per ubatch over slices of the token dim.

Before (one step, ``T`` tokens)::

    x: [T, H], w: [H, H]
    y = mm(x, w); r = dbo.dispatch(y, ...); ...; return (out [T, V],)

After (``num_ubatches=2``; the runtime passes each ubatch its own slice)::

    w: [H, H]                                  # shared: weights, KV caches (never copied)
    x_u0: [T0, H], x_u1: [T1, H]               # per-ubatch inputs
    y_u0 = mm(x_u0, w); r_u0 = dbo.dispatch(y_u0, ...)   # meta["dbo"]["ubatch"] = 0
    y_u1 = mm(x_u1, w); r_u1 = dbo.dispatch(y_u1, ...)   # meta["dbo"]["ubatch"] = 1
    return (out_u0, out_u1)                    # the runtime concatenates in ubatch order

Algorithm:
  1. Shared nodes (not depending on any per-ubatch input) are copied once, ubatch ``None``.
  2. Every other node is copied once per ubatch, reading that ubatch's inputs and the shared
     nodes; ``node.meta`` (``val`` included) is carried over, and ``meta["dbo"]["origin"]``
     names the node the copies came from.
  3. Outputs: per-ubatch outputs are returned once per ubatch; token-free outputs once.
  4. State threads (:mod:`~dbo_compile.passes.state_threads`): in-place updates of shared
     inputs from the tokens are replayed per ubatch in order, not copied per ubatch (see
     ``split_ubatch``'s ``threads``).
"""

from __future__ import annotations

import copy
import logging
from typing import Sequence

import torch.fx as fx

from dbo_compile.lowering import graph_module
from dbo_compile.passes.manager import CompileState, GraphPass
from dbo_compile.passes.meta import dbo_meta
from dbo_compile.passes.state_threads import StateThread
from dbo_compile.signature import InputSpec, SplitSignature

log = logging.getLogger(__name__)


def _copy_meta(dst: fx.Node, src: fx.Node, ubatch: int | None) -> None:
    for k, v in src.meta.items():
        dst.meta[k] = copy.copy(v) if k in ("dbo", "custom") else v
    dbo_meta(dst)["ubatch"] = ubatch


def split_ubatch(gm: fx.GraphModule, specs: list[InputSpec], num_ubatches: int = 2,
                 threads: Sequence[StateThread] = ()) -> tuple[fx.GraphModule, SplitSignature]:
    """Return a new GraphModule holding ``num_ubatches`` copies of ``gm``'s per-ubatch body.

    Args:
        gm: lowered ATen graph, one placeholder per entry of ``specs``.
        specs: input classification; ``per_ubatch`` inputs get one placeholder per ubatch.
        num_ubatches: number of copies (>= 2).
        threads: the state threads of ``gm``
            (:func:`~dbo_compile.passes.state_threads.find_state_threads`): each fold segment
            is emitted once per ubatch at its place in the graph, ubatch 0 first, each copy
            continuing from the previous one's value (``meta["dbo"]["thread"]``); a free
            segment once; each write once, in the last ubatch (``meta["dbo"]["state_write"]``).

    Returns:
        The split GraphModule (shares ``gm``'s attributes) and its
        :class:`~dbo_compile.signature.SplitSignature`.
    """
    src = gm.graph
    placeholders = [n for n in src.nodes if n.op == "placeholder"]
    per_ubatch: set[fx.Node] = {placeholders[s.index] for s in specs if s.per_ubatch}
    for node in src.nodes:
        if node.op != "placeholder" and any(a in per_ubatch for a in node.all_input_nodes):
            per_ubatch.add(node)

    graph = fx.Graph()
    shared_env: dict[fx.Node, fx.Node] = {}
    envs: list[dict[fx.Node, fx.Node]] = [{} for _ in range(num_ubatches)]
    sig_inputs: list[tuple[int, int | None]] = []
    for spec, node in zip(specs, placeholders):
        if not spec.per_ubatch:
            new = graph.placeholder(node.name)
            _copy_meta(new, node, None)
            shared_env[node] = new
            sig_inputs.append((spec.index, None))
    for u in range(num_ubatches):
        for spec, node in zip(specs, placeholders):
            if spec.per_ubatch:
                new = graph.placeholder(f"{node.name}_u{u}")
                _copy_meta(new, node, u)
                envs[u][node] = new
                sig_inputs.append((spec.index, u))

    def lookup(env: dict[fx.Node, fx.Node]):
        return lambda n: env[n] if n in env else shared_env[n]

    segment_of = {n: (t, i) for t in threads for i, seg in enumerate(t.segments)
                  for n in seg.nodes}
    write_of = {t.write: t for t in threads}
    current: dict[int, fx.Node] = {}  # thread -> its value so far, in the new graph
    last = num_ubatches - 1
    output_node = None
    for node in src.nodes:
        if node.op == "placeholder":
            continue
        if node.op == "output":
            output_node = node
            continue
        if node in write_of:
            t = write_of[node]
            value = current.get(id(t), shared_env.get(t.start))
            new = graph.node_copy(node, lambda a, t=t, v=value: v if a is node.args[1] else shared_env[a])
            _copy_meta(new, node, last)
            dbo_meta(new)["state_write"] = t.placeholder.name
            continue
        if node in segment_of:
            t, i = segment_of[node]
            seg = t.segments[i]
            if node is seg.nodes[-1]:  # every input of the segment is there now
                _emit_segment(graph, t, i, current, shared_env, envs, num_ubatches)
            continue
        if node not in per_ubatch:
            new = graph.node_copy(node, lookup(shared_env))
            _copy_meta(new, node, None)
            shared_env[node] = new
            continue
        for u in range(num_ubatches):
            new = graph.node_copy(node, lookup(envs[u]))
            new._rename(f"{node.name}_u{u}")
            _copy_meta(new, node, u)
            dbo_meta(new)["origin"] = node.name  # the ubatch copies of a node share it
            envs[u][node] = new

    outs: list[fx.Node] = []
    sig_outputs: list[tuple[int, ...]] = []
    for arg in output_node.args[0]:
        if isinstance(arg, fx.Node) and arg in per_ubatch:
            idx = []
            for u in range(num_ubatches):
                idx.append(len(outs))
                outs.append(envs[u][arg])
            sig_outputs.append(tuple(idx))
        else:
            sig_outputs.append((len(outs),))
            outs.append(shared_env[arg] if isinstance(arg, fx.Node) else arg)
    graph.output(tuple(outs))
    split = graph_module(gm, graph, class_name="DboSplitGraph")
    return split, SplitSignature(tuple(sig_inputs), tuple(sig_outputs), num_ubatches)


def _emit_segment(graph: fx.Graph, t: StateThread, i: int, current: dict[int, fx.Node],
                  shared_env: dict[fx.Node, fx.Node], envs: list[dict[fx.Node, fx.Node]],
                  num_ubatches: int) -> None:
    """Segment ``i`` of thread ``t``: a fold once per ubatch in ubatch order, each copy
    continuing from the previous one's value; a free segment once (in the last ubatch)."""
    seg = t.segments[i]
    ubatches = range(num_ubatches) if seg.kind == "fold" else [num_ubatches - 1]
    for u in ubatches:
        local = {seg.prev: current.get(id(t), shared_env.get(t.start))}
        env = envs[u]

        def lookup(a: fx.Node) -> fx.Node:
            if a in local:
                return local[a]
            return env[a] if a in env else shared_env[a]

        for n in seg.nodes:
            new = graph.node_copy(n, lookup)
            new._rename(f"{n.name}_u{u}" if seg.kind == "fold" else n.name)
            _copy_meta(new, n, u)
            dbo_meta(new)["origin"] = n.name
            dbo_meta(new)["thread"] = (t.placeholder.name, i)
            local[n] = new
        current[id(t)] = local[seg.nodes[-1]]


def _run(gm: fx.GraphModule, st: CompileState) -> fx.GraphModule:
    split_gm, st.signature = split_ubatch(gm, st.specs, st.config.num_ubatches, st.threads)
    return split_gm


PASS = GraphPass("split_ubatch", _run, reads=("specs", "threads"), writes=("signature",))
