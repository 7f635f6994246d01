"""GPU tests (marker ``gpu``): the split program on 2 GPUs over NCCL against the unsplit model.

Skipped without CUDA / without 2 GPUs. One spawned 2-rank NCCL job (module fixture) runs every
check and returns figures; the tests assert on them. Run::

    PYTHONPATH=$PWD python -m pytest -m gpu tests/test_gpu.py -v
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

pytestmark = pytest.mark.gpu

_HERE = os.path.dirname(os.path.abspath(__file__))

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
#: EP ranks of the multi-process checks: 2 where two GPUs are there, else 1 (EP = 1: the comm
#: ops run the local backend, the split program, its graphs and the runner are the same code)
WORLD = min(2, torch.cuda.device_count()) if torch.cuda.is_available() else 0

# bf16 through 2 layers, 6-of-64 routing: a near-tie in top-k can flip one token's experts when
# the GEMM shapes change (split), so allow a few rows off, but nothing systematic.
MAX_REL = 0.05
MAX_ROWS_OFF = 0.02

#: (phase, tokens/rank, attention kernel, compute_backend)
CASES = [("decode", 256, "ref", "aten"), ("prefill", 1024, "ref", "aten"),
         ("decode", 256, "proj", "inductor"), ("prefill", 1024, "proj", "inductor"),
         ("decode", 256, "fused", "inductor"), ("prefill", 1024, "fused", "inductor")]
KEYS = [f"{p}{t}" + ("" if be == "aten" else f"/{be}") + ("/fused" if att == "fused" else "")
        for p, t, att, be in CASES]


def _init_rank(rank: int, world: int, port: int) -> torch.device:
    """This process's GPU and the NCCL world group (spawned ranks)."""
    import datetime

    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, device_id=dev,
                            timeout=datetime.timedelta(seconds=300))
    return dev


