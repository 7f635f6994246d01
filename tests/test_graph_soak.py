"""The CUDA-graph runner's soak (dbo_compile/testing/graph_soak.py) on CPU at its tiny size:
the code path of ``python benchmarks/soak.py --gpu`` (which runs on one GPU) end to end, and
each of its checks failing when the runner goes wrong."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from dbo_compile.runtime.cudagraph_runner import CudaGraphRunner
from dbo_compile.testing.graph_soak import GraphSoak

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def soaked():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the soak's own process (2 OpenMP threads on a busy 2-core
    torch._dynamo.reset()     # machine spin against each other: 8x slower)
    yield GraphSoak("cpu", seed=3)
    torch.set_num_threads(threads)


def _run(soaked, steps, check_every=1, p_split=0.6, p_veto=0.1):
    records = []
    for i in range(steps):
        drawn = soaked.draw(i, p_split, p_veto, 0.2, 0.05)
        records.append(soaked.step(*drawn, checked=i % check_every == 0))
    return records


def _failed(r):
    return [k for k in ("ok_decision", "finite", "load_total_ok", "untouched", "ok_out",
                        "ok_load", "ok_kv") if getattr(r, k) is False] + (["err"] if r.err else [])


def test_every_kind_of_step_is_served_and_matches_the_reference(soaked):
    records = _run(soaked, 60, check_every=2)
    assert [(i, _failed(r)) for i, r in enumerate(records) if _failed(r)] == []
    graphs = {r.graph for r in records}
    assert graphs == {"split", "unsplit", "eager"}
    assert {r.bucket for r in records if r.graph != "eager"} == set(soaked.buckets)
    assert any(r.tokens == 1 for r in records) and any(r.vetoed for r in records)
    assert any(r.shared for r in records) and any(r.wide for r in records)
    assert sum(r.graph == "split" for r in records) >= 30


def test_capture_leaves_the_model_state_as_it_was(soaked):
    assert soaked.capture_changed_state == []


def _stray_write(soaked, out):
    cache = soaked.model.kv_caches()[0]
    cache.view(2, -1, cache[0, 0, 0].numel())[0, -1] += 1.0  # a slot no step owns
    return out


def _off_output(soaked, out):
    return out + 1e-2 * out.abs().max() if out.numel() else out


def _counted_twice(soaked, out):
    soaked.model.expert_load.mul_(2)
    return out


@pytest.mark.parametrize("after, check", [
    (_stray_write, "untouched"), (_off_output, "ok_out"), (_counted_twice, "load_total_ok")])
def test_each_check_fails_when_the_runner_goes_wrong(soaked, monkeypatch, after, check):
    real = CudaGraphRunner.__call__
    monkeypatch.setattr(CudaGraphRunner, "__call__",
                        lambda self, *a, **kw: after(soaked, real(self, *a, **kw)))
    records = [r for r in _run(soaked, 8, p_split=1.0) if r.tokens > 0]
    assert records and all(getattr(r, check) is False for r in records), [
        (r.tokens, _failed(r)) for r in records]


def test_a_veto_the_runner_ignored_is_a_wrong_decision(soaked, monkeypatch):
    real = CudaGraphRunner.__call__
    monkeypatch.setattr(CudaGraphRunner, "__call__",
                        lambda self, *a, vetoes=(), **kw: real(self, *a, **kw))
    records = _run(soaked, 40, p_split=0.0, p_veto=1.0)
    vetoed = [r for r in records if r.vetoed and r.graph != "eager" and r.tokens >= 2
              and not r.shared]
    assert vetoed and all(r.ok_decision is False for r in vetoed)


@pytest.mark.multirank
def test_the_command_line_runs_it_and_writes_the_counts(tmp_path):
    out = tmp_path / "graph_soak.json"
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "soak.py"), "--gpu",
                        "--gpu-size", "cpu", "--steps", "30", "--check-every", "3",
                        "--out", str(out)], env=env, capture_output=True, text=True,
                       timeout=600)
    (counts,) = json.loads(out.read_text())["runs"]
    assert counts["steps"] == 30 and counts["checked"] == 10, r.stderr[-3000:]
    for key in ("hangs", "errors", "wrong_outputs"):
        assert counts[key] == 0, (key, counts["examples"])
    assert counts["split_replays"] > 0 and counts["steps_per_s"] > 0
    # exit 1 exactly when capture() changed the model's state (issue 29, finding 3)
    assert r.returncode == (1 if counts["capture_changed_state"] else 0), r.stderr[-3000:]
