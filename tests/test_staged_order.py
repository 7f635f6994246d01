"""The staged order (``scheduler="staged"`` / ``"staged-d2"``, issue 28): SGLang's two-batch
overlap as a schedule candidate: each ubatch's units cut into stages after each comm issue,
the stages of the ubatches taken in turn, ubatch 0 given a head start of ``delta`` stages."""

from __future__ import annotations

import pytest
import torch

from conftest import last_artifact
from dbo_compile.candidates import SCHEDULE_CANDIDATES, candidates_of
from dbo_compile.config import DboConfig
from dbo_compile.errors import ScheduleError
from dbo_compile.passes.ordering import list_order, naive_order, staged_order
from dbo_compile.schedule import COMM, COMPUTE, Unit
from moe_cases import MIXED_CUT, build, eager_and_compiled


def _moe_units(layers: int = 2, kv_edges: bool = True):
    """Two ubatches of ``layers`` MoE layers: per layer and ubatch attention ``A`` (with the
    gate), dispatch ``D``, experts ``E``, combine ``C``, shared experts ``S`` (reads ``A``'s
    output) and the residual add ``P`` (reads ``C`` and ``S``); ubatch 0's attention of a
    layer before ubatch 1's (the KV-cache edge) with ``kv_edges``. Ids in graph order:
    ubatch 0's layer, then ubatch 1's; ``S`` before ``E`` (the order a trace may give)."""
    units, deps, names = [], [], {}

    def add(label, kind, ub, layer, cost):
        i = len(units)
        units.append(Unit(i, kind, kind, ub, label, layer, [f"n{i}"], cost))
        names[(label, ub, layer)] = i
        return i

    for layer in range(layers):
        for ub in (0, 1):
            a = add("A", COMPUTE, ub, layer, 10.0)
            if layer:
                deps.append((names[("P", ub, layer - 1)], a))
            s = add("S", COMPUTE, ub, layer, 4.0)
            d = add("D", COMM, ub, layer, 8.0)
            e = add("E", COMPUTE, ub, layer, 6.0)
            c = add("C", COMM, ub, layer, 8.0)
            p = add("P", COMPUTE, ub, layer, 1.0)
            deps += [(a, s), (a, d), (d, e), (e, c), (c, p), (s, p)]
            if kv_edges and ub == 1:
                deps.append((names[("A", 0, layer)], a))
    return units, deps, names


def _names(units, order, stream=None):
    by_id = {u.id: u for u in units}
    return [f"{by_id[i].label}{by_id[i].ubatch}L{by_id[i].layer}" for i in order
            if stream is None or by_id[i].stream == stream]


def _is_topological(order, deps):
    pos = {u: k for k, u in enumerate(order)}
    return all(pos[a] < pos[b] for a, b in deps)


def test_delta_0_takes_the_ubatches_stages_in_turn():
    """SGLang's prefill order (delta 0): each ubatch's attention then its dispatch, the other
    ubatch's attention behind it; the experts before the shared experts, which run beside the
    combine in flight; a stage ends after each comm issue."""
    units, deps, _ = _moe_units()
    order, added = staged_order(units, deps, delta=0)
    assert added == [] and sorted(order) == list(range(len(units)))
    assert _is_topological(order, deps)
    assert _names(units, order) == [
        "A0L0", "D0L0", "A1L0", "D1L0", "E0L0", "C0L0", "E1L0", "C1L0",
        "S0L0", "P0L0", "A0L1", "D0L1", "S1L0", "P1L0", "A1L1", "D1L1",
        "E0L1", "C0L1", "E1L1", "C1L1", "S0L1", "P0L1", "S1L1", "P1L1"]


def test_delta_2_gives_ubatch_0_a_head_start_of_two_stages():
    """SGLang's decode order (delta 2): ubatch 0 runs two stages, then the ubatches take turns;
    ubatch 1's first attention is issued after ubatch 0's second dispatch."""
    units, deps, _ = _moe_units()
    order, _ = staged_order(units, deps, delta=2)
    assert _is_topological(order, deps)
    assert _names(units, order)[:12] == [
        "A0L0", "D0L0", "E0L0", "C0L0",  # the head start
        "S0L0", "P0L0", "A0L1", "D0L1", "A1L0", "D1L0", "E0L1", "C0L1"]


