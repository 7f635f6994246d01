"""The CUDA-graph memory of the captured set (``CudaGraphRunner.memory_report``, issue 26):
per bucket, unsplit vs split graphs, every graph in one pool shared by the buckets."""

from __future__ import annotations

import logging

import pytest
import torch

from dbo_compile.models.deepseek import DeepseekMoEModel, get_config
from dbo_compile.runtime import cudagraph_runner as R
from dbo_compile.runtime.cudagraph_runner import CudaGraphRunner, GraphRunnerError

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _runner(device: str, buckets=(16, 32), options=None, **kwargs) -> CudaGraphRunner:
    cfg = get_config("tiny", num_layers=1)
    model = DeepseekMoEModel(cfg, seed=0, device=device)
    model.allocate_kv_cache(64, 16)
    compiled = torch.compile(model, backend="dbo", options=options or {"split": "always"})
    return CudaGraphRunner(compiled, list(buckets), max_blocks_per_req=4, timing_iters=1,
                           device=device, **kwargs)


def test_the_report_has_every_bucket_and_no_bytes_on_cpu():
    runner = _runner("cpu", keep_candidates=True)
    runner.capture()
    rep = runner.memory_report()
    assert rep["pool_shared"] is True and set(rep["buckets"]) == {16, 32}
    for t, b in rep["buckets"].items():
        assert b["unsplit"] is None and b["split"] is None and b["split_all"] is None
        assert set(b["graphs"]) == set(runner.graphs[t].graphs)  # every captured graph
        assert all(v is None for v in b["graphs"].values())
    assert rep["total"] == {"unsplit": None, "split": None, "split_all": None}
    assert runner.stats["memory"] == rep


@pytest.mark.gpu
@needs_cuda
def test_on_a_gpu_every_graph_is_counted_in_one_pool(monkeypatch):
    pools = []
    real = R.capture
    monkeypatch.setattr(R, "capture", lambda fn, **kw: pools.append(kw.get("pool")) or real(fn, **kw))
    runner = _runner("cuda")
    runner.capture()
    torch.cuda.synchronize()
    rep = runner.memory_report()
    # every graph of every bucket captured into the one pool
    assert len(pools) == sum(len(b["graphs"]) for b in rep["buckets"].values()) > 2
    assert runner.pool is not None and all(p is runner.pool for p in pools)
    for t, b in rep["buckets"].items():
        assert all(isinstance(v, int) and v >= 0 for v in b["graphs"].values()), b["graphs"]
        kept = [k for k in runner.graphs[t].graphs if k != "unsplit"]
        assert b["split"] == sum(b["graphs"][k] for k in kept) <= b["split_all"]
    # the largest bucket is captured first, into an empty pool: its unsplit graph grows it
    assert rep["buckets"][32]["unsplit"] > 0
    assert rep["total"]["unsplit"] == sum(b["unsplit"] for b in rep["buckets"].values())


# -- out of memory at capture, and the split graphs' memory budget ----------------------------

def _serves_as_eager(runner: CudaGraphRunner, b, device: str, tol: float) -> None:
    """A mixed step (decodes and a prefill) served by bucket ``b``'s chosen graph equals the
    model run eagerly."""
    from dbo_compile.models.batch import make_step
    from moe_cases import eager_then_restore

    step = make_step(get_config("tiny", num_layers=1), decode_context_lens=[5, 40, 17],
                     prefills=[(16, 9)], block_size=16, num_blocks=64, device=device)
    ref, _ = eager_then_restore(runner.compiled._orig_mod, step)
    with torch.no_grad():
        out = runner(step.input_ids, step.positions, step.attn_metadata,
                     step.num_scheduled_tokens)
    assert runner.last_graph == b.choice
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)


_OOM = "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB"


def _oom_at(monkeypatch, names):
    """Make the capture of the graphs ``names`` run out of memory in their first run (the
    warm-up run inside ``capture``; on CPU the ``EagerGraph``'s one run), as the prefill 8192
    bucket's split candidates did on one H100 (38.6 GiB in graph pools)."""
    real = CudaGraphRunner._graph

    def graph(self, b, name, fn, cuda):
        def oom():
            raise torch.OutOfMemoryError(_OOM)
        return real(self, b, name, oom if name in names else fn, cuda)
    monkeypatch.setattr(CudaGraphRunner, "_graph", graph)


