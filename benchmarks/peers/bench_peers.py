"""Ours against the peers, side by side in one run, on the same emulated EP-W world.

Run (one GPU; no torchrun)::

    python benchmarks/peers/bench_peers.py --emulate-ep 8 --link-gbps 50
    python benchmarks/peers/bench_peers.py --preset deepseek-v3 --layers 2 --emulate-ep 32

Without CUDA: ``--smoke`` (tiny preset, decode:32 and prefill:64, no graphs; numerics checked).

The world is ``bench_moe.py --emulate-ep``'s (``benchmarks/bench_emulated.py``): the
DeepSeek-shaped model of ``dbo_compile/models/deepseek.py`` as rank 0 of an emulated EP-W
world, the link at ``--link-gbps``, the same buckets and steps (``dbo_compile.testing.moe``). Per bucket:

- ``baseline``: the unsplit program in a CUDA graph (the runner's ``unsplit`` graph);
- ours: the compiled model (default options) run by ``CudaGraphRunner``: ``ours graph`` =
  the graph it picks for the bucket (split or not, by its warm-up timing), ``ours step`` =
  one whole runner call (vote, copies into the static buffers, replay);
- each peer (:mod:`vllm_dbo`: two threads ping-ponging at yields; :mod:`sglang_tbo`: one
  thread, staged op lists with a head start), both running the model's own modules and the
  same emulated dispatch / combine ops (:mod:`layer_ops`):
  - ``eager``: the split step run eagerly, its host work included (the ubatch split of the
    metadata, threads or stage executors);
  - ``graph``: the split step captured as one CUDA graph (with both threads running, for
    vLLM) and replayed: the schedule alone;
  - ``graph step``: the graph with its per-step host work (split, copies into the static
    ubatch inputs, replay);
  - ``as it runs``: what the peer's system runs for this step: not split below its
    thresholds (then the baseline graph), else its graph step where that system captures
    (decode up to ``--vllm-max-capture`` / ``--sglang-max-capture`` tokens), else eager;
- ratios ours/peer = t_peer / t_ours (> 1: ours faster): ``as runs`` (peer as it runs vs
  ``ours step``) and ``graph`` (peer graph vs ``ours graph``); on CUDA each is timed side by
  side, ours and the peer alternating over ``--pair-rounds`` rounds (the median of the
  rounds' ratios, ``paired_*`` in the JSON): a host's drift between two timings minutes
  apart does not enter it;
- numerics: every peer output (eager and graph) and ours against the unsplit model run
  eagerly (``max_rel`` = max |out - ref| / max |ref| of the fp32 logits, within
  ``layer_ops.REL_TOL`` of the dtype, or within the unsplit model's own noise floor under a
  one-ulp change of rounding, ``noise_floor`` of the row: fine-grained routing turns rounding
  into another expert, docs/emulated.md "Numerics at V3 routing"); the run exits 1 when one
  fails (``--fault`` plants a schedule fault to show the check catches it).

µs: median of ``--iters`` CUDA-event-timed calls (wall clock on CPU).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
import time
import traceback

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.dirname(_HERE)]

import bench_emulated as BE  # noqa: E402
import harness  # noqa: E402
import sglang_tbo  # noqa: E402
import vllm_dbo  # noqa: E402
from layer_ops import FAULTS, Streams, check_numerics, layer_ops, split_step  # noqa: E402

from dbo_compile import backend as dbo_backend  # noqa: E402
from dbo_compile.ops import emulated as E  # noqa: E402
from dbo_compile.runtime.capture import capture, run_draining  # noqa: E402
from dbo_compile.runtime.cudagraph_runner import CudaGraphRunner  # noqa: E402
from dbo_compile.testing import moe as H  # noqa: E402
from dbo_compile.testing.bench_cli import check_max_num_reqs, world_options  # noqa: E402

PEERS = ("vllm_dbo", "sglang_tbo")
GPU_BUCKETS = ("decode:64,decode:128,decode:256,decode:512,decode:1024,"
               "prefill:2048,prefill:4096,prefill:8192")


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--emulate-ep", default="8", metavar="W[@GBPS],...",
                   help="emulated EP world sizes, each optionally @link GB/s (default 8)")
    p.add_argument("--link-gbps", type=float, default=50.0)
    p.add_argument("--latency-us", type=float, default=0.0)
    p.add_argument("--preset", default=None, help="default deepseek-v2-lite (tiny with --smoke)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--dense-layers", type=int, default=0)
    p.add_argument("--buckets", default=None, help=f"phase:tokens,... default {GPU_BUCKETS}")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--pair-rounds", type=int, default=3,
                   help="rounds of the side-by-side timing of each ratio (CUDA; default 3): "
                        "ours and the peer alternate, max(10, --iters / rounds) calls each "
                        "per round")
    p.add_argument("--timing-iters", type=int, default=5,
                   help="CudaGraphRunner's replays per graph and round at warm-up")
    p.add_argument("--experts", default="grouped", choices=["grouped", "loop"])
    p.add_argument("--attention", default="fused", choices=list(H.ATTENTION_KINDS))
    p.add_argument("--scheduler", default="list", choices=["list", "naive", "staged", "staged-d2"])
    p.add_argument("--compute-backend", default="auto", choices=["auto", "aten", "inductor"],
                   help="ours: option compute_backend (the peers run the model's modules "
                        "eagerly / in their graphs, as ATen kernels)")
    p.add_argument("--candidates", default="default",
                   help="ours: option schedule_candidates (default: the package default)")
    p.add_argument("--carveout-candidates", default="default")
    p.add_argument("--max-num-reqs", type=int, default=None,
                   help="ours: CudaGraphRunner(max_num_reqs=...), the requests each bucket's "
                        "static buffers hold (the engine's max_num_seqs; default: the bucket's "
                        "token count)")
    p.add_argument("--comm-sms", type=int, default=None)
    p.add_argument("--calibration", default=None)
    p.add_argument("--cost-link-gbps", type=float, default=44.0)
    p.add_argument("--cost-latency-us", type=float, default=10.0)
    p.add_argument("--vllm-max-capture", type=int, default=512,
                   help="vLLM's largest cudagraph_capture_size (default 512)")
    p.add_argument("--sglang-max-capture", type=int, default=160,
                   help="SGLang's cuda_graph_max_bs (default ~160, docs/references.md)")
    p.add_argument("--smoke", action="store_true",
                   help="CPU smoke run: tiny preset, decode:32,prefill:64, no graphs")
    p.add_argument("--fault", default=None, choices=FAULTS,
                   help="plant a schedule fault in both peers (the numerics must catch it)")
    p.add_argument("--json", default=os.path.join(os.path.dirname(_HERE), "results", "local",
                                                  "peers.json"),
                   help="results JSON (default: the ignored benchmarks/results/local/)")
    p.add_argument("--md", default=None, help="markdown path (default: json with .md)")
    args = p.parse_args(argv)
    if args.pair_rounds < 1:
        p.error(f"--pair-rounds {args.pair_rounds}: at least one round")
    if not torch.cuda.is_available() and not args.smoke:
        p.error("no CUDA: run the CPU smoke with --smoke")
    args.cuda = torch.cuda.is_available() and not args.smoke
    args.carveouts = (() if args.carveout_candidates == "default"
                      else tuple(int(v) for v in args.carveout_candidates.split(",") if v))
    args.candidate_names = H.candidate_names(args.candidates)
    return args


def capture_peer(fn, warmup: int = 2):
    """``fn`` (a peer's step on static ubatches) as one CUDA graph after ``warmup`` eager
    calls on a side stream; ``capture_error_mode="thread_local"``: the vLLM peer's threads
    launch onto the capturing stream while the capturing thread waits for them."""
    return capture(fn, warmup=warmup, capture_error_mode="thread_local")


def _load(static, ubatches) -> None:
    """Copy a step's ubatch inputs into the captured graph's static ones (same shapes)."""
    for st, new in zip(static, ubatches):
        st.input_ids.copy_(new.input_ids)
        st.positions.copy_(new.positions)
        for name, t in new.md.tensors().items():
            getattr(st.md, name).copy_(t)


def bench_peer(args, name, peer, traced, step, phase, n, ref, dtype, timer, baseline_us,
               floor=None, ours=None) -> dict:
    """One peer's row at one bucket. ``ours``: ``{"step", "graph", "baseline"}`` callables of
    our runner's call, our picked graph's replay and the unsplit graph's: on CUDA each ratio
    is then also timed side by side in alternating rounds (``paired_as_runs``: ours step
    against the peer as it runs; ``paired_graph``: ours graph against the peer's graph)."""
    ids, pos, md = step.input_ids, step.positions, step.attn_metadata
    qlens = [int(q) for q in step.num_scheduled_tokens]
    uniform = all(q == 1 for q in qlens)
    if name == "vllm_dbo":
        split, cut = vllm_dbo.should_split(n, uniform), n // 2
        max_capture = args.vllm_max_capture
    else:
        cut = sglang_tbo.split_point(qlens, uniform)
        split = cut is not None
        cut = n // 2 if cut is None else cut
        max_capture = args.sglang_max_capture
    r: dict = {"split": split, "split_token": cut}
    if name == "sglang_tbo":
        r["delta"] = peer.delta
    make = lambda: split_step(ids, pos, md, qlens, cut)  # noqa: E731
    with torch.no_grad():
        # the numerics run: the same schedule with its host order recorded
        tpeer, order = traced(name)
        # (run_draining: a step that fails receives what it left in flight, so that the next
        # peer finds the link's slots free)
        r["num_eager"] = check_numerics(run_draining(lambda: tpeer.run(make())), ref, dtype,
                                        floor)
        r["host_order_first_moe_layer"] = first_moe_layer(order)
        def eager():
            run_draining(lambda: peer.run(make()))

        r["t_eager_us"] = timer(eager)
        graphed = False
        if args.cuda:
            static = [dataclass_clone(u) for u in make()]
            g, out = capture_peer(lambda: peer.run(static))
            _load(static, make())
            g.replay()
            torch.cuda.synchronize()
            r["num_graph"] = check_numerics(out, ref, dtype, floor)
            r["t_graph_us"] = timer(g.replay)

            def graph_step():
                _load(static, make())
                g.replay()

            r["t_graph_step_us"] = timer(graph_step)
            graphed = uniform and n <= max_capture
            if ours is not None:
                as_runs = ours["baseline"] if not split else graph_step if graphed else eager
                r["paired_as_runs"] = timer.paired(ours["step"], as_runs, args.pair_rounds)
                r["paired_graph"] = timer.paired(ours["graph"], g.replay, args.pair_rounds)
            del g, out, static
    if not split:
        r["as_runs"], r["t_as_runs_us"] = "unsplit (baseline graph)", baseline_us
    elif graphed:
        r["as_runs"], r["t_as_runs_us"] = "split, CUDA graph", r["t_graph_step_us"]
    else:
        r["as_runs"], r["t_as_runs_us"] = "split, eager", r["t_eager_us"]
    return r


def first_moe_layer(order: list[str]) -> list[str]:
    """``"UBATCH:OP"`` of the first MoE layer's ops, in the order the host issued them."""
    layer = next((e.split(":")[2] for e in order if e.split(":")[1] == "dispatch"), None)
    return [":".join(e.split(":")[:2]) for e in order if e.split(":")[2] == layer]


def dataclass_clone(u):
    """A ubatch whose inputs are fresh copies (the static inputs of a captured graph)."""
    md = dataclasses.replace(u.md, **{k: t.clone() for k, t in u.md.tensors().items()})
    return type(u)(u.index, u.input_ids.clone(), u.positions.clone(), md)


def bench_bucket(args, model, runner, step, phase, n, peers, traced, timer) -> dict:
    ids, pos, md, qlens = (step.input_ids, step.positions, step.attn_metadata,
                           step.num_scheduled_tokens)
    b = runner.graphs[n]
    row: dict = {"phase": phase, "tokens_per_rank": n, "errors": [], "ours_choice": b.choice,
                 # the runner's warm-up timing of each graph it chose among (µs, median)
                 "ours_warmup_us": {k: round(v, 1) for k, v in (b.times_us or {}).items()}}
    with torch.no_grad():
        ref = model(ids, pos, md).float()
        # the unsplit model's own move under a one-ulp change of rounding (H.noise_floor)
        floor = row["noise_floor"] = H.noise_floor(model, ids, pos, md, ref)
        row["num_ours"] = check_numerics(runner(ids, pos, md, qlens), ref, model.dtype, floor)
        t = {"ours_step": timer(lambda: runner(ids, pos, md, qlens))}
        runner.load_step(n, ids, pos, md, qlens, split=False)
        if b.choice != "unsplit":
            runner.load_step(n, ids, pos, md, qlens, split=True)
        t["baseline"] = timer(b.graphs["unsplit"].replay)
        t["ours_graph"] = timer(b.graphs[b.choice].replay)
    ours = {"step": lambda: runner(ids, pos, md, qlens), "graph": b.graphs[b.choice].replay,
            "baseline": b.graphs["unsplit"].replay}
    row.update({f"t_{k}_us": v for k, v in t.items()})
    row["peers"] = {}
    for name, peer in peers.items():
        try:
            r = bench_peer(args, name, peer, traced, step, phase, n, ref, model.dtype, timer,
                           t["baseline"], floor, ours)
        except Exception as e:  # noqa: BLE001 - one peer's failure is its row's
            print(traceback.format_exc()[-3000:], flush=True)
            r = {"error": f"{type(e).__name__}: {e}"[:500]}
            row["errors"].append(f"{name}: {r['error']}")
        if "t_as_runs_us" in r:  # side by side where timed so (CUDA), else apart
            r["ours_vs_peer_as_runs"] = (r["paired_as_runs"]["ratio"] if "paired_as_runs" in r
                                         else r["t_as_runs_us"] / t["ours_step"])
            if "paired_graph" in r:
                r["ours_vs_peer_graph"] = r["paired_graph"]["ratio"]
            elif r.get("t_graph_us"):
                r["ours_vs_peer_graph"] = r["t_graph_us"] / t["ours_graph"]
        row["peers"][name] = r
    checks = [row["num_ours"]] + [r[k] for r in row["peers"].values()
                                  for k in ("num_eager", "num_graph") if k in r]
    row["numerics_ok"] = all(c["ok"] for c in checks)
    return row


def build_world(args, preset: str, w: int, gbps: float, buckets, device,
                keep_candidates: bool = False):
    """One emulated EP-``w`` world at ``gbps`` GB/s: the model (``preset``, ``args.layers``
    layers), a step per bucket (``(phase, tokens)`` -> ``Step``), ours compiled with the
    world's options (``world_options``) and captured by a ``CudaGraphRunner`` over the
    buckets' token counts (``keep_candidates``: every split graph kept), the name of the
    emulated comm instance the compiled program is bound to (the peers run the same world,
    the same link) and the peers' streams. Returns ``(model, steps, runner, spec, streams,
    capture_s)``; ``capture_s``: seconds from the model's build to the end of the capture."""
    t0 = time.perf_counter()
    model = H.build_model(preset, args.layers, None, str(device), emulated_world_size=w,
                          vocab_size=args.vocab, first_k_dense_replace=args.dense_layers)
    cfg = model.config
    steps = {(p, n): H.make_bucket_step(cfg, p, n, str(device), seed=n, host_mirrors=True)
             for p, n in buckets}
    check_max_num_reqs(args.max_num_reqs, steps)
    model.allocate_kv_cache(max(s.num_blocks for s in steps.values()), 16)
    width = max(int(s.attn_metadata.block_table.shape[1]) for s in steps.values())
    cmodel = torch.compile(model, backend="dbo", options=world_options(args, w, gbps))
    runner = CudaGraphRunner(cmodel, sorted({n for _, n in buckets}), max_blocks_per_req=width,
                             block_size=16, vocab_size=cfg.vocab_size,
                             timing_iters=args.timing_iters, keep_candidates=keep_candidates,
                             device=device, max_num_reqs=args.max_num_reqs)
    with torch.no_grad():
        runner.capture()
    capture_s = time.perf_counter() - t0
    spec = E.register_emulated(E.EmulatedWorld(w, cfg.num_experts, cfg.top_k, link_gbps=gbps,
                                               latency_us=args.latency_us))
    streams = Streams(device if args.cuda else torch.device("cpu"))
    return model, steps, runner, spec, streams, capture_s


def run_world(args, preset, w, gbps, buckets, device, timer, save) -> None:
    torch._dynamo.reset()
    dbo_backend.reset_artifacts()
    model, steps, runner, spec, streams, capture_s = build_world(args, preset, w, gbps, buckets,
                                                                 device)
    ops = layer_ops(model, spec, args.fault)
    order: list[str] = []
    traced_ops = layer_ops(model, spec, args.fault, trace=order)
    print(f"[peers] {preset} W={w} {gbps:g} GB/s: ours captured in {capture_s:.1f} s; "
          f"{runner.describe()}", flush=True)
    def make_peers(phase: str, op_list) -> dict:
        return {"vllm_dbo": vllm_dbo.VllmDbo(op_list, streams, device),
                "sglang_tbo": sglang_tbo.SglangTbo(op_list, streams, sglang_tbo.DELTA[phase])}

    for phase, n in buckets:
        def traced(name: str, phase=phase):
            order.clear()
            return make_peers(phase, traced_ops)[name], order

        try:
            row = bench_bucket(args, model, runner, steps[(phase, n)], phase, n,
                               make_peers(phase, ops), traced, timer)
        except Exception as e:  # noqa: BLE001
            print(traceback.format_exc()[-3000:], flush=True)
            row = {"phase": phase, "tokens_per_rank": n, "numerics_ok": False,
                   "errors": [f"{type(e).__name__}: {e}"[:500]]}
        row.update(preset=preset, world_size=w, link_gbps=gbps, layers=args.layers,
                   world=spec, capture_s=round(capture_s, 1))
        save(row)
        print("[peers] " + json.dumps(row, default=str), flush=True)
    del runner, model  # the compiled model goes with the runner
    torch._dynamo.reset()
    if args.cuda:
        torch.cuda.empty_cache()


def markdown(doc: dict) -> str:
    fmt = harness.fmt

    def ratio(v) -> str:  # "1.03×", or "–" where the ratio is missing
        return "–" if v is None else f"{fmt(v, 2)}×"
    head = ["preset", "W", "phase", "tok/rank", "**baseline**", "ours graph (pick)", "ours step"]
    for p in PEERS:
        head += [f"{p} as runs", f"{p} graph", f"ours/{p} as runs", f"ours/{p} graph"]
    head += ["numerics"]
    rows = []
    for r in doc["rows"]:
        cells = [r.get("preset"), r.get("world_size"), r["phase"], r["tokens_per_rank"]]
        if "t_baseline_us" not in r:
            rows.append(cells + [f"failed: {'; '.join(r.get('errors', []))[:200]}"])
            continue
        cells += [fmt(r["t_baseline_us"]), f"{fmt(r['t_ours_graph_us'])} ({r['ours_choice']})",
                  fmt(r["t_ours_step_us"])]
        for p in PEERS:
            pr = r["peers"].get(p, {})
            mode = pr.get("as_runs", "failed").split(",")[-1].strip()
            cells += [f"{fmt(pr.get('t_as_runs_us'))} ({mode})", fmt(pr.get("t_graph_us")),
                      ratio(pr.get('ours_vs_peer_as_runs')), ratio(pr.get('ours_vs_peer_graph'))]
        worst = max((c.get("max_rel", float("inf")) for pr in r["peers"].values()
                     for k, c in pr.items() if k.startswith("num_")), default=None)
        floored = any(c.get("within_noise_floor") for c in [r.get("num_ours", {})] + [
            c for pr in r["peers"].values() for k, c in pr.items() if k.startswith("num_")])
        verdict = "ok" if r["numerics_ok"] else "FAILED"
        if floored and r["numerics_ok"]:
            verdict += f", within noise floor {fmt(r['noise_floor']['max_rel'], 3)}"
        cells.append(f"{verdict} (peers ≤ {fmt(worst, 4)})")
        rows.append(cells)
    lines = [f"Machine: {doc['machine']}; torch {doc['torch']}; {doc['date']}; {doc['setup']}",
             "", *harness.table(head, rows), "",
             "µs per step. ours/peer = t_peer / t_ours (> 1: ours faster): as runs = the "
             "peer as its system runs the step vs one whole runner call; graph = the peer's "
             "split step in one CUDA graph vs the graph the runner picks. On CUDA a ratio is "
             "the median of its paired rounds (ours and the peer alternating, --pair-rounds), "
             "so it need not equal the quotient of the µs columns, each timed alone; on CPU it "
             "is that quotient. numerics: max "
             "|out − ref| / max |ref| of the logits against the unsplit model (over the "
             "tolerance but within the unsplit model's own noise floor: docs/emulated.md, "
             "\"Numerics at V3 routing\")."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse(argv)
    device = torch.device("cuda", 0) if args.cuda else torch.device("cpu")
    if args.cuda:
        torch.cuda.set_device(device)
    dbo_backend.register()
    kernels = H.install_kernels(device.type, experts=args.experts, attention=args.attention)
    preset = args.preset or ("tiny" if args.smoke else "deepseek-v2-lite")
    spec = args.buckets or ("decode:32,prefill:64" if args.smoke else GPU_BUCKETS)
    buckets = [(p, int(v)) for p, v in (b.split(":") for b in spec.split(","))]
    timer = BE.Timer(args.iters, args.warmup)
    machine = harness.machine(1, device)
    setup = (f"{preset}, {args.layers} layers ({args.dense_layers} dense), vocab {args.vocab}, "
             f"bf16, emulated EP world, experts={kernels['experts']}, "
             f"attention={kernels['attention']}, ours: compute_backend={args.compute_backend}, "
             f"candidates={args.candidates}; peers: the model's modules (ATen), vLLM max "
             f"capture {args.vllm_max_capture}, SGLang max capture {args.sglang_max_capture}"
             + (f", FAULT {args.fault}" if args.fault else "")
             + ("" if args.cuda else ", CPU smoke (no graphs)"))
    print(f"[peers] {machine} torch {torch.__version__}: {setup}", flush=True)
    doc = {"machine": machine, "date": datetime.datetime.now().isoformat(timespec="seconds"),
           "torch": torch.__version__, "setup": setup, "command": " ".join(sys.argv),
           "rows": []}
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)

    def save(row=None):  # after every bucket: a run cut off keeps its rows
        if row is not None:
            doc["rows"].append(row)
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1, default=str)

    for w, gbps in BE.parse_worlds(args.emulate_ep, args.link_gbps):
        try:
            run_world(args, preset, w, gbps, buckets, device, timer, save)
        except Exception as e:  # noqa: BLE001
            print(traceback.format_exc()[-3000:], flush=True)
            save({"preset": preset, "world_size": w, "link_gbps": gbps, "phase": "-",
                  "tokens_per_rank": 0, "numerics_ok": False,
                  "errors": [f"{type(e).__name__}: {e}"[:500]]})
    save()
    md = markdown(doc)
    with open(args.md or os.path.splitext(args.json)[0] + ".md", "w") as f:
        f.write(md)
    print(md, flush=True)
    failed = [f"{r['phase']}:{r['tokens_per_rank']}" for r in doc["rows"]
              if not r.get("numerics_ok") or r.get("errors")]
    if failed:
        print(f"[peers] numerics failed or errors at {', '.join(failed)}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
