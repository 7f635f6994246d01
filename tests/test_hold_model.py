"""The scheduler's hold model (``Timeline(preds, hold_fraction=f)``): a transfer holds a share
``f`` of the device's SMs for its duration (the emulated backend's ``hold_sms``,
dbo_compile/ops/emulated/hold.py; DeepEP's normal-mode kernels hold 20-24 SMs), its hold
starting once the compute unit running at its begin has ended, and compute beside a hold runs
at ``1 - f`` of its pace. Every expected figure is worked out by hand in the test (µs)."""

from __future__ import annotations

import random

import pytest
import torch

from dbo_compile.config import DboConfig
from dbo_compile.errors import DboConfigError, ScheduleError
from dbo_compile.passes import stream_assign
from dbo_compile.passes.cost_model import DEFAULT_DEVICE_SMS, hold_fraction
from dbo_compile.passes.ordering import list_order
from dbo_compile.passes.pipeline import resolve_device_defaults
from dbo_compile.schedule import COMM, COMPUTE, Timeline, Unit, predecessors, simulate


def _unit(i, stream, cost, latency=0.0, ubatch=0, label=None):
    return Unit(i, stream, stream, ubatch, label or ("D" if stream == COMM else "A"), None,
                [f"n{i}"], cost, latency_us=latency)


def _place_all(units, deps, f, order=None):
    tl = Timeline(predecessors(units, deps), hold_fraction=f)
    by_id = {u.id: u for u in units}
    times = {i: tl.place(by_id[i]) for i in (order or [u.id for u in units])}
    return tl, times


def test_compute_fully_inside_a_hold_runs_at_1_minus_f():
    # a transfer of 200 µs holds its SMs from 0; a 100 µs compute unit beside it runs at 0.75
    units = [_unit(0, COMM, 0.0, latency=200.0), _unit(1, COMPUTE, 100.0)]
    tl, t = _place_all(units, [], 0.25)
    assert tl.holds[0] == (0.0, 200.0)
    assert t[1] == pytest.approx((0.0, 100.0 / 0.75))
    assert tl.ready[0] == 200.0 and tl.makespan == 200.0


def test_compute_past_the_hold_end_runs_at_full_pace_there():
    # hold [0, 100): 75 µs of work done by 100, the other 25 at full pace: ends at 125
    units = [_unit(0, COMM, 0.0, latency=100.0), _unit(1, COMPUTE, 100.0)]
    _, t = _place_all(units, [], 0.25)
    assert t[1] == pytest.approx((0.0, 125.0))


def test_a_hold_waits_for_the_compute_unit_running_at_its_begin():
    # A (0-50) fills the SMs; D issued 0-10, its copies 10-110, but its SMs free at 50: the
    # hold is [50, 150), D's results ready at 150 (later than the copies' 110), the comm
    # stream busy until 150; B beside the hold runs 40 µs of work at 0.75: 50 + 53.33
    units = [_unit(0, COMPUTE, 50.0), _unit(1, COMM, 10.0, latency=100.0),
             _unit(2, COMPUTE, 40.0), _unit(3, COMM, 5.0, ubatch=1)]
    tl, t = _place_all(units, [], 0.25)
    assert tl.transfers[1] == (10.0, 110.0)
    assert tl.holds[1] == (50.0, 150.0)
    assert tl.ready[1] == 150.0 and tl.free[COMM] == 155.0
    assert t[2] == pytest.approx((50.0, 50.0 + 40.0 / 0.75))
    assert t[3] == (150.0, 155.0)  # the next comm unit waits for the hold


