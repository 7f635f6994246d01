"""Group the split graph into schedule units, list-schedule them on two streams, add events.

The result is a :class:`~dbo_compile.schedule.Schedule` (ground floor), which codegen runs.

A *unit* is either one comm op (its issue phase, on the comm stream) or a *stage*: a maximal
run of one ubatch's compute between its yield points (on the compute stream). The scheduler
orders units over the whole graph, both ubatches and every layer at once, so it can run
ubatch 0's next-layer attention while ubatch 1's combine of the previous layer is in flight.

Algorithm:
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
  3. List scheduling. Simulate the two in-order streams with the cost model; repeatedly issue
     the ready unit with the earliest possible start (ties: comm first, so the collective is
     launched before the compute it hides behind; then the longest path to the end of the
     step, the critical path; then lower ubatch; then graph order).
     Deterministic: no timing, data, rank or set order enters.
  4. Event edges. The transitive reduction of (stream order + cross-stream dependencies)
     keeps exactly the cross-stream edges no other path implies: each is one event record on
     the producer's stream and one wait on the consumer's.

Result pools (``docs/design.md`` invariant 3; :class:`~dbo_compile.ops.comm.ResultPool`): a
comm backend may declare that its calls draw from a pool, the ``k``-th call of a pool (in
issue order, over the whole step) overwriting the results of call ``k - live`` and needing
call ``k - in_flight`` received. Both schedulers treat the pool as a resource: a comm unit is
ready only when every unit reading the results it overwrites (through views) and the receive
it waits for are placed, and placing it adds those edges (``hidden_deps``; an event where the
streams differ). When no ready unit can be placed the schedule is infeasible and the graph is
compiled unsplit with the reason (:class:`UnsplittableGraphError`). :func:`check_pools`
verifies the final order of every schedule, and :func:`unsplit_pool_violation` the unsplit
program's node order.

A backend whose wait phase does work (DeepEP low-latency's receive hook, the emulated link's
unpack) gets a second comm unit per op, its *receive* (``phase="receive"``), on the backend's
stream; the issue (a *send*) then costs its launch and its transfer is the issue's
``latency_us``, in flight while the stream runs other units, on the rank's one link: the
timeline (:class:`~dbo_compile.schedule.Timeline`) runs transfers one at a time.
"""

from __future__ import annotations

import dataclasses
import heapq
import logging
from dataclasses import dataclass, field
from typing import Any

import networkx as nx
import torch
import torch.fx as fx

from dbo_compile.config import DboConfig
from dbo_compile.errors import ScheduleError, UnsplittableGraphError
from dbo_compile.ops.comm import comm_backend_of, comm_spec_of
from dbo_compile.ops.registry import (
    comm_kind,
    is_getitem,
    is_receive,
    is_wait,
    op_arg,
    step_state_key,
)
from dbo_compile.passes.cost_model import CostModel
from dbo_compile.passes.manager import CompileState, GraphPass
from dbo_compile.passes.meta import dbo_meta, set_stream
from dbo_compile.schedule import COMM, COMPUTE, Schedule, Timeline, Unit, predecessors, simulate

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


@dataclasses.dataclass
class PoolPlan:
    """The result pools of a graph's comm units, as the schedulers and the checker use them.

    Attributes:
        pools: pool key -> ``{"live": S, "in_flight": F}`` (``None``: no limit).
        pool_of: issue unit id -> its pool key (only units that draw from a pool).
        receive_of: issue unit id -> the id of its receive unit (backends with one).
            readers: issue unit id -> the units reading its results through views (itself
            excluded; a later call reading the results it overwrites reads them first).
        escapes: issue unit ids whose results reach the graph's outputs (they must stay alive
            past the step).
    """

    pools: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    pool_of: dict[int, str] = dataclasses.field(default_factory=dict)
    receive_of: dict[int, int] = dataclasses.field(default_factory=dict)
    readers: dict[int, set[int]] = dataclasses.field(default_factory=dict)
    escapes: set[int] = dataclasses.field(default_factory=set)

    def remap(self, remap: dict[int, int]) -> PoolPlan:
        return PoolPlan(self.pools, {remap[k]: v for k, v in self.pool_of.items()},
                        {remap[k]: remap[v] for k, v in self.receive_of.items()},
                        {remap[k]: {remap[r] for r in v} for k, v in self.readers.items()},
                        {remap[k] for k in self.escapes})


