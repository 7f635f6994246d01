"""The benchmarks' command lines, parsed and checked here so that a test checks them without
importing a script: ``bench_moe.py`` (torchrun or ``--emulate-ep``) and its emulated world's
compile options, ``soak.py`` (Gloo ranks or ``--gpu``).

A flag that the chosen mode does not read is refused with a usage error, never silently
ignored (issue 29: ``bench_moe.py --emulate-ep 8 --comm-sms 24`` ran without the carve-out it
was asked for): :func:`given_flags`, :func:`refuse_unread`.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Iterable, Mapping, Sequence

import torch

from dbo_compile.config import DboConfig
from dbo_compile.errors import DboConfigError
from dbo_compile.runtime.vote import bucket_never_splits
from dbo_compile.testing.graph_soak import SIZES, TOLERANCES
from dbo_compile.testing.moe import ATTENTION_KINDS

__all__ = ["CPU_ONLY", "CUDA_ONLY", "EMULATED_ONLY", "GPU_ONLY", "TORCHRUN_ONLY",
           "all_rows_failed", "check_max_num_reqs", "failed_cell", "given_flags", "link_label",
           "md_cell", "moe_parser", "no_split_reason", "parse_moe", "parse_soak", "refuse_unread",
           "row_failed", "soak_parser", "timing_note", "world_options"]


def given_flags(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> set[str]:
    """The destinations (``args`` attribute names) that ``argv`` sets explicitly, whatever
    the value (a default given on the command line counts): ``argv`` is parsed again into a
    namespace where every destination already holds a marker, which argparse then keeps for
    the flags not given."""
    unset = object()
    dests = vars(parser.parse_args(argv))
    again = parser.parse_args(argv, namespace=argparse.Namespace(**dict.fromkeys(dests, unset)))
    return {k for k, v in vars(again).items() if v is not unset}


def _dest(flag: str, args: argparse.Namespace) -> str:
    name = flag.lstrip("-").replace("-", "_")
    if name in vars(args):
        return name
    if name.startswith("no_") and name[3:] in vars(args):  # a store_false "--no-X"
        return name[3:]
    raise ValueError(f"{flag}: no such option")


def refuse_unread(parser: argparse.ArgumentParser, args: argparse.Namespace, given: set[str],
                  unread: Iterable[str], mode: str) -> None:
    """Exit with a usage error (``parser.error``) naming the flags of ``unread`` (as
    written: ``"--no-check"``) that ``argv`` gave (``given``: :func:`given_flags`) but
    ``mode`` does not read.

    Raises:
        ValueError: a flag of ``unread`` is no option of ``args``.
    """
    bad = [flag for flag in unread if _dest(flag, args) in given]
    if bad:
        it = "it" if len(bad) == 1 else "them"
        parser.error(f"{', '.join(bad)}: not read {mode} (the run would ignore {it}); drop "
                     f"{it} or change the mode")


# ----------------------------------------------------------------------------- bench_moe.py
#: ``bench_moe.py``: flags only the emulated world reads (the torchrun run refuses them)
EMULATED_ONLY = ("--link-gbps", "--latency-us", "--cost-link-gbps", "--cost-latency-us",
                 "--timing-iters", "--no-check", "--no-eager", "--no-calib", "--unit-reps",
                 "--kernels", "--profile", "--hold-sms", "--experts-backend", "--fp8")
#: flags the emulated world does not read (one process: no link to label, no process group
#: for the vote; no Inductor-compiled unsplit model timed)
TORCHRUN_ONLY = ("--link", "--vote-group", "--inductor")
#: flags that do something on CUDA only (the CPU smoke run refuses them; ``--link`` labels
#: the GPUs' link: a CPU run's is Gloo, :func:`link_label`)
CUDA_ONLY = ("--comm-sms", "--inductor", "--kernels", "--profile", "--hold-sms", "--fp8",
             "--link")


def moe_parser(description: str | None = None, json_default: str | None = None
               ) -> argparse.ArgumentParser:
    """``bench_moe.py``'s command line (:func:`parse_moe` parses and checks it), with the
    script's ``description`` and ``--json`` default."""
    p = argparse.ArgumentParser(description=description,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default=None, help="default deepseek-v2-lite (GPU) / tiny (CPU)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096,
                   help="vocab_size (lm_head cost; default 4096: the full 102400-row lm_head "
                        "weighs as much as ~4 of these layers, which a 27-layer model amortises)")
    p.add_argument("--dense-layers", type=int, default=0,
                   help="first_k_dense_replace: leading dense-MLP layers (default 0: every layer "
                        "MoE, as the hand-written reference of docs/references.md)")
    p.add_argument("--buckets", default=None,
                   help="phase:tokens,... default: decode 64..1024 and prefill 2048..8192 (GPU)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--experts", default="grouped", choices=["grouped", "loop"])
    p.add_argument("--attention", default="fused", choices=list(ATTENTION_KINDS),
                   help="fused (default): the package's dbo.attention (Triton kernel on CUDA); "
                        "proj: KV write + projections only; ref: the reference gather loop")
    p.add_argument("--scheduler", default="list", choices=["list", "naive", "staged", "staged-d2"])
    p.add_argument("--link", default=None,
                   help="label: nvlink | shm (default from NCCL_P2P_DISABLE; CUDA only: a CPU "
                        "run is labelled 'gloo (CPU)')")
    p.add_argument("--comm-sms", type=int, default=None,
                   help="option comm_sms: SM carve-out for compute GEMMs in the split program and "
                        "(torchrun) a dedicated high-priority EP group with that NCCL CTA cap "
                        "(CUDA only)")
    p.add_argument("--carveout-candidates", default="default",
                   help="option sm_carveout_candidates: comma-separated SM counts (e.g. 16), '' "
                        "for none, 'default' for the package default ((16,) on CUDA; with "
                        "--emulate-ep none: the emulated link's copy engines hold no SMs)")
    p.add_argument("--carveout-mode", default="cublas", choices=["cublas", "green_context"],
                   help="option sm_carveout_mode: how a carve-out keeps its SMs free: cuBLAS "
                        "GEMMs only (default) or every compute kernel (the split program's "
                        "compute stream in a CUDA green context)")
    p.add_argument("--max-num-reqs", type=int, default=None,
                   help="CudaGraphRunner(max_num_reqs=...): the requests each bucket's static "
                        "buffers hold (the engine's max_num_seqs); default: the bucket's "
                        "token count (bucket / num_ubatches per ubatch)")
    p.add_argument("--candidates", default="all",
                   help="option schedule_candidates: 'all' (default: every candidate timed, the "
                        "data the package default is chosen from), 'default' (the package "
                        "default, DboConfig.schedule_candidates), 'none', or comma-separated "
                        "names (e.g. list+join,list@link/16+sms16): fewer graphs per bucket")
    p.add_argument("--compute-backend", default="auto", choices=["auto", "aten", "inductor"],
                   help="option compute_backend (default: the package default, 'auto' = Inductor "
                        "on CUDA): 'inductor' compiles every stage of the split program and the "
                        "unsplit program with Inductor, so the baseline moves too")
    p.add_argument("--vote-group", default="gloo", choices=["gloo", "world"],
                   help="group of the per-step DP vote: gloo (default): a CPU group, as a "
                        "server's, so that the vote reads nothing back from the GPU; world: the "
                        "default (NCCL) group, whose vote table goes through the GPU and syncs "
                        "the host every step (the runs up to 2026-11-30)")
    p.add_argument("--calibration", default=None, help="option calibration (a JSON file)")
    p.add_argument("--unsplit-overlap", action="store_true",
                   help="option unsplit_overlap: the runner also captures the unsplit program on "
                        "two streams (graph 'unsplit-overlap'); baseline = the faster unsplit graph")
    p.add_argument("--inductor", action="store_true",
                   help="also time the unsplit model compiled by Inductor, in a CUDA graph")
    e = p.add_argument_group("emulated EP world on one GPU (benchmarks/bench_emulated.py)")
    e.add_argument("--emulate-ep", default=None, metavar="W[@GBPS],...",
                   help="run as rank 0 of an emulated EP-W world on one GPU (no torchrun): "
                        "comma-separated world sizes, each optionally @link GB/s, e.g. "
                        "8,16,32,64,8@25")
    e.add_argument("--link-gbps", type=float, default=50.0,
                   help="emulated link bandwidth per direction, GB/s (default 50: one 400 Gb/s NIC)")
    e.add_argument("--latency-us", type=float, default=0.0, help="added per dispatch / combine")
    e.add_argument("--hold-sms", type=int, default=0,
                   help="the emulated backend's option hold_sms: SMs each transfer holds for its "
                        "emulated duration, as DeepEP's normal-mode kernels hold 20-24 (default "
                        "0: the copy engines alone; CUDA only; not with --comm-sms)")
    e.add_argument("--experts-backend", default=None, choices=["auto", "torch", "deep_gemm"],
                   help="option experts_backend (default: the package default, 'auto'): "
                        "deep_gemm runs DeepGEMM's contiguous grouped GEMMs on the emulated "
                        "world's token-major rows")
    e.add_argument("--fp8", action="store_true",
                   help="option experts_backend_options={'fp8': True}: FP8 e4m3 expert GEMMs "
                        "with DeepSeek's block scales (needs --experts-backend deep_gemm); "
                        "the rows' error is against the bf16 reference")
    e.add_argument("--cost-link-gbps", type=float, default=44.0,
                   help="the cost model's link figure is min(link, this): the hardware's duplex "
                        "copy rate (measured 42-45 GB/s per direction on one H200)")
    e.add_argument("--cost-latency-us", type=float, default=10.0)
    e.add_argument("--timing-iters", type=int, default=5,
                   help="CudaGraphRunner's replays per graph and round at warm-up")
    e.add_argument("--no-check", dest="check", action="store_false",
                   help="skip the numerics against the one-device reference (which holds all "
                        "E experts: 22 GB per layer for DeepSeek-V3)")
    e.add_argument("--no-eager", dest="eager", action="store_false",
                   help="skip the eager unsplit / DBO timings (host-bound)")
    e.add_argument("--no-calib", dest="calib", action="store_false",
                   help="skip the unit timings and features benchmarks/calibrate.py fits")
    e.add_argument("--unit-reps", type=int, default=3)
    e.add_argument("--kernels", type=int, default=0, metavar="TOP",
                   help="print per-kernel tables (calls, µs) of the unsplit graph, the split "
                        "graph without comm and the DBO graph of every bucket, TOP rows")
    e.add_argument("--profile", default=None, metavar="PHASE:TOKENS:W",
                   help="write profiler traces of that bucket's DBO graph (and its schedule) "
                        "and of its split serial, split without comm, comm-only and comm-ops "
                        "graphs beside --json (profile_NAME.json)")
    p.add_argument("--json", default=json_default)
    p.add_argument("--md", default=None, help="markdown table path (default: json with .md)")
    p.add_argument("--append", action="store_true", help="add rows to an existing --json")
    return p


