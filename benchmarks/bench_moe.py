"""DBO benchmark: DeepSeek-V2-Lite-shaped MoE layers, 2 EP ranks, side by side in one run.

Run (2 GPUs; the link regime is the environment's, label it with --link)::

    torchrun --nproc-per-node 2 benchmarks/bench_moe.py --link nvlink
    NCCL_P2P_DISABLE=1 torchrun --nproc-per-node 2 benchmarks/bench_moe.py --link shm --append

One GPU as rank 0 of an emulated EP-W world (``--emulate-ep W --link-gbps X``, no torchrun;
``benchmarks/bench_emulated.py`` says what it measures)::

    python benchmarks/bench_moe.py --emulate-ep 8,16,32,64,8@25 --link-gbps 50

On a machine without CUDA it runs on CPU over Gloo (a smoke test: tiny preset, no graphs; its
rows are labelled ``gloo (CPU)`` and timed wall-clock, eager). Without ``--emulate-ep`` it runs
under torchrun only (``RANK`` and ``WORLD_SIZE`` unset: a usage error, not a traceback).
A flag that the chosen mode does not read is refused with a usage error, never ignored: the
emulated world's flags without ``--emulate-ep``; ``--link``, ``--vote-group`` and
``--inductor`` with it; ``--comm-sms``, ``--inductor``, ``--kernels``, ``--profile``,
``--hold-sms``, ``--fp8``, ``--link`` and ``--experts-backend deep_gemm`` without CUDA. A run
whose every row failed exits with status 1. ``--hold-sms 24`` makes each emulated transfer hold 24 SMs for its
duration (the emulated backend's option ``hold_sms``: DeepEP's normal-mode kernels), beside
the copy-engine rows of a run without it.

Per bucket (phase, tokens/rank), every figure the median of ``--iters`` timed calls (CUDA events),
the max over ranks. The model is compiled with the default options (``split="auto"``, schedule
candidates on) and run by ``dbo_compile.runtime.cudagraph_runner.CudaGraphRunner`` with the bucket as its
only bucket: the runner captures the unsplit program and every split schedule candidate as CUDA
graphs, times them at warm-up and decides. Then, on the benchmark's own step:

- ``unsplit_eager``: the model run eagerly, unsplit.
- ``baseline``: the runner's unsplit graph (THE baseline; with compute_backend "inductor", the
  default on CUDA, the unsplit program compiled by Inductor, like the split program's stages).
  With ``--unsplit-overlap`` the runner also captures the unsplit program on two streams
  (``unsplit-overlap``: the shared experts beside the dispatch) and the baseline is the faster
  of the two on the step (``baseline_graph``; the serial one's time is
  ``t_baseline_serial_us``, its speedup ``speedup_vs_serial_unsplit``).
- ``inductor`` (``--inductor``): the unsplit model compiled by Inductor, in a CUDA graph.
- ``split_serial``: the DBO schedule with its comm stream replaced by the compute stream
  (``dbo_compile.testing.measure.serial_comm``): same kernels, same order, no overlap.
- ``split_nocomm``: as split_serial, with the collectives replaced by local copies of the same
  shapes (``dbo_compile.testing.moe.no_comm``): the compute of the split program alone.
- ``comm``: the collectives of the split program alone (per MoE layer and ubatch: dispatch = 1
  ``all_to_all_single`` of payload rows, combine = 1, static capacity), captured in a CUDA
  graph.
- ``dbo_eager``: the compiled model called eagerly through ``run_step`` (vote, metadata split,
  generated wrapper on two streams).
- ``dbo_graph``: the fastest split schedule candidate (by the runner's warm-up timing) in a
  CUDA graph; every candidate's time is in ``t_variants_us`` (the key, and ``dbo_variant``,
  keep the names of the earlier results files, so that runs compare row by row).
- ``chosen``: the graph the runner runs by default for this bucket; ``runner_step``: one whole
  runner call (vote, copies into the static buffers, replay), as a server calls it: the step's
  attention metadata carries its host mirrors (``query_start_loc_cpu``, ...: the CPU tensors it
  was built from), so that the runner reads nothing back from the GPU;
  ``runner_step_no_mirrors``: the same call with device tensors only (the runner then reads
  the counts and, for the prefix-read veto, the slots and block table back: host syncs).
  The DP vote of every step runs over a Gloo (CPU) group (``--vote-group gloo``), as a
  server's does: over the default NCCL group its table goes through the GPU, and reading the
  result back waits for the previous step's graph, so that the host's per-step work could not
  overlap the GPU's.

speedup = baseline / dbo_graph; η = (split_serial − dbo_graph) / (split_serial − max(split_nocomm,
comm)) (docs/design.md); pick / baseline = baseline / chosen.

GPU stand-ins (see ``dbo_compile.testing.moe``): routed experts as one grouped-GEMM op (``--experts grouped``),
attention as the package's ``dbo.attention`` (``--attention fused``, the default: on CUDA the
fused Triton paged-attention kernel); ``--attention proj`` writes the KV cache and skips the
attention itself (as the hand-written schedule of docs/references.md, and the runs before
2026-11-30 afternoon); ``--attention ref`` the reference attention op (a Python chunk loop:
representative of nothing on GPU).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness  # noqa: E402

from dbo_compile import backend as dbo_backend  # noqa: E402
from dbo_compile.ops import comm as _comm  # noqa: E402
from dbo_compile.ops.experts import experts_path_choices  # noqa: E402
from dbo_compile.runtime.engine import run_step  # noqa: E402
from dbo_compile.runtime.cudagraph_runner import CudaGraphRunner, split_program_fn  # noqa: E402
from dbo_compile.testing import bench_cli  # noqa: E402
from dbo_compile.testing import moe as H  # noqa: E402

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

def parse(argv=None):
    """The command line (:func:`dbo_compile.testing.bench_cli.parse_moe`: a flag that the
    chosen mode does not read is a usage error)."""
    # by default into the ignored results/local/: a run never overwrites a committed result
    return bench_cli.parse_moe(argv, __doc__, os.path.join(_ROOT, "benchmarks", "results",
                                                           "local", "bench_moe.json"))


def log(msg: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(msg, flush=True)


class Timer:
    def __init__(self, cuda: bool, iters: int, warmup: int):
        self.cuda, self.iters, self.warmup = cuda, iters, warmup

    def __call__(self, fn) -> float:
        for _ in range(self.warmup):
            fn()
        self.sync()
        dist.barrier()
        return harness.median_us(fn, self.iters, cuda=self.cuda)

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()


def max_over_ranks(values: dict, device) -> dict:
    keys = sorted(values)
    t = torch.tensor([values[k] if values[k] is not None else -1.0 for k in keys],
                     dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return {k: (float(v) if v >= 0 else None) for k, v in zip(keys, t.tolist())}


def comm_only_fn(model, tokens_per_ubatch: list[int], device):
    """The collectives of the split program, in its per-layer order, alone."""
    cfg = model.config
    w = dist.get_world_size()
    _, cols = _comm.payload_layout(cfg.hidden_size, model.dtype, cfg.top_k)
    bufs = []
    for _layer in range(cfg.num_moe_layers):
        per = []
        for t in tokens_per_ubatch:
            rows = w * t
            per.append(dict(
                ps=torch.randn(rows, cols, device=device, dtype=model.dtype),
                pr=torch.empty(rows, cols, device=device, dtype=model.dtype),
                ys=torch.randn(rows, cfg.hidden_size, device=device, dtype=model.dtype),
                yr=torch.empty(rows, cfg.hidden_size, device=device, dtype=model.dtype)))
        bufs.append(per)

    def run():
        for per in bufs:
            for b in per:
                dist.all_to_all_single(b["pr"], b["ps"])
            for b in per:
                dist.all_to_all_single(b["yr"], b["ys"])
    return run


def bench_bucket(args, model, phase: str, tokens: int, device, cuda: bool, timer: Timer) -> dict:
    cfg = model.config
    torch._dynamo.reset()
    dbo_backend.reset_artifacts()
    step = H.make_bucket_step(cfg, phase, tokens, device, seed=tokens, host_mirrors=True)
    bench_cli.check_max_num_reqs(args.max_num_reqs, {(phase, tokens): step})
    model.allocate_kv_cache(step.num_blocks, step.block_size)
    ids, pos, md = step.input_ids, step.positions, step.attn_metadata
    qlens = step.num_scheduled_tokens
    row: dict = {"phase": phase, "tokens_per_rank": tokens, "errors": []}
    # default options: split="auto", schedule candidates on; the runner measures and decides
    cand = (None if args.carveout_candidates == "default"
            else tuple(int(v) for v in args.carveout_candidates.split(",") if v))
    sched_cand = H.candidate_names(args.candidates)
    options = {"scheduler": args.scheduler, "comm_sms": args.comm_sms,
               "sm_carveout_candidates": cand, "schedule_candidates": sched_cand,
               "compute_backend": args.compute_backend, "dp_group_name": args.vote_group_name,
               "unsplit_overlap": args.unsplit_overlap, "sm_carveout_mode": args.carveout_mode}
    if args.calibration:
        options["calibration"] = args.calibration
    cmodel = torch.compile(model, backend="dbo", options=options)
    with torch.no_grad():
        ref = model(ids, pos, md).clone()
    runner = CudaGraphRunner(cmodel, [tokens], max_blocks_per_req=int(md.block_table.shape[1]),
                             block_size=step.block_size, vocab_size=cfg.vocab_size,
                             timing_iters=args.iters, keep_candidates=True, device=device,
                             max_num_reqs=args.max_num_reqs)
    t0 = time.perf_counter()
    with torch.no_grad():
        runner.capture()
    row["capture_s"] = round(time.perf_counter() - t0, 1)
    b = runner.graphs[tokens]
    art = b.artifact
    row["artifact"] = type(art).__name__
    if b.split_args is None:
        row["errors"].append(f"not split: {bench_cli.no_split_reason(b)}")
        return row
    row["schedules"] = {name: {"units": len(p.schedule.units), "event_edges": len(p.schedule.event_edges),
                               "predicted_us": round(p.schedule.predicted_step_us, 1)}
                        for name, p in art.candidates.items()}
    row["warmup_us"] = {k: round(v, 1) for k, v in b.times_us.items()}
    row["chosen"] = "split" if b.use_split else "unsplit"
    row["chosen_graph"] = b.choice if b.use_split else b.unsplit_choice
    row["unsplit_choice"] = b.unsplit_choice
    row["dbo_variant"] = b.best_candidate
    t: dict = {}
    with torch.no_grad():
        out = runner(ids, pos, md, qlens)  # the serving path on the real step
        row["runner_graph"] = runner.last_graph
        row["num_runner_vs_unsplit"] = H.rel_err(out, ref)
        runner.load_step(tokens, ids, pos, md, qlens, split=False)
        runner.load_step(tokens, ids, pos, md, qlens, split=True)
        for name, g in b.graphs.items():
            g.replay()
            if cuda:
                torch.cuda.synchronize()
            row[f"num_{name}_vs_unsplit"] = H.rel_err(b.outs[name][0][:tokens], ref)
        program = art.candidates[b.best_candidate]
        split_fn = split_program_fn(program, b.split_args, art, b.tokens)
        serial, nocomm = H.serial_and_nocomm(program, split_fn)

        def nocomm_streams():
            with H.no_comm():
                return split_fn()

        comm = comm_only_fn(model, [tokens // 2, tokens - tokens // 2], device)
        t["unsplit_eager"] = timer(lambda: model(ids, pos, md))
        t["dbo_eager"] = timer(lambda: run_step(cmodel, ids, pos, md, qlens,
                                                block_size=step.block_size))
        t["runner_step"] = timer(lambda: runner(ids, pos, md, qlens))
        md_dev = dataclasses.replace(md, **{f"{k}_cpu": None for k in md.tensors()})
        t["runner_step_no_mirrors"] = timer(lambda: runner(ids, pos, md_dev, qlens))
        if cuda:
            for name, g in b.graphs.items():
                t[f"graph:{name}"] = timer(g.replay)
            extra = {}
            makers = [("split_serial", serial), ("split_nocomm", nocomm),
                      ("split_nocomm_streams", nocomm_streams), ("comm", comm)]
            if args.inductor:
                ind = torch.compile(model)
                makers.append(("inductor", lambda: ind(ids, pos, md)))
            for name, fn in makers:
                try:
                    extra[name] = harness.capture(fn, warmup=2)
                except Exception as e:  # noqa: BLE001
                    row["errors"].append(f"capture {name}: {type(e).__name__}: {e}"[:400])
                    log(f"  capture {name} FAILED: {traceback.format_exc()[-1500:]}")
                    torch.cuda.synchronize()
            for name, (g, _) in extra.items():
                t[name] = timer(g.replay)
            del extra
        else:  # CPU smoke run: eager figures
            t["graph:unsplit"] = t["unsplit_eager"]
            t[f"graph:{b.best_candidate}"] = timer(split_fn)
            t["split_serial"] = timer(serial)
            t["split_nocomm"] = timer(nocomm)
            t["comm"] = timer(comm)
    runner = b = None  # free the graphs before the next bucket
    torch.cuda.empty_cache() if cuda else None
    t = max_over_ranks(t, device)
    serial_base_t, base_t, base = H.baseline(t)
    row.update(t_baseline_serial_us=serial_base_t, baseline_graph=base,
               t_unsplit_overlap_us=t.get(f"graph:{H.UNSPLIT_OVERLAP}"),
               unsplit_choice=row.pop("unsplit_choice"))
    dbo_t = t[f"graph:{row['dbo_variant']}"]
    chosen_t = t[f"graph:{row['chosen_graph']}"] if f"graph:{row['chosen_graph']}" in t else None
    serial_t, nocomm_t, comm_t = t["split_serial"], t["split_nocomm"], t["comm"]
    denom = serial_t - max(nocomm_t, comm_t)
    streams = t.get("split_nocomm_streams")
    row.update({
        "t_unsplit_eager_us": t["unsplit_eager"], "t_baseline_us": base_t,
        "t_inductor_us": t.get("inductor"),
        "t_split_serial_us": serial_t, "t_split_nocomm_us": nocomm_t, "t_comm_us": comm_t,
        "t_split_nocomm_streams_us": streams,
        "t_dbo_eager_us": t["dbo_eager"], "t_dbo_graph_us": dbo_t,
        "t_variants_us": H.variants(t),
        "t_runner_step_us": t["runner_step"],
        "t_runner_step_no_mirrors_us": t["runner_step_no_mirrors"],
        "t_chosen_us": chosen_t,
        "speedup": base_t / dbo_t, "speedup_vs_serial_unsplit": serial_base_t / dbo_t,
        "chosen_vs_baseline": base_t / chosen_t if chosen_t else None,
        "eta": (serial_t - dbo_t) / denom if denom > 0 else None,
        "eta_vs_nocomm_streams": ((serial_t - dbo_t) / (serial_t - max(streams, comm_t))
                                  if streams and serial_t > max(streams, comm_t) else None),
        "timing_mode": "graph" if cuda else "eager",
        "experts_paths": experts_path_choices(),
    })
    return row


fmt = harness.fmt


def markdown(doc: dict) -> str:
    rows = []
    for r in doc["rows"]:
        head = [r.get("link"), r["phase"], r["tokens_per_rank"]]
        if r.get("t_dbo_graph_us") is None:
            rows.append(head + [bench_cli.failed_cell(r)])  # one line: a traceback's too
            continue
        err = max((v["max_rel"] for k, v in r.items() if k.startswith("num_") and isinstance(v, dict)),
                  default=None)
        rows.append(head + [
            fmt(r["t_unsplit_eager_us"]), fmt(r["t_baseline_us"]), fmt(r["t_split_serial_us"]),
            fmt(r["t_split_nocomm_us"]), fmt(r["t_comm_us"]), fmt(r["t_dbo_eager_us"]),
            f"{fmt(r['t_dbo_graph_us'])} ({r['dbo_variant']})", f"{r['chosen']} {fmt(r['t_chosen_us'])}",
            f"{fmt(r['speedup'], 3)}×", fmt(r["eta"], 2), f"{fmt(r['chosen_vs_baseline'], 3)}×",
            fmt(err, 4)])
    head = ["link", "phase", "tok/rank", "unsplit eager", "**baseline** (unsplit graph)",
            "split serial", "split no comm", "comm M", "DBO eager", "**DBO graph** (schedule)",
            "runtime picks", "speedup", "η", "pick / baseline", "max rel err"]
    lines = [f"Machine: {doc['machine']}; torch {doc['torch']}, NCCL {doc['nccl']}; {doc['date']}; "
             f"{doc.get('setup', '')}", "", *harness.table(head, rows)]
    lines.append("")
    # CUDA graphs on a GPU, wall-clock eager calls on the CPU smoke run
    lines.append(bench_cli.timing_note(doc.get("timing_mode", "graph") == "graph") +
                 "; runtime picks = what CudaGraphRunner runs by "
                 "default (split=\"auto\": split only where measured faster); speedup = baseline / DBO "
                 "graph; η = (serial − DBO) / (serial − max(no comm, M)).")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse(argv)
    if args.emulate_ep:
        import bench_emulated

        return bench_emulated.main(args)
    cuda = torch.cuda.is_available()
    device = H.init_distributed()
    dbo_backend.register()
    preset = args.preset or ("deepseek-v2-lite" if cuda else "tiny")
    buckets = args.buckets or ("decode:64,decode:128,decode:256,decode:512,decode:1024,"
                               "prefill:2048,prefill:4096,prefill:8192" if cuda
                               else "decode:32,prefill:64")
    link = bench_cli.link_label(args.link, cuda)
    kernels = H.install_kernels(device.type, experts=args.experts, attention=args.attention)
    overrides = {"vocab_size": args.vocab, "first_k_dense_replace": args.dense_layers}
    args.vote_group_name = (dist.new_group(backend="gloo").group_name
                            if args.vote_group == "gloo" else None)
    group = dist.group.WORLD
    if args.comm_sms and cuda:
        from dbo_compile.runtime.streams import new_ep_group

        group = new_ep_group(comm_sms=args.comm_sms)
    model = H.build_model(preset, args.layers, group, str(device), **overrides)
    timer = Timer(cuda, args.iters, args.warmup)
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if cuda else "n/a (gloo)"
    machine = harness.machine(dist.get_world_size(), device)
    mc = model.config
    setup = (f"{preset}, {args.layers} layers ({mc.num_moe_layers} MoE), vocab {mc.vocab_size}, bf16, "
             f"EP={dist.get_world_size()}, experts={kernels['experts']}, "
             f"attention={kernels['attention']}, scheduler={args.scheduler}"
             + (f", comm_sms={args.comm_sms}" if args.comm_sms else "")
             + f", carve-out candidates {args.carveout_candidates or 'none'} "
             f"(sm_carveout_mode={args.carveout_mode})"
             + (f", max_num_reqs={args.max_num_reqs}" if args.max_num_reqs else "")
             + f", compute_backend={args.compute_backend}, DP vote over {args.vote_group}"
             + (f", calibration {args.calibration}" if args.calibration else ""))
    log(f"[bench] {machine} torch {torch.__version__} nccl {nccl} link={link} {setup}")
    rows = []
    for b in buckets.split(","):
        phase, tok = b.split(":")
        try:
            row = bench_bucket(args, model, phase, int(tok), device, cuda, timer)
        except Exception as e:  # noqa: BLE001
            log(traceback.format_exc())
            row = {"phase": phase, "tokens_per_rank": int(tok), "errors": [f"{type(e).__name__}: {e}"[:500]]}
        row["link"] = link
        row["compute_backend"] = args.compute_backend
        rows.append(row)
        log("[bench] " + json.dumps(row, default=str))
    if dist.get_rank() == 0:
        doc = {"machine": machine, "date": datetime.datetime.now().isoformat(timespec="seconds"),
               "torch": torch.__version__, "nccl": nccl, "setup": setup,
               "timing_mode": "graph" if cuda else "eager", "rows": []}
        if args.append and os.path.exists(args.json):
            with open(args.json) as f:
                doc["rows"] = json.load(f).get("rows", [])
        doc["rows"] += rows
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1, default=str)
        md = markdown(doc)
        with open(args.md or os.path.splitext(args.json)[0] + ".md", "w") as f:
            f.write(md)
        print(md, flush=True)
    dist.barrier()
    dist.destroy_process_group()
    if bench_cli.all_rows_failed(rows):
        log(f"[bench] every row of this run failed ({len(rows)}): exit status 1")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