def test_compute_across_two_holds_and_the_gap_between():
    # D1: hold [0, 100). X (25 µs) beside it: 0-33.33. D2 (issue 50 µs, after X) 100-150, hold
    # [150, 250). Y (120 µs, after X) from 33.33: 50 µs of work by 100 (66.67 held), 50 more
    # by 150 (free), the last 20 at 0.75 inside the second hold: 150 + 26.67
    units = [_unit(0, COMM, 0.0, latency=100.0), _unit(1, COMPUTE, 25.0),
             _unit(2, COMM, 50.0, latency=100.0), _unit(3, COMPUTE, 120.0)]
    deps = [(1, 2), (1, 3)]
    tl, t = _place_all(units, deps, 0.25)
    assert t[1] == pytest.approx((0.0, 100.0 / 3))
    assert tl.holds[2] == (150.0, 250.0)
    assert t[3] == pytest.approx((100.0 / 3, 150.0 + 20.0 / 0.75))


@pytest.mark.parametrize("f", [-0.1, 1.0, 1.5, float("nan")])
def test_a_hold_fraction_outside_0_1_is_refused(f):
    with pytest.raises(ScheduleError, match="hold_fraction"):
        Timeline({}, hold_fraction=f)


def _old_place(units, deps):
    """The timeline as it was before the hold model (a copy of ``Timeline.place``)."""
    preds = predecessors(units, deps)
    free, link_free, ready, out = {COMPUTE: 0.0, COMM: 0.0}, 0.0, {}, {}
    for u in units:
        start = max([free[u.stream]] + [ready[p] for p in preds[u.id]])
        end = start + u.cost_us
        if u.latency_us > 0:
            begin = max(end, link_free)
            link_free = begin + u.latency_us
            ready[u.id] = link_free
        else:
            ready[u.id] = end
        free[u.stream] = end
        out[u.id] = (start, end)
    return out, max(ready.values(), default=0.0)


def test_hold_fraction_0_is_the_timeline_of_before():
    rng = random.Random(3)
    for _ in range(300):
        n = rng.randint(1, 25)
        units = [_unit(i, rng.choice([COMM, COMPUTE]), round(rng.uniform(0, 10), 1))
                 for i in range(n)]
        for u in units:
            u.latency_us = rng.choice([0.0, 3.0, 7.5]) if u.stream == COMM else 0.0
        deps = [(a, b) for a in range(n) for b in range(a + 1, n) if rng.random() < 0.2]
        old, span = _old_place(units, deps)
        tl, t = _place_all(units, deps, 0.0)
        assert t == old and tl.makespan == span and not tl.holds


def _two_dispatches():
    """D0 and D1 (issue 1 µs, transfer 100 µs), A0 (20 µs), B1 (30 µs, after A0)."""
    units = [_unit(0, COMM, 1.0, latency=100.0, ubatch=0), _unit(1, COMM, 1.0, latency=100.0,
                                                                  ubatch=1),
             _unit(2, COMPUTE, 20.0, ubatch=0), _unit(3, COMPUTE, 30.0, ubatch=1)]
    return units, [(2, 3)]


def test_list_order_puts_compute_ahead_of_a_dispatch_held_back_by_a_hold():
    # Without holds D1 is issued at 1, beside the compute: [D0, A0, D1, B1]. With f=0.5 the
    # comm stream is busy with D0's hold [1, 101), so B1 (ready at 1 + 19/0.5 = 39; itself
    # 39 + 30/0.5 = 99) goes ahead of D1: [D0, A0, B1, D1], and the simulated step agrees.
    units, deps = _two_dispatches()
    assert list_order(units, deps)[0] == [0, 2, 1, 3]
    order, _ = list_order(units, deps, hold_fraction=0.5)
    assert order == [0, 2, 3, 1]
    placed = [units[i] for i in order]
    span = simulate(placed, deps, hold_fraction=0.5)
    assert (units[2].start_us, units[2].end_us) == pytest.approx((0.0, 39.0))
    assert (units[3].start_us, units[3].end_us) == pytest.approx((39.0, 99.0))
    # D1 issued 101-102; its copies 102-202 (the link free at 101), its hold [102, 202)
    assert (units[1].start_us, units[1].end_us) == (101.0, 102.0)
    assert span == pytest.approx(202.0)