def _worker(rank: int, world: int, port: int, out_q) -> None:
    import traceback

    import torch.distributed as dist

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    res: dict = {}
    try:
        dev = _init_rank(rank, world, port)
        from dbo_compile import backend as B
        from dbo_compile.runtime import capture as cg_capture
        from dbo_compile.testing import measure as cg
        from dbo_compile.testing import moe as H

        B.register()
        for (phase, tokens, attention, backend), key in zip(CASES, KEYS):
            try:
                H.install_kernels("cuda", experts="grouped", attention=attention)
                torch._dynamo.reset()
                B.reset_artifacts()
                model = H.build_model("deepseek-v2-lite", 2, dist.group.WORLD, str(dev),
                                      vocab_size=4096, first_k_dense_replace=0)
                step = H.make_bucket_step(model.config, phase, tokens, str(dev), seed=1, prompt=384)
                model.allocate_kv_cache(step.num_blocks, step.block_size)
                g = torch.Generator(device=dev).manual_seed(7)
                for c in model.kv_caches():
                    c.normal_(generator=g)
                kv0 = [c.clone() for c in model.kv_caches()]
                ids, pos, md = step.input_ids, step.positions, step.attn_metadata
                cm = torch.compile(model, backend="dbo",
                                   options={"split": "always", "compute_backend": backend})
                with torch.no_grad():
                    ref = model(ids, pos, md).clone()
                    for c, c0 in zip(model.kv_caches(), kv0):
                        c.copy_(c0)
                    out = cm(ids, pos, md)
                    out = out[0] if isinstance(out, tuple) else out
                    art = B.compiled_artifacts()[-1]
                    res[key + "/split_steps"] = art.stats.split_steps
                    res[key + "/eager"] = H.rel_err(out, ref)
                    sstep = cg.SplitStep(art, lambda: cm(ids, pos, md))
                    graph, gout = cg_capture.capture(sstep, warmup=2)
                    graph.replay()
                    torch.cuda.synchronize()
                    res[key + "/graph"] = H.rel_err(gout[0], ref)
                    # new step, same layout: new tokens, positions, KV contents; no recapture
                    new = H.make_bucket_step(model.config, phase, tokens, str(dev), seed=2,
                                             prompt=384, decode_ctx=130)
                    ids.copy_(new.input_ids)
                    pos.copy_(new.positions)
                    for name, t in md.tensors().items():
                        nt = getattr(new.attn_metadata, name)
                        if nt.shape == t.shape:
                            t.copy_(nt)
                    for c in model.kv_caches():
                        c.normal_(generator=g)
                    kv1 = [c.clone() for c in model.kv_caches()]
                    ref2 = model(ids, pos, md).clone()
                    for c, c1 in zip(model.kv_caches(), kv1):
                        c.copy_(c1)
                    sstep.refresh()
                    graph.replay()
                    torch.cuda.synchronize()
                    res[key + "/graph_new"] = H.rel_err(gout[0], ref2)
                    res[key + "/graph_new_vs_old"] = H.rel_err(gout[0], ref)
                del graph, gout, sstep, model
                torch.cuda.empty_cache()
            except Exception as e:  # noqa: BLE001
                res[key + "/error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}"
        try:
            res.update(_runner_checks(rank, world, dev, dist, H, B))
        except Exception as e:  # noqa: BLE001
            res["runner/error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}"
        dist.barrier()
        dist.destroy_process_group()
    except Exception as e:  # noqa: BLE001
        res["fatal"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}"
    out_q.put((rank, res))


RUNNER_BUCKETS = [256, 1024]
#: (phase, tokens on rank 0, tokens on rank 1): ranks differ, the vote pads to the group max
RUNNER_STEPS = [("decode", 200, 187), ("prefill", 900, 1000), ("decode", 256, 256),
                ("prefill", 300, 40), ("decode", 64, 250), ("prefill", 1024, 990)]


def _runner_checks(rank, world, dev, dist, H, B, preset="deepseek-v2-lite",
                   buckets=RUNNER_BUCKETS, steps=RUNNER_STEPS, num_blocks=4096) -> dict:
    """CudaGraphRunner: capture two buckets once, then serve steps of other sizes and layouts
    on both ranks; each against the unsplit eager model on the same step (KV restored). The
    eager reference pads every rank to the group's max (static-capacity all-to-all)."""
    from dbo_compile.runtime.engine import _pad_rows
    from dbo_compile.runtime.cudagraph_runner import CudaGraphRunner

    res: dict = {}
    cuda = dev.type == "cuda"
    H.install_kernels(dev.type, experts="grouped", attention="ref")
    torch._dynamo.reset()
    B.reset_artifacts()
    model = H.build_model(preset, 2, dist.group.WORLD, str(dev), vocab_size=4096,
                          first_k_dense_replace=0)
    model.allocate_kv_cache(num_blocks, 16)
    g = torch.Generator(device=dev).manual_seed(11)
    for c in model.kv_caches():
        c.normal_(generator=g)
    cm = torch.compile(model, backend="dbo", options={"split": "always"})
    runner = CudaGraphRunner(cm, buckets, max_blocks_per_req=40, block_size=16,
                             vocab_size=4096, timing_iters=3, device=dev)
    with torch.no_grad():
        runner.capture()
        graphs = {t: dict(b.graphs) for t, b in runner.graphs.items()}
        res["runner/choices"] = {t: b.choice for t, b in runner.graphs.items()}
        arts = len(B.compiled_artifacts())
        for i, (phase, n0, n1) in enumerate(steps):
            n = n0 if rank == 0 else n1
            step = H.make_bucket_step(model.config, phase, n, str(dev), seed=100 + i,
                                      decode_ctx=100 + 17 * i, prompt=256 + 64 * i)
            kv = [c.clone() for c in model.kv_caches()]
            group_max = max(n0, n1) if world > 1 else n
            tokens, md = _pad_rows({"input_ids": step.input_ids, "positions": step.positions},
                                   step.attn_metadata, group_max)
            ref = model(tokens["input_ids"], tokens["positions"], md)[:n].clone()
            kv_ref = [c.clone() for c in model.kv_caches()]
            for c, c0 in zip(model.kv_caches(), kv):
                c.copy_(c0)
            out = runner(step.input_ids, step.positions, step.attn_metadata,
                         step.num_scheduled_tokens)
            if cuda:
                torch.cuda.synchronize()
            res[f"runner/{i}"] = H.rel_err(out, ref)
            res[f"runner/{i}/graph"] = [runner.last_choice, runner.eager_steps]
            # bf16 rounding of the later layers' K/V (their inputs went through the MoE layers
            # before), against each cache's scale; a missed or stray write is O(1) of it
            res[f"runner/{i}/kv_max_rel"] = max(H.rel_err(c, r)["max_rel"]
                                                for c, r in zip(model.kv_caches(), kv_ref))
        res["runner/same_graphs"] = all(
            dict(runner.graphs[t].graphs) == graphs[t] for t in graphs)
        res["runner/new_artifacts"] = len(B.compiled_artifacts()) - arts
    runner = model = None
    if cuda:
        torch.cuda.empty_cache()
    return res


@pytest.fixture(scope="module")
def gpu_results():
    return _spawn(_worker, timeout=600, world=WORLD)


def _check(results: dict, key: str, what: str) -> None:
    for rank, res in results.items():
        assert "fatal" not in res, res["fatal"]
        assert key + "/error" not in res, f"rank {rank}: {res[key + '/error']}"
        err = res[f"{key}/{what}"]
        assert err["finite"], (rank, err)
        assert err["max_rel"] < MAX_REL and err["rows_off_5pct"] <= MAX_ROWS_OFF, (rank, what, err)


@needs_cuda
@pytest.mark.parametrize("key", KEYS)
def test_split_eager_matches_unsplit(gpu_results, key):
    for res in gpu_results.values():
        assert res.get(key + "/split_steps", 0) >= 1
    _check(gpu_results, key, "eager")


@needs_cuda
@pytest.mark.parametrize("key", KEYS)
def test_split_graph_replay_matches_unsplit(gpu_results, key):
    _check(gpu_results, key, "graph")


@needs_cuda
@pytest.mark.parametrize("key", KEYS)
def test_graph_replay_new_step_no_recapture(gpu_results, key):
    _check(gpu_results, key, "graph_new")
    for res in gpu_results.values():  # the new step really is different
        assert res[key + "/graph_new_vs_old"]["max_rel"] > 0.05


@needs_cuda
def test_runner_serves_new_steps_from_captured_buckets(gpu_results):
    """Per-bucket graphs captured once; steps of other sizes and layouts (ranks differ, padded
    to the group max) replay them, match the unsplit model and write the same KV cache."""
    for rank, res in gpu_results.items():
        assert "fatal" not in res, res["fatal"]
        assert "runner/error" not in res, f"rank {rank}: {res['runner/error']}"
        assert all(c != "unsplit" for c in res["runner/choices"].values()), res["runner/choices"]
        for i in range(len(RUNNER_STEPS)):
            (bucket, which), eager_steps = res[f"runner/{i}/graph"]
            assert eager_steps == 0 and which == "split", (rank, i, res[f"runner/{i}/graph"])
            err = res[f"runner/{i}"]
            assert err["finite"] and err["max_rel"] < MAX_REL, (rank, i, err)
            assert err["rows_off_5pct"] <= MAX_ROWS_OFF, (rank, i, err)
            assert res[f"runner/{i}/kv_max_rel"] < MAX_REL, (rank, i, res[f"runner/{i}/kv_max_rel"])
        assert res["runner/same_graphs"] and res["runner/new_artifacts"] == 0


_SANITIZER_SCRIPT = r"""
import json, os, sys
import torch
import torch.cuda._sanitizer as csan
from torch.utils._python_dispatch import _disable_current_modes
from dbo_compile import backend as B
from dbo_compile.runtime import capture as cg_capture  # noqa: E402
from dbo_compile.testing import measure as cg  # noqa: E402
from dbo_compile.testing import moe as H  # noqa: E402

res = {"csan_enabled": bool(csan.cuda_sanitizer.enabled)}
B.register()
H.install_kernels("cuda", experts="grouped", attention="ref")
model = H.build_model("deepseek-v2-lite", 2, None, "cuda", vocab_size=4096,
                      first_k_dense_replace=0)
step = H.make_bucket_step(model.config, "prefill", 512, "cuda", seed=1, prompt=200)
model.allocate_kv_cache(step.num_blocks, step.block_size)
ids, pos, md = step.input_ids, step.positions, step.attn_metadata
with torch.no_grad():
    with _disable_current_modes():  # Dynamo does not compile under a dispatch mode
        cm = torch.compile(model, backend="dbo", options={"split": "always"})
        cm(ids, pos, md)
        art = B.compiled_artifacts()[-1]
        sstep = cg.SplitStep(art, lambda: cm(ids, pos, md))
    res["comm_units"] = sum(u.kind == "comm" for u in art.schedule.units)
    for name, program in art.candidates.items():
        try:
            program(*sstep.split_args)
            torch.cuda.synchronize()
            res["clean/" + name] = "ok"
        except Exception as e:
            res["clean/" + name] = type(e).__name__ + ": " + str(e)[:1500]
    program = art.split_program
    program._fn.__globals__["wait"] = lambda stream, event: None  # drop every event wait
    try:
        program(*sstep.split_args)
        torch.cuda.synchronize()
        res["no_waits"] = "not reported"
    except Exception as e:
        res["no_waits"] = type(e).__name__
print("RESULT " + json.dumps(res), flush=True)
"""


def _spawn(target, timeout: int = 420, world: int = 2) -> dict:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, world, port, q)) for r in range(world)]
    for p in procs:
        p.start()
    results = {}
    try:
        for _ in procs:
            rank, res = q.get(timeout=timeout)
            results[rank] = res
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    for r, res in results.items():
        print(f"rank {r}: {res}")
    return results


