"""The package's one timer (``dbo_compile/timing.py``): what it calls and what it returns; on
CPU its wall-clock form, on a GPU (marker ``gpu``) CUDA events and a captured graph's replay.
It asserts what is called and how samples are formed, never how long anything took."""

from __future__ import annotations

import pytest
import torch

from dbo_compile.errors import TimingError
from dbo_compile.timing import graph_median_us, median_us, samples_us


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
