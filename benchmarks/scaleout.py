"""The scale-out table: predicted DBO gain for DeepSeek-V3 at EP 8/16/32/64 from the calibrated
cost model and DeepEP's published bandwidths, checked against the published anchors.

Run (CPU; the schedules are compiled on the meta device, no weights)::

    python benchmarks/scaleout.py --calibration benchmarks/calibration/h200.json \
        --md benchmarks/results/scaleout.md --json benchmarks/results/scaleout.json \
        --plot docs/scaleout.png

How a row is predicted (every assumption is named in :data:`ASSUMPTIONS` and printed):

1. The compiler's own schedules: DeepSeek-V3 layer shapes are compiled with ``backend="dbo"``
   on the meta device as rank 0 of an emulated EP-``W`` world (``comm_backend="emulated"``:
   ``E / W`` local experts over the routed rows, the shapes one rank of EP-``W`` sees), every
   schedule candidate; each unit's cost-model features are evaluated at the row's tokens per
   device (``dbo_compile/passes/calibrate.py``).
2. Compute costs: the calibrated per-class figures measured on one H200
   (``benchmarks/calibrate.py``), except attention, modelled for MLA at production contexts
   (the calibration's attention is the benchmark's short-context GQA). A calibration fitted on
   Inductor's fused runs (``"fusion": "runs"``) costs each unit's runs of element-wise nodes
   as fused kernels, as it was fitted (``dbo_compile/passes/calibrate.py``: ``fuse_runs``).
3. Comm costs: DeepEP's published per-GPU bandwidths (``docs/legacy.md`` of
   github.com/deepseek-ai/DeepEP, V1 kernels, H800 + CX7 400 Gb/s): decode with the
   low-latency kernels (pure RDMA, one message per token and expert), prefill with the normal
   kernels (NVLink within a node at EP 8; RDMA between nodes beyond, a token sent once per
   remote node). Bytes per op from the routed volume under uniform routing.
4. The unsplit step runs compute and comm in turn; the split step is the makespan of the
   candidate's schedule (normal-mode comm kernels hold SMs: compute that overlaps them runs
   slower). The steps of a 2- and a 4-MoE-layer model give the per-layer slope, extrapolated to
   V3's 58 MoE layers. Gain = unsplit / split - 1 with the best candidate (what the runner
   would pick by measuring); "runtime pick" = max(gain, 0) (the runner keeps the unsplit graph
   where splitting loses).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import sys

import torch

import harness

from dbo_compile.backend import compiled_artifacts, reset_artifacts
from dbo_compile.errors import DpVoteError
from dbo_compile.models import DeepseekMoEModel, get_config, make_step
from dbo_compile.ops.emulated import EmulatedWorld
from dbo_compile.passes.calibrate import FUSED, fused_features, simulate_overlapped, step_features
from dbo_compile.passes.cost_model import Figures
from dbo_compile.runtime.engine import run_step
from dbo_compile.schedule import COMM, Schedule

#: DeepEP V1 (docs/legacy.md of github.com/deepseek-ai/DeepEP, H800, CX7 400 Gb/s RDMA):
#: normal kernels' bottleneck bandwidth (dispatch, combine; GB/s) and the link they ride
DEEPEP_NORMAL = {8: ("NVLink", 153.0, 158.0), 16: ("RDMA", 43.0, 43.0),
                 32: ("RDMA", 58.0, 57.0), 64: ("RDMA", 51.0, 50.0)}
#: low-latency kernels (pure RDMA, 128 tokens, top-8, FP8 dispatch, BF16 combine): latency µs and
#: RDMA bandwidth GB/s of (dispatch, combine)
DEEPEP_LL = {8: ((77, 98.0), (114, 127.0)), 16: ((118, 63.0), (195, 74.0)),
             32: ((155, 48.0), (273, 53.0)), 64: ((173, 43.0), (314, 46.0))}
#: the published anchors: SGLang two-batch overlap, DeepSeek-V3 on 96 H100 (prefill on 4 nodes,
#: EP 32; decode on 9 nodes, EP 72 -> our EP 64 row); throughput gain
ANCHORS = [("prefill", 32, 4096, (0.27, 0.35)), ("prefill", 32, 16384, (0.27, 0.35)),
           ("decode", 64, 32, (-0.27, -0.27)), ("decode", 64, 256, (0.255, 0.255))]

ASSUMPTIONS = {
    "hardware": "compute figures calibrated on one H200 (bf16 GEMMs, the benchmark's kernels: "
                "torch grouped GEMM, {stages}){fp8}; the anchors ran on H100 (≈30 % less "
                "HBM bandwidth) with FP8 GEMMs",
    "model": "DeepSeek-V3 shapes: hidden 7168, 256 routed experts top-8 (uniform routing), "
             "1 shared expert, moe_intermediate 2048, vocab 129280; MLA replaced by GQA with 8 KV "
             "heads for the projections (249 M vs MLA's ~187 M parameters per layer); 58 MoE "
             "layers by extrapolating 2- and 4-layer schedules; the 3 dense layers are left out "
             "(≈5 % of the step, on both sides)",
    "attention": "decode: MLA latent cache (576 bf16 values per token) read at {ctx} cached "
                 "tokens per request at {attn_gbps:g} GB/s; prefill: prompts of {prompt} tokens, "
                 "causal, 2*128*(192+128)*2 FLOP per query-key pair at {attn_tflops:g} TFLOP/s",
    "comm_decode": "DeepEP low-latency kernels: one message per (token, expert), FP8 dispatch "
                   "(7168 + 56 scale bytes), BF16 combine, at the published RDMA bandwidth of "
                   "the EP size, plus {ll_lat:g} µs per op; they hold no SM while the other "
                   "ubatch computes (receive hooks)",
    "comm_prefill": "DeepEP normal kernels: FP8 dispatch / BF16 combine of each token once per "
                    "remote rank (EP 8, NVLink) or once per remote node (EP >= 16, RDMA, 8 GPUs "
                    "a node; NVLink forwarding hidden), at the published bottleneck bandwidth, "
                    "plus {hn_lat:g} µs per op; they hold {sms} of 132 SMs while in flight "
                    "(compute overlapping them runs 132/{free} slower)",
    "schedule": "the compiler's schedule candidates, the best one per row (the runner measures "
                "and keeps it); compute and comm units slowed where they overlap by the factors "
                "measured on the emulated world ({slow}); DP balance, stragglers and routing "
                "skew are not modelled",
    "torch_backend": "what the torch backend would cost instead: its fixed capacity (W*T bf16 "
                     "rows per op, every rank whatever the routing) at the same bandwidth, "
                     "25 µs per op, its best DBO step",
}


def meta_artifact(world: int, layers: int, cfg_over: dict):
    """Compile V3-shaped layers on the meta device (no weights) as rank 0 of EP-``world``."""
    torch._dynamo.reset()
    reset_artifacts()
    cfg = get_config("deepseek-v3", num_layers=layers, first_k_dense_replace=0, **cfg_over)
    model = DeepseekMoEModel(cfg, device="meta", dtype=torch.bfloat16, emulated_world_size=world)
    step = make_step(cfg, decode_context_lens=[100] * 16, prefills=[], block_size=16)
    model.allocate_kv_cache(step.num_blocks, 16, device="meta")
    md = dataclasses.replace(step.attn_metadata, **{k: v.to("meta") for k, v in
                                                    step.attn_metadata.tensors().items()})
    cm = torch.compile(model, backend="dbo", options={
        "split": "always", "comm_backend": "emulated",
        "comm_backend_options": {"world_size": world}, "compute_backend": "aten",
        "sm_carveout_candidates": ()})
    with torch.no_grad():
        try:  # compiles; the step itself cannot run on meta tensors (no data to vote on:
            run_step(cm, step.input_ids.to("meta"), step.positions.to("meta"), md,
                     step.num_scheduled_tokens)
        except NotImplementedError:
            pass
        except DpVoteError as e:  # the vote raises the metadata check's error on every rank)
            if "meta tensor" not in str(e):
                raise
    return compiled_artifacts()[-1], cfg


def _comb_ratio(e: int, group: int, k: int) -> float:
    return math.comb(e - group, k) / math.comb(e, k) if e - group >= k else 0.0


def comm_us(args, cfg, world: int, phase: str, kind: str, tokens: int, torch_backend=False) -> float:
    """µs of one dispatch / combine of ``tokens`` tokens (see :data:`ASSUMPTIONS`)."""
    h, k, e = cfg.hidden_size, cfg.top_k, cfg.num_experts
    fp8 = h + h // 128 * 4 + 16  # FP8 values, one fp32 scale per 128, top-k ids/weights
    row = fp8 if kind == "dispatch" else 2 * h
    if torch_backend:
        gbps = (DEEPEP_LL[world][0 if kind == "dispatch" else 1][1] if phase == "decode"
                else DEEPEP_NORMAL[world][1 if kind == "dispatch" else 2])
        return args.hn_lat + world * tokens * (2 * h + 16) / (gbps * 1e3)
    if phase == "decode":
        _, gbps = DEEPEP_LL[world][0 if kind == "dispatch" else 1]
        return args.ll_lat + tokens * k * row / (gbps * 1e3)
    link, gd, gc = DEEPEP_NORMAL[world]
    gbps = gd if kind == "dispatch" else gc
    if link == "NVLink":
        dests = (world - 1) * (1 - _comb_ratio(e, e // world, k))
    else:
        nodes = world // 8
        dests = (nodes - 1) * (1 - _comb_ratio(e, e // nodes, k))
    return args.hn_lat + tokens * dests * row / (gbps * 1e3)


def attention_us(args, figs, phase: str, rows: float) -> float:
    base = figs["attention"].launch_us
    if phase == "decode":
        return base + rows * args.ctx * 576 * 2 / (args.attn_gbps * 1e3)
    prompt = min(args.prompt, max(rows, 1.0) * 2)
    return base + rows * prompt / 2 * 2 * 128 * (192 + 128) * 2 / (args.attn_tflops * 1e6)


def unit_cost(args, figs, cfg, world, phase, feats, tokens_u, torch_backend=False) -> float:
    """µs of the compute nodes ``feats`` (one unit's, or the unsplit program's), their runs of
    element-wise nodes fused where the calibration was fitted so (``args.fusion``)."""
    t = 0.0
    for cls, f, b, r in fused_features(feats, args.fusion):
        if cls == "comm":
            continue
        t += attention_us(args, figs, phase, r) if cls == "attention" else figs[cls].cost_us(f, b, r)
    return t


def predict(args, figs, art, cfg, world: int, phase: str, tokens: int, torch_backend=False):
    """(unsplit µs, {candidate: split µs}) at ``tokens`` per device."""
    nub = art.config.num_ubatches
    tu = tokens / nub
    out = {}
    unsplit = None
    for cand in art.candidates:
        st = step_features(art, cand, tokens)
        if unsplit is None:
            comp = unit_cost(args, figs, cfg, world, phase, [tuple(f) for f in st["unsplit"]], tokens)
            ncomm = sum(1 for f in st["unsplit"] if f[0] == "comm") // 2
            unsplit = comp + ncomm * sum(comm_us(args, cfg, world, phase, kd, tokens, torch_backend)
                                         for kd in ("dispatch", "combine"))
        sched = Schedule.from_dict(st["schedule"])
        for u in sched.units:
            feats = [tuple(f) for f in st["features"][str(u.id)]]
            if u.phase == "receive":  # the emulated schedule's receive: nothing of DeepEP's
                u.cost_us = 0.0
            elif u.stream == COMM:
                us = comm_us(args, cfg, world, phase, "dispatch" if u.label == "D" else "combine",
                             tu, torch_backend)
                if u.latency_us > 0:  # a send: the transfer holds the link, not the stream
                    u.cost_us, u.latency_us = 0.0, us
                else:
                    u.cost_us = us
            else:
                u.cost_us = unit_cost(args, figs, cfg, world, phase, feats, tu)
        k_compute, k_comm = args.slowdown
        if phase == "prefill":  # normal kernels hold SMs: at least their share
            k_compute = max(k_compute, 132 / (132 - args.sms))
        out[cand] = simulate_overlapped(sched, (k_compute, k_comm))
    return unsplit, out


def load_figures(path: str | None) -> tuple[dict, str, tuple[float, float], str | None]:
    """The compute figures, their source, the measured slowdown of compute / comm units where
    they overlap, and the calibration's fusion (``benchmarks/calibrate.py``)."""
    if path is None:  # the uncalibrated roofline (DboConfig's defaults)
        d = {c: Figures(790.0, 4300.0, 4.0) for c in ("gemm", "experts", "other")}
        d["attention"] = Figures(None, 4300.0, 4.0)
        return d, "uncalibrated roofline (DboConfig defaults)", (1.0, 1.0), None
    with open(path) as f:
        cal = json.load(f)
    slow = cal.get("overlap_slowdown") or {}
    return ({c: Figures(**v) for c, v in cal["figures"].items()
             if c in ("gemm", "experts", "attention", "other", FUSED)},
            f"{path} ({cal.get('machine')}, measured {', '.join(cal.get('measured', []))})",
            (slow.get("compute", 1.0), slow.get("comm", 1.0)), cal.get("fusion"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calibration", default=None)
    p.add_argument("--worlds", default="8,16,32,64")
    p.add_argument("--decode", default="32,64,128,256")
    p.add_argument("--prefill", default="4096,8192,16384")
    p.add_argument("--ctx", type=int, default=2000, help="decode: cached tokens per request")
    p.add_argument("--prompt", type=int, default=4096, help="prefill: prompt length")
    p.add_argument("--attn-gbps", type=float, default=3400.0)
    p.add_argument("--attn-tflops", type=float, default=400.0)
    p.add_argument("--ll-lat", type=float, default=15.0)
    p.add_argument("--hn-lat", type=float, default=25.0)
    p.add_argument("--sms", type=int, default=20)
    p.add_argument("--fp8", action="store_true",
                   help="GEMMs and expert GEMMs in FP8 (as DeepSeek-V3 is served): their "
                        "calibrated bf16 TFLOP/s times --fp8-speedup, their bytes halved")
    p.add_argument("--fp8-speedup", type=float, default=1.7)
    p.add_argument("--hbm-scale", type=float, default=1.0,
                   help="scale the calibrated memory bandwidths (0.70: an H100's 3.35 TB/s "
                        "against the H200's 4.8)")
    p.add_argument("--md", default=None)
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None)
    args = p.parse_args(argv)
    logging.getLogger("dbo_compile").setLevel(logging.ERROR)
    figs, source, args.slowdown, args.fusion = load_figures(args.calibration)
    if args.hbm_scale != 1.0:  # another GPU's memory: every bandwidth-bound term
        figs = {c: dataclasses.replace(f, gbps=f.gbps * args.hbm_scale if f.gbps else None)
                for c, f in figs.items()}
        args.attn_gbps *= args.hbm_scale
    if args.fp8:  # FP8 GEMMs and weights: faster math, half the weight bytes
        for c in ("gemm", "experts"):
            f = figs[c]
            figs[c] = dataclasses.replace(f, tflops=f.tflops * args.fp8_speedup if f.tflops else None,
                                          gbps=f.gbps * 2 if f.gbps else None)
    assumptions = {k: v.format(ctx=args.ctx, attn_gbps=args.attn_gbps, prompt=args.prompt,
                               attn_tflops=args.attn_tflops, ll_lat=args.ll_lat,
                               hn_lat=args.hn_lat, sms=args.sms, free=132 - args.sms,
                               slow="compute ×{:.2f}, comm ×{:.2f}".format(*args.slowdown),
                               stages=("Inductor stages, element-wise runs fused"
                                       if args.fusion == "runs" else "ATen stages"),
                               fp8=(f"; here FP8 GEMMs: bf16 TFLOP/s × {args.fp8_speedup:g}, "
                                    "weight bytes halved" if args.fp8 else "")
                               + (f"; memory bandwidths × {args.hbm_scale:g}"
                                  if args.hbm_scale != 1.0 else ""))
                   for k, v in ASSUMPTIONS.items()}
    rows = []
    target_layers = 58
    for w in (int(v) for v in args.worlds.split(",")):
        arts = {layers: meta_artifact(w, layers, {"num_kv_heads": 8}) for layers in (2, 4)}
        cfg = arts[2][1]
        world = EmulatedWorld(w, cfg.num_experts, cfg.top_k)
        for phase, toks in (("decode", args.decode), ("prefill", args.prefill)):
            for tokens in (int(v) for v in toks.split(",")):
                per = {}
                for layers, (art, _) in arts.items():
                    per[layers] = (predict(args, figs, art, cfg, w, phase, tokens),
                                   predict(args, figs, art, cfg, w, phase, tokens, True))
                (u2, s2), (tu2, ts2) = per[2]
                (u4, s4), (tu4, ts4) = per[4]

                def at(a2, a4):  # linear in the layer count, to V3's 58 MoE layers
                    return a2 + (a4 - a2) / 2 * (target_layers - 2)

                unsplit = at(u2, u4)
                split = {c: at(s2[c], s4[c]) for c in s2 if c in s4}
                best = min(split, key=lambda c: (split[c], c))
                tsplit = min(at(ts2[c], ts4[c]) for c in ts2 if c in ts4)
                tunsplit = at(tu2, tu4)
                comm1 = sum(comm_us(args, cfg, w, phase, kd, tokens) for kd in ("dispatch", "combine"))
                m_over_c = (comm1 * target_layers) / max(unsplit - comm1 * target_layers, 1.0)
                gain = unsplit / split[best] - 1
                rows.append({
                    "world_size": w, "phase": phase, "tokens_per_device": tokens,
                    "kernel": "low-latency" if phase == "decode" else "normal",
                    "link": "RDMA" if phase == "decode" else DEEPEP_NORMAL[w][0],
                    "unsplit_ms": unsplit / 1e3, "dbo_ms": split[best] / 1e3, "candidate": best,
                    "gain": gain, "runtime_pick_gain": max(0.0, gain), "m_over_c": m_over_c,
                    "remote_ranks_per_token": world.remote_ranks_per_token(),
                    "torch_backend_gain": tunsplit / tsplit - 1,
                    "torch_backend_dbo_ms": tsplit / 1e3,
                    "torch_backend_comm_factor": world.world_size / max(
                        world.remote_ranks_per_token(), 1e-9)})
                print(json.dumps(rows[-1]), flush=True)
    checks = []
    for phase, w, tokens, (lo, hi) in ANCHORS:
        r = next((r for r in rows if (r["phase"], r["world_size"], r["tokens_per_device"])
                  == (phase, w, tokens)), None)
        if r is None:
            continue
        # the gain's distance from the anchor's range, relative to the anchor's gain
        off = max(lo - r["gain"], r["gain"] - hi, 0.0)
        rel = off / abs((lo + hi) / 2)
        checks.append({"phase": phase, "world_size": w, "tokens_per_device": tokens,
                       "anchor": [lo, hi], "predicted": r["gain"], "off_pp": 100 * off,
                       "relative_deviation": rel, "beyond_20pct": rel > 0.20})
    doc = {"source": source, "assumptions": assumptions, "rows": rows, "anchors": checks,
           "deepep": {"normal": DEEPEP_NORMAL, "low_latency": DEEPEP_LL,
                      "source": "github.com/deepseek-ai/DeepEP docs/legacy.md (V1 kernels, "
                                "H800, CX7 400 Gb/s), read 2026-12-01 at dd758ca"}}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    md = markdown(doc)
    if args.md:
        with open(args.md, "w") as f:
            f.write(md)
    print(md)
    if args.plot:
        plot(doc, args.plot)
    return 0


def markdown(doc: dict) -> str:
    rows = [[r["world_size"], r["phase"], r["tokens_per_device"], f"{r['kernel']} ({r['link']})",
             f"{r['unsplit_ms']:.2f}", f"{r['dbo_ms']:.2f} ({r['candidate']})",
             f"{r['m_over_c']:.2f}", f"**{r['gain']:+.1%}**", f"{r['runtime_pick_gain']:+.1%}",
             f"{r['torch_backend_dbo_ms']:.1f} ({r['torch_backend_dbo_ms'] / r['dbo_ms']:.2f}×)"]
            for r in doc["rows"]]
    anchors = []
    for c in doc["anchors"]:
        lo, hi = c["anchor"]
        a = f"{lo:+.1%}" if lo == hi else f"{lo:+.0%} … {hi:+.0%}"
        anchors.append([c["phase"], c["world_size"], c["tokens_per_device"], a,
                        f"{c['predicted']:+.1%}", f"{c['off_pp']:.1f} pp",
                        f"{c['relative_deviation']:.0%}", "yes" if c["beyond_20pct"] else "no"])
    lines = [f"Compute figures: {doc['source']}.", "", *harness.table(
        ["EP", "phase", "tok/device", "DeepEP kernel (link)", "unsplit ms", "DBO ms (schedule)",
         "M/C", "**DBO gain**", "runtime pick", "torch backend: DBO ms (× DeepEP's)"], rows)]
    lines += ["", "Anchors (SGLang two-batch overlap, DeepSeek-V3, 96 H100):", "", *harness.table(
        ["phase", "EP", "tok/device", "anchor", "predicted", "outside the anchor by",
         "relative to the anchor's gain", "> 20 %"], anchors)]
    lines += ["", "Assumptions:", ""] + [f"- **{k}**: {v}" for k, v in doc["assumptions"].items()]
    return "\n".join(lines) + "\n"


def plot(doc: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax, phase in zip(axes, ("decode", "prefill")):
        for w in sorted({r["world_size"] for r in doc["rows"]}):
            pts = sorted((r["tokens_per_device"], 100 * r["gain"]) for r in doc["rows"]
                         if r["phase"] == phase and r["world_size"] == w)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"EP {w}")
        for c in doc["anchors"]:
            if c["phase"] == phase:
                lo, hi = (100 * v for v in c["anchor"])
                first = c is next(a for a in doc["anchors"] if a["phase"] == phase)
                ax.errorbar([c["tokens_per_device"]], [(lo + hi) / 2], yerr=[[(hi - lo) / 2],
                            [(hi - lo) / 2]], fmt="k*", ms=11, capsize=4,
                            label="SGLang TBO, 96 H100" if first else None)
                ax.annotate("EP 32" if phase == "prefill" else "EP 72", (c["tokens_per_device"],
                            (lo + hi) / 2), textcoords="offset points", xytext=(8, -12), fontsize=7)
        ax.axhline(0, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens per device")
        ax.set_ylabel("predicted DBO gain (%)")
        ax.set_title(f"DeepSeek-V3 {phase} (DeepEP {'low-latency' if phase == 'decode' else 'normal'})")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