def test_the_staged_order_is_neither_the_naive_nor_the_list_order():
    units, deps, _ = _moe_units()
    staged = staged_order(units, deps, delta=0)[0]
    assert staged != naive_order(units, deps)[0]
    assert staged != list_order(units, deps)[0]


def test_a_stage_waiting_for_the_other_ubatch_yields_its_turn():
    """A dependency across the ubatches the stage structure does not know of (ubatch 0's
    experts reading ubatch 1's dispatch, as joined experts do) is honoured: ubatch 0's turn
    ends at the unit that waits, and ubatch 1 goes on."""
    for src, dst in ((("D", 1, 0), ("E", 0, 0)), (("E", 0, 0), ("A", 1, 0))):
        units, deps, names = _moe_units(layers=1)
        deps.append((names[src], names[dst]))
        for delta in (0, 2):
            order, _ = staged_order(units, deps, delta=delta)
            assert _is_topological(order, deps), (src, dst, delta)
            assert sorted(order) == list(range(len(units)))


def test_a_cycle_is_refused():
    units, deps, names = _moe_units(layers=1)
    deps.append((names[("P", 1, 0)], names[("A", 0, 0)]))
    with pytest.raises(ScheduleError):
        staged_order(units, deps, delta=0)


def test_a_negative_delta_is_refused():
    units, deps, _ = _moe_units(layers=1)
    with pytest.raises(ScheduleError, match="delta"):
        staged_order(units, deps, delta=-1)


def test_the_staged_schedulers_are_candidates_and_options():
    assert {"staged", "staged-d2"} <= set(SCHEDULE_CANDIDATES)
    names = [c.name for c in candidates_of(DboConfig(schedule_candidates=("staged",)))]
    assert names == ["list", "staged"]
    assert DboConfig(scheduler="staged-d2").scheduler == "staged-d2"
    assert DboConfig(scheduler="staged").fingerprint() != DboConfig(
        scheduler="staged-d2").fingerprint()


@pytest.mark.parametrize("scheduler", ["staged", "staged-d2"])
def test_the_staged_program_computes_what_eager_does(scheduler):
    """The split program in the staged order equals the eager model (the harness asserts it)
    and its host order is the stage interleave: the later ubatch's first attention is issued
    after the first ubatch's first dispatch."""
    torch._dynamo.reset()
    model, step = build(MIXED_CUT, layers=2)
    eager_and_compiled(model, step, {"split": "always", "scheduler": scheduler})
    sched = last_artifact().schedule
    assert sched.scheduler == scheduler
    first_dispatch = next(u.id for u in sched.units if u.kind == COMM and u.ubatch == 0)
    later_compute = [u.id for u in sched.units
                     if u.kind == COMPUTE and u.ubatch == 1 and u.layer is not None]
    assert later_compute and min(later_compute) > first_dispatch


@pytest.mark.parametrize("scheduler,num_ubatches", [("staged", 3), ("staged-d2", 2)])
def test_staged_with_joined_experts_and_more_ubatches_equals_eager(scheduler, num_ubatches):
    """Joined expert calls belong to no ubatch (they run when both dispatches are in); the
    staged order places them as soon as they are ready, with 2 or 3 ubatches."""
    torch._dynamo.reset()
    model, step = build(MIXED_CUT, layers=2)
    eager, out, _, _ = eager_and_compiled(model, step, {
        "split": "always", "scheduler": scheduler, "join_experts": True,
        "num_ubatches": num_ubatches, "schedule_candidates": False})
    art = last_artifact()
    assert art.is_split and art.schedule.meta["candidate"] == f"{scheduler}+join"
    assert art.schedule.meta["joined_calls"] == 2
    torch.testing.assert_close(out, eager, rtol=0, atol=0)