#: the environment variables ``torchrun`` sets and ``init_process_group("env://")`` reads
TORCHRUN_ENV = ("RANK", "WORLD_SIZE")


def parse_moe(argv: Sequence[str] | None = None, description: str | None = None,
              json_default: str | None = None,
              environ: Mapping[str, str] | None = None) -> argparse.Namespace:
    """``bench_moe.py``'s arguments: a flag that the chosen mode (``--emulate-ep`` or
    torchrun, CUDA or not) does not read, a ``--candidates`` name that is none,
    ``--experts-backend deep_gemm`` without CUDA, or the multi-rank mode outside torchrun
    (``environ``, default ``os.environ``, lacks ``RANK`` / ``WORLD_SIZE``) is a usage error
    (``SystemExit(2)``)."""
    environ = os.environ if environ is None else environ
    p = moe_parser(description, json_default)
    args = p.parse_args(argv)
    # a flag the chosen mode does not read is refused, not ignored
    given = given_flags(p, argv)
    if args.emulate_ep:
        refuse_unread(p, args, given, TORCHRUN_ONLY, "with --emulate-ep")
    else:
        refuse_unread(p, args, given, EMULATED_ONLY, "without --emulate-ep")
    if args.fp8 and args.experts_backend != "deep_gemm":
        p.error("--fp8 needs --experts-backend deep_gemm (only DeepGEMM serves FP8 experts; "
                f"got {args.experts_backend or 'the default'})")
    if not torch.cuda.is_available():
        if args.experts_backend == "deep_gemm":  # before --fp8's refusal: the cause of both
            p.error("--experts-backend deep_gemm: DeepGEMM needs a CUDA GPU (its kernels are "
                    "CUDA only) and this machine has none; use --experts-backend torch or "
                    "auto, or run on a GPU")
        refuse_unread(p, args, given, CUDA_ONLY, "without CUDA")
    if args.hold_sms and args.comm_sms:
        p.error("--hold-sms and --comm-sms emulate the same cost twice (SMs held by the "
                "transfers, a carve-out of the GEMMs); give one of them")
    if args.hold_sms < 0:
        p.error(f"--hold-sms {args.hold_sms}: SMs, an int >= 0")
    args.profile_at = None
    if args.profile:
        ph, tok, w = args.profile.split(":")
        args.profile_at = (ph, int(tok), int(w))
    if args.candidates not in ("all", "none", "default"):
        try:
            DboConfig(schedule_candidates=tuple(v for v in args.candidates.split(",") if v))
        except DboConfigError as e:
            p.error(f"--candidates: {e}")
    missing = [v for v in TORCHRUN_ENV if v not in environ]
    if not args.emulate_ep and missing:
        p.error(f"{' and '.join(missing)} not set: the multi-rank mode runs under torchrun: "
                "torchrun --nproc-per-node 2 benchmarks/bench_moe.py ... (or --emulate-ep W "
                "for one process)")
    return args


