"""Comm and experts backends side by side on one GPU (1 EP rank), in one run.

DeepSeek-V2-Lite shapes (``--layers`` MoE layers, vocab 4096, bf16), decode 64..1024 and
prefill 2048..8192 tokens per step. Per bucket and per backend pair:

- ``torch``: the ops' own backends (one EP rank: the local dispatch, a copy; torch's grouped
  GEMM + Triton for the experts);
- ``deep_ep_ll+deep_gemm``: DeepEP low-latency (send at issue, receive hook as its own unit)
  + DeepGEMM's masked grouped GEMM on DeepEP's receive buffer; ``max_tokens`` = the largest
  bucket of the phase (decode 1024, prefill 8192: DeepEP's static per-expert capacity, one
  buffer per process, rebuilt between the phases);

the unsplit program and the DBO split program (the primary list schedule), each captured as a
CUDA graph and timed (median of ``--iters`` replays, CUDA events), with their error against
the eager model on torch. Then the expert op alone on the same routing (6 of 64 experts):
torch grouped GEMM on the rank-major rows, DeepGEMM contiguous on the same rows, DeepGEMM
masked (bf16 and FP8, with FP8's error against bf16) on the LL receive. And the Hugging Face
expert path: a Qwen3-MoE-shaped layer (hidden 2048, 128 experts of 768, top-8), 1024 tokens:
the old dense masked loop (every local expert on every row) against ``dbo.grouped_experts``.

Compile options: ``split="always"``, one schedule (``schedule_candidates=False``), ATen stages
(``compute_backend="aten"``: seconds instead of minutes of Inductor), no carve-out. One EP rank
means the "all-to-all" moves nothing between GPUs: the figures show each backend's own cost
and the DBO schedule's, not overlap of a real link (that needs 2 GPUs).

Run::

    python benchmarks/bench_backends.py --out benchmarks/results/backends_h200.json

JSON is written after every bucket (a run stopped by ``--budget-s`` keeps what it measured).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness  # noqa: E402

from dbo_compile import backend as dbo_backend  # noqa: E402
from dbo_compile.runtime.engine import run_step  # noqa: E402
from dbo_compile.testing import moe as H  # noqa: E402
from dbo_compile.testing import measure as cg  # noqa: E402

BUCKETS = {"decode": [64, 128, 256, 512, 1024], "prefill": [2048, 4096, 8192]}
BASE = {"split": "always", "schedule_candidates": False, "compute_backend": "aten",
        "sm_carveout_candidates": ()}


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--phases", default="decode,prefill")
    p.add_argument("--buckets", default=None, help="phase:tokens,... (default: all)")
    p.add_argument("--budget-s", type=float, default=1e9,
                   help="start no new bucket after this many seconds")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def _versions() -> dict:
    out = {}
    for name in ("deep_ep", "deep_gemm"):
        try:
            mod = __import__(name)
            out[name] = getattr(mod, "__version__", "imported")
        except Exception as e:  # noqa: BLE001
            out[name] = f"not importable: {type(e).__name__}"
    return out


def _buckets(args) -> dict[str, list[int]]:
    if args.buckets:
        out: dict[str, list[int]] = {}
        for item in args.buckets.split(","):
            phase, tokens = item.split(":")
            out.setdefault(phase, []).append(int(tokens))
        return out
    return {p: BUCKETS[p] for p in args.phases.split(",")}


def _steps(cfg, buckets):
    steps = {}
    for phase, sizes in buckets.items():
        for t in sizes:
            steps[(phase, t)] = H.make_bucket_step(cfg, phase, t, "cuda", seed=1, prompt=512)
    return steps


def _model_rows(model, args, buckets, results, t_start, write):
    """Unsplit and DBO graphs of the model, per phase, bucket and backend pair."""
    from dbo_compile.ops import deep_ep as deep_ep_adapter

    cfg = model.config
    steps = _steps(cfg, buckets)
    model.allocate_kv_cache(max(s.num_blocks for s in steps.values()), 16)
    g = torch.Generator(device="cuda").manual_seed(7)
    for c in model.kv_caches():
        c.normal_(generator=g)
    kv0 = [c.clone() for c in model.kv_caches()]

    def restore():
        for c, c0 in zip(model.kv_caches(), kv0):
            c.copy_(c0)

    for phase, sizes in buckets.items():
        cap = max(sizes)
        pairs = {"torch": {}, "deep_ep_ll+deep_gemm": {
            "comm_backend": "deep_ep", "experts_backend": "deep_gemm",
            "comm_backend_options": {"mode": "low_latency", "max_tokens": cap}}}
        for pair, opts in pairs.items():
            torch._dynamo.reset()
            dbo_backend.reset_artifacts()
            cm = torch.compile(model, backend="dbo", options={**BASE, **opts})
            for t in sizes:
                key = f"{phase}/{t}/{pair}"
                if time.perf_counter() - t_start > args.budget_s:
                    results["rows"][key] = {"skipped": "time budget"}
                    continue
                step = steps[(phase, t)]
                ids, pos, md = step.input_ids, step.positions, step.attn_metadata
                qlens = step.num_scheduled_tokens
                row: dict = {"phase": phase, "tokens": t, "backends": pair}
                try:
                    t0 = time.perf_counter()
                    with torch.no_grad():
                        restore()
                        ref = model(ids, pos, md).clone()
                        restore()
                        run_step(cm, ids, pos, md, qlens)
                        art = dbo_backend.compiled_artifacts()[-1]
                        row["compile_and_first_step_s"] = round(time.perf_counter() - t0, 2)
                        sstep = cg.SplitStep(art, lambda: run_step(cm, ids, pos, md, qlens))
                        args_u = sstep.graph_args
                        row.update(predicted_dbo_us=art.schedule.predicted_step_us,
                                   comm_backends=art.schedule.comm_backends)
                        restore()
                        t_u, out_u = H.time_graph(lambda: art.unsplit(*args_u), args.iters)
                        u = out_u[0] if isinstance(out_u, (tuple, list)) else out_u
                        row.update(unsplit_graph_us=round(t_u, 1), err_unsplit=H.rel_err(u, ref))
                        del out_u, u
                        restore()
                        t_s, out_s = H.time_graph(sstep, args.iters)
                        row.update(dbo_graph_us=round(t_s, 1), speedup=round(t_u / t_s, 3),
                                   err_dbo=H.rel_err(out_s[0], ref))
                        del sstep, out_s
                except Exception as e:  # noqa: BLE001 - record and go on
                    row["error"] = f"{type(e).__name__}: {e}"[:800]
                    row["traceback"] = traceback.format_exc()[-1500:]
                results["rows"][key] = row
                print(json.dumps({key: {k: v for k, v in row.items() if k != "traceback"}}),
                      flush=True)
                write()
            torch.cuda.empty_cache()
        deep_ep_adapter.release_buffers()  # the next phase's capacity needs a new buffer
        _expert_rows(model, sizes, cap, results, args, write, t_start, extra=phase == "decode")


def _expert_rows(model, sizes, cap, results, args, write, t_start, extra=True):
    """The expert op alone on the same routing, per backend and layout (``extra``: also FP8
    and torch's grouped GEMM on the expert-major rows, the fallback when DeepGEMM is missing;
    in decode only, to keep the JIT compiles and the run short)."""
    moe = model.layers[0].mlp
    w13, w2 = moe.w13, moe.w2
    e, h = w13.shape[0], w13.shape[2]
    ll = f"deep_ep:max_tokens={cap},mode=low_latency"
    g = torch.Generator(device="cuda").manual_seed(3)
    for t in sizes:
        key = f"experts/{t}"
        row: dict = {"tokens": t}
        if time.perf_counter() - t_start > args.budget_s:
            results["rows"][key + f"/cap{cap}"] = {"skipped": "time budget"}
            continue
        try:
            with torch.no_grad():
                x = torch.randn(t, h, device="cuda", generator=g).bfloat16()
                probs = torch.softmax(torch.randn(t, e, device="cuda", generator=g), -1)
                wts, ids = torch.topk(probs, model.config.top_k, dim=-1)
                rx, rid, rw, _ = torch.ops.dbo.moe_dispatch(x, ids, wts, e, "")
                lx, cnt, lay, _ = torch.ops.dbo.moe_dispatch(x, ids, wts, e, "", ll)
                calls = {
                    "torch_grouped_rank_major": lambda: torch.ops.dbo.grouped_experts(
                        rx, rid, rw, w13, w2),
                    "deep_gemm_contiguous_rank_major": lambda: torch.ops.dbo.grouped_experts(
                        rx, rid, rw, w13, w2, "deep_gemm"),
                    "torch_grouped_expert_major": lambda: torch.ops.dbo.grouped_experts(
                        lx, cnt, lay, w13, w2),
                    "deep_gemm_masked_expert_major": lambda: torch.ops.dbo.grouped_experts(
                        lx, cnt, lay, w13, w2, "deep_gemm"),
                    "deep_gemm_masked_fp8_expert_major": lambda: torch.ops.dbo.grouped_experts(
                        lx, cnt, lay, w13, w2, "deep_gemm:fp8=true"),
                }
                if not extra:
                    del calls["torch_grouped_expert_major"], calls["deep_gemm_masked_fp8_expert_major"]
                outs = {}
                for name, fn in calls.items():
                    fn()  # JIT / FP8 weight cast outside the timing
                    row[name + "_us"], outs[name] = H.time_graph(fn, args.iters)
                    row[name + "_us"] = round(row[name + "_us"], 1)
                valid = [(i, int(cnt[i])) for i in range(e)]
                pick = lambda y: torch.cat([y[i, :n] for i, n in valid]).float()  # noqa: E731
                bf = pick(outs["deep_gemm_masked_expert_major"])
                tg = outs["torch_grouped_rank_major"].float()
                row["contiguous_rel_err_vs_torch"] = float(
                    (outs["deep_gemm_contiguous_rank_major"].float() - tg).norm() / tg.norm())
                if extra:
                    row["fp8_rel_err_vs_bf16"] = float(
                        (pick(outs["deep_gemm_masked_fp8_expert_major"]) - bf).norm() / bf.norm())
                    row["masked_rel_err_vs_torch"] = float(
                        (bf - pick(outs["torch_grouped_expert_major"])).norm() / bf.norm())
                row["speedup_masked_vs_torch_rank_major"] = round(
                    row["torch_grouped_rank_major_us"] / row["deep_gemm_masked_expert_major_us"], 3)
        except Exception as ex:  # noqa: BLE001
            row["error"] = f"{type(ex).__name__}: {ex}"[:800]
            row["traceback"] = traceback.format_exc()[-1500:]
        results["rows"][key + f"/cap{cap}"] = row
        print(json.dumps({key: {k: v for k, v in row.items() if k != "traceback"}}), flush=True)
        write()
    from dbo_compile.ops import deep_ep as deep_ep_adapter

    deep_ep_adapter.release_buffers()


def _hf_row(args, results, write):
    """A Qwen3-MoE-shaped layer (Qwen3-30B-A3B: hidden 2048, 128 experts of 768, top-8), 1024
    tokens, 1 EP rank: the dense masked loop vs dbo.grouped_experts on the received rows."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from dbo_compile.models.hf import EPMoEBlock, make_expert_parallel

    cfg = Qwen3MoeConfig(vocab_size=128, hidden_size=2048, num_hidden_layers=1,
                         num_attention_heads=16, num_key_value_heads=4, head_dim=128,
                         intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                         num_experts_per_tok=8, norm_topk_prob=True, tie_word_embeddings=False)
    with torch.device("cuda"):
        model = Qwen3MoeForCausalLM(cfg).to(dtype=torch.bfloat16).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, p.shape[-1] ** -0.5 if p.dim() > 1 else 0.1)
    make_expert_parallel(model, None)
    block = next(m for m in model.modules() if isinstance(m, EPMoEBlock))
    g = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(1024, 2048, device="cuda", generator=g).bfloat16()
    row: dict = {"layer": "Qwen3-MoE (hidden 2048, 128 x 768 experts, top-8)", "tokens": 1024}
    with torch.no_grad():
        _, w, ids = block.gate(x)
        rx, rid, rw, _ = torch.ops.dbo.moe_dispatch(x, ids.long(), w.float(), 128, "")
        t_dense, dense = H.time_graph(lambda: block._dense_experts(rx, rid, rw), args.iters)
        t_grouped, grouped = H.time_graph(lambda: block._local_experts(rx, rid, rw), args.iters)
    row.update(dense_masked_us=round(t_dense, 1), grouped_us=round(t_grouped, 1),
               speedup=round(t_dense / t_grouped, 2),
               rel_err=float((grouped.float() - dense.float()).norm() / dense.float().norm()))
    results["rows"]["hf/qwen3_moe/1024"] = row
    print(json.dumps({"hf": row}), flush=True)
    write()


