"""Result pools of the comm units: the plan, the schedulers' rotation state, the checks.

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
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import networkx as nx
import torch
import torch.fx as fx

from dbo_compile.errors import ScheduleError, UnsplittableGraphError
from dbo_compile.ops.comm import comm_backend_of, comm_spec_of
from dbo_compile.ops.registry import comm_kind, is_getitem, is_receive, is_wait, op_arg
from dbo_compile.schedule import Schedule, Unit

log = logging.getLogger(__name__)


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

def pool_plan(ordered: list[list[fx.Node]], node_unit: dict[fx.Node, int]) -> PoolPlan:
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

class PoolState:
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


def check_escapes(plan: PoolPlan, by_id: dict[int, Unit]) -> None:
    for u in sorted(plan.escapes):
        limits = plan.pools[plan.pool_of[u]]
        if limits["live"] is not None:
            raise UnsplittableGraphError(
                f"a graph output aliases the result of {by_id[u].name}, drawn from pool "
                f"{plan.pool_of[u].split('|')[1]!r} of comm backend "
                f"{plan.pool_of[u].split('|')[0]!r}, which later calls overwrite "
                f"(live={limits['live']}); return a copy (y.clone()) from the model")

def pool_plan_of(graph: fx.Graph, schedule: Schedule) -> PoolPlan:
    """The result pools of ``schedule``'s comm units (ids of ``schedule``), recomputed from the
    split graph it orders (for :func:`check_pools` on a schedule made elsewhere)."""
    nodes = {n.name: n for n in graph.nodes}
    ordered = [[nodes[name] for name in u.nodes] for u in schedule.units]
    node_unit = {n: i for i, ns in enumerate(ordered) for n in ns}
    return pool_plan(ordered, node_unit)


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
