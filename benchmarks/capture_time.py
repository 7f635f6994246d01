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

**Cold vs warm restart** (issue 26): ``--cache-dir DIR --runs 2`` runs this tree twice, each
in a fresh ``torchrun`` process, on the same ``cache_dir`` (our compile cache, Inductor's and
Triton's caches under it: ``dbo_compile/codegen/cache_dirs.py``; without ``--cache-dir`` a
temporary one, deleted after): run 1 is cold (empty dir), run 2 warm; the table puts them side
by side, part by part, with warm / cold. Each run's cache hits are printed
(``counters["dbo_compile"]``, Inductor's ``fxgraph_cache_hit``)::

    python benchmarks/capture_time.py --nproc 1 --compute-backend inductor --runs 2 \
        --cache-dir $OUT/cache --buckets 2,4,8,16,32,64,128,256,512,1024,2048,4096 \
        --json $OUT/capture_cold_warm.json

**Pruned vs time-all** (issue 26): ``--prune-compare --calibration FILE`` runs this tree twice,
each cold in a fresh process: every split candidate timed (``prune_margin=None``), then the
pruned set (``--prune-margin``, default the runner's); it prints per bucket the candidates each
captured, both picks, whether they agree, and where they do not the time-all run's timing of
the pruned pick against its own (how much slower the pruned pick is), and the capture() time
saved. ``--emulate-ep W`` runs as rank 0 of an emulated EP-W world (``--nproc 1``; link
``--link-gbps``), as the calibration was measured.

**Memory**: the runner's ``memory_report()`` (CUDA-graph pool growth per bucket, unsplit vs
split graphs) is printed and kept in the JSON (``memory``).

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
sys.path.insert(0, _HERE)
from dbo_compile.testing.bench_cli import given_flags, refuse_unread  # noqa: E402

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
    emulated = {} if not args.emulate_ep else {"emulated_world_size": args.emulate_ep}
    model = H.build_model(args.preset or ("deepseek-v2-lite" if cuda else "tiny"), args.layers,
                          None if emulated else dist.group.WORLD, str(device), vocab_size=4096,
                          first_k_dense_replace=0, **emulated)
    step = H.make_bucket_step(model.config, "decode", max(buckets), device)
    model.allocate_kv_cache(step.num_blocks, step.block_size)
    options = {"compute_backend": args.compute_backend}
    if args.emulate_ep:  # as bench_emulated.py's world_options
        options.update(comm_backend="emulated", dp_group_name=None, link_gbps=args.link_gbps,
                       comm_backend_options={"world_size": args.emulate_ep,
                                             "link_gbps": args.link_gbps})
    for name in ("cache_dir", "calibration"):
        if getattr(args, name):
            options[name] = getattr(args, name)
    compiled = torch.compile(model, backend="dbo", options=options)
    extra = {}
    if args.prune_margin is not None:  # a tree without pruning refuses the keyword
        extra["prune_margin"] = None if args.prune_margin == "off" else float(args.prune_margin)
    runner = CudaGraphRunner(compiled, buckets, max_blocks_per_req=int(step.attn_metadata.block_table.shape[1]),
                             block_size=step.block_size, vocab_size=4096,
                             timing_iters=args.timing_iters, device=device, **extra)
    from torch._dynamo.utils import counters

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
               "memory": runner.memory_report() if hasattr(runner, "memory_report") else None,
               "cache_counters": {k: {n: c for n, c in counters[k].items() if "cache" in n}
                                  for k in ("dbo_compile", "inductor")},
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


def _run_tree(args, root: str, label: str, cache_dir: str | None = None,
              prune_margin: str | None = None) -> dict:
    """One fresh ``torchrun`` run of the tree at ``root``; ``cache_dir``: the compile option
    (Inductor's cache under it, kept); else with Inductor a fresh cache (unless
    ``--warm-cache``); ``prune_margin``: the runner's (``"off"``: time all)."""
    out = tempfile.mktemp(suffix=".json", prefix="capture_time_")
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cache = None
    if cache_dir is not None:  # the option points Inductor's and Triton's caches under it
        for var in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
            env.pop(var, None)
    elif args.compute_backend == "inductor" and not args.warm_cache:
        cache = tempfile.mkdtemp(prefix="inductor_cache_")
        env["TORCHINDUCTOR_CACHE_DIR"] = cache
    prune_margin = prune_margin if prune_margin is not None else args.prune_margin
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.nproc),
           os.path.abspath(__file__), "--_measure", "--out", out, "--buckets", args.buckets,
           "--compute-backend", args.compute_backend, "--timing-iters", str(args.timing_iters),
           "--layers", str(args.layers)] + (["--preset", args.preset] if args.preset else [])
    cmd += ["--cache-dir", cache_dir] if cache_dir else []
    cmd += ["--calibration", os.path.abspath(args.calibration)] if args.calibration else []
    cmd += ["--prune-margin", prune_margin] if prune_margin is not None else []
    cmd += (["--emulate-ep", str(args.emulate_ep), "--link-gbps", str(args.link_gbps)]
            if args.emulate_ep else [])
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


