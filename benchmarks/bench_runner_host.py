"""Host time of one ``CudaGraphRunner`` call without the graph replay, per part, on CPU.

Run::

    python benchmarks/bench_runner_host.py
    python benchmarks/bench_runner_host.py --against /tmp/base   # another checkout, side by side

What a runner call costs the host besides launching its graph: the DP vote (metadata checks,
vetoes), the metadata split into ubatches, the copies into the captured static buffers and the
output views. On a GPU that time is spent while the GPU idles between steps (the runner
measured 1.1-4.4 ms above its replay on 2x H200, ``t_runner_step_us`` vs ``t_chosen_us`` of
``bench_moe.py``); here it is measured alone: the tiny preset (``--layers``, default 4 as
``bench_moe.py``) is captured on CPU for one bucket and every captured graph is then replaced by
a stand-in whose ``replay()`` does nothing, so that the model's execution is excluded.

Per case (``phase:tokens[xrequests]``; decode: that many 1-token requests after 128-134 cached
tokens; prefill: ``requests`` fresh prompts of equal length) and graph (``split``: the bucket's
split graph, ``unsplit``: its unsplit graph; the model is compiled with ``split="always"`` and
the bucket's choice is set to that graph, so the vote splits and the prefix-read veto runs in
both, as for a bucket above the split thresholds on a GPU), the runner is called ``--iters``
times on the same step (after ``--warmup`` calls) and each figure is the median over the calls,
in µs:

- ``call``: the whole runner call (with the no-op replay);
- ``vote`` / ``load_step``: the runner's two phases (inclusive), ``other``: the rest of the call
  (bucket choice, graph-input mapping, output views);
- below them, functions called inside the call (inclusive, summed over their calls in the
  call: ``validate`` runs in the vote and in the split; ``-``: not called);
- ``device reads``: reads of the step's tensors to the host in one more call
  (:func:`dbo_compile.testing.count_host_reads`, loaded from this script's tree so that it
  counts for any version; each is a host sync on CUDA).

Columns: ``device`` = metadata as device tensors only (every count read from the "device");
``mirrors`` = the same step with its host mirrors attached
(:meth:`~dbo_compile.metadata.AttentionMetadata.with_host_mirrors`), when the package
has them. ``--against DIR`` runs this same script with ``PYTHONPATH=DIR`` (e.g. an export of
another commit: ``git archive HEAD | tar -x -C /tmp/base``) in a subprocess and prints its
columns first, so that before/after come from one invocation on one machine.

CPU times are not the GPU host's, and a CPU tensor "read" costs no sync here: the figures rank
the parts and compare versions; the GPU effect is ``bench_moe.py``'s ``t_runner_step_us``.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import torch

from trees import first_attr, first_module

#: (label, "module:Class" or "module", attribute) of each timed function; absent ones are
#: skipped; "a|b" (of modules, classes or attributes): the first that exists (older trees: the runner in
#: ``runtime/graphs.py``, the metadata in ``runtime/metadata.py``) (the serving path calls internal forms that skip the
#: checks the vote made: ``_load``, ``_check_vetoes``, ...).
PHASES = [
    ("vote", "dbo_compile.runtime.cudagraph_runner|dbo_compile.runtime.graphs:CudaGraphRunner", "_vote"),
    ("load_step", "dbo_compile.runtime.cudagraph_runner|dbo_compile.runtime.graphs:CudaGraphRunner", "_load|load_step"),
]
INSIDE = [
    ("host_counts", "dbo_compile.metadata|dbo_compile.runtime.metadata:AttentionMetadata", "host_counts"),
    ("host_fields", "dbo_compile.metadata|dbo_compile.runtime.metadata:AttentionMetadata", "host_fields"),
    ("validate", "dbo_compile.metadata|dbo_compile.runtime.metadata:AttentionMetadata", "validate"),
    ("check_vetoes", "dbo_compile.runtime.vetoes", "_check_vetoes|check_vetoes"),
    ("coordinate_across_dp", "dbo_compile.runtime.vote", "coordinate_across_dp"),
    ("_pad_args", "dbo_compile.runtime.cudagraph_runner|dbo_compile.runtime.graphs", "_pad_args"),
    ("split_args", "dbo_compile.runtime.program:SplitArtifact|DboCompiledModule", "split_args"),
    ("make_ubatch_slices", "dbo_compile.runtime.ubatch", "_slices_at_offsets|make_ubatch_slices"),
    ("split_attn_metadata", "dbo_compile.runtime.ubatch", "_split_validated|split_attn_metadata"),
    ("_copy_into", "dbo_compile.runtime.cudagraph_runner|dbo_compile.runtime.graphs", "_copy_into"),
    ("_token_outputs", "dbo_compile.runtime.cudagraph_runner|dbo_compile.runtime.graphs", "_token_outputs"),
    ("_real_rows", "dbo_compile.runtime.cudagraph_runner|dbo_compile.runtime.graphs", "_real_rows"),
]


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default="decode:1024,prefill:2048x4",
                   help="phase:tokens[xrequests],... (default decode:1024,prefill:2048x4)")
    p.add_argument("--graphs", default="split,unsplit", help="which graph the bucket runs")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--against", default=None,
                   help="another package tree: run this script there too and print it first")
    p.add_argument("--json", action="store_true", help="print the results as JSON only")
    return p.parse_args(argv)


class _NoReplay:
    def replay(self) -> None:
        pass


class _Clock:
    """Wraps the :data:`PHASES` and :data:`INSIDE` functions; ``spent`` accumulates µs."""

    def __init__(self):
        self.spent: dict[str, float] = {}
        self._undo: list[tuple[Any, str, Any]] = []

    def install(self) -> None:
        for label, where, attr in PHASES + INSIDE:
            mods, _, cls = where.partition(":")
            owner = first_module(mods.split("|"))
            if cls:
                owner = first_attr(owner, cls)
            attr = next((a for a in attr.split("|") if hasattr(owner, a)), None)
            if owner is None or attr is None:
                continue
            raw = inspect.getattr_static(owner, attr)
            fn = raw.__func__ if isinstance(raw, staticmethod) else raw
            wrapped = self._wrap(label, fn)
            setattr(owner, attr, staticmethod(wrapped) if isinstance(raw, staticmethod) else wrapped)
            self._undo.append((owner, attr, raw))

    def uninstall(self) -> None:
        for owner, attr, raw in reversed(self._undo):
            setattr(owner, attr, raw)
        self._undo.clear()

    def _wrap(self, label: str, fn):
        spent = self.spent

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[label] = spent.get(label, 0.0) + (time.perf_counter() - t0) * 1e6
        return timed


def _count_host_reads():
    """``count_host_reads`` of this script's tree (works on any version of the package)."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "dbo_compile", "testing", "host_reads.py")
    spec = importlib.util.spec_from_file_location("_bench_host_reads", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.count_host_reads


def _step(cfg, phase: str, tokens: int, requests: int | None):
    from dbo_compile.models.batch import make_step

    if phase == "decode":
        return make_step(cfg, decode_context_lens=[128 + i % 7 for i in range(tokens)],
                         prefills=[], block_size=16)
    requests = requests or 4
    lens = [tokens // requests + (1 if i < tokens % requests else 0) for i in range(requests)]
    return make_step(cfg, decode_context_lens=[], prefills=[(0, q) for q in lens], block_size=16)


def run_case(case: str, graphs: list[str], layers: int, iters: int, warmup: int) -> dict:
    from dbo_compile.backend import register
    from dbo_compile.models.deepseek import DeepseekMoEModel, get_config
    CudaGraphRunner = first_module(["dbo_compile.runtime.cudagraph_runner",
                                     "dbo_compile.runtime.graphs"]).CudaGraphRunner
    register()
    torch._dynamo.reset()
    phase, _, size = case.partition(":")
    tok, _, reqs = size.partition("x")
    tokens = int(tok)
    cfg = get_config("tiny", num_layers=layers)
    step = _step(cfg, phase, tokens, int(reqs) if reqs else None)
    model = DeepseekMoEModel(cfg, seed=0)
    model.allocate_kv_cache(step.num_blocks, step.block_size)
    compiled = torch.compile(model, backend="dbo", options={"split": "always"})
    runner = CudaGraphRunner(compiled, [tokens], max_blocks_per_req=int(step.attn_metadata.block_table.shape[1]),
                             block_size=step.block_size, timing_iters=1)
    with torch.no_grad():
        runner.capture()
    b = runner.graphs[tokens]
    for name in b.graphs:
        b.graphs[name] = _NoReplay()
    md = step.attn_metadata
    with_mirrors = getattr(md, "with_host_mirrors", None)
    columns = {"device": md, "mirrors": with_mirrors() if with_mirrors else None}
    count_host_reads = _count_host_reads()
    out: dict = {}
    for graph in graphs:
        b.choice = b.best_candidate if graph == "split" else "unsplit"
        for column, metadata in columns.items():
            if metadata is None:
                continue
            call = (step.input_ids, step.positions, metadata, step.num_scheduled_tokens)
            res = _time_calls(runner, call, iters, warmup)
            with torch.no_grad(), count_host_reads(step.input_ids, step.positions,
                                                   *md.tensors().values()) as reads:
                runner(*call)
            res["device reads"] = reads.count
            res["graph"] = runner.last_graph
            out[f"{case} {graph} graph/{column}"] = res
    return out


def _time_calls(runner, call: tuple, iters: int, warmup: int) -> dict[str, float]:
    clock = _Clock()
    samples: dict[str, list[float]] = {}
    with torch.no_grad():
        for _ in range(warmup):
            runner(*call)
        clock.install()
        try:
            for _ in range(iters):
                clock.spent.clear()
                t0 = time.perf_counter()
                runner(*call)
                total = (time.perf_counter() - t0) * 1e6
                per = dict(clock.spent, call=total)
                per["other"] = total - sum(clock.spent.get(k, 0.0) for k, *_ in PHASES)
                for k, v in per.items():
                    samples.setdefault(k, []).append(v)
        finally:
            clock.uninstall()
    return {k: statistics.median(v) for k, v in samples.items()}


def measure(args) -> dict:
    # one thread: the host's per-step work is small ops, and a contended intra-op pool makes
    # single copies take milliseconds
    torch.set_num_threads(1)
    results = {}
    for case in args.cases.split(","):
        results.update(run_case(case, args.graphs.split(","), args.layers, args.iters,
                                args.warmup))
    return results


def _head(tree: str) -> str:
    with contextlib.suppress(Exception):
        return subprocess.run(["git", "-C", tree, "rev-parse", "--short", "HEAD"], check=True,
                              capture_output=True, text=True).stdout.strip()
    return os.path.basename(os.path.abspath(tree))


def table(runs: list[tuple[str, dict]]) -> str:
    """One block per case and graph; a column per (tree, metadata) measured."""
    rows = ["call", *[p for p, *_ in PHASES], "other", *[f"  {p}" for p, *_ in INSIDE],
            "device reads"]
    cases = dict.fromkeys(k.rsplit("/", 1)[0] for _, res in runs for k in res)
    lines = []
    for case in cases:
        cols = [(f"{label}/{key.rsplit('/', 1)[1]}", res[key]) for label, res in runs
                for key in res if key.rsplit("/", 1)[0] == case]
        lines.append(f"\n{case}  (µs per runner call, median; replays: {cols[0][1]['graph']})")
        lines.append(f"{'part':<24}" + "".join(f"{name:>20}" for name, _ in cols))
        for row in rows:
            vals = [c.get(row.strip()) for _, c in cols]
            lines.append(f"{row:<24}" + "".join(
                f"{'-' if v is None else f'{v:,.0f}':>20}" for v in vals))
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse(argv)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    runs = []
    if args.against:
        env = dict(os.environ, PYTHONPATH=os.path.abspath(args.against))
        cmd = [sys.executable, os.path.abspath(__file__), "--json", "--cases", args.cases,
               "--graphs", args.graphs, "--layers", str(args.layers), "--iters", str(args.iters),
               "--warmup", str(args.warmup)]
        done = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
        runs.append((_head(args.against), json.loads(done.stdout.strip().splitlines()[-1])))
    here = measure(args)
    if args.json:
        print(json.dumps(here))
        return 0
    runs.append((_head(root), here))
    print(table(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
