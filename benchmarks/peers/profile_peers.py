r"""Why a step runs faster eagerly than in one CUDA graph: the same step both ways, profiled.

Why (issue 28, ``docs/results.md`` "Peers again"): at V3 EP-32 prefill both peers' split step
ran 9-13 % faster eagerly than captured in one CUDA graph, and so beat our graphs "as they run".
This runs one bucket of ``bench_peers.py``'s world and, for each program below, times it
eagerly and as one graph replay (µs, median of CUDA-event-timed calls) and profiles one call of
each with ``torch.profiler`` (CUDA activity): the GPU's own view of the step, so the two modes'
differences show as kernel time, copy time, overlap or idle time:

- ``unsplit``: our unsplit program (one stream and the link's copy streams);
- ``ours:NAME``: our split program of schedule candidate ``NAME`` (``--candidates``);
- ``sglang`` / ``vllm``: the peers (:mod:`sglang_tbo`, :mod:`vllm_dbo`) on the same world.

Per program and mode: ``wall_us`` (median), and from the trace ``span_us`` (first GPU activity to
last), ``kernel_us`` / ``memcpy_us`` per CUDA stream (sums of durations), ``busy_us`` (union of
the kernels' intervals over all streams: when at least one kernel ran), ``overlap_us`` (kernel
time beyond ``busy_us``: two kernels at once), ``idle_us`` (span less busy: no kernel ran) and
the kernels by short name (calls, µs). The table printed per program: the kernel names whose
time differs most between eager and graph.

    python benchmarks/peers/profile_peers.py --preset deepseek-v3 --layers 2 --emulate-ep 32 \
        --bucket prefill:2048 --candidates staged --json $OUT/profile_peers.json

Every flag of ``bench_peers.py`` but ``--buckets`` applies (the world, ``--candidates``,
``--compute-backend``).
CUDA only.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import sys
import tempfile

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.dirname(_HERE)]

import bench_emulated as BE  # noqa: E402
import bench_peers as BP  # noqa: E402
import harness  # noqa: E402
import sglang_tbo  # noqa: E402
import vllm_dbo  # noqa: E402
from kernel_summary import _short  # noqa: E402
from layer_ops import layer_ops, split_step  # noqa: E402

from dbo_compile import backend as dbo_backend  # noqa: E402
from dbo_compile.runtime.buckets import split_program_fn  # noqa: E402
from dbo_compile.runtime.capture import run_draining  # noqa: E402
from dbo_compile.testing import moe as H  # noqa: E402

#: trace categories of GPU activity (torch.profiler's chrome trace)
_KERNEL, _COPIES = "kernel", ("gpu_memcpy", "gpu_memset")


def trace_stats(fn, reps: int) -> dict:
    """One profiled call of ``fn`` per rep (synchronised before and after), averaged over
    ``reps``: the figures of the module docstring (µs)."""
    from torch.profiler import ProfilerActivity, profile

    acc: dict = collections.defaultdict(float)
    names: dict = collections.defaultdict(lambda: [0.0, 0.0])
    streams: dict = collections.defaultdict(lambda: collections.defaultdict(float))
    for _ in range(reps):
        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        with tempfile.NamedTemporaryFile("r", suffix=".json") as f:
            prof.export_chrome_trace(f.name)
            events = json.load(open(f.name))["traceEvents"]
        gpu = [e for e in events if e.get("cat") in (_KERNEL, *_COPIES) and e.get("dur", 0) > 0]
        if not gpu:
            continue
        t0 = min(e["ts"] for e in gpu)
        t1 = max(e["ts"] + e["dur"] for e in gpu)
        acc["span_us"] += t1 - t0
        kernels = sorted((e["ts"], e["ts"] + e["dur"]) for e in gpu if e["cat"] == _KERNEL)
        busy, end = 0.0, float("-inf")
        for a, b in kernels:  # union of the kernels' intervals
            if a > end:
                busy += b - a
                end = b
            elif b > end:
                busy += b - end
                end = b
        ksum = sum(b - a for a, b in kernels)
        acc["busy_us"] += busy
        acc["kernel_us"] += ksum
        acc["overlap_us"] += ksum - busy
        acc["idle_us"] += (t1 - t0) - busy
        acc["kernels"] += len(kernels)
        for e in gpu:
            s = streams[str(e.get("args", {}).get("stream", "?"))]
            s["kernel_us" if e["cat"] == _KERNEL else "memcpy_us"] += e["dur"]
            if e["cat"] == _KERNEL:
                row = names[_short(e["name"])]
                row[0] += 1
                row[1] += e["dur"]
            else:
                acc["memcpy_us"] += e["dur"]
    out = {k: round(v / reps, 1) for k, v in acc.items()}
    out["streams"] = {k: {kk: round(vv / reps, 1) for kk, vv in v.items()}
                      for k, v in sorted(streams.items(), key=lambda kv: -kv[1]["kernel_us"])}
    out["by_kernel"] = {k: [round(c / reps, 1), round(t / reps, 1)]
                        for k, (c, t) in sorted(names.items(), key=lambda kv: -kv[1][1])}
    return out


def compare(name: str, eager: dict, graph: dict, top: int) -> str:
    """The eager vs graph figures of one program and the kernels that differ most."""
    lines = [f"== {name}: wall eager {eager['wall_us']:,.0f} / graph {graph['wall_us']:,.0f} µs"]
    for k in ("span_us", "busy_us", "kernel_us", "overlap_us", "idle_us", "memcpy_us", "kernels"):
        lines.append(f"   {k:11s} eager {eager.get(k, 0):>11,.1f}   graph {graph.get(k, 0):>11,.1f}"
                     f"   Δ {graph.get(k, 0) - eager.get(k, 0):>+10,.1f}")
    ke, kg = eager["by_kernel"], graph["by_kernel"]
    rows = sorted(set(ke) | set(kg),
                  key=lambda n: -abs(kg.get(n, [0, 0])[1] - ke.get(n, [0, 0])[1]))
    lines.append(f"   {'kernel':60s} {'n eager':>8s} {'µs eager':>10s} {'n graph':>8s} "
                 f"{'µs graph':>10s} {'Δ µs':>9s}")
    for n in rows[:top]:
        a, b = ke.get(n, [0, 0.0]), kg.get(n, [0, 0.0])
        lines.append(f"   {n[:60]:60s} {a[0]:8.0f} {a[1]:10.1f} {b[0]:8.0f} {b[1]:10.1f} "
                     f"{b[1] - a[1]:+9.1f}")
    return "\n".join(lines)


def parse(argv=None) -> tuple[argparse.Namespace, argparse.Namespace]:
    """``(own, args)``: this script's flags and ``bench_peers.py``'s (every flag of it but
    ``--buckets``: one bucket, ``--bucket``). Usage errors (exit 2): no CUDA, ``--buckets``."""
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Every other flag is bench_peers.py's (python benchmarks/peers/bench_peers.py "
               "--help: the world, --candidates, --compute-backend, ...), but --buckets.")
    p.add_argument("--bucket", default="prefill:2048", help="phase:tokens (one bucket)")
    p.add_argument("--reps", type=int, default=3, help="profiled calls per program and mode")
    p.add_argument("--top", type=int, default=20, help="kernel rows printed per program")
    p.add_argument("--peers", default="sglang,vllm", help="the peers profiled (comma-separated)")
    p.add_argument("--json", default=None, help="write the figures here")
    own, rest = p.parse_known_args(argv)
    if any(a == "--buckets" or a.startswith("--buckets=") for a in rest):
        p.error("--buckets: this script profiles one bucket, --bucket PHASE:TOKENS")
    if not torch.cuda.is_available():
        p.error("needs CUDA: it profiles the GPU's kernels of each program (no CPU mode; "
                "bench_peers.py --smoke is the CPU check of the peers)")
    args = BP.parse(rest + ["--buckets", own.bucket])
    args.json = own.json
    return own, args


def main(argv=None) -> int:
    own, args = parse(argv)
    phase, n = own.bucket.split(":")
    n = int(n)
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dbo_backend.register()
    H.install_kernels("cuda", experts=args.experts, attention=args.attention)
    preset = args.preset or "deepseek-v2-lite"
    (w, gbps), = BE.parse_worlds(args.emulate_ep, args.link_gbps)
    timer = BE.Timer(args.iters, args.warmup)
    model, steps, runner, spec, streams, _ = BP.build_world(args, preset, w, gbps, [(phase, n)],
                                                            device, keep_candidates=True)
    step = steps[(phase, n)]
    b = runner.graphs[n]
    art = b.artifact
    print(f"[profile] {preset} W={w} {gbps:g} GB/s {phase}:{n}: {runner.describe()}", flush=True)
    programs: dict = {}  # name -> (eager fn, graph replay fn)
    with torch.no_grad():
        runner.load_step(n, step.input_ids, step.positions, step.attn_metadata,
                         step.num_scheduled_tokens, split=False)
        programs["unsplit"] = (lambda: art.unsplit(*b.args), b.graphs["unsplit"].replay)
        if b.split_args is not None:
            runner.load_step(n, step.input_ids, step.positions, step.attn_metadata,
                             step.num_scheduled_tokens, split=True)
            for name in b.graphs:
                if name in art.candidates:
                    programs[f"ours:{name}"] = (
                        split_program_fn(art.candidates[name], b.split_args, art, b.tokens),
                        b.graphs[name].replay)
        ops = layer_ops(model, spec)
        qlens = [int(q) for q in step.num_scheduled_tokens]
        cut = sglang_tbo.split_point(qlens, all(q == 1 for q in qlens)) or n // 2

        def make():
            return split_step(step.input_ids, step.positions, step.attn_metadata, qlens, cut)

        peers = {"sglang": sglang_tbo.SglangTbo(ops, streams, sglang_tbo.DELTA[phase]),
                 "vllm": vllm_dbo.VllmDbo(ops, streams, device)}
        keep = []
        for pname in [v for v in own.peers.split(",") if v]:
            peer = peers[pname]
            static = [BP.dataclass_clone(u) for u in make()]
            g, out = BP.capture_peer(lambda peer=peer, static=static: peer.run(static))
            keep.append((g, out, static))
            programs[pname] = (lambda peer=peer: run_draining(lambda: peer.run(make())), g.replay)
        doc = {"machine": harness.machine(1, device),
               "date": datetime.datetime.now().isoformat(timespec="seconds"),
               "torch": torch.__version__, "command": " ".join(sys.argv), "preset": preset,
               "world_size": w, "link_gbps": gbps, "phase": phase, "tokens_per_rank": n,
               "ours_choice": b.choice,
               "ours_warmup_us": {k: round(v, 1) for k, v in (b.times_us or {}).items()},
               "programs": {}}
        report = []
        for name, (eager, graph) in programs.items():
            row = {}
            for mode, fn in (("eager", eager), ("graph", graph)):
                t0 = datetime.datetime.now().strftime("%H:%M:%S.%f")[:-3]
                r = trace_stats(fn, own.reps)
                r["wall_us"] = round(timer(fn), 1)
                # wall-clock start and end of the mode (to read nvidia-smi's clock log beside)
                r["clock"] = [t0, datetime.datetime.now().strftime("%H:%M:%S.%f")[:-3]]
                row[mode] = r
            row["graph_over_eager"] = round(row["graph"]["wall_us"] / row["eager"]["wall_us"], 4)
            doc["programs"][name] = row
            report.append(compare(name, row["eager"], row["graph"], own.top))
            print(report[-1], flush=True)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(doc, f, indent=1)
    print("[profile] graph / eager wall: " + ", ".join(
        f"{k} {v['graph_over_eager']:.3f}" for k, v in doc["programs"].items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
