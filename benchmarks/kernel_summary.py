"""Where the split program's extra time goes: per-kernel totals of the unsplit graph and of a
split schedule's graph, side by side, from one profiled replay of each.

Run (2 GPUs)::

    torchrun --nproc-per-node 2 benchmarks/kernel_summary.py --phase prefill --tokens 2048 \
        --compute-backend inductor

Prints, for rank 0, the kernels grouped by a short name: calls and total µs in the unsplit
graph and in the split graph (the runner's fastest candidate), sorted by the difference; and the
total kernel count and kernel time of each. NCCL kernels are listed like the others; run with
``NCCL_P2P_DISABLE=1`` for the comm-heavy link.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys

import torch
import torch.distributed as dist

from dbo_compile import backend as dbo_backend
from dbo_compile.runtime.cudagraph_runner import CudaGraphRunner
from dbo_compile.testing import moe as H


def _short(name: str) -> str:
    name = re.sub(r"<.*", "", name)  # template arguments
    name = re.sub(r"\(.*", "", name)
    return name.split("::")[-1][:60] or name[:60]


def kernel_table(graph, reps: int) -> dict[str, list[float]]:
    from torch.profiler import ProfilerActivity, profile

    graph.replay()
    torch.cuda.synchronize()
    if dist.is_initialized():
        dist.barrier()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            graph.replay()
        torch.cuda.synchronize()
    table: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA and ev.device_time > 0:
            row = table[_short(ev.name)]
            row[0] += 1 / reps
            row[1] += ev.device_time / reps
    return table


def op_table(fn, reps: int) -> dict[str, list[float]]:
    """Kernels of ``reps`` eager calls of ``fn`` grouped by ``"<innermost CPU op> > <kernel>"``
    (the launching op; a unit's ``record_function`` range for Inductor's own launches)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    table: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CPU:
            continue
        for k in ev.kernels:
            row = table[f"{re.sub(r'^dbo[.]u[0-9]+[.]', 'unit ', ev.name)[:40]} > {_short(k.name)}"]
            row[0] += 1 / reps
            row[1] += k.duration / reps
    return table


def print_tables(tables: dict[str, dict[str, list[float]]], top: int, title: str) -> None:
    """``tables``: ``{"unsplit": table, "split": table, ...more}`` (calls and µs per kernel
    name); rows sorted by split minus unsplit µs, one column pair per table."""
    print(title)
    for name, t in tables.items():
        print(f"{name}: {sum(r[0] for r in t.values()):.0f} kernels, "
              f"{sum(r[1] for r in t.values()):,.0f} µs of kernel time")
    names = set().union(*tables.values())
    rows = sorted(names, key=lambda n: -(tables["split"].get(n, [0, 0])[1]
                                          - tables["unsplit"].get(n, [0, 0])[1]))
    w = max([60] + [len(n) for n in rows[:top]])
    print(f"{'kernel':{w}s} " + " ".join(f"{'n ' + k:>10.10s} {'µs ' + k:>11.11s}" for k in tables)
          + f" {'Δ µs':>8s}")
    for n in rows[:top]:
        cells = [tables[k].get(n, [0, 0.0]) for k in tables]
        d = tables["split"].get(n, [0, 0.0])[1] - tables["unsplit"].get(n, [0, 0.0])[1]
        print(f"{n:{w}s} " + " ".join(f"{c[0]:10.0f} {c[1]:11.0f}" for c in cells) + f" {d:8.0f}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--phase", default="prefill", choices=("decode", "prefill"))
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--attention", default="fused", choices=list(H.ATTENTION_KINDS))
    p.add_argument("--compute-backend", default="aten", choices=["aten", "inductor"])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--ops", action="store_true",
                   help="also profile both programs eagerly and group kernels by launching op")
    args = p.parse_args(argv)
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    device = torch.device("cuda", local)
    dist.init_process_group("nccl", device_id=device)
    dbo_backend.register()
    H.install_kernels("cuda", experts="grouped", attention=args.attention)
    model = H.build_model("deepseek-v2-lite", args.layers, dist.group.WORLD, str(device),
                          vocab_size=args.vocab, first_k_dense_replace=0)
    step = H.make_bucket_step(model.config, args.phase, args.tokens, str(device), seed=1)
    model.allocate_kv_cache(step.num_blocks, step.block_size)
    cm = torch.compile(model, backend="dbo", options={"split": "always",
                                                      "compute_backend": args.compute_backend})
    runner = CudaGraphRunner(cm, [args.tokens], block_size=step.block_size,
                             max_blocks_per_req=int(step.attn_metadata.block_table.shape[1]),
                             vocab_size=model.config.vocab_size, timing_iters=5,
                             keep_candidates=True, device=device)
    with torch.no_grad():
        runner.capture()
    b = runner.graphs[args.tokens]
    tables = {"unsplit": kernel_table(b.graphs["unsplit"], args.reps),
              "split": kernel_table(b.graphs[b.best_candidate], args.reps)}
    if args.ops:
        from dbo_compile.runtime.cudagraph_runner import split_program_fn

        art = b.artifact
        with torch.no_grad():
            op_tables = {"unsplit": op_table(lambda: art.unsplit(*b.args), args.reps),
                         "split": op_table(split_program_fn(art.candidates[b.best_candidate], b.split_args,
                                                     art, b.tokens), args.reps)}
    if dist.get_rank() == 0:
        print_tables(tables, args.top,
                     f"{args.phase} {args.tokens} tok/rank, compute_backend={args.compute_backend}, "
                     f"split = {b.best_candidate}; warm-up µs "
                     f"{dict((k, round(v)) for k, v in b.times_us.items())}")
        if args.ops:
            print_tables(op_tables, args.top, "eager calls, kernels by launching op:")
    sys.stdout.flush()
    dist.barrier()
    # destroy_process_group() hung here with the captured graphs (holding NCCL work) alive
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
