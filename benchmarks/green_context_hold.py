"""Compute beside SM-holding comm, with and without a green context (one GPU, no model).

The question behind ``DboConfig.sm_carveout_mode="green_context"`` (issue 28 item 3): when comm
kernels hold SMs (the emulated link's ``hold_sms``, DeepEP's normal kernels), does running the
compute in a CUDA green context of the device's SMs less the held ones keep the two apart?

Work: 4 x (an [8192, 8192] bf16 GEMM and an Inductor pointwise kernel over 64 Mi floats) on a
compute stream; beside it, 4 holds of 24 SMs x 1,500 µs (``dbo_compile.ops.emulated.hold``) on
a high-priority comm stream. Timed (µs, median of 5 CUDA-event-timed calls), eagerly and
replayed from a CUDA graph: the work alone, the holds alone, both; then the same with the
compute stream in a green context of ``green_context_sms(SMs, 24)`` SMs
(``dbo_compile.runtime.streams``). Run::

    python benchmarks/green_context_hold.py --json $OUT/green_context_hold.json

CUDA only; ``supported: false`` in the output where this torch has no green contexts.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dbo_compile.ops.emulated.hold import hold_sms  # noqa: E402
from dbo_compile.runtime.streams import green_context_sms  # noqa: E402

HELD, HOLD_US, HOLDS = 24, 1500.0, 4


def timed_us(fn, n: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(n):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        out.append(s.elapsed_time(e) * 1e3)
    return sorted(out)[len(out) // 2]


def graphed(fn):
    g, s = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
        torch.cuda.synchronize()
        with torch.cuda.graph(g, stream=s):
            fn()
    return g.replay


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", default=None, help="write the figures here (JSON)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("green_context_hold needs a CUDA GPU", file=sys.stderr)
        sys.exit(2)
    dev = torch.device("cuda", 0)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    gc_mod = getattr(torch.cuda, "green_contexts", None)
    doc = {"machine": torch.cuda.get_device_name(dev), "torch": torch.__version__,
           "date": datetime.datetime.now().isoformat(timespec="seconds"), "sms": sms,
           "held_sms": HELD, "hold_us": HOLD_US, "holds": HOLDS,
           "supported": bool(gc_mod and gc_mod.SUPPORTED)}
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    x = torch.randn(64 * 2**20, device=dev)
    pointwise = torch.compile(lambda t: (t * 1.5).sin() + t)
    pointwise(x)
    comm = torch.cuda.Stream(priority=torch.cuda.Stream.priority_range()[1])

    def step(compute: torch.cuda.Stream, work: bool, holds: int):
        cur = torch.cuda.current_stream()
        compute.wait_stream(cur)
        comm.wait_stream(cur)
        if work:
            with torch.cuda.stream(compute):
                for _ in range(4):
                    a @ a
                    pointwise(x)
        with torch.cuda.stream(comm):
            for _ in range(holds):
                hold_sms(dev, HELD, HOLD_US)
        cur.wait_stream(compute)
        cur.wait_stream(comm)

    streams = {"all_sms": torch.cuda.Stream()}
    if doc["supported"]:
        doc["green_context_sms"] = green_context_sms(sms, HELD)
        ctx = gc_mod.GreenContext.create(num_sms=doc["green_context_sms"], device_id=0)
        streams["green_context"] = ctx.Stream()
    for name, stream in streams.items():
        for case, (work, holds) in {"work": (True, 0), "holds": (False, HOLDS),
                                    "both": (True, HOLDS)}.items():
            fn = lambda s=stream, w=work, h=holds: step(s, w, h)  # noqa: E731
            doc[f"{name}/{case}/eager_us"] = round(timed_us(fn), 1)
            doc[f"{name}/{case}/graph_us"] = round(timed_us(graphed(fn)), 1)
    print(json.dumps(doc, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