def main(argv=None) -> int:
    args = parse(argv)
    t_start = time.perf_counter()
    results = {"machine": {"gpu": harness.machine(), "host": platform.node(),
                           "torch": torch.__version__, "cuda": torch.version.cuda,
                           **_versions()},
               "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "command": " ".join([sys.executable] + sys.argv),
               "options": {**BASE, "layers": args.layers, "iters": args.iters,
                           "preset": "deepseek-v2-lite", "vocab": 4096, "ep_ranks": 1},
               "rows": {}}

    def write():
        if args.out:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)

    print(json.dumps(results["machine"]), flush=True)
    H.install_kernels("cuda", experts="grouped", attention="fused")
    dbo_backend.register()
    if not args.skip_hf:
        try:
            _hf_row(args, results, write)
        except Exception as e:  # noqa: BLE001
            results["rows"]["hf/qwen3_moe/1024"] = {"error": f"{type(e).__name__}: {e}"[:800]}
            write()
        torch.cuda.empty_cache()
    model = H.build_model("deepseek-v2-lite", args.layers, None, "cuda", vocab_size=4096,
                          first_k_dense_replace=0)
    _model_rows(model, args, _buckets(args), results, t_start, write)
    results["wall_s"] = round(time.perf_counter() - t_start, 1)
    write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