def test_a_split_candidate_out_of_memory_is_dropped_and_the_bucket_still_serves(monkeypatch,
                                                                                caplog):
    """A split candidate whose capture runs out of GPU memory is dropped (with why, in the
    bucket's stats and one warning), and so is one that another rank could not capture (every
    rank must time the same graphs); capture() completes, the bucket chooses among the rest
    and a served step matches eager. It raised torch.OutOfMemoryError out of capture()."""
    runner = _runner("cpu", buckets=(32,))
    # "list" OOMs here, "staged" on another rank: the max over the job of the bucket's
    # per-candidate flags (one per planned candidate, in order) comes back 1 for it
    _oom_at(monkeypatch, {"list"})
    planned = []
    real_plan = R.plan
    monkeypatch.setattr(R, "plan", lambda names, *a, **kw: (
        planned.extend(names), real_plan(names, *a, **kw))[1])
    monkeypatch.setattr(R, "max_over_ranks", lambda values: [
        1.0 if len(values) == len(planned) and planned[i] == "staged" else v
        for i, v in enumerate(values)])
    # "list" would win if it were there
    monkeypatch.setattr(runner, "_time", lambda b, names: {
        n: {"unsplit": 200.0, "list": 10.0, "staged": 20.0}.get(n, 100.0 + len(n)) for n in names})
    with caplog.at_level(logging.WARNING, logger="dbo_compile"):
        runner.capture()
    b = runner.graphs[32]
    names = list(b.artifact.candidates)
    assert {"list", "staged"} < set(names)
    kept = [n for n in names if n not in ("list", "staged")]
    # split="always": the unsplit graph's time cannot change the choice
    assert "list" not in b.graphs and "staged" not in b.graphs and set(b.times_us) == set(kept)
    assert b.choice == min(kept, key=lambda n: 100.0 + len(n))
    why = b.dropped["list"]
    assert "bucket 32" in why and "list" in why and "Tried to allocate 2.00 GiB" in why
    assert "another rank" in b.dropped["staged"]
    prune = runner.stats["buckets"][32]["prune"]
    assert prune["dropped"] == b.dropped and prune["timed"] == kept
    assert runner.stats["buckets"][32]["dropped"] == b.dropped
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING
                and "out of GPU memory" in r.getMessage()]
    assert len(warnings) == 1, warnings
    for word in ("bucket 32", "list", "staged", "schedule_candidates", "graph_memory_budget"):
        assert word in warnings[0], word
    _serves_as_eager(runner, b, "cpu", tol=1e-5)


def test_the_unsplit_graph_out_of_memory_is_a_graph_runner_error(monkeypatch):
    """The unsplit graph is what every step falls back to: without it the bucket cannot
    serve. Its OOM is a GraphRunnerError naming the bucket, the memory held and what to do."""
    runner = _runner("cpu", buckets=(32,))
    _oom_at(monkeypatch, {"unsplit"})
    with pytest.raises(GraphRunnerError, match=r"bucket 32.*unsplit graph.*out of GPU memory.*"
                                               r"Tried to allocate 2\.00 GiB.*fewer buckets") as e:
        runner.capture()
    assert isinstance(e.value.__cause__, torch.OutOfMemoryError)


def test_the_graph_memory_budget_skips_split_candidates_past_it(monkeypatch, caplog):
    """With ``graph_memory_budget``, a split candidate is not captured once the split graphs
    captured so far (over every bucket, largest first) grew the pool by the budget; on a GPU
    the pool's growth per graph is ``graph_bytes`` (faked here: 1000 bytes each)."""
    runner = _runner("cpu", buckets=(16, 32), graph_memory_budget=2000)
    assert runner.graph_memory_budget == 2000
    real = CudaGraphRunner._graph

    def graph(self, b, name, fn, cuda):
        real(self, b, name, fn, cuda)
        b.graph_bytes[name] = 1000
    monkeypatch.setattr(CudaGraphRunner, "_graph", graph)
    with caplog.at_level(logging.INFO, logger="dbo_compile"):
        runner.capture()
    big, small = runner.graphs[32], runner.graphs[16]
    names = list(big.artifact.candidates)
    assert len(names) > 2
    # bucket 32 (first): two candidates reach the budget, the others are skipped
    assert set(big.graph_s) == {"unsplit", *names[:2]}
    assert set(big.dropped) == set(names[2:]) and big.choice in names[:2]
    assert all("memory budget" in why and "graph_memory_budget=2000" in why
               for why in big.dropped.values())
    # bucket 16: no split graph at all, the unsplit one serves
    assert set(small.graphs) == {"unsplit"} and small.choice == "unsplit"
    assert set(small.dropped) == set(names) and small.split_args is None
    assert runner.memory_report()["total"]["split_all"] is None  # off CUDA
    assert sum(v for b in runner.graphs.values() for k, v in b.graph_bytes.items()
               if k != "unsplit") == 2000