def link_label(link: str | None, cuda: bool, environ: Mapping[str, str] | None = None) -> str:
    """The ``link`` of ``bench_moe.py``'s torchrun rows: ``--link`` where given (``link``),
    else ``"gloo (CPU)"`` without CUDA (the ranks talk over Gloo), else ``"shm"`` where
    ``environ`` (default ``os.environ``) has ``NCCL_P2P_DISABLE=1``, else ``"nvlink"``."""
    environ = os.environ if environ is None else environ
    if link:
        return link
    if not cuda:
        return "gloo (CPU)"
    return "shm" if environ.get("NCCL_P2P_DISABLE") == "1" else "nvlink"


def timing_note(cuda: bool) -> str:
    """What ``bench_moe.py``'s torchrun figures (µs) are, for its table's footer: on CUDA the
    median of CUDA-event-timed graph replays, the baseline and the DBO program each in one
    CUDA graph; on CPU (``cuda`` false: the Gloo smoke run) the median of wall-clock eager
    calls, no graph."""
    if cuda:
        return ("µs per step, median of CUDA-event-timed graph replays on the benchmark's step, "
                "max over ranks. baseline = unsplit program in one CUDA graph; DBO graph = the "
                "split program's fastest schedule candidate (measured at warm-up by the "
                "runtime's CudaGraphRunner) in one CUDA graph")
    return ("µs per step, median of wall-clock (perf_counter) eager calls on the benchmark's "
            "step, max over ranks (CPU smoke run over Gloo: no graphs are captured). baseline = "
            "the unsplit model called eagerly; DBO graph = the split program of the fastest "
            "schedule candidate (measured at warm-up by the runtime's CudaGraphRunner) called "
            "eagerly")


