"""``python -m dbo_compile.viz``: show a DBO schedule as text, a Perfetto trace or a PNG."""

from __future__ import annotations

import argparse
import json
import sys

from dbo_compile.viz.chrome import to_chrome_trace
from dbo_compile.viz.common import VizInputError, load_schedule
from dbo_compile.viz.example import example_schedule
from dbo_compile.viz.png import to_png
from dbo_compile.viz.profile import load_trace, match_profile
from dbo_compile.viz.text import render_text

DESCRIPTION = """\
Show the schedule the dbo backend compiled: which units (attention, experts, dispatch,
combine) run on the compute and comm streams, when (predicted by the cost model), and how
much communication hides under compute.

Where a schedule comes from: the backend keeps what it compiled;
  from dbo_compile.backend import compiled_artifacts
  open("schedule.json", "w").write(compiled_artifacts()[-1].schedule.to_json())
or let this tool compile the tiny example model itself with --example (CPU, a few seconds).
"""

EPILOG = """\
formats:
  text    two lanes per layer (Comp:/Comm:) on a time axis, per-layer overlap, legend (default)
  chrome  Chrome trace JSON: open in https://ui.perfetto.dev or chrome://tracing
  png     Gantt chart image (needs matplotlib; -o is required)

measured beside predicted (--profile):
  TRACE.json is torch.profiler's export_chrome_trace() of a GPU run of the same schedule.
  Units are matched by record_function ranges named dbo.u<ID>.<name> when the trace has them,
  else comm units by kernel order on the comm stream (compute units then stay unmatched).

examples:
  python -m dbo_compile.viz --example
  python -m dbo_compile.viz schedule.json --format chrome -o trace.json
  python -m dbo_compile.viz schedule.json --format png -o schedule.png
  python -m dbo_compile.viz schedule.json --profile gpu_trace.json

exit codes: 0 ok, 2 bad arguments or unreadable/malformed input file.
"""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dbo_compile.viz", description=DESCRIPTION,
                                epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("schedule", nargs="?", metavar="SCHEDULE.json",
                     help="schedule written by Schedule.to_json()")
    src.add_argument("--example", action="store_true",
                     help="compile the tiny example MoE model on CPU and show its schedule")
    p.add_argument("--layers", type=int, default=2, metavar="N",
                   help="with --example: number of layers (default 2)")
    p.add_argument("--format", "-f", choices=("text", "chrome", "png"), default="text",
                   help="output format (default: text)")
    p.add_argument("-o", "--output", metavar="PATH",
                   help="write here instead of stdout (required for png)")
    p.add_argument("--width", type=int, default=100, help="text: target line width (default 100)")
    p.add_argument("--rank", type=int, default=0, help="chrome: rank used as pid (default 0)")
    p.add_argument("--profile", metavar="TRACE.json",
                   help="torch.profiler Chrome trace of a GPU run: show measured beside predicted")
    p.add_argument("--step", type=int, default=-1,
                   help="with --profile: which annotated step to use (default -1, the last)")
    return p


def main(argv: list[str] | None = None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    if args.format == "png" and not args.output:
        p.error("--format png needs -o PATH")
    try:
        if args.example:
            schedule = example_schedule(num_layers=args.layers)
        else:
            schedule = load_schedule(args.schedule)
        measured = None
        if args.profile:
            measured = match_profile(schedule, load_trace(args.profile), step=args.step)
    except VizInputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    if args.format == "png":
        to_png(schedule, args.output, measured=measured)
        print(f"wrote {args.output}", file=sys.stderr)
        return 0
    if args.format == "chrome":
        out = json.dumps(to_chrome_trace(schedule, rank=args.rank, measured=measured))
    else:
        out = render_text(schedule, width=args.width, measured=measured)
    if args.output:
        try:
            with open(args.output, "w", encoding="utf-8") as f:
                f.write(out + "\n")
        except OSError as e:
            print(f"error: cannot write {args.output!r}: {e.strerror or e}", file=sys.stderr)
            return 2
        print(f"wrote {args.output}", file=sys.stderr)
    else:
        sys.stdout.write(out + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