@pytest.mark.quick
@pytest.mark.parametrize("bad", [-1, 0, True, "1G", 1.5, float("inf"), -8e9])
def test_a_bad_graph_memory_budget_is_refused(bad):
    with pytest.raises(GraphRunnerError,
                       match=r"graph_memory_budget \(bytes\) must be None or an int >= 1"):
        _runner("cpu", graph_memory_budget=bad)
    assert _runner("cpu", graph_memory_budget=None).graph_memory_budget is None
    assert _runner("cpu", graph_memory_budget=2**30).graph_memory_budget == 2**30
    # bytes written as a float with no fraction (8e9) are bytes
    assert _runner("cpu", graph_memory_budget=8e9).graph_memory_budget == 8_000_000_000


def test_off_cuda_the_budget_has_no_effect_and_says_so_once(caplog):
    runner = _runner("cpu", buckets=(16, 32), graph_memory_budget=1, keep_candidates=True)
    runner._time = lambda b, names: dict.fromkeys(names, 1.0)  # no replays: not under test
    with caplog.at_level(logging.WARNING, logger="dbo_compile"):
        runner.capture()
    for b in runner.graphs.values():
        assert set(b.graphs) == {"unsplit", *b.artifact.candidates} and not b.dropped
    said = [r for r in caplog.records if "graph_memory_budget" in r.getMessage()]
    assert len(said) == 1 and "no effect off CUDA" in said[0].getMessage()


def test_a_candidate_out_of_memory_between_dispatch_and_combine_leaves_nothing_in_flight(
        monkeypatch):
    """A candidate that runs out of memory between an emulated dispatch and its combine left
    the dispatch in flight; the capture's run drains it (``run_draining``), so the next
    candidates and the served steps find the link free."""
    from dbo_compile.models.batch import fill_kv_cache, make_step
    from dbo_compile.ops import emulated as E
    from dbo_compile.testing import faults
    from moe_cases import faulty_emulated_runner

    cfg, model, ref, runner = faulty_emulated_runner(layers=1)
    runner._time = lambda b, names: dict.fromkeys(names, 1.0)  # no replays: not under test
    monkeypatch.setattr(faults, "InjectedFault", torch.OutOfMemoryError)  # what the op raises
    real = CudaGraphRunner._graph
    busy = []

    def graph(self, b, name, fn, cuda):
        if name == "list":
            faults.arm("experts", 0)  # its first routed experts: their dispatch is in flight
        try:
            return real(self, b, name, fn, cuda)
        finally:
            busy.append(any(any(x) for x in E.LINK.busy.values()))
            faults.disarm()
    monkeypatch.setattr(CudaGraphRunner, "_graph", graph)
    runner.capture()
    b = runner.graphs[32]
    assert "list" not in b.graphs and "list" in b.dropped and len(busy) > 2 and not any(busy)
    step = make_step(cfg, decode_context_lens=[20, 37, 5, 60], prefills=[(0, 20)],
                     block_size=16, num_blocks=64)
    fill_kv_cache(ref, step, seed=0)
    with torch.no_grad():
        want = ref(step.input_ids, step.positions, step.attn_metadata)
        fill_kv_cache(model, step, seed=0)
        out = runner(step.input_ids, step.positions, step.attn_metadata,
                     step.num_scheduled_tokens)
    assert runner.last_graph == b.choice != "list"
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def test_split_inputs_out_of_memory_leave_the_bucket_unsplit(monkeypatch, caplog):
    """The split graphs' static per-ubatch inputs (``split_args``) are allocated before their
    captures: where they do not fit, no split candidate is captured and the bucket serves
    unsplit."""
    runner = _runner("cpu", buckets=(32,))
    real = CudaGraphRunner._capture_bucket

    def capture_bucket(self, b, cuda):  # the synthetic steps before it split as ever
        def split_args(*a, **kw):
            raise torch.OutOfMemoryError(_OOM)
        b.artifact.split_args = split_args
        try:
            return real(self, b, cuda)
        finally:
            del b.artifact.split_args
    monkeypatch.setattr(CudaGraphRunner, "_capture_bucket", capture_bucket)
    with caplog.at_level(logging.WARNING, logger="dbo_compile"):
        runner.capture()
    b = runner.graphs[32]
    assert set(b.graphs) == {"unsplit"} and b.choice == "unsplit" and b.split_args is None
    assert set(b.dropped) == set(b.artifact.candidates)
    assert all("static per-ubatch inputs" in why and "2.00 GiB" in why
               for why in b.dropped.values())
    assert runner.stats["buckets"][32]["prune"]["timed"] == []
    assert sum("out of GPU memory" in r.getMessage() for r in caplog.records) == 1