def _aliases(node: fx.Node) -> bool:
    """``node``'s value is (a view of) its first input's: waits, ``getitem``, view ops."""
    if is_wait(node) or is_getitem(node):
        return True
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and (
        target.is_view or target._opname in ("alias", "detach"))


def _readers(issue: fx.Node, node_unit: dict[fx.Node, int]) -> tuple[set[int], bool]:
    """Units holding a node that reads ``issue``'s results through alias-preserving nodes, and
    whether the results reach the graph output."""
    readers: set[int] = set()
    escapes = False
    frontier = [issue]
    seen = {issue}
    while frontier:
        n = frontier.pop()
        for user in n.users:
            if user in seen:
                continue
            seen.add(user)
            if user.op == "output":
                escapes = True
            elif _aliases(user) and user.args and user.args[0] is n:
                frontier.append(user)
            elif user in node_unit:
                readers.add(node_unit[user])
    return readers, escapes


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
    plan = _pool_plan(ordered, node_unit)
    units, sends = _label_units(ordered, [keys.get(ns[0]) for ns in ordered])
    return UnitGraph(ordered, units, sorted(deps), sorted(hidden), plan, sends)


def _pool_plan(ordered: list[list[fx.Node]], node_unit: dict[fx.Node, int]) -> PoolPlan:
    plan = PoolPlan()
    for i, ns in enumerate(ordered):
        head = ns[0]
        kind = comm_kind(head)
        if kind is None:
            if is_receive(head):
                plan.receive_of[node_unit[head.args[0]]] = i
            continue
        backend = comm_backend_of(head)
        pool = backend.pool_of(kind) if backend is not None else None
        if pool is None or (pool.live is None and pool.in_flight is None):
            continue
        spec = comm_spec_of(head)
        key = f"{spec}|{pool.name}|{op_arg(head, 'group_name', '')}"
        plan.pools[key] = {"live": pool.live, "in_flight": pool.in_flight}
        plan.pool_of[i] = key
        readers, escapes = _readers(head, node_unit)
        plan.readers[i] = readers - {i}
        if escapes:
            plan.escapes.add(i)
    return plan


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


class _PoolState:
    """The pools' rotation while a scheduler places units (module docstring)."""

    def __init__(self, plan: PoolPlan, by_id: dict[int, Unit]):
        self.plan, self.by_id = plan, by_id
        self.calls: dict[str, list[int]] = {k: [] for k in plan.pools}
        self.added: list[tuple[int, int]] = []

    def needs(self, u: int) -> list[int]:
        """The units issue ``u`` must follow if it is the next call of its pool."""
        key = self.plan.pool_of.get(u)
        if key is None:
            return []
        calls, limits = self.calls[key], self.plan.pools[key]
        need: list[int] = []
        live, in_flight = limits["live"], limits["in_flight"]
        if live is not None and len(calls) >= live:
            # a call reading the results it overwrites (a combine, its dispatch's handle) reads
            # its inputs before it writes: not a hazard
            need += sorted(self.plan.readers[calls[len(calls) - live]] - {u})
        if in_flight is not None and len(calls) >= in_flight:
            prev = calls[len(calls) - in_flight]
            need.append(self.plan.receive_of.get(prev, prev))
        return need

    def ready(self, u: int, placed: set[int]) -> bool:
        return all(n in placed for n in self.needs(u))

    def place(self, u: int, deps: set[tuple[int, int]]) -> None:
        key = self.plan.pool_of.get(u)
        if key is None:
            return
        for n in self.needs(u):
            if (n, u) not in deps:
                self.added.append((n, u))
        self.calls[key].append(u)

    def infeasible(self, blocked: list[int], placed: set[int], num_ubatches: int) -> str:
        """Why no unit can be placed (the units in ``blocked`` wait for pool edges)."""
        u = min(blocked)
        key = self.plan.pool_of[u]
        spec, pool, _ = key.split("|")
        limits = self.plan.pools[key]
        missing = [self.by_id[n].name for n in self.needs(u) if n not in placed]
        what = ", ".join(f"{k}={v}" for k, v in limits.items() if v is not None)
        return (f"comm backend {spec!r} declares pool {pool!r} ({what}); no order of the split "
                f"program honours it at num_ubatches={num_ubatches}: call "
                f"{self.by_id[u].name} (call {len(self.calls[key])} of the pool) must wait for "
                f"{missing}, which need results of calls not yet issued (e.g. joined experts "
                "reading more results at once than the pool keeps)")


