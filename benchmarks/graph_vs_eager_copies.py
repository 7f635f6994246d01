"""The emulated link's copy pattern, eagerly and in one CUDA graph, alone and beside GEMMs.

Why (issue 28, ``docs/results.md`` "Peers again"): at V3 EP-32 prefill the peers' split step
ran 9-13 % faster eagerly than in one CUDA graph. This isolates the emulated link
(:mod:`dbo_compile.ops.emulated.link`): 16 chunks of a device buffer out to pinned host memory
and back on two copy streams (the way back of chunk ``i`` waits for its way out), beside ``N``
bf16 GEMMs ``[4096, 7168] @ [7168, 4096]`` on a third stream. Each of ``gemms``, ``copies`` and
``both`` is timed eagerly and as one captured graph (µs per call, median of CUDA-event-timed
calls, :func:`harness.median_us`). If the graph runs ``both`` slower than eagerly while each part
alone is not, the link's memcpy nodes are what a graph changes.

    python benchmarks/graph_vs_eager_copies.py --gemms 40 --json out.json

CUDA only.
"""

from __future__ import annotations

import argparse
import datetime
import json

import torch

import harness


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gemms", type=int, default=40, help="GEMMs beside the copies")
    p.add_argument("--mib", type=int, default=256, help="bytes each round trip moves (MiB)")
    p.add_argument("--chunks", type=int, default=16)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("graph_vs_eager_copies.py needs CUDA")
    dev = torch.device("cuda")
    a = torch.randn(4096, 7168, device=dev, dtype=torch.bfloat16)
    b = torch.randn(7168, 4096, device=dev, dtype=torch.bfloat16)
    nbytes = args.mib << 20
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    back = torch.empty_like(src)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    s_comp, s_out, s_in = torch.cuda.Stream(), torch.cuda.Stream(), torch.cuda.Stream()
    bounds = [nbytes * i // args.chunks for i in range(args.chunks + 1)]
    events = [torch.cuda.Event() for _ in range(args.chunks)]

    def gemms() -> None:
        for _ in range(args.gemms):
            torch.mm(a, b)

    def copies() -> None:
        cur = torch.cuda.current_stream()
        s_out.wait_stream(cur)
        s_in.wait_stream(cur)
        for i in range(args.chunks):
            x, y = bounds[i], bounds[i + 1]
            with torch.cuda.stream(s_out):
                host[x:y].copy_(src[x:y], non_blocking=True)
                events[i].record(s_out)
            with torch.cuda.stream(s_in):
                s_in.wait_event(events[i])
                back[x:y].copy_(host[x:y], non_blocking=True)
        cur.wait_stream(s_in)
        cur.wait_stream(s_out)

    def both() -> None:
        cur = torch.cuda.current_stream()
        s_comp.wait_stream(cur)
        copies()
        with torch.cuda.stream(s_comp):
            gemms()
        cur.wait_stream(s_comp)

    rows = {}
    for name, fn in (("gemms", gemms), ("copies", copies), ("both", both)):
        graph, _ = harness.capture(fn)
        rows[name] = {"eager_us": round(harness.median_us(fn, args.iters, warmup=3), 1),
                      "graph_us": round(harness.median_us(graph.replay, args.iters, warmup=3), 1)}
        print(f"{name:7s} eager {rows[name]['eager_us']:>10,.1f} µs   "
              f"graph {rows[name]['graph_us']:>10,.1f} µs")
    doc = {"machine": harness.machine(), "torch": torch.__version__,
           "date": datetime.datetime.now().isoformat(timespec="minutes"),
           "command": "benchmarks/graph_vs_eager_copies.py " + " ".join(
               f"--{k} {v}" for k, v in vars(args).items() if k != "json"),
           "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
