"""Where ``CudaGraphRunner.capture()`` spends its time, part by part (seconds).

Run (CPU: 2 Gloo ranks; on a host with 2 GPUs the same command captures CUDA graphs)::

    python benchmarks/capture_time.py                          # this tree, buckets 32,64
    python benchmarks/capture_time.py --compare HEAD~3         # + the package at HEAD~3
    python benchmarks/capture_time.py --compare HEAD~3 --repeat 2 --compute-backend inductor
    # one GPU, one EP rank, the bench's 8 buckets, an unpacked older tree as "before":
    python benchmarks/capture_time.py --nproc 1 --buckets 64,128,256,512,1024,2048,4096,8192 \
        --before ../before --compute-backend aten --timing-iters 10 --json $OUT/capture_time.json

The script launches ``torchrun --nproc-per-node 2`` once per tree (with ``--compare REV``:
first REV's package, from ``git archive`` in a temporary folder, then this tree's, one after the other
in the same run), builds the benchmark's model (``dbo_compile.testing.moe``, in older trees
``benchmarks/moe_harness.py``: tiny preset on CPU,
DeepSeek-V2-Lite shapes on CUDA; 4 MoE layers, vocab 4096), compiles it with
``backend="dbo"`` and lets one :class:`~dbo_compile.runtime.cudagraph_runner.CudaGraphRunner` capture
every bucket, as a serving job's warm-up does (``bench_moe.py``'s ``capture_s`` instead
resets Dynamo for each bucket). Each part's time is **exclusive** (a part nested in another
is not counted twice), so the parts add up to the whole ``capture()``; the figure of a part
is the max over the ranks. Parts (functions timed):

- Dynamo: trace and guards of the warm-up steps (``CudaGraphRunner._record`` less its
  children);
- lowering / token dims / split + yields / schedules / codegen: the backend's passes
  (``lower_to_aten``, ``annotate_token_dims``, ``split_ubatch`` + ``insert_yields``,
  ``stream_assign``, ``SplitProgram`` construction); backend other: the rest of
  ``compile_split`` (``dbo_compile.passes.pipeline``) / ``dbo_backend``;
- Inductor: ``InductorStage._compile`` (``compute_backend="inductor"``; the first includes
  Inductor's own start-up); "Inductor runs" below the table counts the compiled callables;
- warm-up step runs: the compiled module's calls inside ``_record`` (vote, split or not);
- graph capture: ``CudaGraphRunner._graph`` (CUDA: 2 warm-up runs + capture; CPU: one eager
  run);
- timing: ``CudaGraphRunner._time`` (3 rounds x ``timing_iters`` replays per graph);
- capture() other: the rest (choice, bookkeeping).

Where the tree's ``CudaGraphRunner`` reports its own warm-up (``runner.stats``, issue 17:
per bucket ``record`` / ``probe`` / ``warmup_runs`` / ``capture`` / ``timing`` / ``total``), that
report is printed and kept in the JSON too, with each bucket's graphs and their warm-up
timings (``times_us``); with two trees the script prints, per bucket, the graphs captured by
each and the after / before ratio of the warm-up timing of every split candidate both have
(the kept candidates: their times must not move beyond noise).

Figures are wall-clock seconds on this machine; compare trees only within one run. Other load
on the machine only adds time: ``--repeat N`` alternates the trees N times and keeps each part's
least time (the load average before and after each run is printed). With
``compute_backend="inductor"`` every run gets a fresh Inductor cache directory (a cold cache,
as on a new serving host) unless ``--warm-cache``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import subprocess
import sys
import tempfile
import time

from trees import first_attr, first_module, moe_harness

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)

#: (part, "module:qualname") in table order; a target a tree does not have is skipped; "a|b":
#: the first of the modules (or classes) that the tree has (before 3f21f21 the runner was
#: runtime/graphs.py; the artifacts were DboCompiledModule and UnsplitProgram before issue 30)
PARTS = [
    ("Dynamo (trace, guards)", "dbo_compile.runtime.cudagraph_runner|dbo_compile.runtime.graphs:CudaGraphRunner._record"),
    ("lowering (AOT)", "dbo_compile.lowering:lower_to_aten"),
    ("token dims", "dbo_compile.passes.token_dim:annotate_token_dims"),
    ("split + yields", "dbo_compile.passes.split_ubatch:split_ubatch"),
    ("split + yields", "dbo_compile.passes.insert_yields:insert_yields"),
    ("schedules", "dbo_compile.passes.stream_assign:stream_assign"),
    ("codegen", "dbo_compile.codegen.wrapper:SplitProgram.__init__"),
    ("backend other", "dbo_compile.backend:compile_split"),  # before the pass pipeline
    ("backend other", "dbo_compile.passes.pipeline:compile_split"),
    ("backend other", "dbo_compile.backend:_unsplit_program"),
    ("Inductor compile", "dbo_compile.codegen.inductor:InductorStage._compile"),
    ("Inductor compile", "dbo_compile.codegen.inductor:InductorStage._compile_dynamic"),
    ("warm-up step runs", "dbo_compile.runtime.program:SplitArtifact|DboCompiledModule.__call__"),
    ("warm-up step runs", "dbo_compile.runtime.program:UnsplitArtifact|UnsplitProgram.__call__"),
    ("graph capture", "dbo_compile.runtime.cudagraph_runner|dbo_compile.runtime.graphs:CudaGraphRunner._graph"),
    ("timing", "dbo_compile.runtime.cudagraph_runner|dbo_compile.runtime.graphs:CudaGraphRunner._time"),
    ("capture() other", "dbo_compile.runtime.cudagraph_runner|dbo_compile.runtime.graphs:CudaGraphRunner.capture"),
]
#: parts whose call count is worth printing
COUNTED = ("schedules", "codegen", "graph capture")  # Inductor: compiled callables, below


class ExclusiveTimer:
    """Wall time per part, exclusive of nested timed calls; calls per part; which bucket."""

    def __init__(self):
        self.seconds: dict[tuple[str, int], float] = {}
        self.calls: dict[tuple[str, int], int] = {}
        self.bucket = 0
        self._stack: list[list[float]] = []  # [start, child seconds]

    def wrap(self, part: str, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            if part.startswith("Dynamo") and not kwargs.get("prefill", False):
                self.bucket = int(args[1])  # _record(self, tokens, prefill=False): next bucket
            frame = [time.perf_counter(), 0.0]
            self._stack.append(frame)
            try:
                return fn(*args, **kwargs)
            finally:
                self._stack.pop()
                total = time.perf_counter() - frame[0]
                key = (part, self.bucket)
                self.seconds[key] = self.seconds.get(key, 0.0) + total - frame[1]
                self.calls[key] = self.calls.get(key, 0) + 1
                if self._stack:
                    self._stack[-1][1] += total

        return timed

    def install(self) -> None:
        for part, target in PARTS:
            mod_names, qual = target.split(":")
            owner = first_module(mod_names.split("|"))
            *path, attr = qual.split(".")
            for p in path:
                owner = first_attr(owner, p)
            if owner is None or not hasattr(owner, attr):
                continue
            setattr(owner, attr, self.wrap(part, getattr(owner, attr)))


# ------------------------------------------------------------------------------ one rank
def measure(args) -> None:
    """Runs under torchrun: capture every bucket once, write the per-part table (rank 0)."""
    import torch
    import torch.distributed as dist

    H = moe_harness()
    from dbo_compile import backend as dbo_backend
    CudaGraphRunner = first_module(["dbo_compile.runtime.cudagraph_runner",
                                     "dbo_compile.runtime.graphs"]).CudaGraphRunner
    device = H.init_distributed()
    cuda = device.type == "cuda"
    dbo_backend.register()
    timer = ExclusiveTimer()
    timer.install()
    H.install_kernels(device.type, attention="fused")
    buckets = [int(b) for b in args.buckets.split(",")]
    model = H.build_model(args.preset or ("deepseek-v2-lite" if cuda else "tiny"), args.layers,
                          dist.group.WORLD, str(device), vocab_size=4096, first_k_dense_replace=0)
    step = H.make_bucket_step(model.config, "decode", max(buckets), device)
    model.allocate_kv_cache(step.num_blocks, step.block_size)
    compiled = torch.compile(model, backend="dbo",
                             options={"compute_backend": args.compute_backend})
    runner = CudaGraphRunner(compiled, buckets, max_blocks_per_req=int(step.attn_metadata.block_table.shape[1]),
                             block_size=step.block_size, vocab_size=4096,
                             timing_iters=args.timing_iters, device=device)
    dist.barrier()
    t0 = time.perf_counter()
    with torch.no_grad():
        runner.capture()
    total = time.perf_counter() - t0
    arts = dbo_backend.compiled_artifacts()
    candidates = sorted(getattr(arts[-1], "candidates", None) or getattr(arts[-1], "variants", {})
                        or {}) if arts else []
    # Inductor runs = distinct compiled callables of every stage and unsplit program
    stages = [fn for a in arts for p in (getattr(a, "candidates", None) or getattr(a, "variants", {})
                                         ).values() for fn in p.units]
    stages += [getattr(a, "unsplit", None) for a in arts] + [getattr(a, "fn", None) for a in arts]
    compiled = {id(fn) for s in {id(s): s for s in stages}.values()
                for fn in getattr(s, "compiled", {}).values()}
    keys = sorted(timer.seconds)
    values = [timer.seconds[k] for k in keys] + [total]
    t = torch.tensor(values, dtype=torch.float64, device=device)  # NCCL reduces device tensors
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    values = t.tolist()
    if dist.get_rank() == 0:
        doc = {"seconds": [[p, b, v] for (p, b), v in zip(keys, values)],
               "calls": [[p, b, timer.calls[(p, b)]] for p, b in keys],
               "total": values[-1], "buckets": buckets, "backend_compiles": len(arts),
               "candidates": candidates, "device": str(device),
               "choice": {t: b.choice for t, b in runner.graphs.items()},
               "times_us": {t: b.times_us for t, b in runner.graphs.items()},
               "graphs_per_bucket": {t: len(getattr(b.artifact, "candidates", {}) or {}) + 1
                                     for t, b in runner.graphs.items()},
               "runner_stats": getattr(runner, "stats", None),
               "inductor_runs": len(compiled), "dynamo": _dynamo_times()}
        with open(args.out, "w") as f:
            json.dump(doc, f)
    dist.barrier()
    dist.destroy_process_group()


def _dynamo_times() -> dict:
    try:
        import torch._dynamo.utils as du

        return {k: round(sum(v), 2) for k, v in du.compilation_time_metrics.items()
                if k in ("_compile.compile_inner", "OutputGraph.call_user_compiler",
                         "bytecode_tracing")}
    except Exception:  # noqa: BLE001 - an extra, not the table
        return {}


# ------------------------------------------------------------------------------ launcher
@contextlib.contextmanager
def _tree(rev: str | None):
    """The package root of ``rev`` (its files, from ``git archive``, in a temporary folder), or
    this tree."""
    if rev is None:
        yield _ROOT
        return
    with tempfile.TemporaryDirectory(prefix="capture_time_") as path:
        archive = subprocess.run(["git", "-C", _ROOT, "archive", rev], check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", path], input=archive, check=True)
        yield path


def _kept_candidates(runs: list[tuple[str, dict]]) -> str:
    """Per bucket: graphs captured by each tree, and after / before of the warm-up timing of
    every split candidate both trees timed."""
    (_, before), (_, after) = runs
    lines = ["| bucket | graphs before | graphs after | kept candidates: warm-up time after / "
             "before |", "|---|---|---|---|"]
    for t in sorted(after.get("times_us", {}), key=int):
        tb, ta = before.get("times_us", {}).get(t, {}), after["times_us"][t]
        common = [k for k in ta if k in tb and k != "unsplit"]
        ratios = ", ".join(f"{k} {ta[k] / tb[k]:.3f}" for k in common) or "-"
        lines.append(f"| {t} | {before.get('graphs_per_bucket', {}).get(t, '?')} | "
                     f"{after.get('graphs_per_bucket', {}).get(t, '?')} | {ratios} |")
    return "\n".join(lines)


def _runner_report(doc: dict) -> str:
    stats = doc.get("runner_stats")
    if not stats:
        return ""
    parts = list(stats["warmup_s"])
    lines = ["| bucket | " + " | ".join(parts) + " | graphs |",
             "|---" * (len(parts) + 2) + "|"]
    for t, b in stats["buckets"].items():
        lines.append(f"| {t} | " + " | ".join(f"{b['warmup_s'].get(p, 0.0):.2f}" for p in parts)
                     + f" | {b['graphs_captured']} |")
    lines.append("| all | " + " | ".join(f"{stats['warmup_s'][p]:.2f}" for p in parts) + " | |")
    return "\n".join(lines)


def _run_tree(args, root: str, label: str) -> dict:
    out = tempfile.mktemp(suffix=".json", prefix="capture_time_")
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cache = None
    if args.compute_backend == "inductor" and not args.warm_cache:
        cache = tempfile.mkdtemp(prefix="inductor_cache_")
        env["TORCHINDUCTOR_CACHE_DIR"] = cache
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.nproc),
           os.path.abspath(__file__), "--_measure", "--out", out, "--buckets", args.buckets,
           "--compute-backend", args.compute_backend, "--timing-iters", str(args.timing_iters),
           "--layers", str(args.layers)] + (["--preset", args.preset] if args.preset else [])
    print(f"[capture_time] {label}: {root} ...", flush=True)
    load = os.getloadavg()[0]
    subprocess.run(cmd, env=env, check=True, cwd=root, timeout=args.timeout_s)
    with open(out) as f:
        doc = json.load(f)
    doc["load"] = [round(load, 1), round(os.getloadavg()[0], 1)]
    os.unlink(out)
    if cache:
        subprocess.run(["rm", "-rf", cache], check=False)
    return doc


def best_of(docs: list[dict]) -> dict:
    """One run's figures from several: per part and bucket, and for the total, the least (the
    run least disturbed by other load on the machine)."""
    doc = dict(docs[0])
    seconds: dict[tuple[str, int], float] = {}
    for d in docs:
        for p, b, v in d["seconds"]:
            seconds[(p, b)] = min(v, seconds.get((p, b), v))
    doc["seconds"] = [[p, b, v] for (p, b), v in seconds.items()]
    doc["total"] = min(d["total"] for d in docs)
    doc["load"] = [x for d in docs for x in d["load"]]
    return doc


def _calls(doc: dict) -> dict[str, int]:
    per: dict[str, int] = {}
    for p, _b, c in doc["calls"]:
        per[p] = per.get(p, 0) + c
    return per


def table(runs: list[tuple[str, dict]]) -> str:
    """Markdown: one row per part, per run the seconds of each bucket and the total."""
    order = list(dict.fromkeys(p for p, _ in PARTS))
    head = ["part"]
    for label, doc in runs:
        head += [f"{label} b{b}" for b in doc["buckets"][::-1]] + [f"{label} total"]
    if len(runs) == 2:
        head.append("after / before")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    rows = order + ["**capture() total**"]
    for part in rows:
        cells = [part]
        totals = []
        for _label, doc in runs:
            per_b = {b: v for p, b, v in doc["seconds"] if p == part}
            for b in doc["buckets"][::-1]:
                cells.append("" if part.startswith("**") else f"{per_b.get(b, 0.0):.2f}")
            tot = doc["total"] if part.startswith("**") else sum(per_b.values())
            n = _calls(doc).get(part)
            cells.append(f"{tot:.2f}" + (f" ({n}x)" if n and part in COUNTED else ""))
            totals.append(tot)
        if len(runs) == 2:
            cells.append(f"{totals[1] / totals[0]:.2f}" if totals[0] > 0.005 else "–")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--buckets", default="32,64", help="token counts (tokens per rank)")
    p.add_argument("--compute-backend", default="auto", choices=["auto", "aten", "inductor"])
    p.add_argument("--timing-iters", type=int, default=20,
                   help="CudaGraphRunner(timing_iters=...); 20 as bench_moe.py's --iters")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--preset", default=None)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--compare", default=None, metavar="REV",
                   help="also measure the package at git revision REV, first, in this run")
    p.add_argument("--before", default=None, metavar="DIR",
                   help="as --compare, with the package root DIR (e.g. an unpacked git archive, "
                        "where the machine has no git history)")
    p.add_argument("--timeout-s", type=int, default=None, help="per tree run (torchrun)")
    p.add_argument("--warm-cache", action="store_true",
                   help="keep the Inductor cache between runs (default: a fresh one per run)")
    p.add_argument("--repeat", type=int, default=1,
                   help="measure each tree this many times, alternating, and keep each part's "
                        "least time (other load on the machine only adds time)")
    p.add_argument("--json", default=None, help="write every run's figures here")
    p.add_argument("--_measure", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args._measure:
        measure(args)
        return 0
    head = subprocess.run(["git", "-C", _ROOT, "describe", "--always", "--dirty"],
                          capture_output=True, text=True).stdout.strip()
    other = args.compare or args.before
    label = "after" if other else "this tree"
    all_runs: dict[str, list[dict]] = {}
    with _tree(args.compare) as old:
        old = os.path.abspath(args.before) if args.before else old
        for _ in range(args.repeat):
            if other:
                all_runs.setdefault(f"before ({other})", []).append(
                    _run_tree(args, old, "before"))
            all_runs.setdefault(label, []).append(_run_tree(args, _ROOT, label))
    runs = [(name, best_of(docs)) for name, docs in all_runs.items()]
    print(f"\ncapture() by part, seconds (exclusive; max over ranks; least of {args.repeat} "
          f"run(s) per tree, alternating); buckets {args.buckets}, "
          f"compute_backend={args.compute_backend}, timing_iters={args.timing_iters}, "
          f"{runs[-1][1]['device']}, this tree {head}\n")
    print(table(runs))
    for name, doc in runs:
        print(f"\n{name}: Dynamo/backend compiles {doc['backend_compiles']}, Inductor runs "
              f"{doc['inductor_runs']}, candidates {doc.get('candidates', doc.get('variants'))}, choice {doc['choice']}, "
              f"load average before/after each run {doc['load']}, Dynamo's own figures "
              f"(last run) {doc['dynamo']}")
    for name, doc in runs:
        report = _runner_report(doc)
        if report:
            print(f"\n{name}: CudaGraphRunner's own warm-up report (runner.stats, seconds)\n")
            print(report)
    if len(runs) == 2:
        print("\nper bucket: graphs captured, and the kept candidates' warm-up timing\n")
        print(_kept_candidates(runs))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(all_runs, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
