"""The CUDA-graph memory of the captured set (``CudaGraphRunner.memory_report``, issue 26):
per bucket, unsplit vs split graphs, every graph in one pool shared by the buckets."""

from __future__ import annotations

import pytest
import torch

from dbo_compile.models.deepseek import DeepseekMoEModel, get_config
from dbo_compile.runtime.cudagraph_runner import CudaGraphRunner

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _runner(device: str, buckets=(16, 32), **kwargs) -> CudaGraphRunner:
    cfg = get_config("tiny", num_layers=1)
    model = DeepseekMoEModel(cfg, seed=0, device=device)
    model.allocate_kv_cache(64, 16)
    compiled = torch.compile(model, backend="dbo", options={"split": "always"})
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
    from dbo_compile.runtime import cudagraph_runner as R

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
        assert all(isinstance(v, int) and v >= 0 for v in b["graphs"].values())
        kept = [k for k in runner.graphs[t].graphs if k != "unsplit"]
        assert b["split"] == sum(b["graphs"][k] for k in kept) <= b["split_all"]
    # the largest bucket is captured first, into an empty pool: its unsplit graph grows it
    assert rep["buckets"][32]["unsplit"] > 0
    assert rep["total"]["unsplit"] == sum(b["unsplit"] for b in rep["buckets"].values())