def _check_escapes(plan: PoolPlan, by_id: dict[int, Unit]) -> None:
    for u in sorted(plan.escapes):
        limits = plan.pools[plan.pool_of[u]]
        if limits["live"] is not None:
            raise UnsplittableGraphError(
                f"a graph output aliases the result of {by_id[u].name}, drawn from pool "
                f"{plan.pool_of[u].split('|')[1]!r} of comm backend "
                f"{plan.pool_of[u].split('|')[0]!r}, which later calls overwrite "
                f"(live={limits['live']}); return a copy (y.clone()) from the model")


def _list_order(units: list[Unit], deps: list[tuple[int, int]], plan: PoolPlan | None = None,
                num_ubatches: int = 2) -> tuple[list[int], list[tuple[int, int]]]:
    """Step 3: earliest-start list scheduling over two in-order streams (simulated), honouring
    the result pools; returns the order and the pool edges it added.

    Raises:
        UnsplittableGraphError: no order honours the pools.
    """
    plan = plan or PoolPlan()
    preds = predecessors(units, deps)
    succs: dict[int, list[int]] = {u.id: [] for u in units}
    for a, b in deps:
        succs[a].append(b)
    missing = {u.id: len(preds[u.id]) for u in units}
    ready = sorted(i for i, m in missing.items() if m == 0)
    timeline = Timeline(preds)
    order: list[int] = []
    placed: set[int] = set()
    by_id = {u.id: u for u in units}
    _check_escapes(plan, by_id)
    pools = _PoolState(plan, by_id)
    dep_set = set(deps)
    # bottom level: the longest cost path from a unit to the end of the step
    bottom: dict[int, float] = {}
    dag = nx.DiGraph(sorted(deps))
    dag.add_nodes_from(by_id)
    for i in reversed(list(nx.lexicographical_topological_sort(dag))):
        bottom[i] = by_id[i].cost_us + by_id[i].latency_us + max(
            (bottom[s] for s in succs[i]), default=0.0)

    # The key of step 3 is (start, comm first, -bottom level, ubatch, id); only the start
    # changes as units are placed: max(free time of the unit's stream, the time its latest
    # predecessor's results are ready), the latter fixed once the unit is ready. So per stream,
    # the ready units whose predecessors were ready by the stream's free time all start then
    # (ordered by the rest of the key) and the others at their own ready time: two heaps per
    # stream, where a min over the ready list, recomputing every start, was quadratic in the
    # depth of the model. A unit drawing from a result pool also waits for the units the pool
    # names, which change as the pool's calls are placed: those (a few comm units at a time)
    # stay in a list whose starts are computed afresh at every step, as before.
    rest = {i: (0 if by_id[i].kind == COMM else 1, -round(bottom[i], 6),
                -1 if by_id[i].ubatch is None else by_id[i].ubatch, i) for i in by_id}
    waiting: dict[str, list] = {COMPUTE: [], COMM: []}  # (round(ready time), rest, ready time)
    startable: dict[str, list] = {COMPUTE: [], COMM: []}  # rest
    pooled: list[int] = []  # ready units drawing from a pool

    def make_ready(i: int) -> None:
        if i in plan.pool_of:
            pooled.append(i)
            return
        t = max((timeline.ready[p] for p in preds[i]), default=0.0)
        heapq.heappush(waiting[by_id[i].stream], (round(t, 6), rest[i], t))

    for i in ready:
        make_ready(i)
    while any(waiting.values()) or any(startable.values()) or pooled:
        best = None  # (round(start), rest, stream, where the unit waits)
        for stream in (COMPUTE, COMM):
            free = timeline.free[stream]
            while waiting[stream] and waiting[stream][0][2] <= free:
                heapq.heappush(startable[stream], heapq.heappop(waiting[stream])[1])
            if startable[stream]:
                cand = (round(free, 6), startable[stream][0], stream, "startable")
                best = cand if best is None or cand[:2] < best[:2] else best
            if waiting[stream]:
                top = waiting[stream][0]
                cand = (top[0], top[1], stream, "waiting")
                best = cand if best is None or cand[:2] < best[:2] else best
        for i in pooled:
            if pools.ready(i, placed):
                cand = (round(timeline.start_of(by_id[i], pools.needs(i)), 6), rest[i],
                        by_id[i].stream, "pooled")
                best = cand if best is None or cand[:2] < best[:2] else best
        if best is None:
            raise UnsplittableGraphError(pools.infeasible(pooled, placed, num_ubatches))
        _, key_rest, stream, where = best
        chosen = key_rest[-1]
        if where == "pooled":
            pooled.remove(chosen)
        else:
            heapq.heappop(startable[stream] if where == "startable" else waiting[stream])
        timeline.place(by_id[chosen], pools.needs(chosen))
        pools.place(chosen, dep_set)
        order.append(chosen)
        placed.add(chosen)
        for s in succs[chosen]:
            missing[s] -= 1
            if missing[s] == 0:
                make_ready(s)
    if len(order) != len(units):
        raise ScheduleError("list scheduler could not place every unit (cyclic deps)")
    return order, pools.added


