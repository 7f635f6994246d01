"""The package's one timer (``dbo_compile/timing.py``): what it calls and what it returns; on
CPU its wall-clock form, on a GPU (marker ``gpu``) CUDA events and a captured graph's replay.
It asserts what is called and how samples are formed, never how long anything took."""

from __future__ import annotations

import pytest
import torch

from dbo_compile.errors import TimingError
from dbo_compile.timing import graph_median_us, median_us, paired_us, samples_us


def test_cpu_samples_count_the_calls_and_divide_by_reps(monkeypatch):
    calls = []
    clock = iter(range(0, 1000, 1))  # perf_counter advances 1 s per read
    monkeypatch.setattr("dbo_compile.timing.time.perf_counter", lambda: float(next(clock)))
    got = samples_us(lambda: calls.append(1), 3, warmup=2, reps=4, cuda=False)
    assert len(calls) == 2 + 3 * 4  # warm-up calls, then iters x reps timed ones
    assert got == [1e6 / 4] * 3  # one clock read before and after each sample, µs per call


def test_median_is_the_median_of_the_samples(monkeypatch):
    steps = iter([0.0, 3.0, 3.0, 4.0, 4.0, 9.0])  # samples of 3, 1 and 5 s
    monkeypatch.setattr("dbo_compile.timing.time.perf_counter", lambda: next(steps))
    assert median_us(lambda: None, 3, cuda=False) == 3e6


@pytest.mark.parametrize("kwargs", [{"iters": 0}, {"iters": 2, "reps": 0},
                                    {"iters": 2, "warmup": -1}])
def test_asking_for_no_samples_is_an_error(kwargs):
    calls = []
    with pytest.raises(TimingError, match="iters and reps must be >= 1"):
        samples_us(lambda: calls.append(1), cuda=False, **kwargs)
    assert calls == []


class _FakeClock:
    """perf_counter for the paired timer: a call of ``fn(name)`` advances the clock by
    ``cost[name]()`` seconds and is logged."""

    def __init__(self, cost):
        self.now, self.cost, self.log = 0.0, cost, []

    def fn(self, name):
        def call():
            self.log.append(name)
            self.now += self.cost[name]()
        return call


def test_paired_alternates_the_order_and_takes_the_per_round_ratio(monkeypatch):
    """Rounds alternate which side runs first (a b, b a, a b, ...), each side runs ``iters``
    calls per round after its own warm-up, and the ratio is the median over rounds of b / a
    within the round: a drift that slows both sides alike (here every round 1 s slower than
    the last for both) leaves it exact, where medians taken apart would not be."""
    # the drift: the calls of round i cost (1 + i) x (4 timed calls a round, after 2 warm-up)
    def drift(clock_log):
        return 1.0 + max(0, len(clock_log) - 3) // 4

    clock = _FakeClock({"a": lambda: drift(clock.log), "b": lambda: 2.0 * drift(clock.log)})
    monkeypatch.setattr("dbo_compile.timing.time.perf_counter", lambda: clock.now)
    got = paired_us(clock.fn("a"), clock.fn("b"), 2, rounds=3, warmup=1, cuda=False)
    assert clock.log == ["a", "b"] + ["a", "a", "b", "b"] + ["b", "b", "a", "a"] \
        + ["a", "a", "b", "b"]
    assert got["ratio"] == 2.0
    assert got["a_us"] == 2e6 and got["b_us"] == 4e6  # medians over all samples
    assert got["rounds"] == 3 and len(got["ratios"]) == 3


def test_paired_rejects_no_rounds():
    with pytest.raises(TimingError, match="rounds"):
        paired_us(lambda: None, lambda: None, 2, rounds=0, cuda=False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_graph_replay_time_and_static_output():
    x = torch.randn(256, 256, device="cuda")
    seen = []

    def fn():
        seen.append(1)
        return x @ x

    t, out = graph_median_us(fn, 5, reps=3)
    assert t > 0 and len(seen) == 2 * 3  # the warm-up call and the capture, 3 calls each
    torch.testing.assert_close(out, x @ x)
    assert median_us(lambda: x @ x, 5, warmup=1) > 0
