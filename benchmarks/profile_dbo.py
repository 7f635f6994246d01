"""Profile one DBO step on 2 GPUs and write what the viewer needs to compare it with the schedule.

Run (2 GPUs)::

    torchrun --nproc-per-node 2 benchmarks/profile_dbo.py --out prof/
    python -m dbo_compile.viz prof/schedule.json --profile prof/trace_rank0.json

Writes ``schedule.json`` (the compiled schedule), ``trace_rank0.json`` (torch.profiler Chrome
trace of one eager DBO step; every rank's with ``--all-ranks``, with the ``dbo.u<id>`` ranges the generated wrapper opens) and
``measured.txt`` / ``measured.png`` (measured beside predicted, rank 0).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

from dbo_compile import backend as dbo_backend
from dbo_compile.testing import moe as H


def candidate_options(name: str) -> dict:
    """Backend options that compile only the schedule candidate ``name`` (as the runner names
    them: ``list``, ``naive``, ``list@link/16``, ``...+sms16``), as the primary schedule:
    compiling every candidate with Inductor takes minutes."""
    from dbo_compile.candidates import candidates_of
    from dbo_compile.config import DboConfig

    base, _, sms = name.partition("+sms")
    schedules = {c.name: c.apply(DboConfig()) for c in candidates_of(DboConfig())}
    if base not in schedules or (sms and not sms.isdigit()):
        raise SystemExit(f"--candidate {name!r}: expected one of {sorted(schedules)}, "
                         "optionally with +sms<N>")
    cfg = schedules[base]
    opts = {"scheduler": cfg.scheduler, "link_gbps": cfg.link_gbps,
            "join_experts": cfg.join_experts, "schedule_candidates": False,
            "sm_carveout_candidates": ()}
    if sms:
        opts["comm_sms"] = int(sms)
    return opts


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="prof")
    p.add_argument("--phase", default="prefill", choices=("decode", "prefill"))
    p.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--all-ranks", action="store_true", help="write every rank's trace")
    p.add_argument("--graph", action="store_true",
                   help="profile a replay of the split program captured as one CUDA graph "
                        "(no host overhead; kernels are matched to comm units by order)")
    p.add_argument("--candidate", "--variant", dest="candidate", default=None,
                   help="schedule candidate to profile (e.g. 'list@link/16+sms16'; compiled "
                        "alone; default: the default options' primary schedule)")
    p.add_argument("--attention", default="fused", choices=list(H.ATTENTION_KINDS))
    p.add_argument("--compute-backend", default="auto", choices=["auto", "aten", "inductor"])
    args = p.parse_args(argv)
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    device = torch.device("cuda", local)
    dist.init_process_group("nccl", device_id=device)
    rank = dist.get_rank()
    dbo_backend.register()
    H.install_kernels("cuda", experts="grouped", attention=args.attention)
    model = H.build_model("deepseek-v2-lite", args.layers, dist.group.WORLD, str(device),
                          vocab_size=args.vocab, first_k_dense_replace=0)  # as bench_moe
    step = H.make_bucket_step(model.config, args.phase, args.tokens, str(device), seed=rank)
    model.allocate_kv_cache(step.num_blocks, step.block_size)
    options = {"split": "always", "compute_backend": args.compute_backend}
    if args.candidate is not None:
        options.update(candidate_options(args.candidate))
    compiled = torch.compile(model, backend="dbo", options=options)
    with torch.no_grad():
        compiled(step.input_ids, step.positions, step.attn_metadata)  # compile
        art = dbo_backend.compiled_artifacts()[-1]
        for _ in range(2):  # warm up
            compiled(step.input_ids, step.positions, step.attn_metadata)
        torch.cuda.synchronize()
        dist.barrier()
        from torch.profiler import ProfilerActivity, profile

        if args.graph:
            from dbo_compile.runtime.capture import capture
            from dbo_compile.testing.measure import SplitStep

            sstep = SplitStep(art, lambda: compiled(step.input_ids, step.positions,
                                                    step.attn_metadata))
            graph, _ = capture(sstep, warmup=2)
            graph.replay()
            torch.cuda.synchronize()
            dist.barrier()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            if args.graph:
                graph.replay()
            else:
                compiled(step.input_ids, step.positions, step.attn_metadata)
            torch.cuda.synchronize()
    os.makedirs(args.out, exist_ok=True)
    if rank == 0 or args.all_ranks:
        prof.export_chrome_trace(os.path.join(args.out, f"trace_rank{rank}.json"))
    schedule = art.split_program.schedule
    if rank == 0:
        with open(os.path.join(args.out, "schedule.json"), "w") as f:
            f.write(schedule.to_json())
        from dbo_compile.viz.png import to_png
        from dbo_compile.viz.profile import load_trace, match_profile
        from dbo_compile.viz.text import render_text

        try:
            measured = match_profile(schedule,
                                     load_trace(os.path.join(args.out, "trace_rank0.json")))
        except Exception as e:  # noqa: BLE001 - keep the trace and schedule for a later look
            print(f"could not match the profile to the schedule: {e}")
            measured = None
        text = render_text(schedule, measured=measured)
        with open(os.path.join(args.out, "measured.txt"), "w") as f:
            f.write(text)
        to_png(schedule, os.path.join(args.out, "measured.png"), measured=measured)
        print(text)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