def md_cell(text: Any, limit: int | None = None) -> str:
    """``text`` as one markdown table cell: every run of whitespace (newlines included) as
    one space, cut to ``limit`` characters (before escaping; ``None``: whole), ``|`` escaped
    as ``\\|`` so that it splits no column."""
    one = " ".join(str(text).split())
    if limit is not None:
        one = one[:limit]
    return one.replace("|", "\\|")


def failed_cell(row: Mapping[str, Any], limit: int = 200) -> str:
    """The markdown cell of a row without figures: its ``errors`` joined by ``"; "``, on one
    line (:func:`md_cell`, at most ``limit`` characters of errors), after ``"failed: "`` where
    the row failed (:func:`row_failed`; a bucket not split is an outcome: its reason alone)."""
    text = md_cell("; ".join(map(str, row.get("errors", []))), limit)
    return ("failed: " + text) if row_failed(row) else text


def row_failed(row: Mapping[str, Any]) -> bool:
    """Whether a row of ``bench_moe.py`` (either mode) failed: no figure (neither
    ``t_baseline_us`` nor ``t_dbo_graph_us``) and an error other than ``"not split: ..."``
    (a bucket not split is a measured outcome, not a failure)."""
    if row.get("t_baseline_us") is not None or row.get("t_dbo_graph_us") is not None:
        return False
    return any(not str(e).startswith("not split:") for e in row.get("errors", []))