def _naive_order(units: list[Unit], deps: list[tuple[int, int]], plan: PoolPlan | None = None,
                 num_ubatches: int = 2) -> tuple[list[int], list[tuple[int, int]]]:
    """Per-ubatch stage lists interleaved round-robin: A0 A1 | D0 D1 | ... (no cross-layer);
    a lane whose next unit waits for a pool edge waits, the others go on.

    Raises:
        UnsplittableGraphError: no lane can go on because of the result pools.
    """
    plan = plan or PoolPlan()
    dag = nx.DiGraph(sorted(deps))
    dag.add_nodes_from(u.id for u in units)
    by_id = {u.id: u for u in units}
    _check_escapes(plan, by_id)
    pools = _PoolState(plan, by_id)
    dep_set = set(deps)
    per_ubatch: dict[Any, list[int]] = {}
    for i in nx.lexicographical_topological_sort(dag):
        u = by_id[i]
        per_ubatch.setdefault(-1 if u.ubatch is None else u.ubatch, []).append(u.id)
    lanes = [per_ubatch[k] for k in sorted(per_ubatch)]
    order: list[int] = []
    placed: set[int] = set()
    preds: dict[int, set[int]] = {u.id: set() for u in units}
    for a, b in deps:
        preds[b].add(a)
    pos = [0] * len(lanes)
    while len(order) < len(units):
        progressed = False
        for li, lane in enumerate(lanes):
            if pos[li] >= len(lane):
                continue
            nxt = lane[pos[li]]
            if preds[nxt] <= placed and pools.ready(nxt, placed):
                pools.place(nxt, dep_set)
                order.append(nxt)
                placed.add(nxt)
                pos[li] += 1
                progressed = True
        if not progressed:
            heads = [lane[pos[li]] for li, lane in enumerate(lanes) if pos[li] < len(lane)]
            blocked = [h for h in heads if preds[h] <= placed]
            if blocked and all(not pools.ready(h, placed) for h in blocked):
                raise UnsplittableGraphError(pools.infeasible(blocked, placed, num_ubatches))
            raise ScheduleError("naive order is blocked (a ubatch depends on a later unit)")
    return order, pools.added


def pool_plan_of(graph: fx.Graph, schedule: Schedule) -> PoolPlan:
    """The result pools of ``schedule``'s comm units (ids of ``schedule``), recomputed from the
    split graph it orders (for :func:`check_pools` on a schedule made elsewhere)."""
    nodes = {n.name: n for n in graph.nodes}
    ordered = [[nodes[name] for name in u.nodes] for u in schedule.units]
    node_unit = {n: i for i, ns in enumerate(ordered) for n in ns}
    return _pool_plan(ordered, node_unit)


