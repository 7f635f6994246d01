"""Order the units of a split graph on the two streams (step 3 of the scheduler).

List scheduling (``scheduler="list"``, :func:`list_order`). Simulate the two in-order streams
with the cost model; repeatedly issue the ready unit with the earliest possible start (ties:
comm first, so the collective is launched before the compute it hides behind; then the longest
path to the end of the step, the critical path; then lower ubatch; then graph order).
Where the comm backend's transfers hold SMs
(``hold_sms``), the simulated streams slow the compute beside a transfer and keep the comm
stream busy for its hold (:class:`~dbo_compile.schedule.Timeline`'s hold model).
Deterministic: no timing, data, rank or set order enters. The naive order
(``scheduler="naive"``, :func:`naive_order`) interleaves the ubatches' stage lists round-robin.
The staged order (``scheduler="staged"`` / ``"staged-d2"``, :func:`staged_order`) is SGLang's
two-batch overlap: each ubatch's units cut into stages after each comm issue, the ubatches'
stages taken in turn, ubatch 0 given a head start of ``delta`` stages.

Both orders honour the comm backends' result pools (:mod:`~dbo_compile.passes.pools`): a comm
unit is ready only when the units its pool names are placed, and each order returns the pool
edges it added.
"""

from __future__ import annotations

import heapq
import logging
from typing import Any

import networkx as nx

from dbo_compile.errors import ScheduleError, UnsplittableGraphError
from dbo_compile.passes.pools import PoolPlan, PoolState, check_escapes
from dbo_compile.schedule import COMM, COMPUTE, Timeline, Unit, predecessors

log = logging.getLogger(__name__)


def list_order(units: list[Unit], deps: list[tuple[int, int]], plan: PoolPlan | None = None,
                num_ubatches: int = 2, hold_fraction: float = 0.0
                ) -> tuple[list[int], list[tuple[int, int]]]:
    """Step 3: earliest-start list scheduling over two in-order streams (simulated), honouring
    the result pools; returns the order and the pool edges it added. ``hold_fraction``: the
    share of the device's SMs each transfer holds (the timeline's hold model,
    :class:`~dbo_compile.schedule.Timeline`; 0: none).

    Raises:
        UnsplittableGraphError: no order honours the pools.
        ScheduleError: ``hold_fraction`` outside ``[0, 1)``.
    """
    plan = plan or PoolPlan()
    preds = predecessors(units, deps)
    succs: dict[int, list[int]] = {u.id: [] for u in units}
    for a, b in deps:
        succs[a].append(b)
    missing = {u.id: len(preds[u.id]) for u in units}
    ready = sorted(i for i, m in missing.items() if m == 0)
    timeline = Timeline(preds, hold_fraction)
    order: list[int] = []
    placed: set[int] = set()
    by_id = {u.id: u for u in units}
    check_escapes(plan, by_id)
    pools = PoolState(plan, by_id)
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