def all_rows_failed(rows: Sequence[Mapping[str, Any]]) -> bool:
    """Whether a run's ``rows`` (those it wrote, not ``--append``'s older ones) all failed
    (:func:`row_failed`): the run then exits non-zero. ``False`` for no rows."""
    return bool(rows) and all(row_failed(r) for r in rows)


def no_split_reason(b: Any) -> str:
    """Why bucket ``b`` (a runner's ``BucketGraphs``) has no split graph, in words: the graph
    cannot split (the artifact's ``reason``), no step of the bucket can split
    (:func:`~dbo_compile.runtime.vote.bucket_never_splits`, the runner's own rule), the
    pruning skipped the split (``prune.skip_split``), or every split graph was dropped (out of
    GPU memory, the memory budget: ``dropped``)."""
    art = b.artifact
    if getattr(art, "reason", None):
        return str(art.reason)
    never = bucket_never_splits(b.tokens, art.config)
    if never:
        return never
    prune = getattr(b, "prune", None)
    if prune is not None and prune.skip_split:
        return f"pruned: {prune.skip_split}"
    dropped = getattr(b, "dropped", None) or {}
    if dropped:
        return "every split graph dropped: " + "; ".join(dropped.values())
    return "no split graph captured (split='never', or the runner kept none)"


def world_options(args: argparse.Namespace, w: int, gbps: float) -> dict[str, Any]:
    """The compile options of one emulated world of ``bench_moe.py --emulate-ep`` (``args``:
    :func:`parse_moe`'s, with ``carveouts`` and ``candidate_names`` set by the run): the link,
    the cost model's figures and every option flag of ``bench_moe.py`` that applies to one
    process (``--scheduler``, ``--comm-sms``: the split program's SM carve-out, as the
    emulated comm kernels would hold them; ``--compute-backend``, ``--carveout-candidates``,
    ``--carveout-mode``, ``--candidates``, ``--calibration``, ``--latency-us``,
    ``--hold-sms``: the SMs each transfer holds; ``--unsplit-overlap``; ``--experts-backend``
    and ``--fp8``: the experts backend and its FP8 option)."""
    emulated = {"world_size": w, "link_gbps": gbps}
    options = {"comm_backend": "emulated", "comm_backend_options": emulated,
               "link_gbps": min(gbps, args.cost_link_gbps), "comm_latency_us": args.cost_latency_us,
               "scheduler": args.scheduler, "compute_backend": args.compute_backend,
               "sm_carveout_candidates": args.carveouts,
               "sm_carveout_mode": getattr(args, "carveout_mode", "cublas"),
               "schedule_candidates": args.candidate_names, "dp_group_name": None,
               "unsplit_overlap": getattr(args, "unsplit_overlap", False)}
    if args.comm_sms is not None:
        options["comm_sms"] = args.comm_sms
    if args.latency_us:
        emulated["latency_us"] = args.latency_us
    if getattr(args, "hold_sms", 0):
        emulated["hold_sms"] = args.hold_sms
    if args.calibration:
        options["calibration"] = args.calibration
    if getattr(args, "experts_backend", None):
        options["experts_backend"] = args.experts_backend
    if getattr(args, "fp8", False):
        options["experts_backend_options"] = {"fp8": True}
    return options


# ----------------------------------------------------------------------------- soak.py
#: ``soak.py``: the options of each mode that the other mode does not read (refused there)
CPU_ONLY = ("--world-sizes", "--max-tokens", "--p-fail", "--contents")
GPU_ONLY = ("--gpu-size", "--dtype", "--check-every", "--p-wide", "--compute-backend")