def check_pools(schedule: Schedule, plan: PoolPlan) -> None:
    """Verify that ``schedule`` (units in host order) honours the result pools: for the
    ``k``-th call of a pool, every reader of call ``k - live`` and the receive of call
    ``k - in_flight`` precede it on the device (same stream earlier in host order, or joined
    by a dependency path through event edges).

    Raises:
        ScheduleError: a call can run before a unit it must follow (names both).
    """
    if not plan.pool_of:
        return
    g = nx.DiGraph()
    g.add_nodes_from(u.id for u in schedule.units)
    last: dict[str, int] = {}
    for u in schedule.units:
        if u.stream in last:
            g.add_edge(last[u.stream], u.id)
        last[u.stream] = u.id
    g.add_edges_from(schedule.deps)
    names = {u.id: u.name for u in schedule.units}
    calls: dict[str, list[int]] = {}
    for u in schedule.units:
        key = plan.pool_of.get(u.id)
        if key is None:
            continue
        seq = calls.setdefault(key, [])
        limits = plan.pools[key]
        must: list[tuple[int, str]] = []  # (a unit that must precede u, why); u itself is fine
        if limits["live"] is not None and len(seq) >= limits["live"]:
            prev = seq[len(seq) - limits["live"]]
            must += [(r, f"it overwrites the results {names[r]} reads") for r in plan.readers[prev]]
        if limits["in_flight"] is not None and len(seq) >= limits["in_flight"]:
            prev = seq[len(seq) - limits["in_flight"]]
            r = plan.receive_of.get(prev, prev)
            must.append((r, f"at most {limits['in_flight']} call(s) of the pool in flight"))
        for r, why in must:
            if r != u.id and not nx.has_path(g, r, u.id):
                raise ScheduleError(f"pool {key}: {names[u.id]} may run before {names[r]} "
                                    f"({why})")
        seq.append(u.id)


