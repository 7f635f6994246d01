"""Group the split graph into schedule units: the part of a schedule no candidate changes.

A *unit* is either one comm op (its issue phase, on the comm stream) or a *stage*: a maximal
run of one ubatch's compute between its yield points (on the compute stream). The scheduler
(:mod:`~dbo_compile.passes.stream_assign`) orders units over the whole graph, both ubatches and
every layer at once, so it can run ubatch 0's next-layer attention while ubatch 1's combine of
the previous layer is in flight.

Algorithm (steps 1-2 of the scheduler; 3 is :mod:`~dbo_compile.passes.ordering`, 4
:mod:`~dbo_compile.passes.events`):
  1. Stages. A compute node of ubatch ``u`` belongs to the stage keyed by
     ``(u, waits it depends on, first comm op depending on it)``. The key is monotone along
     every path, so stages are convex (no path leaves a stage and comes back). Nodes that no
     ubatch input reaches (weight views) form one shared prologue stage.
  2. Dependencies. Data edges between units (a wait node stands for its issue's unit), plus
     the edges FX cannot see: every access of ubatch ``u`` to an input that some op mutates in
     place (the KV cache), or to the state a step-state op keys by an input (vLLM's KV cache
     by layer name, :func:`~dbo_compile.ops.registry.step_state_key`), precedes ubatch
     ``u + 1``'s accesses (``docs/design.md``, invariant 3), and every reader of a state input's old value precedes its write back
     (:mod:`~dbo_compile.passes.state_threads`; each ubatch's copy of a state-thread segment
     and each write back is a unit of its own).

A backend whose wait phase does work (DeepEP low-latency's receive hook, the emulated link's
unpack) gets a second comm unit per op, its *receive* (``phase="receive"``), on the backend's
stream; the issue (a *send*) then costs its launch and its transfer is the issue's
``latency_us``, in flight while the stream runs other units, on the rank's one link: the
timeline (:class:`~dbo_compile.schedule.Timeline`) runs transfers one at a time.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any

import networkx as nx
import torch.fx as fx

from dbo_compile.errors import ScheduleError
from dbo_compile.ops.comm import comm_backend_of
from dbo_compile.ops.registry import comm_kind, is_receive, is_wait, step_state_key
from dbo_compile.passes.cost_model import CostModel
from dbo_compile.passes.meta import dbo_meta
from dbo_compile.passes.pools import PoolPlan, pool_plan
from dbo_compile.schedule import COMM, COMPUTE, Unit

log = logging.getLogger(__name__)


def _stage_keys(graph: fx.Graph) -> dict[fx.Node, tuple]:
    """Stage key of every compute node (see step 1 of the module docstring).

    The waits a node depends on are kept as a bit set (an int, bit ``i`` for the ``i``-th
    wait node of the graph): a union per node costs a word per 64 waits, where a set of
    them grows with the layers and made this quadratic in the depth of the model."""
    nodes = list(graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    waits: dict[fx.Node, int] = {}
    ubatch_waits: dict[Any, int] = {}  # ubatch -> bits of its own wait nodes
    bit = 0
    for n in nodes:
        acc = 0
        for a in n.all_input_nodes:
            acc |= waits[a]
        if is_wait(n):
            acc |= 1 << bit
            u = dbo_meta(n).get("ubatch")
            ubatch_waits[u] = ubatch_waits.get(u, 0) | (1 << bit)
            bit += 1
        waits[n] = acc
    first_comm: dict[fx.Node, int] = {}
    big = len(nodes) + 1
    for n in reversed(nodes):
        best = big
        for u in n.users:
            if comm_kind(u) is not None:
                best = min(best, order[u])
            best = min(best, first_comm.get(u, big))
        first_comm[n] = best
    keys = {}
    for n in nodes:
        if n.op in ("placeholder", "output") or comm_kind(n) is not None or is_wait(n):
            continue
        meta = dbo_meta(n)
        u = meta.get("ubatch")
        if meta.get("join") is not None:  # a joined call: its own stage, shared by all ubatches
            keys[n] = ("J", meta["join"])
        elif meta.get("thread") is not None:  # one ubatch's copy of a state-thread segment
            keys[n] = ("F", *meta["thread"], u)  # (it reads the previous ubatch's copy)
        elif meta.get("state_write") is not None:  # the write back of a state thread
            keys[n] = ("W", meta["state_write"])
        elif u is None:
            keys[n] = ("P",)
        else:
            # the last entry, the waits of the node's own ubatch, names the stage (labels)
            own = (waits[n] & ubatch_waits.get(u, 0)).bit_count()
            keys[n] = (u, waits[n].bit_count(), first_comm[n], own)
    return keys

@dataclass
class UnitGraph:
    """The part of a schedule that no candidate changes, found once per split graph: the
    units (their nodes, kinds, ubatches, labels; steps 1-2), their dependencies and the
    hidden ones. The candidates of one graph differ only in the costs (cost-model figures)
    and the order; :meth:`units` hands each a fresh copy of the units with its costs.

    Attributes:
        ordered: the nodes of each unit, units in graph order of their first node.
        template: the units in that order, ``cost_us`` 0.
        deps: ``(src, dst)`` unit dependencies, hidden ones included, sorted.
        hidden: the dependencies that are not FX data edges (KV-cache accesses), sorted.
        plan: the result pools of the comm units (:class:`PoolPlan`).
        sends: the comm units whose backend has a receive unit: the issue costs its launch
            and the transfer is its ``latency_us``.
    """

    ordered: list[list[fx.Node]]
    template: list[Unit]
    deps: list[tuple[int, int]]
    hidden: list[tuple[int, int]]
    plan: PoolPlan
    sends: frozenset[int]
    _compute_costs: dict[tuple, list[float]] = field(default_factory=dict)

    def units(self, cost: CostModel) -> list[Unit]:
        """Copies of the units with their costs under ``cost`` (µs; compute costs computed
        once per set of compute figures, comm costs per call: the link figure is what the
        candidates vary)."""
        cfg = cost.config
        # every figure a compute node's cost reads (the calibrated ones included)
        key = (cfg.peak_tflops, cfg.hbm_gbps, cfg.launch_us, cfg.cost_model_tokens,
               repr(sorted((cost.figures or {}).items())))
        compute = self._compute_costs.get(key)
        if compute is None:
            compute = [0.0 if u.kind == COMM else sum(cost.node_cost_us(n) for n in ns)
                       for u, ns in zip(self.template, self.ordered)]
            self._compute_costs[key] = compute
        out = []
        for u, ns, c in zip(self.template, self.ordered, compute):
            latency = 0.0
            if u.phase == "receive":
                c = cfg.launch_us
            elif u.kind == COMM:
                c = sum(cost.node_cost_us(n) for n in ns)
                if u.id in self.sends:  # the transfer is in flight until the receive
                    c, latency = cfg.launch_us, round(c, 3)
            out.append(dataclasses.replace(u, nodes=list(u.nodes), cost_us=c,
                                           latency_us=latency))
        return out


def build_units(graph: fx.Graph, cost: CostModel
                ) -> tuple[list[Unit], list[tuple[int, int]], list[tuple[int, int]], PoolPlan]:
    """Units in graph order (not yet scheduled), their deps, the hidden deps and the result
    pools of the comm units."""
    ug = unit_graph(graph)
    return ug.units(cost), list(ug.deps), list(ug.hidden), ug.plan


def unit_graph(graph: fx.Graph) -> UnitGraph:
    """Steps 1-2 of the module docstring for ``graph`` (see :class:`UnitGraph`).

    Raises:
        ScheduleError: the unit graph has a cycle.
    """
    nodes = list(graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    keys = _stage_keys(graph)
    unit_nodes: dict[tuple, list[fx.Node]] = {}
    for n in nodes:
        if comm_kind(n) is not None:
            unit_nodes[("comm", order[n])] = [n]
        elif is_receive(n):
            unit_nodes[("receive", order[n])] = [n]
        elif n in keys:
            unit_nodes.setdefault(keys[n], []).append(n)
    # units in order of their first node
    ordered = sorted(unit_nodes.values(), key=lambda ns: order[ns[0]])
    node_unit: dict[fx.Node, int] = {}
    for i, ns in enumerate(ordered):
        for n in ns:
            node_unit[n] = i
    wait_issue = {}
    for n in nodes:
        if is_wait(n) and not is_receive(n):
            wait_issue[n] = n.args[0]

    def producer(a: fx.Node) -> int | None:
        while a in wait_issue:
            a = wait_issue[a]
        return node_unit.get(a)

    deps: set[tuple[int, int]] = set()
    for i, ns in enumerate(ordered):
        for n in ns:
            for a in n.all_input_nodes:
                p = producer(a)
                if p is not None and p != i:
                    deps.add((p, i))
    # hidden deps: accesses of inputs mutated in place, ordered by ubatch then graph order
    hidden: set[tuple[int, int]] = set()
    mutated = sorted({m for n in nodes for m in dbo_meta(n).get("mutates", [])})
    by_name = {n.name: n for n in nodes}
    # and of the state a step-state op keys by an argument (vLLM's layer name, a graph input:
    # the layer's KV cache in its forward context), by every op with that key
    keyed: dict[str, list[fx.Node]] = {}
    for n in nodes:
        key = step_state_key(n)
        if key is not None:
            name = key.name if isinstance(key, fx.Node) else f"const:{key!r}"
            keyed.setdefault(name, []).append(n)
    for m in sorted(set(mutated) | set(keyed)):
        ph = by_name.get(m)
        if m in keyed and m not in mutated:
            users = keyed[m]
        elif ph is None:
            continue
        else:
            users = list(ph.users)
        accesses = sorted({node_unit[u] for u in users if u in node_unit},
                          key=lambda i: (ordered[i][0].meta.get("dbo", {}).get("ubatch") or 0,
                                         order[ordered[i][0]]))
        for a, b in zip(accesses, accesses[1:]):
            if (a, b) not in deps and a != b:
                hidden.add((a, b))
    # hidden deps: every reader of a state input's old value precedes its write back
    for n in nodes:
        target = by_name.get(dbo_meta(n).get("state_write") or "")
        if target is None or n not in node_unit:
            continue
        for reader in target.users:
            r = node_unit.get(reader)
            if reader is not n and r is not None and r != node_unit[n] and \
                    (r, node_unit[n]) not in deps:
                hidden.add((r, node_unit[n]))
    deps |= hidden
    g = nx.DiGraph(sorted(deps))
    g.add_nodes_from(range(len(ordered)))
    if not nx.is_directed_acyclic_graph(g):
        cycle = nx.find_cycle(g)
        raise ScheduleError(f"unit graph has a cycle: {cycle}")
    plan = pool_plan(ordered, node_unit)
    units, sends = _label_units(ordered, [keys.get(ns[0]) for ns in ordered])
    return UnitGraph(ordered, units, sorted(deps), sorted(hidden), plan, sends)

def _label_units(ordered: list[list[fx.Node]], keys: list[tuple | None]
                 ) -> tuple[list[Unit], frozenset[int]]:
    """The units (costs 0: :meth:`UnitGraph.units` fills them in) and the comm units whose
    backend has a receive unit."""
    units = []
    comm_index: dict[tuple, int] = {}
    comm_layer: dict[str, int] = {}
    unit_of_issue: dict[str, Unit] = {}
    sends = set()
    for i, ns in enumerate(ordered):
        head = ns[0]
        meta = dbo_meta(head)
        joined = keys[i] is not None and keys[i][0] == "J"
        ubatch = None if joined else meta.get("ubatch")
        kind = comm_kind(head)
        if kind is not None:
            k = (ubatch, kind)
            layer = comm_index.get(k, 0)
            comm_index[k] = layer + 1
            comm_layer[head.name] = layer
            label = {"dispatch": "D", "combine": "C"}.get(kind, "X")
            backend = comm_backend_of(head)
            stream = COMPUTE if backend is not None and backend.stream == "compute" else COMM
            if any(is_receive(u) for u in head.users):  # its receive is a unit of its own
                sends.add(i)
            units.append(Unit(i, COMM, stream, ubatch, label, layer, [n.name for n in ns], 0.0))
            unit_of_issue[head.name] = units[-1]
        elif is_receive(head):
            issue = unit_of_issue[head.args[0].name]
            units.append(Unit(i, COMM, issue.stream, issue.ubatch, issue.label, issue.layer,
                              [n.name for n in ns], 0.0, phase="receive"))
        else:
            units.append(Unit(i, COMPUTE, COMPUTE, ubatch, "P" if keys[i] == ("P",) else "?",
                              None, [n.name for n in ns], 0.0))
    _assign_stage_labels(units, ordered, keys)
    return units, frozenset(sends)


def _assign_stage_labels(units: list[Unit], ordered: list[list[fx.Node]],
                         keys: list[tuple | None]) -> None:
    """Name each compute stage after the comm ops around it (labels are for people and viz).

    With ``w`` the number of comm waits a stage depends on and ``k`` the layer of the first comm
    op depending on it: first dependent op combine ``k`` and ``w == 2k + 1``: routed experts
    (``MLP``) of layer ``k``; dispatch ``k`` and ``w == 2k``: attention part (``A``, with the
    previous layer's tail) of layer ``k``; dispatch ``k`` and ``w == 2k - 2``: shared experts
    (``S``) of layer ``k - 1``, computed beside the routed ones; no dependent comm op and all
    waits: the final tail (``T``). Anything else (e.g. RoPE tables computed ahead) is ``X``. A
    joined call (:mod:`dbo_compile.passes.join_experts`, no ubatch) is the routed experts
    (``MLP``) of the layer of the first combine depending on it. ``w`` counts the waits of the
    stage's own ubatch (after a joined call, a stage also depends on the other's dispatch).
    """
    comm_units = {u.nodes[0]: u for u in units if u.kind == COMM}
    num_layers = 1 + max((u.layer for u in comm_units.values()), default=0)
    first_below = _first_comm_below(ordered[0][0].graph, comm_units) if ordered else {}
    for u, ns, key in zip(units, ordered, keys):
        if u.kind == COMM or u.label == "P":
            continue
        w = key[3] if key and len(key) == 4 else 0
        first = min((first_below[n] for n in ns if first_below[n] is not None),
                    key=lambda cu: cu.id, default=None)
        if first is None:
            k, kind = num_layers, "D"  # the end of the step acts as dispatch of layer L
        else:
            k, kind = first.layer, first.label
        if (key and key[0] == "J") or (kind == "C" and w == 2 * k + 1):
            u.label, u.layer = "MLP", k
        elif kind == "D" and w == 2 * k:
            u.label, u.layer = ("A", k) if first is not None else ("T", k - 1)
        elif kind == "D" and w == 2 * k - 2:
            u.label, u.layer = "S", k - 1
        else:
            u.label, u.layer = "X", min(k, num_layers - 1)


def _first_comm_below(graph: fx.Graph, comm_units: dict[str, Unit]) -> dict[fx.Node, Unit | None]:
    """Per node, the comm unit of lowest id that a path from it reaches through compute nodes
    only (a path stops at the first comm op). One pass in reverse graph order: the residual
    stream of a decoder runs from every layer to the end, so a walk per stage was quadratic
    in the depth of the model."""
    below: dict[fx.Node, Unit | None] = {}
    for n in reversed(graph.nodes):
        best: Unit | None = None
        for user in n.users:
            cu = comm_units.get(user.name)
            if cu is None:
                cu = below.get(user)
            if cu is not None and (best is None or cu.id < best.id):
                best = cu
        below[n] = best
    return below