def soak_parser(description: str | None = None) -> argparse.ArgumentParser:
    """``soak.py``'s command line (:func:`parse_soak` parses and checks it)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--steps", type=int, default=10_000, help="steps (per world size)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--p-split", type=float, default=0.7,
                   help="share of the steps aimed at a split (every rank past the threshold, "
                        "no veto, no shared prefix)")
    p.add_argument("--p-veto", type=float, default=0.1,
                   help="engine vetoes per rank and step not aimed at a split")
    p.add_argument("--p-share", type=float, default=0.2,
                   help="shared prefixes per rank and step not aimed at a split")
    p.add_argument("--step-timeout", type=float, default=None,
                   help="seconds a step may take before its rank is counted as hung (default "
                        "120, with --gpu 60; the first step, which compiles, or the capture: "
                        "ten times that); raise it on a loaded machine, where a recompiling "
                        "step can take minutes")
    p.add_argument("--minutes", type=float, default=None,
                   help="time budget (per world size; with --gpu: of the steps, after the "
                        "capture): stop before --steps once it is spent (the counts say how "
                        "many steps ran)")
    p.add_argument("--out", default=None,
                   help="also write the counts (every world size) and the machine to this "
                        "JSON file")
    c = p.add_argument_group("CPU soak (Gloo ranks)")
    c.add_argument("--world-sizes", default="2,4", help="comma-separated Gloo world sizes")
    c.add_argument("--max-tokens", type=int, default=96, help="largest token count of a rank")
    c.add_argument("--p-fail", type=float, default=0.02, help="injected failures per step")
    c.add_argument("--contents", type=int, default=256,
                   help="step contents per kind and rank, each with its reference computed "
                        "once (0: a new content every step)")
    g = p.add_argument_group("one GPU (--gpu): CudaGraphRunner over an emulated EP world")
    g.add_argument("--gpu", action="store_true", help="run the CUDA-graph runner's soak")
    g.add_argument("--gpu-size", default="gpu", choices=sorted(SIZES),
                   help="model and buckets (cpu: the same code at a tiny size, on CPU)")
    g.add_argument("--dtype", default="float32", choices=sorted(TOLERANCES),
                   help="model dtype (float32: the reference comparison's tolerance is 1e-3; "
                        "bfloat16: 5e-2)")
    g.add_argument("--check-every", type=int, default=10,
                   help="compare every N-th step with the reference")
    g.add_argument("--p-wide", type=float, default=0.01,
                   help="steps with a block table wider than the runner's (they run eagerly)")
    g.add_argument("--compute-backend", default="aten", choices=["aten", "inductor"],
                   help="the compute_backend option (aten: seconds of capture; inductor "
                        "compiles every stage per bucket, and each eager step's new size)")
    return p


def parse_soak(argv: Sequence[str] | None = None,
               description: str | None = None) -> argparse.Namespace:
    """``soak.py``'s arguments: a flag of the other mode (``--gpu`` or not), or a bad count,
    is a usage error (``SystemExit(2)``)."""
    p = soak_parser(description)
    args = p.parse_args(argv)
    refuse_unread(p, args, given_flags(p, argv), CPU_ONLY if args.gpu else GPU_ONLY,
                  "with --gpu" if args.gpu else "without --gpu")
    if args.step_timeout is None:
        args.step_timeout = 60.0 if args.gpu else 120.0
    args.sizes = [int(w) for w in args.world_sizes.split(",") if w]
    if args.steps < 1 or not args.sizes or min(args.sizes) < 2:
        p.error("--steps must be >= 1 and --world-sizes ints >= 2")
    if (args.minutes is not None and args.minutes <= 0) or args.step_timeout <= 0:
        p.error("--minutes and --step-timeout must be > 0")
    if args.contents < 0 or args.check_every < 1:
        p.error("--contents must be >= 0 and --check-every >= 1")
    return args


def check_max_num_reqs(max_num_reqs: int | None, steps: dict) -> None:
    """``--max-num-reqs M`` against the benchmark's steps (``(phase, tokens) -> Step``): a step
    of more than ``M`` requests cannot be loaded into a bucket's graph (the runner serves it
    eagerly; the benchmarks time the graphs). Raises ``SystemExit`` (usage, code 2) naming
    the buckets; a decode bucket's step holds one request per token."""
    if max_num_reqs is None:
        return
    over = [f"{p}:{n} ({len(s.num_scheduled_tokens)} requests)" for (p, n), s in steps.items()
            if len(s.num_scheduled_tokens) > max_num_reqs]
    if over:
        print(f"--max-num-reqs {max_num_reqs}: the steps of {', '.join(over)} hold more requests "
              "than the graphs would; a decode bucket's step holds one request per token: give "
              "a larger value or leave those buckets out", file=sys.stderr)
        raise SystemExit(2)
