"""DBO on one GPU as rank 0 of an emulated EP-W world (``bench_moe.py --emulate-ep W``).

Run (one GPU; no torchrun)::

    python benchmarks/bench_moe.py --emulate-ep 8 --link-gbps 50
    python benchmarks/bench_moe.py --emulate-ep 8,16,32,64,8@25 --preset deepseek-v3 \
        --layers 2 --buckets decode:256,decode:1024,prefill:4096

The model holds the ``E / W`` experts of rank 0 (``DeepseekMoEModel(...,
emulated_world_size=W)``) and is compiled with ``comm_backend="emulated"``
(``dbo_compile/ops/emulated/``): identical batches on every emulated rank, expert weights
repeating every ``E / W`` experts, the remote share of every dispatch / combine (by routing,
the volume DeepEP sends) out to pinned host memory and back on the copy engines, both
directions at once, throttled to ``--link-gbps`` where the hardware is faster. One compile and
one ``CudaGraphRunner`` per (preset, W, link) serve every bucket.

Per bucket, side by side in one run (µs, median of CUDA-event-timed replays), the columns of
``bench_moe.py`` (see there) plus:

- ``bound``: baseline / max(split without comm, comm alone), what perfect overlap would give;
- ``comm``: the link's round trips of the split program alone (per MoE layer and ubatch, in
  order, the static capacity of each dispatch and combine), captured in a CUDA graph;
- ``split_nocomm``: the split program with the link copying nothing (the backend's packing
  stays);
- ``comm_ops``: the split program's dispatches and combines alone, whole (their pack and
  unpack kernels and the round trips, in the DBO schedules' order, on uniform routing): what
  the comm stream carries; ``eta_vs_comm_ops`` is η with it in place of ``comm`` (the packing
  then counts on both sides: it is in ``split_nocomm`` too);
- ``routed``: remote rows per step that mattered against the link's static capacity rows
  (``ops.emulated.stats``; rows past the capacity stay on the device: ``overflow``);
- numerics (V2-Lite shapes, ``--check``): every captured graph and the eager DBO step against
  the one-device reference (``model.emulated_reference()``: all ``E`` experts, unsplit, local
  backend), bf16;
- ``calib``: what ``benchmarks/calibrate.py`` fits and predicts from: the unsplit program's
  and the DBO graph's schedule's cost-model features at this bucket, and the isolated replay
  time of the DBO graph's units of layer 0 (each captured alone, ``--unit-reps`` times in one
  graph).
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness  # noqa: E402

from dbo_compile import backend as dbo_backend  # noqa: E402
from dbo_compile.ops import emulated as E  # noqa: E402
from dbo_compile.ops.experts import experts_path_choices  # noqa: E402
from dbo_compile.ops.registry import bound_backend, comm_kind  # noqa: E402
from dbo_compile.passes.calibrate import step_features  # noqa: E402
from dbo_compile.runtime.cudagraph_runner import CudaGraphRunner, split_program_fn  # noqa: E402
from dbo_compile.runtime.engine import run_step  # noqa: E402
from dbo_compile.runtime.padding import join_ubatch_outputs  # noqa: E402
from dbo_compile.testing import bench_cli  # noqa: E402
from dbo_compile.testing import moe as H  # noqa: E402
from dbo_compile.timing import paired_us  # noqa: E402


def log(msg: str) -> None:
    print(msg, flush=True)


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class Timer:
    """Median of ``iters`` CUDA-event-timed calls after ``warmup`` (µs; wall clock on CPU)."""

    def __init__(self, iters: int, warmup: int):
        self.iters, self.warmup = iters, warmup

    def __call__(self, fn, iters: int | None = None) -> float:
        return harness.median_us(fn, iters or self.iters, warmup=self.warmup)

    def paired(self, fa, fb, rounds: int = 3) -> dict:
        """``fa`` against ``fb`` in ``rounds`` alternating rounds of ``max(10, iters / rounds)``
        calls each (:func:`dbo_compile.timing.paired_us`): ``ratio`` = t_b / t_a, drift
        cancelled. Ten calls at least: a round starts from an idle GPU, and an eager step's
        first calls wait for the host to get ahead (with 4 calls a round, one H100 timed
        SGLang-style eager prefill 2048 at 35.5 ms against 24.4 ms in 20 calls)."""
        got = paired_us(fa, fb, max(10, -(-self.iters // rounds)), rounds=rounds,
                        warmup=self.warmup)
        return {k: (round(v, 1) if k.endswith("_us") else v) for k, v in got.items()}


def parse_worlds(spec: str, default_gbps: float) -> list[tuple[int, float]]:
    """``"8,16,8@25"`` -> ``[(8, default), (16, default), (8, 25.0)]``."""
    out = []
    for item in spec.split(","):
        w, _, g = item.partition("@")
        out.append((int(w), float(g) if g else default_gbps))
    return out


def _world_of(art) -> E.EmulatedWorld:
    names = {bound_backend(n) for n in art.lowered_gm.graph.nodes if comm_kind(n)}
    (name,) = names
    return E.emulated_backend(name).world


def time_units(program, split_args, outputs, timer: Timer, reps: int) -> dict[int, float]:
    """Isolated replay time (µs) of the units of layer 0 (and the prologue and final tail),
    each captured alone ``reps`` times in one graph, on the inputs of one eager run. A comm
    op whose receive is a unit of its own is timed whole, issue and receive, under its
    issue's id."""
    units, ios = program.schedule.units, program.unit_io
    made_by = {name: i for i, io in enumerate(ios) for name in io.outputs}
    receive_of = {made_by[ios[u.id].inputs[0]]: u.id for u in units if u.phase == "receive"}
    which = {u.id for u in units if u.phase != "receive"
             and (u.layer in (0, None) or u.label in ("P", "T"))}
    recorded: dict[int, tuple] = {}
    orig = program.units

    def wrap(i, u):
        def f(*a):
            if i in which and i not in recorded:
                recorded[i] = a
            return u(*a)
        return f

    program.units = [wrap(i, u) for i, u in enumerate(orig)]
    try:
        join_ubatch_outputs(program(*split_args), outputs)
    finally:
        program.units = orig
    _sync()
    out = {}
    for i, a in sorted(recorded.items()):
        u = orig[i]
        r_id = receive_of.get(i)

        def fn(u=u, a=a, r_id=r_id, i=i):
            r = None
            for _ in range(reps):
                r = u(*a)
                if r_id is not None:  # the receive, on what this issue returned
                    made = dict(zip(ios[i].outputs, r))
                    r = orig[r_id](*[made[name] for name in ios[r_id].inputs])
            return r

        try:
            g, o = harness.capture(fn, warmup=1)
            out[i] = timer(g.replay, iters=max(5, timer.iters // 2)) / reps
            del g, o
        except Exception as e:  # noqa: BLE001 - a unit that will not capture alone
            log(f"  unit {i} not timed: {type(e).__name__}: {e}"[:300])
            _sync()
    recorded.clear()
    return out


def run_world(args, preset: str, w: int, gbps: float, buckets, device, timer: Timer,
              save) -> None:
    """One (preset, W, link): one compile and one runner for every bucket; ``save(row)``
    after each bucket."""
    torch._dynamo.reset()
    dbo_backend.reset_artifacts()
    t0 = time.perf_counter()
    model = H.build_model(preset, args.layers, None, str(device), emulated_world_size=w,
                          vocab_size=args.vocab, first_k_dense_replace=args.dense_layers)
    cfg = model.config
    steps = {(p, n): H.make_bucket_step(cfg, p, n, str(device), seed=n, host_mirrors=True)
             for p, n in buckets}
    bench_cli.check_max_num_reqs(args.max_num_reqs, steps)
    blocks = max(s.num_blocks for s in steps.values())
    width = max(int(s.attn_metadata.block_table.shape[1]) for s in steps.values())
    model.allocate_kv_cache(blocks, 16)
    ref = model.emulated_reference() if args.check else None
    cmodel = torch.compile(model, backend="dbo", options=bench_cli.world_options(args, w, gbps))
    tokens = sorted({n for _, n in buckets})
    runner = CudaGraphRunner(cmodel, tokens, max_blocks_per_req=width, block_size=16,
                             vocab_size=cfg.vocab_size, timing_iters=args.timing_iters,
                             keep_candidates=True, device=device,
                             max_num_reqs=args.max_num_reqs)
    with torch.no_grad():
        runner.capture()
    capture_s = time.perf_counter() - t0
    log(f"[emulated] {preset} W={w} {gbps:g} GB/s: compiled and captured {tokens} in "
        f"{capture_s:.1f} s; {runner.describe()}")
    for phase, n in buckets:
        try:
            row = bench_bucket(args, model, ref, cmodel, runner, steps[(phase, n)], phase, n,
                               device, timer)
        except Exception as e:  # noqa: BLE001
            log(traceback.format_exc()[-3000:])
            row = {"phase": phase, "tokens_per_rank": n, "errors": [f"{type(e).__name__}: {e}"[:500]]}
        row.update(preset=preset, world_size=w, link_gbps=gbps, layers=args.layers,
                   hold_sms=getattr(args, "hold_sms", 0),
                   capture_s=round(capture_s, 1))
        save(row)
        log("[emulated] " + json.dumps({k: v for k, v in row.items() if k != "calib"}, default=str))
    del runner, cmodel, model, ref
    torch._dynamo.reset()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def bench_bucket(args, model, ref, cmodel, runner, step, phase, n, device, timer) -> dict:
    cfg = model.config
    b = runner.graphs[n]
    art = b.artifact
    row: dict = {"phase": phase, "tokens_per_rank": n, "errors": []}
    ids, pos, md, qlens = step.input_ids, step.positions, step.attn_metadata, step.num_scheduled_tokens
    if b.split_args is None:
        row["errors"].append(f"not split: {bench_cli.no_split_reason(b)}")
        if len(b.graphs) > 1:  # the unsplit graphs side by side (unsplit_overlap)
            _unsplit_rows(row, runner, b, step, ref, timer)
        return row
    world = _world_of(art)
    row.update(world=world.name, fanout=world.fanout,
               remote_ranks_per_token=round(world.remote_ranks_per_token(), 3),
               chosen=b.choice, dbo_variant=b.best_candidate, unsplit_choice=b.unsplit_choice,
               warmup_us={k: round(v, 1) for k, v in b.times_us.items()},
               schedules={k: round(p.schedule.predicted_step_us, 1) for k, p in art.candidates.items()})
    t: dict = {}
    with torch.no_grad():
        if ref is not None:  # numerics: every graph and the eager DBO step vs the reference
            want = ref(ids, pos, md).float()
            got = run_step(cmodel, ids, pos, md, qlens, block_size=16)
            row["num_eager_vs_reference"] = H.rel_err(got.float(), want)
            for name, g in b.graphs.items():
                runner.load_step(n, ids, pos, md, qlens, split=name not in H.UNSPLIT_GRAPHS)
                g.replay()
                _sync()
                row[f"num_{name}_vs_reference"] = H.rel_err(b.outs[name][0][:n].float(), want)
        runner.load_step(n, ids, pos, md, qlens, split=False)
        runner.load_step(n, ids, pos, md, qlens, split=True)
        program = art.candidates[b.best_candidate]
        serial, nocomm = H.serial_and_nocomm(
            program, split_program_fn(program, b.split_args, art, b.tokens))
        if args.eager:
            t["unsplit_eager"] = timer(lambda: art.unsplit(*b.args), iters=3)
            t["dbo_eager"] = timer(lambda: run_step(cmodel, ids, pos, md, qlens, block_size=16),
                                   iters=3)
        for name, g in b.graphs.items():
            t[f"graph:{name}"] = timer(g.replay)
        t["runner_step"] = timer(lambda: runner(ids, pos, md, qlens), iters=5)
        extra = {}
        halves = [n // 2, n - n // 2]
        comm = H.comm_only_fn(world, cfg, model.dtype, halves, device)
        comm_ops = H.comm_ops_fn(world, cfg, model.dtype, halves, device)
        for name, fn in (("split_serial", serial), ("split_nocomm", nocomm), ("comm", comm),
                         ("comm_ops", comm_ops)):
            try:
                extra[name] = harness.capture(fn, warmup=2)
            except Exception as e:  # noqa: BLE001
                row["errors"].append(f"capture {name}: {type(e).__name__}: {e}"[:400])
                log(traceback.format_exc()[-2000:])
                _sync()
        for name, (g, _) in extra.items():
            t[name] = timer(g.replay)
        if args.kernels and torch.cuda.is_available() and "split_nocomm" in extra:
            _kernel_tables(args, b, extra["split_nocomm"][0], phase, n)
        if (args.profile and torch.cuda.is_available()
                and (phase, n, world.world_size) == tuple(args.profile_at)):
            _profile(args, {"dbo_graph": b.graphs[b.best_candidate],
                            **{k: g for k, (g, _) in extra.items()}}, program, row)
        del extra
        # the routed remote rows of one step of the DBO graph vs the link's capacity
        E.reset_stats()
        for _ in range(4):
            b.graphs[b.best_candidate].replay()
        _sync()
        st = next(iter(E.stats().values()))
        layers, nub = cfg.num_moe_layers, art.config.num_ubatches
        cap = layers * sum(world.capacity(c) for c in (n // 2, n - n // 2))
        row["routed"] = {"dispatch_rows": st["dispatch_rows"] / 4,
                         "dispatch_overflow": st["dispatch_overflow"] / 4,
                         "combine_rows": st["combine_rows"] / 4,
                         "combine_overflow": st["combine_overflow"] / 4,
                         "capacity_rows": cap, "fixed_capacity_rows": layers * n * world.world_size,
                         "num_ubatches": nub}
        if args.calib:
            calib = step_features(art, b.best_candidate, n)
            for u in calib["schedule"]["units"]:  # predictions read none of them: a smaller file
                u["nodes"] = []
            calib["measured_units_us"] = {
                str(k): round(v, 2) for k, v in time_units(
                    program, b.split_args, art.signature.outputs, timer, args.unit_reps).items()}
            row["calib"] = calib
    serial_base_t, base_t, base = H.baseline(t)
    dbo_t = t[f"graph:{b.best_candidate}"]
    chosen_t = t[f"graph:{b.choice if b.use_split else b.unsplit_choice}"]
    serial_t, nocomm_t, comm_t, ops_t = (t.get(k) for k in ("split_serial", "split_nocomm",
                                                             "comm", "comm_ops"))
    hideable = max(nocomm_t, comm_t) if nocomm_t and comm_t else None
    # the comm stream's own work: the ops with their packing (which "split no comm" holds too)
    ops_bound = max(nocomm_t, ops_t) if nocomm_t and ops_t else None
    row.update({
        "t_unsplit_eager_us": t.get("unsplit_eager"), "t_baseline_us": base_t,
        "t_baseline_serial_us": serial_base_t, "baseline_graph": base,
        "t_unsplit_overlap_us": t.get(f"graph:{H.UNSPLIT_OVERLAP}"),
        "speedup_vs_serial_unsplit": serial_base_t / dbo_t,
        "t_split_serial_us": serial_t, "t_split_nocomm_us": nocomm_t, "t_comm_us": comm_t,
        "t_dbo_eager_us": t.get("dbo_eager"), "t_dbo_graph_us": dbo_t,
        "t_variants_us": H.variants(t),
        "t_runner_step_us": t["runner_step"], "t_chosen_us": chosen_t,
        "speedup": base_t / dbo_t, "chosen_vs_baseline": base_t / chosen_t,
        "bound": base_t / hideable if hideable else None,
        "eta": ((serial_t - dbo_t) / (serial_t - hideable)
                if hideable and serial_t and serial_t > hideable else None),
        "t_comm_ops_us": ops_t,
        "eta_vs_comm_ops": ((serial_t - dbo_t) / (serial_t - ops_bound)
                            if ops_bound and serial_t and serial_t > ops_bound else None),
        "timing_mode": "graph" if torch.cuda.is_available() else "eager",
        "experts_paths": experts_path_choices(),
    })
    return row


def _unsplit_rows(row: dict, runner, b, step, ref, timer) -> None:
    """A bucket that is not split: its unsplit graphs (the serial one and ``unsplit-overlap``)
    timed side by side on the step, their numerics against the reference, and the runner's
    pick (``unsplit_choice``)."""
    n = b.tokens
    ids, pos, md, qlens = step.input_ids, step.positions, step.attn_metadata, step.num_scheduled_tokens
    t: dict = {}
    with torch.no_grad():
        want = ref(ids, pos, md).float() if ref is not None else None
        runner.load_step(n, ids, pos, md, qlens, split=False)
        for name, g in b.graphs.items():
            g.replay()
            _sync()
            if want is not None:
                row[f"num_{name}_vs_reference"] = H.rel_err(b.outs[name][0][:n].float(), want)
            t[f"graph:{name}"] = timer(g.replay)
        t["runner_step"] = timer(lambda: runner(ids, pos, md, qlens), iters=5)
    serial_base_t, base_t, base = H.baseline(t)
    row.update(unsplit_choice=b.unsplit_choice, warmup_us={k: round(v, 1) for k, v in b.times_us.items()},
               t_baseline_us=base_t, t_baseline_serial_us=serial_base_t, baseline_graph=base,
               t_unsplit_overlap_us=t.get(f"graph:{H.UNSPLIT_OVERLAP}"),
               t_chosen_us=t[f"graph:{b.unsplit_choice}"], t_runner_step_us=t["runner_step"])


def _kernel_tables(args, b, nocomm_graph, phase: str, n: int) -> None:
    """Print where the split program's time goes: kernels by name in the unsplit graph, the
    split graph without comm (``split``) and the DBO graph (``dbo``, both streams)."""
    from kernel_summary import kernel_table, print_tables

    tables = {"unsplit": kernel_table(b.graphs["unsplit"], 3),
              "split": kernel_table(nocomm_graph, 3),
              "dbo": kernel_table(b.graphs[b.best_candidate], 3)}
    print_tables(tables, args.kernels, f"[kernels] {phase} {n} tok/rank, split = "
                 f"{b.best_candidate} without comm, dbo = {b.best_candidate}")
    sys.stdout.flush()


def _profile(args, graphs: dict, program, row) -> None:
    """A torch.profiler trace of one replay of each graph (``profile_NAME.json``: the DBO
    graph as ``dbo_graph``, for ``python -m dbo_compile.viz SCHEDULE.json --profile TRACE.json``,
    and the split serial / without comm / comm-only / comm-ops graphs beside it, to compare the
    link's copies alone and beside the compute) and the DBO graph's schedule."""
    from torch.profiler import ProfilerActivity, profile

    for name, graph in graphs.items():
        graph.replay()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            graph.replay()
            torch.cuda.synchronize()
        prof.export_chrome_trace(os.path.join(args.out_dir, f"profile_{name}.json"))
    with open(os.path.join(args.out_dir, "profile_schedule.json"), "w") as f:
        f.write(program.schedule.to_json())
    row["profiled"] = True


def markdown(doc: dict) -> str:
    fmt = harness.fmt
    rows = []
    for r in doc["rows"]:
        head = [r.get("preset"), r.get("world_size"), fmt(r.get("link_gbps")),
                r.get("hold_sms") or "CE", r["phase"], r["tokens_per_rank"]]
        if r.get("t_dbo_graph_us") is None:
            rows.append(head + [bench_cli.failed_cell(r)])  # one line: a traceback's too
            continue
        errs = [v["max_rel"] for k, v in r.items() if k.startswith("num_") and isinstance(v, dict)]
        rt = r.get("routed", {})
        routed = (f"{rt['dispatch_rows'] / max(rt['capacity_rows'], 1):.2f}"
                  if rt.get("capacity_rows") else "–")
        rows.append(head + [
            fmt(r["t_unsplit_eager_us"]), fmt(r["t_baseline_us"]), fmt(r["t_split_serial_us"]),
            fmt(r["t_split_nocomm_us"]), fmt(r["t_comm_us"]), fmt(r.get("t_comm_ops_us")),
            fmt(r["t_dbo_eager_us"]), f"{fmt(r['t_dbo_graph_us'])} ({r['dbo_variant']})",
            f"{'split' if r['chosen'] != 'unsplit' else 'unsplit'} {fmt(r['t_chosen_us'])}",
            f"{fmt(r['speedup'], 3)}×", f"{fmt(r['bound'], 2)}×", fmt(r["eta"], 2),
            fmt(r.get("eta_vs_comm_ops"), 2), f"{fmt(r['chosen_vs_baseline'], 3)}×", routed,
            fmt(max(errs) if errs else None, 4)])
    head = ["preset", "W", "GB/s", "SMs held", "phase", "tok/rank", "unsplit eager", "**baseline**",
            "split serial", "split no comm", "comm M", "comm ops", "DBO eager",
            "**DBO graph** (schedule)", "runtime picks", "speedup", "bound", "η", "η vs ops",
            "pick / baseline", "routed / cap rows", "max rel err"]
    lines = [f"Machine: {doc['machine']}; torch {doc['torch']}; {doc['date']}; {doc['setup']}", "",
             *harness.table(head, rows)]
    return "\n".join(lines) + "\n"


def main(args) -> int:
    """Run every world of ``--emulate-ep`` and write the JSON and the markdown table; 0, or 1
    where every row of this run failed (:func:`bench_cli.all_rows_failed`)."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dbo_backend.register()
    kernels = H.install_kernels(device.type, experts=args.experts, attention=args.attention)
    # without a GPU: a smoke run (tiny preset, eager stand-ins for the graphs)
    preset = args.preset or ("deepseek-v2-lite" if cuda else "tiny")
    buckets = [(p, int(v)) for p, v in (b.split(":") for b in (
        args.buckets or ("decode:64,decode:128,decode:256,decode:512,decode:1024,"
                         "prefill:2048,prefill:4096,prefill:8192" if cuda
                         else "decode:32,prefill:64")).split(","))]
    # SM carve-outs (the comm kernels' SMs held from compute) only where asked: the copy
    # engines of the emulated link hold none
    args.carveouts = (() if args.carveout_candidates == "default"
                      else tuple(int(v) for v in args.carveout_candidates.split(",") if v))
    args.candidate_names = H.candidate_names(args.candidates)
    args.out_dir = os.path.dirname(os.path.abspath(args.json))
    os.makedirs(args.out_dir, exist_ok=True)
    timer = Timer(args.iters, args.warmup)
    machine = harness.machine(1, device)
    setup = (f"{preset}, {args.layers} layers ({args.dense_layers} dense), vocab {args.vocab}, "
             f"bf16, emulated EP world (comm_backend=emulated), experts={kernels['experts']}, "
             f"attention={kernels['attention']}, scheduler={args.scheduler}, "
             f"compute_backend={args.compute_backend}, candidates={args.candidates}, carve-out "
             f"candidates {','.join(map(str, args.carveouts)) or 'none'} "
             f"(sm_carveout_mode={args.carveout_mode})"
             + (f", max_num_reqs={args.max_num_reqs}" if args.max_num_reqs else "")
             + (f", comm_sms={args.comm_sms}" if args.comm_sms else "")
             + (f", hold_sms={args.hold_sms} (each transfer holds that many SMs)"
                if getattr(args, "hold_sms", 0) else ", copy engines (no SM held)")
             + (f", calibration {args.calibration}" if args.calibration else "")
             + (f", experts_backend={args.experts_backend}" if args.experts_backend else "")
             + (" with FP8 e4m3 expert GEMMs (error vs the bf16 reference)" if args.fp8
                else ""))
    log(f"[emulated] {machine} torch {torch.__version__}: {setup}")
    doc = {"machine": machine, "date": datetime.datetime.now().isoformat(timespec="seconds"),
           "torch": torch.__version__, "setup": setup, "command": " ".join(sys.argv),
           "rows": []}
    if args.append and os.path.exists(args.json):
        with open(args.json) as f:
            doc["rows"] = json.load(f).get("rows", [])
    first_new = len(doc["rows"])  # this run's rows follow --append's

    def save(row=None):  # after every bucket: a run cut off by its time limit keeps its rows
        if row is not None:
            doc["rows"].append(row)
        doc["link"] = E.link_figures()
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1, default=str)

    for w, gbps in parse_worlds(args.emulate_ep, args.link_gbps):
        try:
            run_world(args, preset, w, gbps, buckets, device, timer, save)
        except Exception as e:  # noqa: BLE001
            log(traceback.format_exc()[-3000:])
            save({"preset": preset, "world_size": w, "link_gbps": gbps, "phase": "-",
                  "tokens_per_rank": 0, "errors": [f"{type(e).__name__}: {e}"[:500]]})
    save()
    md = markdown(doc)
    with open(args.md or os.path.splitext(args.json)[0] + ".md", "w") as f:
        f.write(md)
    print(md, flush=True)
    if bench_cli.all_rows_failed(doc["rows"][first_new:]):
        log(f"[emulated] every row of this run failed ({len(doc['rows']) - first_new}; their "
            "errors are in the table above and in the log): exit status 1")
        return 1
    return 0
