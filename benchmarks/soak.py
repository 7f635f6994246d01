"""Soak: random steps over 2 and 4 Gloo ranks (issue 16), or on one GPU through the CUDA-graph
runner (``--gpu``, issue 29): 0 hangs, 0 divergent decisions, every output equal to the
reference or the project's own error on every rank.

Run (the full CPU soak, 10,000 steps per world size)::

    python benchmarks/soak.py --steps 10000 --world-sizes 2,4 --out benchmarks/results/soak.json

``--minutes M`` bounds each world size's run (a nightly job's slot, a busy machine): the ranks
stop together after the first step at which one of them has run M minutes, and the counts
say how many steps ran.

Per step and rank: a random token count (0, 1, 2, the thresholds +- 1, or up to
``--max-tokens``), a request mix (decodes, chunked prefills, fresh prompts), a shared prefix
(the prefix-read veto's case), an engine veto, and for the group an injected failure on one
rank (an op raising inside a ubatch); a share ``--p-split`` of the steps is aimed at a split
(every rank past the threshold, nothing vetoed), so that most steps run the split programs;
see :mod:`dbo_compile.testing.soak`. Each rank draws from ``--contents`` step contents per
kind and computes a content's reference once (``--contents 0``: a new one every step).
Prints one JSON line per world size with the counts (steps, splits, unsplit, split_share,
vetoes, prefix_shared, idle and one-token rank steps, injected_failures, agreed_failures,
hangs, divergences, wrong_outputs, foreign_errors, the agreed failures by error type,
steps_per_s, CPU ms per step by part) and exits 1 if hangs, divergences, wrong outputs or
foreign errors are not all 0.

One GPU (``--gpu``; :mod:`dbo_compile.testing.graph_soak`): ``CudaGraphRunner`` over an
emulated EP-8 world (DeepSeek-V2-Lite's routing at a reduced width, 4 layers, buckets 2 / 4 /
16 / 64 / 256, fp32), every step's decision, counter total and KV writes checked and every
``--check-every``-th step against the one-device reference; about a minute of capture, then
some ms a step::

    python benchmarks/soak.py --gpu --steps 10000 --minutes 5 --out $OUT/graph_soak.json

``--gpu-size cpu`` runs the same code on CPU at a tiny size. Exits 1 if hangs, errors or wrong
outputs are not all 0 or ``capture()`` changed the model's state.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys

from dbo_compile.testing import bench_cli
from dbo_compile.testing.graph_soak import run_graph_soak
from dbo_compile.testing.soak import run_soak

def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (:func:`dbo_compile.testing.bench_cli.parse_soak`: a flag of the
    other mode is a usage error)."""
    return bench_cli.parse_soak(argv, __doc__.split("\n\n")[0])


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    budget = None if args.minutes is None else 60 * args.minutes
    runs = []
    if args.gpu:
        counts = run_graph_soak(
            args.steps, seed=args.seed, size=args.gpu_size, dtype=args.dtype,
            check_every=args.check_every, p_split=args.p_split, p_veto=args.p_veto,
            p_share=args.p_share, p_wide=args.p_wide, step_timeout_s=args.step_timeout,
            budget_s=budget, compute_backend=args.compute_backend)
        runs.append(counts)
        ok = (all(counts[k] == 0 for k in ("hangs", "errors", "wrong_outputs"))
              and not counts["capture_changed_state"] and "error" not in counts)
    else:
        ok = True
        for world in args.sizes:
            counts = run_soak(world, args.steps, seed=args.seed, max_tokens=args.max_tokens,
                              p_fail=args.p_fail, p_veto=args.p_veto, p_share=args.p_share,
                              step_timeout_s=args.step_timeout, budget_s=budget,
                              p_split=args.p_split, contents=args.contents or None)
            runs.append(counts)
            ok &= all(counts[k] == 0 for k in ("hangs", "divergences", "wrong_outputs",
                                               "foreign_errors")) and "error" not in counts
    for counts in runs:
        print(json.dumps({k: v for k, v in counts.items() if k != "examples"}), flush=True)
        for ex in counts["examples"]:
            print("  example:", json.dumps(ex), flush=True)
    if args.out:
        doc = {"command": " ".join(sys.argv), "machine": platform.node(),
               "cpus": os.cpu_count(), "date": datetime.datetime.now().isoformat("T", "seconds"),
               "ok": ok, "runs": runs}
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
