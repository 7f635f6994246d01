"""Compile time of the tiny DeepSeek graph against its depth: Dynamo, each pass, the first call.

Run (CPU, 1 rank, no GPU needed)::

    python benchmarks/compile_time.py                       # N = 4, 16, 32, 61; candidates on, off
    python benchmarks/compile_time.py --compare 50880c5     # + the package at that revision
    python benchmarks/compile_time.py --layers 16 61 --repeat 3
    python benchmarks/compile_time.py --warm                # cold vs warm (compile cache)

Each measurement is one fresh process (``python benchmarks/compile_time.py --one N --candidates
on``): it builds ``get_config("tiny", num_layers=N)`` on one rank (no EP group: the comm ops run
locally), compiles it with ``backend="dbo"`` and ``compute_backend="aten"``, ``split="always"``,
``schedule_candidates`` on (the default: every candidate of ``candidates.CANDIDATES``) or off, and
calls it twice on one small step (8 decodes with 16–37-token contexts and a 16-token prefill,
24 tokens: the step itself is not what is measured, and the example's step, with its
1,000-token contexts, takes seconds to run at 61 layers on this CPU). The persistent compile
cache (``DboConfig.cache_dir``, where the tree has it) is off, so every run is a cold compile.
Columns (seconds):

- ``dynamo``: the first call less the backend and less ``step``: Dynamo's trace and guards;
- one column per pass of the pipeline (``artifact.compile_times``; ``stream_assign`` and
  ``codegen`` summed over the candidates, their count in brackets in the header);
- ``backend other``: the backend's wall time less its passes;
- ``step``: the second call (same shapes, compiles nothing): what the first call spent
  running the step;
- ``compile``: the first call less ``step`` (Dynamo + the backend), the figure of issue 17;
- ``compile cpu``: the same in CPU seconds of the process (``time.process_time``, all its
  threads): on a machine shared with other jobs the wall times grow with the load, the CPU
  seconds much less, so the table gives both.

``--warm``: per N, two fresh processes with one new ``DboConfig.cache_dir``: the first
compiles and writes the compile cache (cold), the second reads it (warm); the table shows
the backend's time (the passes, or ``cache_key`` + ``cache_load``) and ``compile`` of both, and
warm / cold of the backend (issue 17 asks <= 25 %). Dynamo traces in both processes.

Other load on the machine only adds time: ``--repeat R`` (default 2) measures each point R
times, alternating the trees, and keeps each column's least time (the load average before and
after is printed). Below each table: ``t(61)/t(16)`` of ``compile`` against the linear bound
``1.25 x 61/16`` (issue 17).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)


def _one(num_layers: int, candidates: bool, cache_dir: str | None = None) -> dict:
    """One compile in this process (cold without ``cache_dir``); returns the row (seconds)."""
    import torch

    from dbo_compile.backend import compiled_artifacts, dbo_backend
    from dbo_compile.config import DboConfig
    from dbo_compile.models.batch import fill_kv_cache, make_step
    from dbo_compile.models.deepseek import DeepseekMoEModel, get_config

    torch.manual_seed(0)
    cfg = get_config("tiny", num_layers=num_layers)
    model = DeepseekMoEModel(cfg, seed=0)
    step = make_step(cfg, decode_context_lens=[16 + 3 * i for i in range(8)],
                     prefills=[(0, 16)], block_size=16, seed=0)
    model.allocate_kv_cache(step.num_blocks, step.block_size)
    fill_kv_cache(model, step, seed=0)
    options = {"split": "always", "compute_backend": "aten", "schedule_candidates": candidates}
    if "cache_dir" in DboConfig.field_names():
        options["cache_dir"] = cache_dir
    backend_s: list[float] = []
    backend_cpu: list[float] = []

    def backend(gm, example_inputs):
        t0, c0 = time.perf_counter(), time.process_time()
        out = dbo_backend(gm, example_inputs, options=options)
        backend_s.append(time.perf_counter() - t0)
        backend_cpu.append(time.process_time() - c0)
        return out

    compiled = torch.compile(model, backend=backend)
    args = (step.input_ids, step.positions, step.attn_metadata)
    with torch.no_grad():
        t0, c0 = time.perf_counter(), time.process_time()
        compiled(*args)
        first, first_cpu = time.perf_counter() - t0, time.process_time() - c0
        t0, c0 = time.perf_counter(), time.process_time()
        compiled(*args)
        again, again_cpu = time.perf_counter() - t0, time.process_time() - c0
    artifact = compiled_artifacts()[-1]
    if len(backend_s) != 1 or artifact.split_program is None:
        raise SystemExit(f"expected one split graph, got {len(backend_s)} backend calls "
                         f"({getattr(artifact, 'reason', '')})")
    times = dict(artifact.compile_times)
    row: dict[str, float] = {}
    counts: dict[str, int] = {}
    for key, seconds in times.items():
        name = key.split("[", 1)[0]
        row[name] = row.get(name, 0.0) + seconds
        counts[name] = counts.get(name, 0) + 1
    row["backend other"] = backend_s[0] - sum(times.values())
    row["dynamo"] = first - backend_s[0] - again
    row["step"] = again
    row["compile"] = first - again
    row["backend"] = backend_s[0]
    row["backend cpu"] = backend_cpu[0]
    row["compile cpu"] = first_cpu - again_cpu
    return {"row": row, "counts": counts, "units": len(artifact.schedule.units)}


def _load() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "?"


def _measure(tree: str, num_layers: int, candidates: bool, timeout_s: int,
             cache_dir: str | None = None) -> dict:
    env = dict(os.environ, PYTHONPATH=tree + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, os.path.abspath(__file__), "--one", str(num_layers),
           "--candidates", "on" if candidates else "off"]
    if cache_dir:
        cmd += ["--cache-dir", cache_dir]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s,
                         cwd=tree)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} (tree {tree}) failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _table(title: str, rows: dict[int, dict]) -> str:
    counts: dict[str, int] = {}
    for r in rows.values():
        counts.update(r["counts"])
    # the pipeline's passes in its order (this tree's); a pass a tree does not have is blank
    from dbo_compile.passes.pipeline import pass_names

    cols = ["dynamo"] + [p for p in pass_names() if any(p in r["row"] for r in rows.values())]
    cols += ["backend other", "step", "compile", "compile cpu"]
    head = [c + (f" [{counts[c]}]" if counts.get(c, 1) > 1 else "") for c in cols]
    lines = [title, "| layers | units | " + " | ".join(head) + " |",
             "|---" * (len(cols) + 2) + "|"]
    for n, r in sorted(rows.items()):
        cells = [f"{r['row'][c]:.3f}" if c in r["row"] else "" for c in cols]
        lines.append(f"| {n} | {r['units']} | " + " | ".join(cells) + " |")
    if 16 in rows and 61 in rows:
        ratio = rows[61]["row"]["compile"] / rows[16]["row"]["compile"]
        bound = 1.25 * 61 / 16
        lines.append(f"t(61)/t(16) = {ratio:.2f} (linear bound 1.25 x 61/16 = {bound:.2f}: "
                     f"{'ok' if ratio <= bound else 'ABOVE'}); t(61) = "
                     f"{rows[61]['row']['compile']:.2f} s (target <= 10 s)")
        if all("compile cpu" in rows[n]["row"] for n in (16, 61)):
            cpu = rows[61]["row"]["compile cpu"] / rows[16]["row"]["compile cpu"]
            lines.append(f"CPU seconds: t(61)/t(16) = {cpu:.2f} "
                         f"({'ok' if cpu <= bound else 'ABOVE'}); t(61) = "
                         f"{rows[61]['row']['compile cpu']:.2f} s")
    return "\n".join(lines)


def _least(runs: list[dict]) -> dict:
    best = dict(runs[0])
    best["row"] = {k: min(r["row"].get(k, float("inf")) for r in runs) for k in runs[0]["row"]}
    return best


def _warm(args: argparse.Namespace) -> int:
    """Cold and warm compile in two fresh processes per point (see the module docstring)."""
    modes = {"on": [True], "off": [False], "both": [True, False]}[args.candidates]
    print(f"load average before: {_load()}", flush=True)
    rows = []
    for cand in modes:
        for n in args.layers:
            best: dict[str, dict] = {}
            for _ in range(args.repeat):
                with tempfile.TemporaryDirectory(prefix="dbo_cache_") as d:
                    for label in ("cold", "warm"):
                        r = _measure(_ROOT, n, cand, args.timeout_s, cache_dir=d)["row"]
                        if label not in best or r["backend"] < best[label]["backend"]:
                            best[label] = r
            rows.append((cand, n, best["cold"], best["warm"]))
            print(f"  {n} layers, candidates {'on' if cand else 'off'}: backend cold "
                  f"{best['cold']['backend']:.3f} s, warm {best['warm']['backend']:.3f} s",
                  flush=True)
    print(f"load average after: {_load()}\n")
    print(f"cold vs warm compile (seconds, least of {args.repeat}; backend: our passes, or "
          "cache_key + cache_load)")
    print("| candidates | layers | backend cold | backend warm | warm / cold | backend CPU s "
          "cold | warm | warm / cold | compile cold | compile warm |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for cand, n, cold, warm in rows:
        cpu = (f"{cold['backend cpu']:.3f} | {warm['backend cpu']:.3f} | "
               f"{warm['backend cpu'] / cold['backend cpu']:.1%}")
        print(f"| {'on' if cand else 'off'} | {n} | {cold['backend']:.3f} | {warm['backend']:.3f} "
              f"| {warm['backend'] / cold['backend']:.1%} | {cpu} | {cold['compile']:.2f} "
              f"| {warm['compile']:.2f} |")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 16, 32, 61])
    parser.add_argument("--candidates", choices=("on", "off", "both"), default="both")
    parser.add_argument("--repeat", type=int, default=2, help="runs per point; least kept")
    parser.add_argument("--compare", metavar="REV", default=None,
                        help="also measure the package at git revision REV (git archive)")
    parser.add_argument("--timeout-s", type=int, default=600, help="per process")
    parser.add_argument("--json", metavar="PATH", default=None, help="write the rows there")
    parser.add_argument("--warm", action="store_true",
                        help="cold vs warm compile through the compile cache (this tree)")
    parser.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--cache-dir", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one is not None:
        print(json.dumps(_one(args.one, args.candidates == "on", args.cache_dir)))
        return 0
    if args.warm:
        return _warm(args)
    trees = []
    tmp = None
    if args.compare:
        tmp = tempfile.TemporaryDirectory(prefix="dbo_compile_time_")
        archive = subprocess.run(["git", "-C", _ROOT, "archive", args.compare],
                                 capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", tmp.name], input=archive, check=True)
        trees.append((args.compare, tmp.name))
    trees.append(("this tree", _ROOT))
    modes = {"on": [True], "off": [False], "both": [True, False]}[args.candidates]
    results: dict[tuple[str, bool], dict[int, list[dict]]] = {}
    print(f"load average before: {_load()}", flush=True)
    for _ in range(args.repeat):
        for cand in modes:
            for n in args.layers:
                for label, tree in trees:
                    r = _measure(tree, n, cand, args.timeout_s)
                    results.setdefault((label, cand), {}).setdefault(n, []).append(r)
                    print(f"  {label}, {n} layers, candidates {'on' if cand else 'off'}: "
                          f"compile {r['row']['compile']:.2f} s", flush=True)
    print(f"load average after: {_load()}\n")
    dump = {}
    for (label, cand), by_n in results.items():
        rows = {n: _least(runs) for n, runs in by_n.items()}
        title = (f"{label}: schedule_candidates={'True' if cand else 'False'} "
                 f"(seconds, least of {args.repeat})")
        print(_table(title, rows) + "\n")
        dump[f"{label}|candidates={'on' if cand else 'off'}"] = {str(n): r for n, r in rows.items()}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dump, f, indent=1)
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