def _emulated(**extra):
    return DboConfig(comm_backend="emulated", comm_backend_options={"world_size": 8, **extra})


def test_hold_fraction_comes_from_hold_sms_and_the_device_sms():
    assert DEFAULT_DEVICE_SMS == 132
    assert hold_fraction(DboConfig()) == 0.0
    assert hold_fraction(_emulated()) == 0.0
    assert hold_fraction(_emulated(hold_sms=24)) == 24 / 132
    assert hold_fraction(_emulated(hold_sms=24).replace(device_sms=78)) == 24 / 78


@pytest.mark.parametrize("value", [0, -4, True, 2.5, "132"])
def test_a_bad_device_sms_is_refused(value):
    with pytest.raises(DboConfigError, match=f"device_sms={value!r}"):
        DboConfig(device_sms=value)


def test_hold_sms_at_or_above_the_device_sms_is_refused():
    with pytest.raises(DboConfigError, match="hold_sms=24 .* device_sms=24"):
        hold_fraction(_emulated(hold_sms=24).replace(device_sms=24))


def test_device_sms_is_in_the_fingerprint_only_when_given():
    assert DboConfig(device_sms=None).fingerprint() == DboConfig().fingerprint()
    assert DboConfig(device_sms=78).fingerprint() != DboConfig().fingerprint()


def test_device_sms_resolves_from_the_cuda_device_where_a_transfer_holds_sms(monkeypatch):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        on_gpu = torch.empty(4, 8, device="cuda")

    class Props:
        multi_processor_count = 78

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index=None: Props())
    assert resolve_device_defaults(_emulated(hold_sms=24), [on_gpu]).device_sms == 78
    # no hold, or no CUDA input: left unset (the default figure; the fingerprint of before)
    assert resolve_device_defaults(_emulated(), [on_gpu]).device_sms is None
    assert resolve_device_defaults(_emulated(hold_sms=24), [torch.ones(2)]).device_sms is None
    # given: kept
    given = _emulated(hold_sms=24).replace(device_sms=114)
    assert resolve_device_defaults(given, [on_gpu]).device_sms == 114


def test_schedule_units_schedules_and_predicts_with_the_hold():
    """``hold_sms`` in ``comm_backend_options`` reaches the list scheduler's timeline and the
    predicted step: with 66 of 132 SMs held (f = 0.5) the case of the list-order test."""
    units, deps = _two_dispatches()
    sched = stream_assign.schedule_units(units, deps, [], _emulated(hold_sms=66), 2)
    assert [u.name for u in sched.units] == ["D0", "A0", "A1", "D1"]
    assert sched.predicted_step_us == pytest.approx(202.0)
    assert sched.meta["hold_fraction"] == 0.5
    units, deps = _two_dispatches()
    plain = stream_assign.schedule_units(units, deps, [], _emulated(), 2)
    assert [u.name for u in plain.units] == ["D0", "A0", "D1", "A1"]
    assert "hold_fraction" not in plain.meta


def test_a_calibrated_prediction_of_a_held_schedule_uses_the_hold():
    """``predict_split`` re-times a schedule with calibrated costs on the timeline of its
    ``meta["hold_fraction"]``: the hold case predicts 202 µs (D1's hold [102, 202)); the same
    order without the hold 201 (D1 issued at 1, its copies after D0's, 101-201)."""
    from dbo_compile.passes.calibrate import predict_split

    units, deps = _two_dispatches()
    sched = stream_assign.schedule_units(units, deps, [], _emulated(hold_sms=66), 2)
    features = {str(u.id): [("c", u.latency_us or u.cost_us, 0.0, 0.0)] for u in sched.units}
    step = {"schedule": sched.to_dict(), "features": features}
    assert predict_split(lambda f: f[1], step)[0] == pytest.approx(202.0)
    del step["schedule"]["meta"]["hold_fraction"]
    assert predict_split(lambda f: f[1], step)[0] == pytest.approx(201.0)