def test_unsplit_overlap_out_of_memory_is_dropped_and_the_serial_unsplit_graph_serves(
        monkeypatch):
    """``"unsplit-overlap"`` is one of DBO's optional graphs too: dropped (in the bucket's
    ``dropped``, not in its split plan, whose candidates are unaffected)."""
    runner = _runner("cpu", buckets=(32,), options={
        "split": "always", "unsplit_overlap": True, "schedule_candidates": False})
    runner._time = lambda b, names: dict.fromkeys(names, 1.0)  # no replays: not under test
    _oom_at(monkeypatch, {R.UNSPLIT_OVERLAP})
    runner.capture()
    b = runner.graphs[32]
    assert b.artifact.unsplit_overlap is not None
    assert set(b.graphs) == {"unsplit", "list"} and b.unsplit_choice == "unsplit"
    assert set(b.dropped) == {R.UNSPLIT_OVERLAP} and "2.00 GiB" in b.dropped[R.UNSPLIT_OVERLAP]
    assert b.prune.timed == ("list",) and not b.prune.dropped


def test_an_oom_that_ends_the_capture_with_another_error_is_still_an_oom(monkeypatch):
    """Out of memory *inside* a CUDA-graph capture: leaving ``torch.cuda.graph`` ends the
    capture, and where that fails too (an invalidated capture) Python raises the second error
    with the OOM as its context. The candidate is still dropped for memory, not fatal."""
    runner = _runner("cpu", buckets=(32,))
    real = CudaGraphRunner._graph

    def graph(self, b, name, fn, cuda):
        if name != "staged":
            return real(self, b, name, fn, cuda)
        try:
            raise torch.OutOfMemoryError(_OOM)
        except torch.OutOfMemoryError:
            raise RuntimeError("CUDA error: operation failed due to a previous error during "
                               "capture (cudaErrorStreamCaptureInvalidated)")
    monkeypatch.setattr(CudaGraphRunner, "_graph", graph)
    runner.capture()
    b = runner.graphs[32]
    assert "staged" not in b.graphs and "Tried to allocate 2.00 GiB" in b.dropped["staged"]
    # any other error of a capture is still the caller's
    monkeypatch.setattr(CudaGraphRunner, "_graph", lambda self, b, name, fn, cuda: (
        real(self, b, name, fn, cuda) if name != "staged" else 1 / 0))
    with pytest.raises(ZeroDivisionError):
        _runner("cpu", buckets=(32,)).capture()


@pytest.mark.gpu
@needs_cuda
def test_on_a_gpu_a_candidate_out_of_memory_inside_its_capture_is_dropped(monkeypatch):
    """A real allocation failure in the middle of a stream capture (not in a warm-up run): the
    capture ends, the candidate is dropped, the bucket serves a step equal to eager."""
    runner = _runner("cuda", buckets=(32,))
    real = CudaGraphRunner._graph

    def graph(self, b, name, fn, cuda):
        def too_big():
            out = fn()
            if torch.cuda.is_current_stream_capturing():
                torch.empty(1 << 50, dtype=torch.uint8, device="cuda")  # 1 PiB
            return out
        return real(self, b, name, too_big if name == "staged" else fn, cuda)
    monkeypatch.setattr(CudaGraphRunner, "_graph", graph)
    runner.capture()
    b = runner.graphs[32]
    assert "staged" not in b.graphs and "staged" in b.dropped and b.graphs
    _serves_as_eager(runner, b, "cuda", tol=2e-2)