@needs_cuda
def test_split_program_under_cuda_sanitizer():
    """TORCH_CUDA_SANITIZER=1 (CSAN on from ``import torch``) in a fresh process, one GPU (the
    local comm backend still runs dispatch/combine on the comm stream). Dynamo does not compile
    under a dispatch mode, so the model is compiled with the mode popped; every schedule variant
    of the split program then runs eagerly under CSAN, which checks each kernel's reads and
    writes against the other stream's. Negative control: without its event waits the program
    must be reported."""
    import json
    import subprocess

    env = dict(os.environ, TORCH_CUDA_SANITIZER="1",
               PYTHONPATH=os.pathsep.join([os.path.dirname(_HERE), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", _SANITIZER_SCRIPT], env=env,
                          capture_output=True, text=True, timeout=300)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line, f"rc={proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    res = json.loads(line[len("RESULT "):])
    print(res)
    assert res["csan_enabled"] and res["comm_units"] > 0
    clean = {k: v for k, v in res.items() if k.startswith("clean/")}
    assert clean and all(v == "ok" for v in clean.values()), clean
    assert res["no_waits"] == "CUDASanitizerErrors", res["no_waits"]


@needs_cuda
@pytest.mark.parametrize("path", ["sorted", "fused"])
@pytest.mark.parametrize("rows", [1, 300, 4096])
def test_grouped_experts_cuda_kernel_matches_loop(rows, path):
    """dbo.grouped_experts on CUDA, both paths (sorted: sort, grouped GEMM, Triton SiLU-mul
    and weighted gather-sum; fused: align, two Triton GEMMs, gather-sum) against the reference
    loop: the split-vs-unsplit checks cannot see an error that both programs share. The
    grouped GEMM's uncomputed rows are poisoned with NaN. The path: the torch backend's
    option, through its spec."""
    from dbo_compile.ops.experts import experts_loop

    g = torch.Generator(device="cuda").manual_seed(rows)
    e, k, h, inter = 8, 6, 512, 384
    x = torch.randn(rows, h, device="cuda", generator=g).to(torch.bfloat16)
    ids = torch.randint(-1, 2 * e, (rows, k), device="cuda", generator=g)
    ids = torch.where(ids < e, ids, -1)  # about half the slots on another rank
    w = torch.rand(rows, k, device="cuda", generator=g)
    w13 = (torch.randn(e, 2 * inter, h, device="cuda", generator=g) / h ** 0.5).to(torch.bfloat16)
    w2 = (torch.randn(e, h, inter, device="cuda", generator=g) / inter ** 0.5).to(torch.bfloat16)
    real_gmm = torch._grouped_mm

    def poisoned_gmm(a, b, offs=None, **kw):  # rows past the last expert: NaN, never read
        out = real_gmm(a, b, offs=offs, **kw)
        rows = torch.arange(out.shape[0], device=out.device).unsqueeze(-1)
        return out.masked_fill(rows >= offs[-1], float("nan"))

    torch._grouped_mm = poisoned_gmm
    try:
        got = torch.ops.dbo.grouped_experts(x, ids, w, w13, w2,
                                            backend=f"torch:path={path}").float()
    finally:
        torch._grouped_mm = real_gmm
    ref = experts_loop(x.float(), ids, w, w13.float(), w2.float())
    assert torch.isfinite(got).all()
    err = (got - ref).abs().max() / ref.abs().max().clamp(min=1e-6)
    assert err < 0.02, float(err)


@needs_cuda
def test_experts_path_is_measured_once_and_captures(monkeypatch):
    """The automatic choice times both paths at a shape's first eager call and keeps it: a
    capture afterwards (no host sync allowed) replays the same answer; a shape first seen
    inside a capture takes the static rule and captures too."""
    from dbo_compile.ops import experts

    monkeypatch.setattr(experts, "_PATH_TIMES", {})
    g = torch.Generator(device="cuda").manual_seed(0)
    e, k, h, inter = 8, 6, 512, 384
    w13 = (torch.randn(e, 2 * inter, h, device="cuda", generator=g) / h ** 0.5).to(torch.bfloat16)
    w2 = (torch.randn(e, h, inter, device="cuda", generator=g) / inter ** 0.5).to(torch.bfloat16)

    def call(rows):
        x = torch.randn(rows, h, device="cuda", generator=g).to(torch.bfloat16)
        ids = torch.randint(-1, e, (rows, k), device="cuda", generator=g)
        w = torch.rand(rows, k, device="cuda", generator=g)
        return x, ids, w

    first = call(64)
    want = torch.ops.dbo.grouped_experts(*first, w13, w2)
    assert len(experts._PATH_TIMES) == 1
    unseen = call(96)
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        with torch.cuda.graph(graph, stream=s):
            got = torch.ops.dbo.grouped_experts(*first, w13, w2)
            torch.ops.dbo.grouped_experts(*unseen, w13, w2)
    graph.replay()
    torch.cuda.synchronize()
    assert len(experts._PATH_TIMES) == 1  # the unseen shape was not measured inside the capture
    torch.testing.assert_close(got, want)


@needs_cuda
@pytest.mark.parametrize("tokens", [1, 1000])
def test_dispatch_pack_kernel_matches_torch_ops(tokens):
    """The dispatch's Triton packing kernel against the torch ops it replaces, bit for bit."""
    from dbo_compile.ops.comm.packing import send_buffers_torch, send_buffers_triton

    g = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, 2048, device="cuda", generator=g).to(torch.bfloat16)
    ids = torch.randint(-1, 64, (tokens, 6), device="cuda", generator=g)
    w = torch.rand(tokens, 6, device="cuda", generator=g)
    for world in (2, 4):
        got = send_buffers_triton(x, ids, w, 64 // world, world)
        ref = send_buffers_torch(x, ids, w, 64 // world, world)
        # bitwise: halves of the float32 metadata can be NaN patterns in bf16
        assert got.shape == ref.shape and torch.equal(got.view(torch.uint8), ref.view(torch.uint8))


@needs_cuda
def test_write_kv_kernel_matches_torch_ops():
    """The KV-cache write's Triton kernel against the torch ops, bit for bit: strided k / v
    (slices of a qkv projection), padding rows, fp32 -> bf16 rounding."""
    from dbo_compile.ops.attention import _write_kv_torch, _write_kv_triton

    g = torch.Generator(device="cuda").manual_seed(0)
    t, hkv, d, nb, bs = 1000, 16, 128, 200, 16
    for dtype in (torch.bfloat16, torch.float32):
        qkv = torch.randn(t, 3 * hkv * d, device="cuda", generator=g).to(dtype)
        k = qkv[:, hkv * d:2 * hkv * d].view(t, hkv, d)
        v = qkv[:, 2 * hkv * d:].view(t, hkv, d)
        slots = torch.randperm(nb * bs, device="cuda", generator=g)[:t]
        slots[::7] = -1
        cache0 = torch.randn(2, nb, bs, hkv, d, device="cuda", generator=g).to(torch.bfloat16)
        ref, got = cache0.clone(), cache0.clone()
        _write_kv_torch(ref, k, v, slots)
        _write_kv_triton(got, k, v, slots)
        assert torch.equal(got, ref), dtype


@needs_cuda
def test_capture_helper_single_gpu():
    from dbo_compile.runtime.capture import capture

    x = torch.randn(64, 64, device="cuda")
    g, out = capture(lambda: x @ x + 1)
    x.copy_(torch.randn_like(x))
    g.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, x @ x + 1)


@needs_cuda
@pytest.mark.parametrize("compute_backend", ["aten", "inductor"])
def test_capture_leaves_the_models_state_as_it_was(compute_backend):
    """On a GPU the captures' warm-up calls and every candidate graph's timing replays write
    the model's real buffers (an expert-load counter, a step counter): ``capture()`` puts them
    back, and one served step then counts as eager does (the CPU test:
    ``tests/test_graph_runner.py``)."""
    from dbo_compile.models.batch import fill_kv_cache, make_step
    from dbo_compile.models.deepseek import get_config
    from dbo_compile.runtime.cudagraph_runner import CudaGraphRunner
    from moe_cases import CountingModel, model_state

    cfg = get_config("tiny", num_layers=2)
    model, ref = (CountingModel(cfg, seed=0, device="cuda") for _ in range(2))
    step = make_step(cfg, decode_context_lens=[30, 41, 7, 19, 60], prefills=[(16, 9)],
                     block_size=16, num_blocks=64, seed=3, device="cuda")
    for m in (model, ref):
        m.allocate_kv_cache(64, 16)
        fill_kv_cache(m, step, seed=1)
        m.expert_load.fill_(3.0)
        m.steps.fill_(5)
    before = model_state(model)
    compiled = torch.compile(model, backend="dbo", options={
        "split": "always", "compute_backend": compute_backend})
    runner = CudaGraphRunner(compiled, [16, 48], max_blocks_per_req=8, block_size=16,
                             timing_iters=3)
    runner.capture()
    torch.cuda.synchronize()
    after = model_state(model)
    changed = {k: (float(before[k].sum()), float(after[k].sum())) for k in before
               if not torch.equal(before[k], after[k])}
    assert not changed, changed
    assert all(len(b.times_us) > 1 for b in runner.graphs.values())  # replays were timed
    with torch.no_grad():
        runner(step.input_ids, step.positions, step.attn_metadata, step.num_scheduled_tokens)
        ref(step.input_ids, step.positions, step.attn_metadata)
    torch.cuda.synchronize()
    assert runner.last_choice == (16, "split"), runner.last_choice
    served, want = model_state(model), model_state(ref)
    assert torch.equal(served["steps"], want["steps"]), (served["steps"], want["steps"])
    # every real token counted once per MoE layer and top-k slot, none of warm-up's (a
    # near-tie in the router may move a count between experts on another GEMM shape)
    assert float(served["expert_load"].sum()) == float(want["expert_load"].sum()), (
        served["expert_load"], want["expert_load"])