def naive_order(units: list[Unit], deps: list[tuple[int, int]], plan: PoolPlan | None = None,
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
    check_escapes(plan, by_id)
    pools = PoolState(plan, by_id)
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


#: the head start of ubatch 0, in stages, of each staged scheduler (SGLang's
#: ``tbo_delta_stages``: 0 for prefill, 2 for decode; docs/references.md)
STAGED_DELTA = {"staged": 0, "staged-d2": 2}


def staged_order(units: list[Unit], deps: list[tuple[int, int]], plan: PoolPlan | None = None,
                 num_ubatches: int = 2, delta: int = 0) -> tuple[list[int], list[tuple[int, int]]]:
    """SGLang's two-batch overlap (TBO) as an order: a schedule candidate the cost model does
    not choose, for the worlds where its figures mislead the list scheduler (V3 EP-32 prefill
    on one H200: SGLang's staged order ran 6-8 % ahead of every list candidate, issue 28).

    Each ubatch's units in a topological order that takes, among the ready units, the one
    whose earliest comm descendant comes first (the dispatch's producers before the shared
    experts, which run beside the combine in flight), cut into *stages* after each comm
    issue. Ubatch 0 runs ``delta`` stages, then the ubatches take turns, one stage each
    (stage ``k`` of ubatch 1 after stage ``k + delta`` of ubatch 0). A turn ends early at a
    unit that waits for a unit not yet placed (the other ubatch's, or a result pool's); the
    stage goes on at that ubatch's next turn. Units of no ubatch run as soon as they are ready.

    Raises:
        ScheduleError: ``delta`` < 0, or no ubatch can go on (cyclic deps).
        UnsplittableGraphError: no ubatch can go on because of the result pools.
    """
    if delta < 0:
        raise ScheduleError(f"staged order: delta must be >= 0 stages, got {delta}")
    plan = plan or PoolPlan()
    by_id = {u.id: u for u in units}
    check_escapes(plan, by_id)
    pools = PoolState(plan, by_id)
    dep_set = set(deps)
    dag = nx.DiGraph(sorted(deps))
    dag.add_nodes_from(by_id)
    if not nx.is_directed_acyclic_graph(dag):
        raise ScheduleError("staged order: the unit graph has a cycle")
    topo = list(nx.lexicographical_topological_sort(dag))
    # per unit, the topological rank of the first comm unit at or below it (a comm unit's own:
    # its descendants rank after it)
    first_comm: dict[int, float] = {}
    for rank, i in reversed(list(enumerate(topo))):
        first_comm[i] = rank if by_id[i].kind == COMM else min(
            (first_comm[s] for s in dag.successors(i)), default=float("inf"))
    lanes: dict[Any, list[list[int]]] = {}
    for ub in sorted({u.ubatch for u in units if u.ubatch is not None}):
        sub = dag.subgraph([u.id for u in units if u.ubatch == ub])
        stage_list: list[list[int]] = [[]]
        for i in nx.lexicographical_topological_sort(sub, key=lambda i: (first_comm[i], i)):
            stage_list[-1].append(i)
            if by_id[i].kind == COMM and by_id[i].phase == "issue":
                stage_list.append([])
        lanes[ub] = [st for st in stage_list if st]
    free = [u.id for u in units if u.ubatch is None]  # in graph order
    order: list[int] = []
    placed: set[int] = set()
    pos = {ub: [0, 0] for ub in lanes}  # (stage, unit within it)

    def can_place(i: int) -> bool:
        return all(p in placed for p in dag.predecessors(i)) and pools.ready(i, placed)

    def place(i: int) -> None:
        pools.place(i, dep_set)
        order.append(i)
        placed.add(i)

    def run_free() -> bool:
        went = False
        for i in [i for i in free if i not in placed]:
            if can_place(i):
                place(i)
                went = True
        return went

    def turn(ub: Any) -> bool:
        """Run ``ub``'s current stage until it ends or a unit waits; True if a unit ran."""
        went = run_free()
        stage_list, (k, j) = lanes[ub], pos[ub]
        if k >= len(stage_list):
            return went
        stage = stage_list[k]
        while j < len(stage) and can_place(stage[j]):
            place(stage[j])
            j, went = j + 1, True
            went |= run_free()
        pos[ub] = [k + 1, 0] if j == len(stage) else [k, j]
        return went

    ubs = sorted(lanes)
    head = ubs[0] if ubs else None
    for _ in range(delta if head is not None else 0):
        if not turn(head):
            break
    while len(order) < len(units):
        went = False
        for ub in ubs:
            went |= turn(ub)
        went |= run_free()
        if not went:
            waiting = [lanes[ub][pos[ub][0]][pos[ub][1]] for ub in ubs
                       if pos[ub][0] < len(lanes[ub])]
            waiting += [i for i in free if i not in placed]
            ready = [i for i in waiting if all(p in placed for p in dag.predecessors(i))]
            if ready and all(not pools.ready(i, placed) for i in ready):
                raise UnsplittableGraphError(pools.infeasible(ready, placed, num_ubatches))
            raise ScheduleError("staged order is blocked (a ubatch waits for a unit no ubatch "
                                "can place)")
    return order, pools.added