def unsplit_pool_violation(graph: fx.Graph) -> str | None:
    """Whether the unsplit program (``graph``'s node order, one stream, each comm op complete
    in its call) breaks a declared ``live`` limit: why, or ``None``."""
    nodes = list(graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    calls: dict[str, list[fx.Node]] = {}
    for n in nodes:
        kind = comm_kind(n)
        backend = comm_backend_of(n) if kind is not None else None
        pool = backend.pool_of(kind) if backend is not None else None
        if pool is None or pool.live is None:
            continue
        key = f"{comm_spec_of(n)}|{pool.name}|{op_arg(n, 'group_name', '')}"
        seq = calls.setdefault(key, [])
        if len(seq) >= pool.live:
            prev = seq[len(seq) - pool.live]
            node_unit = {m: order[m] for m in nodes if m is not prev}
            readers, _ = _readers(prev, node_unit)
            late = [nodes[r] for r in sorted(readers) if r > order[n]]
            if late:
                return (f"{late[0].name} reads the result of {prev.name} after {n.name}, which "
                        f"overwrites it (pool {key}, live={pool.live})")
        seq.append(n)
    return None


def minimal_event_edges(units: list[Unit], deps: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Step 4: cross-stream edges of the transitive reduction of stream order + deps.

    ``units`` are in host order, which every dep and every stream-order edge follows (a
    topological order). A cross-stream edge ``a -> b`` is implied by another path exactly when
    another successor ``c`` of ``a`` reaches ``b``; and since each stream is a chain, ``c``
    reaches ``b`` exactly when ``c`` reaches some unit at or before ``b`` on ``b``'s stream.
    So one reverse pass computes, per unit and stream, the earliest position on that stream
    it reaches, and each edge is then tested in constant time per successor: O(units + deps),
    where a general transitive reduction (``networkx``, a search per unit) was quadratic in
    the depth of the model.
    """
    stream = {u.id: u.stream for u in units}
    position: dict[int, int] = {}  # index on its own stream
    succs: dict[int, set[int]] = {u.id: set() for u in units}
    last: dict[str, int] = {}
    count: dict[str, int] = {}
    for u in units:  # host order
        if u.stream in last:
            succs[last[u.stream]].add(u.id)
        last[u.stream] = u.id
        position[u.id] = count.get(u.stream, 0)
        count[u.stream] = position[u.id] + 1
    for a, b in deps:
        succs[a].add(b)
    streams = sorted(set(stream.values()))
    never = len(units) + 1
    earliest: dict[int, dict[str, int]] = {}
    for u in reversed(units):
        reach = {s: never for s in streams}
        reach[u.stream] = position[u.id]
        for c in succs[u.id]:
            for s, p in earliest[c].items():
                if p < reach[s]:
                    reach[s] = p
        earliest[u.id] = reach
    out = set()
    for a, b in deps:
        if stream[a] == stream[b]:
            continue
        sb, pb = stream[b], position[b]
        if not any(c != b and earliest[c][sb] <= pb for c in succs[a]):
            out.add((a, b))
    return sorted(out)


def schedule_units(units: list[Unit], deps: list[tuple[int, int]], hidden: list[tuple[int, int]],
                   config: DboConfig, num_ubatches: int, plan: PoolPlan | None = None,
                   comm_backends: list[str] | None = None) -> Schedule:
    """Order ``units`` (steps 3-4) and return the :class:`Schedule` with ids in host order.

    Raises:
        UnsplittableGraphError: no order honours the comm backends' result pools.
    """
    plan = plan or PoolPlan()
    order, added = (_list_order if config.scheduler == "list" else _naive_order)(
        units, deps, plan, num_ubatches)
    deps = sorted(set(deps) | set(added))
    hidden = sorted(set(hidden) | set(added))
    remap = {old: new for new, old in enumerate(order)}
    new_units = []
    for old in order:
        u = units[old]
        u.id = remap[old]
        new_units.append(u)
    deps = sorted((remap[a], remap[b]) for a, b in deps)
    hidden = sorted((remap[a], remap[b]) for a, b in hidden)
    makespan = simulate(new_units, deps)
    events = minimal_event_edges(new_units, deps)
    schedule = Schedule(
        units=new_units, deps=deps, hidden_deps=hidden, event_edges=events,
        num_ubatches=num_ubatches, scheduler=config.scheduler,
        config_fingerprint=config.fingerprint(),
        predicted_step_us=round(makespan, 3),
        serial_us=round(sum(u.cost_us + u.latency_us for u in new_units), 3),
        pools=dict(sorted(plan.pools.items())), comm_backends=sorted(comm_backends or []),
    )
    check_pools(schedule, plan.remap(remap))
    return schedule


def stream_assign(graph: fx.Graph, config: DboConfig, token_symbols: frozenset,
                  num_ubatches: int, units_of: UnitGraph | None = None) -> Schedule:
    """Build units, schedule them and annotate nodes with ``unit`` and ``stream``.

    Args:
        graph: the split graph after :func:`~dbo_compile.passes.insert_yields.insert_yields`.
        config: scheduler choice and cost-model figures.
        token_symbols: symbols of the token/request dims (substituted by the cost model).
        num_ubatches: number of ubatch copies in ``graph``.
        units_of: ``unit_graph(graph)``, shared by the schedule candidates of ``graph``
            (default: found here).

    Raises:
        ScheduleError: the unit graph has a cycle.
        UnsplittableGraphError: no order honours the comm backends' result pools.
    """
    cost = CostModel(config, token_symbols, num_ubatches)
    ug = units_of if units_of is not None else unit_graph(graph)
    units, deps, hidden, plan = ug.units(cost), list(ug.deps), list(ug.hidden), ug.plan
    for u in units:
        u.cost_us = round(u.cost_us, 3)
    specs = sorted({s for n in graph.nodes if comm_kind(n) is not None
                    for s in [comm_spec_of(n)] if s is not None})
    schedule = schedule_units(units, deps, hidden, config, num_ubatches, plan, specs)
    by_name = {n.name: n for n in graph.nodes}
    for u in schedule.units:
        for name in u.nodes:
            node = by_name[name]
            dbo_meta(node)["unit"] = u.id
            set_stream(node, u.stream)
    for n in graph.nodes:
        if is_wait(n) and not is_receive(n):
            set_stream(n, COMPUTE)
    return schedule


def _run(gm: fx.GraphModule, st: CompileState) -> None:
    units_of = st.unit_graphs.get(id(gm.graph))
    if units_of is None:  # the first candidate of this split graph finds its units
        units_of = st.unit_graphs[id(gm.graph)] = unit_graph(gm.graph)
    st.schedule = stream_assign(gm.graph, st.candidate.apply(st.config), st.token_symbols,
                                st.config.num_ubatches, units_of)


PASS = GraphPass("stream_assign", _run, reads=("candidate", "token_symbols"),
                 writes=("schedule", "unit_graphs"), changes_graph=False)
