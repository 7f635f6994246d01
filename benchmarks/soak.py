"""Soak: random steps over 2 and 4 Gloo ranks (issue 16): 0 hangs, 0 divergent decisions,
every output equal to eager or the project's own error on every rank.

Run (the full soak, ~an hour per 10,000 steps and world size on 2 free cores)::

    python benchmarks/soak.py --steps 10000 --world-sizes 2,4

``--minutes M`` bounds each world size's run (a nightly job's slot, a busy machine): the ranks
stop together after the first step at which one of them has run M minutes, and the counts
say how many steps ran.

Per step and rank: a random token count (0, 1, 2, the thresholds +- 1, or up to
``--max-tokens``), a request mix (decodes, chunked prefills, fresh prompts), a shared prefix
(the prefix-read veto's case), an engine veto, and for the group an injected failure on one
rank (an op raising inside a ubatch); see :mod:`dbo_compile.testing.soak`. Prints one JSON line
per world size with the counts (steps, splits, unsplit, vetoes, prefix_shared,
injected_failures, agreed_failures, hangs, divergences, wrong_outputs, foreign_errors, the
agreed failures by error type) and exits 1 if hangs, divergences, wrong outputs or foreign
errors are not all 0.
"""

from __future__ import annotations

import argparse
import json
import sys

from dbo_compile.testing.soak import run_soak


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=10_000, help="steps per world size")
    p.add_argument("--world-sizes", default="2,4", help="comma-separated Gloo world sizes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-tokens", type=int, default=96, help="largest token count of a rank")
    p.add_argument("--p-fail", type=float, default=0.02, help="injected failures per step")
    p.add_argument("--p-veto", type=float, default=0.05, help="engine vetoes per rank and step")
    p.add_argument("--p-share", type=float, default=0.1, help="shared prefixes per rank and step")
    p.add_argument("--step-timeout", type=float, default=120.0,
                   help="seconds a step may take before its rank is counted as hung (the "
                        "first step, which compiles: ten times that); raise it on a loaded "
                        "machine, where a recompiling step can take minutes")
    p.add_argument("--minutes", type=float, default=None,
                   help="time budget per world size: stop before --steps once it is spent "
                        "(the counts say how many steps ran)")
    args = p.parse_args(argv)
    sizes = [int(w) for w in args.world_sizes.split(",") if w]
    if args.steps < 1 or not sizes or min(sizes) < 2:
        p.error("--steps must be >= 1 and --world-sizes ints >= 2")
    if (args.minutes is not None and args.minutes <= 0) or args.step_timeout <= 0:
        p.error("--minutes and --step-timeout must be > 0")
    ok = True
    for world in sizes:
        counts = run_soak(world, args.steps, seed=args.seed, max_tokens=args.max_tokens,
                          p_fail=args.p_fail, p_veto=args.p_veto, p_share=args.p_share,
                          step_timeout_s=args.step_timeout,
                          budget_s=None if args.minutes is None else 60 * args.minutes)
        print(json.dumps({k: v for k, v in counts.items() if k != "examples"}), flush=True)
        for ex in counts["examples"]:
            print("  example:", json.dumps(ex), flush=True)
        ok &= all(counts[k] == 0 for k in ("hangs", "divergences", "wrong_outputs",
                                           "foreign_errors")) and "error" not in counts
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