def _mib(v) -> str:
    return "-" if v is None else f"{v / 2**20:,.1f}"


def memory_table(doc: dict) -> str:
    """The runner's ``memory_report()``: per bucket the pool growth of its unsplit graph and
    of its split graphs (kept, and every one captured), MiB."""
    mem = doc.get("memory")
    if not mem:
        return ""
    lines = ["| bucket | unsplit MiB | split MiB (kept) | split MiB (all captured) |",
             "|---|---|---|---|"]
    for t, b in sorted(mem["buckets"].items(), key=lambda kv: int(kv[0])):
        lines.append(f"| {t} | {_mib(b['unsplit'])} | {_mib(b['split'])} | {_mib(b['split_all'])} |")
    tot = mem["total"]
    lines.append(f"| all | {_mib(tot['unsplit'])} | {_mib(tot['split'])} | {_mib(tot['split_all'])} |")
    return "\n".join(lines) + f"\n\none pool shared by every bucket's graphs: {mem['pool_shared']}"


def prune_report(time_all: dict, pruned: dict) -> tuple[str, dict]:
    """Per bucket: the candidates each run captured, both picks, whether they agree, and the
    time-all run's timing of the pruned pick over its own pick (where it timed both); the
    summary (JSON-able)."""
    sa, sp = time_all["runner_stats"]["buckets"], pruned["runner_stats"]["buckets"]
    lines = ["| bucket | time-all graphs | time-all pick | pruned graphs | pruned pick | same | "
             "pruned pick / time-all pick (time-all timings) | pruned: why |",
             "|---|---|---|---|---|---|---|---|"]
    worst, same, rows = 1.0, 0, {}
    for t in sorted(sa, key=int):
        a, b = sa[t], sp[str(t)] if str(t) in sp else sp[t]
        ta = time_all["times_us"].get(str(t), time_all["times_us"].get(t, {}))
        pa, pp = a["choice"], b["choice"]
        ratio = ta[pp] / ta[pa] if pp in ta and pa in ta else None
        if pp == pa:
            same += 1
            ratio = 1.0
        if ratio is not None:
            worst = max(worst, ratio)
        why = (b.get("prune") or {}).get("skip_split") or (b.get("prune") or {}).get("why", "-")
        rows[t] = {"time_all": pa, "pruned": pp, "ratio": ratio,
                   "graphs_time_all": sorted(a["graph_s"]), "graphs_pruned": sorted(b["graph_s"]),
                   "prune": b.get("prune")}
        lines.append(f"| {t} | {len(a['graph_s'])} | {pa} | {len(b['graph_s'])} | {pp} | "
                     f"{'yes' if pp == pa else 'no'} | "
                     f"{'-' if ratio is None else f'{ratio:.3f}'} | {why} |")
    summary = {"buckets": len(sa), "same_pick": same, "worst_ratio": worst,
               "total_s": {"time_all": time_all["total"], "pruned": pruned["total"]},
               "graphs": {"time_all": sum(len(a["graph_s"]) for a in sa.values()),
                          "pruned": sum(len(b["graph_s"]) for b in sp.values())},
               "rows": rows}
    saved = time_all["total"] - pruned["total"]
    lines += ["", f"picks agree at {same} of {len(sa)} buckets; worst pruned pick / time-all "
              f"pick (time-all's timings) {worst:.3f}; graphs captured {summary['graphs']['time_all']}"
              f" -> {summary['graphs']['pruned']}; capture() {time_all['total']:.1f} s -> "
              f"{pruned['total']:.1f} s (saved {saved:.1f} s, {saved / time_all['total']:.0%})"]
    return "\n".join(lines), summary


