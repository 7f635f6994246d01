"""DBO benchmark: DeepSeek-V2-Lite-shaped MoE layers, 2 EP ranks, side by side in one run.

Run (2 GPUs; the link regime is the environment's, label it with --link)::

    torchrun --nproc-per-node 2 benchmarks/bench_moe.py --link nvlink
    NCCL_P2P_DISABLE=1 torchrun --nproc-per-node 2 benchmarks/bench_moe.py --link shm --append

On a machine without CUDA it runs on CPU over Gloo (a smoke test: tiny preset, no graphs).

Per bucket (phase, tokens/rank), every figure the median of ``--iters`` timed calls (CUDA events),
the max over ranks:

- ``unsplit_eager``: the model run eagerly, unsplit.
- ``baseline``: the same unsplit model captured whole in a CUDA graph (THE baseline).
- ``split_serial``: the split program in a CUDA graph with its comm stream replaced by the compute
  stream (``dbo_compile.runtime.cudagraph.serial_comm``): same generated code, same kernels, same
  order, but every collective serialises with the compute around it.
- ``split_nocomm``: as split_serial, with the collectives replaced by local copies of the same
  shapes (``moe_harness.no_comm``): the compute of the split program alone.
- ``comm``: the collectives of the split program alone (per MoE layer and ubatch: dispatch = 2
  ``all_to_all_single``, combine = 1, static capacity), captured in a CUDA graph.
- ``dbo_eager``: ``torch.compile(backend="dbo", split="always")`` called eagerly (runtime guard,
  metadata split, generated wrapper on two streams).
- ``dbo_graph``: the split program (two streams) captured in a CUDA graph.
- ``chosen``: what ``split="auto"`` decides for this step (thresholds), timed as the graph it
  would run.

speedup = baseline / dbo_graph; η = (split_serial − dbo_graph) / (split_serial − max(split_nocomm,
comm)) (../shared/DESIGN.md).

GPU stand-ins (see moe_harness): routed experts as one grouped-GEMM op (``--experts grouped``),
projection-only attention (``--attention proj``); ``--attention ref`` runs the reference
attention op (a Python chunk loop: representative of nothing on GPU).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
import traceback

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import moe_harness as H  # noqa: E402

from dbo_compile import backend as dbo_backend  # noqa: E402
from dbo_compile.runtime import cudagraph as cg  # noqa: E402

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default=None, help="default deepseek-v2-lite (GPU) / tiny (CPU)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=None, help="override vocab_size (lm_head cost)")
    p.add_argument("--buckets", default=None,
                   help="phase:tokens,... default decode:256,decode:1024,prefill:2048,prefill:4096")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--experts", default="grouped", choices=["grouped", "loop"])
    p.add_argument("--attention", default="proj", choices=["proj", "ref"])
    p.add_argument("--scheduler", default="list", choices=["list", "naive"])
    p.add_argument("--link", default=None, help="label: nvlink | shm (default from NCCL_P2P_DISABLE)")
    p.add_argument("--no-graph", action="store_true")
    p.add_argument("--json", default=os.path.join(_ROOT, "benchmarks", "results", "latest.json"))
    p.add_argument("--md", default=None, help="markdown table path (default: json with .md)")
    p.add_argument("--append", action="store_true", help="add rows to an existing --json")
    return p.parse_args(argv)


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
        self.sync()
        if not self.cuda:
            ts = []
            for _ in range(self.iters):
                t0 = time.perf_counter()
                fn()
                ts.append((time.perf_counter() - t0) * 1e6)
            return statistics.median(ts)
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(self.iters)]
        for s, e in ev:
            s.record()
            fn()
            e.record()
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) * 1e3 for s, e in ev)

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
    bufs = []
    for _layer in range(cfg.num_moe_layers):
        per = []
        for t in tokens_per_ubatch:
            rows = w * t
            per.append(dict(
                xs=torch.randn(rows, cfg.hidden_size, device=device, dtype=model.dtype),
                xr=torch.empty(rows, cfg.hidden_size, device=device, dtype=model.dtype),
                ms=torch.randn(rows, 2 * cfg.top_k, device=device, dtype=torch.float32),
                mr=torch.empty(rows, 2 * cfg.top_k, device=device, dtype=torch.float32),
                yr=torch.empty(rows, cfg.hidden_size, device=device, dtype=model.dtype)))
        bufs.append(per)

    def run():
        for per in bufs:
            for b in per:
                dist.all_to_all_single(b["xr"], b["xs"])
                dist.all_to_all_single(b["mr"], b["ms"])
            for b in per:
                dist.all_to_all_single(b["yr"], b["xr"])
    return run


def bench_bucket(args, model, phase: str, tokens: int, device, cuda: bool, timer: Timer) -> dict:
    cfg = model.config
    torch._dynamo.reset()
    dbo_backend.reset_artifacts()
    step = H.make_bucket_step(cfg, phase, tokens, device, seed=tokens)
    model.allocate_kv_cache(step.num_blocks, step.block_size)
    ids, pos, md = step.input_ids, step.positions, step.attn_metadata
    row: dict = {"phase": phase, "tokens_per_rank": tokens, "errors": []}
    cmodel = torch.compile(model, backend="dbo",
                           options={"split": "always", "scheduler": args.scheduler})
    t0 = time.perf_counter()
    with torch.no_grad():
        ref = model(ids, pos, md).clone()
        out = cmodel(ids, pos, md)
    row["compile_s"] = round(time.perf_counter() - t0, 1)
    art = dbo_backend.compiled_artifacts()[-1]
    row["artifact"] = type(art).__name__
    if getattr(art, "split_program", None) is None:
        row["errors"].append(f"not split: {getattr(art, 'reason', '?')}")
        return row
    row["schedule"] = {"units": len(art.schedule.units), "event_edges": len(art.schedule.event_edges),
                       "predicted_us": round(art.schedule.predicted_step_us, 1),
                       "serial_pred_us": round(art.schedule.serial_us, 1)}
    row["num_dbo_eager_vs_unsplit"] = H.rel_err(out[0] if isinstance(out, tuple) else out, ref)
    with torch.no_grad():
        sstep = cg.SplitStep(art, lambda: cmodel(ids, pos, md))
    tok_ub = [int(a.shape[0]) for a, (idx, ub) in zip(sstep.split_args, art.signature.inputs)
              if ub is not None and art.specs[idx].kind == "token" and art.specs[idx].field is None][:2]
    row["ubatch_tokens"] = tok_ub
    saved = art.config
    art.config = saved.replace(split="auto")
    row["chosen"] = "split" if art.decide(sstep.graph_args)[0] else "unsplit"
    art.config = saved
    program = art.split_program
    t: dict = {}

    def serial():
        with cg.serial_comm(program):
            return sstep()

    def nocomm():
        with H.no_comm(), cg.serial_comm(program):
            return sstep()

    def nocomm_streams():
        with H.no_comm():
            return sstep()

    comm = comm_only_fn(model, tok_ub, device)
    with torch.no_grad():
        t["unsplit_eager"] = timer(lambda: model(ids, pos, md))
        t["dbo_eager"] = timer(lambda: cmodel(ids, pos, md))
        t["split_serial_eager"] = timer(serial)
        t["split_nocomm_eager"] = timer(nocomm)
        t["comm_eager"] = timer(comm)
        if cuda and not args.no_graph:
            pool = torch.cuda.graph_pool_handle()
            graphs = {}
            for name, fn in (("baseline", lambda: model(ids, pos, md)), ("dbo_graph", sstep),
                             ("split_serial", serial), ("split_nocomm", nocomm),
                             ("split_nocomm_streams", nocomm_streams), ("comm", comm)):
                try:
                    graphs[name] = cg.capture(fn, warmup=2, pool=pool)
                except Exception as e:  # noqa: BLE001
                    row["errors"].append(f"capture {name}: {type(e).__name__}: {e}"[:400])
                    log(f"  capture {name} FAILED: {traceback.format_exc()[-1500:]}")
                    torch.cuda.synchronize()
            for name in ("baseline", "dbo_graph"):
                if name in graphs:
                    graphs[name][0].replay()
                    torch.cuda.synchronize()
                    o = graphs[name][1]
                    o = o[0] if isinstance(o, tuple) else o
                    row[f"num_{name}_vs_unsplit"] = H.rel_err(o, ref)
            for name, (g, _) in graphs.items():
                t[name] = timer(g.replay)
            del graphs
    del sstep
    torch.cuda.empty_cache() if cuda else None
    t = max_over_ranks({k: t.get(k) for k in ("unsplit_eager", "dbo_eager", "split_serial_eager",
                                               "split_nocomm_eager", "comm_eager", "baseline",
                                               "dbo_graph", "split_serial", "split_nocomm", "split_nocomm_streams",
                                               "comm")},
                       device)
    graph = t["dbo_graph"] is not None
    serial_t = t["split_serial"] if graph else t["split_serial_eager"]
    nocomm_t = t["split_nocomm"] if graph else t["split_nocomm_eager"]
    comm_t = t["comm"] if graph else t["comm_eager"]
    dbo_t = t["dbo_graph"] if graph else t["dbo_eager"]
    base_t = t["baseline"] if t["baseline"] is not None else t["unsplit_eager"]
    denom = serial_t - max(nocomm_t, comm_t)
    row.update({
        "t_unsplit_eager_us": t["unsplit_eager"], "t_baseline_us": t["baseline"],
        "t_split_serial_us": serial_t, "t_split_nocomm_us": nocomm_t, "t_comm_us": comm_t,
        "t_dbo_eager_us": t["dbo_eager"], "t_dbo_graph_us": t["dbo_graph"],
        "t_split_nocomm_streams_us": t["split_nocomm_streams"],
        "eta_vs_nocomm_streams": ((serial_t - dbo_t) / (serial_t - max(t["split_nocomm_streams"], comm_t))
                                  if t["split_nocomm_streams"] and serial_t > max(t["split_nocomm_streams"], comm_t)
                                  else None),
        "t_split_serial_eager_us": t["split_serial_eager"],
        "t_split_nocomm_eager_us": t["split_nocomm_eager"], "t_comm_eager_us": t["comm_eager"],
        "timing_mode": "graph" if graph else "eager",
        "t_chosen_us": dbo_t if row["chosen"] == "split" else base_t,
        "speedup": base_t / dbo_t if dbo_t else None,
        "eta": (serial_t - dbo_t) / denom if denom > 0 else None,
    })
    return row


def fmt(v, nd=0):
    if v is None:
        return "–"
    return f"{v:,.{nd}f}" if isinstance(v, float) else str(v)


def markdown(doc: dict) -> str:
    lines = [f"Machine: {doc['machine']}; torch {doc['torch']}, NCCL {doc['nccl']}; {doc['date']}; "
             f"{doc.get('setup', '')}", "",
             "| link | phase | tok/rank | unsplit eager | **baseline** (unsplit graph) | split serial "
             "| split no comm (1 stream / 2 streams) | comm M | DBO eager | **DBO graph** | chosen | speedup | η | max rel err |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in doc["rows"]:
        if r.get("t_dbo_eager_us") is None:
            lines.append(f"| {r.get('link')} | {r['phase']} | {r['tokens_per_rank']} | failed: "
                         f"{'; '.join(r.get('errors', []))[:200]} |")
            continue
        err = max((v["max_rel"] for k, v in r.items() if k.startswith("num_") and isinstance(v, dict)),
                  default=None)
        lines.append(
            f"| {r['link']} | {r['phase']} | {r['tokens_per_rank']} | {fmt(r['t_unsplit_eager_us'])} | "
            f"{fmt(r['t_baseline_us'])} | {fmt(r['t_split_serial_us'])} | {fmt(r['t_split_nocomm_us'])} / {fmt(r.get('t_split_nocomm_streams_us'))} | "
            f"{fmt(r['t_comm_us'])} | {fmt(r['t_dbo_eager_us'])} | {fmt(r['t_dbo_graph_us'])} | "
            f"{r['chosen']} {fmt(r['t_chosen_us'])} | {fmt(r['speedup'], 2)}× | {fmt(r['eta'], 2)} ({fmt(r.get('eta_vs_nocomm_streams'), 2)}) | "
            f"{fmt(err, 4)} |")
    lines.append("")
    lines.append("µs per step, median, max over ranks. baseline = unsplit model in one CUDA graph; "
                 "speedup = baseline / DBO graph; η = (serial − DBO) / (serial − max(no comm, M)) with the "
                 "1-stream no-comm figure (in brackets: with the 2-stream one).")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse(argv)
    cuda = torch.cuda.is_available()
    if cuda:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    dbo_backend.register()
    preset = args.preset or ("deepseek-v2-lite" if cuda else "tiny")
    buckets = args.buckets or ("decode:256,decode:1024,prefill:2048,prefill:4096" if cuda
                               else "decode:16,prefill:32")
    link = args.link or ("shm" if os.environ.get("NCCL_P2P_DISABLE") == "1" else "nvlink")
    kernels = H.install_kernels(device.type, experts=args.experts, attention=args.attention)
    overrides = {"vocab_size": args.vocab} if args.vocab else {}
    model = H.build_model(preset, args.layers, dist.group.WORLD, str(device), **overrides)
    timer = Timer(cuda, args.iters, args.warmup)
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if cuda else "n/a (gloo)"
    machine = (f"{dist.get_world_size()}x {torch.cuda.get_device_name(device)}" if cuda
               else f"{dist.get_world_size()} CPU ranks ({platform.machine()})")
    setup = (f"{preset}, {args.layers} layers, bf16, EP={dist.get_world_size()}, experts={kernels['experts']}, "
             f"attention={kernels['attention']}, scheduler={args.scheduler}")
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
        rows.append(row)
        log("[bench] " + json.dumps(row, default=str))
    if dist.get_rank() == 0:
        doc = {"machine": machine, "date": datetime.datetime.now().isoformat(timespec="seconds"),
               "torch": torch.__version__, "nccl": nccl, "setup": setup, "rows": []}
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
