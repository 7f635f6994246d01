"""The scheduling pass: group the split graph into units, list-schedule them on two streams,
add events; annotate the nodes with the schedule chosen.

The result is a :class:`~dbo_compile.schedule.Schedule` (ground floor), which codegen runs.

A *unit* is either one comm op (its issue phase, on the comm stream) or a *stage*: a maximal
run of one ubatch's compute between its yield points (on the compute stream). The scheduler
orders units over the whole graph, both ubatches and every layer at once, so it can run
ubatch 0's next-layer attention while ubatch 1's combine of the previous layer is in flight.

Algorithm, one module a step:
  1. Stages (:mod:`~dbo_compile.passes.units`): a compute node of ubatch ``u`` belongs to the
     stage of its ubatch, the waits it depends on and the first comm op depending on it.
  2. Dependencies (:mod:`~dbo_compile.passes.units`): data edges between units, plus the
     edges FX cannot see (in-place inputs such as the KV cache and step-state keys, ubatch
     ``u`` before ``u + 1``; readers of a state input before its write back).
  3. Order (:mod:`~dbo_compile.passes.ordering`): list scheduling on the two simulated
     in-order streams (or the naive per-layer interleave), deterministic.
  4. Event edges (:mod:`~dbo_compile.passes.events`): the cross-stream edges of the transitive
     reduction of stream order + dependencies, one event record and wait each.
Both orders honour the comm backends' result pools (:mod:`~dbo_compile.passes.pools`).

This module runs the steps for one candidate (:func:`stream_assign`, which leaves the graph's
nodes as they are) and writes the chosen schedule's units and streams onto the nodes, once
(:func:`annotate_streams`).
"""

from __future__ import annotations

import logging

import torch.fx as fx

from dbo_compile.config import DboConfig
from dbo_compile.errors import ScheduleError
from dbo_compile.ops.comm import comm_spec_of
from dbo_compile.ops.registry import comm_kind, is_receive, is_wait
from dbo_compile.passes.cost_model import CostModel, hold_fraction
from dbo_compile.passes.events import minimal_event_edges
from dbo_compile.passes.manager import CompileState, GraphPass
from dbo_compile.passes.meta import dbo_meta, set_stream
from dbo_compile.passes.ordering import STAGED_DELTA, list_order, naive_order, staged_order
from dbo_compile.passes.pools import PoolPlan, check_pools, unsplit_pool_violation
from dbo_compile.passes.units import UnitGraph, unit_graph
from dbo_compile.schedule import COMPUTE, Schedule, Unit, simulate

__all__ = ["UnitGraph", "annotate_streams", "schedule_units", "stream_assign", "unit_graph",
           "unsplit_pool_violation"]

log = logging.getLogger(__name__)


def schedule_units(units: list[Unit], deps: list[tuple[int, int]], hidden: list[tuple[int, int]],
                   config: DboConfig, num_ubatches: int, plan: PoolPlan | None = None,
                   comm_backends: list[str] | None = None) -> Schedule:
    """Order ``units`` (steps 3-4) and return the :class:`Schedule` with ids in host order.
    Where the comm backend's transfers hold SMs (its option ``hold_sms``), the list scheduler
    and the predicted step time use the timeline's hold model
    (:func:`~dbo_compile.passes.cost_model.hold_fraction`, recorded as the schedule's
    ``meta["hold_fraction"]``); the naive and staged orders do not simulate, but their
    predicted time does.

    Raises:
        UnsplittableGraphError: no order honours the comm backends' result pools.
        DboConfigError: ``hold_sms`` is not below the device's SMs.
    """
    plan = plan or PoolPlan()
    held = hold_fraction(config)
    if config.scheduler in STAGED_DELTA:
        order, added = staged_order(units, deps, plan, num_ubatches,
                                    delta=STAGED_DELTA[config.scheduler])
    elif config.scheduler == "list":
        order, added = list_order(units, deps, plan, num_ubatches, hold_fraction=held)
    else:
        order, added = naive_order(units, deps, plan, num_ubatches)
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
    makespan = simulate(new_units, deps, held)
    events = minimal_event_edges(new_units, deps)
    schedule = Schedule(
        units=new_units, deps=deps, hidden_deps=hidden, event_edges=events,
        num_ubatches=num_ubatches, scheduler=config.scheduler,
        config_fingerprint=config.fingerprint(),
        predicted_step_us=round(makespan, 3),
        serial_us=round(sum(u.cost_us + u.latency_us for u in new_units), 3),
        pools=dict(sorted(plan.pools.items())), comm_backends=sorted(comm_backends or []),
    )
    if held:
        schedule.meta["hold_fraction"] = held
    check_pools(schedule, plan.remap(remap))
    return schedule


def stream_assign(graph: fx.Graph, config: DboConfig, token_symbols: frozenset,
                  num_ubatches: int, units_of: UnitGraph | None = None) -> Schedule:
    """Build units and schedule them: one candidate's schedule of ``graph``, which is left as
    it is (several candidates schedule one graph; :func:`annotate_streams` writes the chosen
    one's streams onto its nodes).

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
    return schedule_units(units, deps, hidden, config, num_ubatches, plan, specs)


def annotate_streams(graph: fx.Graph, schedule: Schedule) -> None:
    """Annotate the nodes of ``graph`` with ``schedule``: ``meta["dbo"]["unit"]`` (the unit's
    id) and the unit's stream (:func:`~dbo_compile.passes.meta.set_stream`); the wait of an
    issue without a receive unit runs on the compute stream. Called once per split graph, with
    the schedule chosen for it (the candidates' schedules of one graph differ).

    Raises:
        ScheduleError: ``schedule`` names a node that ``graph`` lacks (a schedule of another
            graph).
    """
    by_name = {n.name: n for n in graph.nodes}
    for u in schedule.units:
        for name in u.nodes:
            node = by_name.get(name)
            if node is None:
                raise ScheduleError(f"annotate_streams: unit {u.name} (id {u.id}) names node "
                                    f"{name!r}, which the graph lacks; pass the schedule made "
                                    "for this graph")
            dbo_meta(node)["unit"] = u.id
            set_stream(node, u.stream)
    for n in graph.nodes:
        if is_wait(n) and not is_receive(n):
            set_stream(n, COMPUTE)


def _run(gm: fx.GraphModule, st: CompileState) -> None:
    units_of = st.unit_graphs.get(id(gm.graph))
    if units_of is None:  # the first candidate of this split graph finds its units
        units_of = st.unit_graphs[id(gm.graph)] = unit_graph(gm.graph)
    st.schedule = stream_assign(gm.graph, st.candidate.apply(st.config), st.token_symbols,
                                st.config.num_ubatches, units_of)


PASS = GraphPass("stream_assign", _run, reads=("candidate", "token_symbols"),
                 writes=("schedule", "unit_graphs"), changes_graph=False)