def _cache_runs(args) -> list[tuple[str, dict]]:
    """``--runs N``: this tree N times, each a fresh process, on one cache dir."""
    cache = args.cache_dir or tempfile.mkdtemp(prefix="dbo_cache_")
    cold = not os.path.isdir(cache) or not os.listdir(cache)
    runs = []
    try:
        for i in range(args.runs):
            label = f"run {i + 1}" + (" (cold)" if i == 0 and cold else " (warm)" if i else "")
            runs.append((label, _run_tree(args, _ROOT, label, cache_dir=cache)))
    finally:
        if not args.cache_dir:
            subprocess.run(["rm", "-rf", cache], check=False)
    return runs


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
    p.add_argument("--cache-dir", default=None, metavar="DIR",
                   help="compile option cache_dir (our cache, Inductor's and Triton's under it)")
    p.add_argument("--runs", type=int, default=1,
                   help="run this tree N times, each a fresh process, on one cache dir "
                        "(--cache-dir, else a temporary one): cold, then warm")
    p.add_argument("--calibration", default=None, help="compile option calibration (a JSON)")
    p.add_argument("--prune-margin", default=None, metavar="FRACTION|off",
                   help="CudaGraphRunner(prune_margin=...); off: time every candidate "
                        "(default: the runner's)")
    p.add_argument("--prune-compare", action="store_true",
                   help="run this tree twice, cold: every candidate timed, then pruned "
                        "(--prune-margin); compare picks and capture() time (needs --calibration)")
    p.add_argument("--emulate-ep", type=int, default=None, metavar="W",
                   help="rank 0 of an emulated EP-W world on one device (--nproc 1)")
    p.add_argument("--link-gbps", type=float, default=50.0,
                   help="with --emulate-ep: the emulated link, GB/s per direction")
    p.add_argument("--_measure", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args._measure:
        measure(args)
        return 0
    check_flags(p, args, given_flags(p, argv))
    head = subprocess.run(["git", "-C", _ROOT, "describe", "--always", "--dirty"],
                          capture_output=True, text=True).stdout.strip()
    other = args.compare or args.before
    label = "after" if other else "this tree"
    all_runs: dict[str, list[dict]] = {}
    if args.prune_compare or args.runs > 1:
        if args.prune_compare:
            margin = args.prune_margin if args.prune_margin is not None else "0.10"
            runs = [("time all", _run_tree(args, _ROOT, "time all", prune_margin="off")),
                    (f"pruned {margin}", _run_tree(args, _ROOT, "pruned", prune_margin=margin))]
        else:
            runs = _cache_runs(args)
        return report(args, head, runs, {name: [doc] for name, doc in runs})
    with _tree(args.compare) as old:
        old = os.path.abspath(args.before) if args.before else old
        for _ in range(args.repeat):
            if other:
                all_runs.setdefault(f"before ({other})", []).append(
                    _run_tree(args, old, "before"))
            all_runs.setdefault(label, []).append(_run_tree(args, _ROOT, label))
    runs = [(name, best_of(docs)) for name, docs in all_runs.items()]
    return report(args, head, runs, all_runs)


def report(args, head: str, runs: list[tuple[str, dict]], all_runs: dict) -> int:
    """Print the runs' tables (and the comparisons their mode asks for); ``--json``."""
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
    for name, doc in runs:
        mem = memory_table(doc)
        if mem:
            print(f"\n{name}: CUDA-graph memory (runner.memory_report(), pool growth)\n")
            print(mem)
        if doc.get("cache_counters"):
            print(f"\n{name}: cache counters {doc['cache_counters']}")
    out: dict = {"runs": all_runs}
    if args.prune_compare:
        text, out["prune_compare"] = prune_report(runs[0][1], runs[1][1])
        print("\npruned vs time-all, per bucket\n")
        print(text)
    elif len(runs) == 2:
        print("\nper bucket: graphs captured, and the kept candidates' warm-up timing\n")
        print(_kept_candidates(runs))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(out if args.prune_compare or args.runs > 1 else all_runs, f, indent=1)
    return 0


def check_flags(p: argparse.ArgumentParser, args, given: set[str]) -> None:
    """Refuse flag combinations a mode would ignore or misreport (``flags.py``)."""
    if args.runs < 1:
        p.error(f"--runs must be >= 1, got {args.runs}")
    if args.prune_compare or args.runs > 1:
        mode = "with --prune-compare" if args.prune_compare else "with --runs"
        refuse_unread(p, args, given, ["--compare", "--before", "--repeat"], mode)
    if args.prune_compare:
        refuse_unread(p, args, given, ["--cache-dir", "--runs"], "with --prune-compare (each "
                      "run is cold)")
        if not args.calibration:
            p.error("--prune-compare needs --calibration FILE: without predictions nothing is "
                    "pruned")
        if args.prune_margin == "off":
            p.error("--prune-compare: --prune-margin off would time every candidate twice")
    if args.cache_dir:
        refuse_unread(p, args, given, ["--warm-cache"], "with --cache-dir (Inductor's cache "
                      "is under it)")
    if args.emulate_ep and args.nproc != 1:
        p.error("--emulate-ep: one process is rank 0 of the emulated world: give --nproc 1")
    if not args.emulate_ep:
        refuse_unread(p, args, given, ["--link-gbps"], "without --emulate-ep")
    if args.prune_margin not in (None, "off"):
        try:
            float(args.prune_margin)
        except ValueError:
            p.error(f"--prune-margin {args.prune_margin!r}: a fraction or off")


if __name__ == "__main__":
    sys.exit(main())
