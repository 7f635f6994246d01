"""Time ``dbo.attention``'s fused Triton kernel against the reference, side by side, one GPU.

Run::

    python benchmarks/bench_attention.py --out benchmarks/results/attention.json
    python benchmarks/bench_attention.py --sweep --out /tmp/attention_sweep.json  # + tile shapes

Cases (DeepSeek-V2-Lite attention: Hq = Hkv = 16, D = 128, bf16, block_size 16; ``--hkv`` for
GQA): ``decode`` = 1024 requests of 1 token after a context drawn uniformly from [128, 2048]
(seeded), ``prefill`` = 2048 tokens as 4 fresh prompts of 512. Block tables are shuffled (real
indirection). The cache already holds the step's K/V: what is timed is the attention alone
(``paged_attention_triton`` vs ``paged_attention``), the part that differs; the KV write
(``write_kv``, shared by both) is timed on its own.

Per case, median of ``--iters`` CUDA-event-timed calls (the reference: ``--ref-iters``), in µs:
each implementation called eagerly and replayed from a CUDA graph; ratio = reference / fused
(graph replays); for the fused kernel the K/V bytes it reads per µs (GB/s) and its causal
attention FLOP rate (TFLOP/s); the max abs difference between the two outputs. ``--sweep``
also times the fused kernel (graph replay) for several tile shapes (rows = tokens x padded
query heads per program, context positions per iteration, warps, pipeline stages).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
import traceback

import torch

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)

import harness  # noqa: E402

from dbo_compile.models.batch import make_step  # noqa: E402
from dbo_compile.ops import attention as A  # noqa: E402

#: (rows per program, context positions per iteration, warps, stages) timed by --sweep
SWEEP = [(16, 16, 4, 2), (16, 32, 4, 2), (16, 64, 4, 2), (16, 64, 4, 3), (16, 128, 4, 2),
         (32, 64, 4, 2), (64, 32, 4, 2), (64, 64, 4, 2), (64, 64, 4, 3), (64, 64, 8, 2),
         (64, 128, 8, 2), (128, 32, 8, 2), (128, 64, 8, 2), (128, 64, 8, 3)]

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default="decode,prefill", help="comma-separated: decode, prefill")
    p.add_argument("--decode-reqs", type=int, default=1024)
    p.add_argument("--decode-ctx", default="128,2048", help="min,max context of a decode request")
    p.add_argument("--prefill-tokens", type=int, default=2048)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--hq", type=int, default=16)
    p.add_argument("--hkv", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default="bf16", choices=sorted(_DTYPES))
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--ref-iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--sweep", action="store_true", help="also time the tile shapes of SWEEP")
    p.add_argument("--pad-requests", type=int, default=0,
                   help="pad each case's request dim to this many requests with zero-length "
                        "ones, as the CUDA-graph runner pads a step to its bucket's request "
                        "capacity (bucket / num_ubatches per ubatch); 0: none")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.path.join(_ROOT, "benchmarks", "results", "local",
                                                 "attention.json"),
                   help="JSON output path")
    return p.parse_args(argv)


class _Cfg:
    vocab_size = 10


def build_case(args, phase: str, device: str = "cuda") -> dict:
    """A step's attention inputs on ``device``; the cache holds the step's K/V."""
    dev, dtype = torch.device(device), _DTYPES[args.dtype]
    if phase == "decode":
        lo, hi = (int(x) for x in args.decode_ctx.split(","))
        g = torch.Generator().manual_seed(args.seed)
        ctx = torch.randint(lo, hi + 1, (args.decode_reqs,), generator=g).tolist()
        step = make_step(_Cfg, decode_context_lens=ctx, prefills=[], block_size=args.block_size,
                         seed=args.seed)
    elif phase == "prefill":
        prompts, left = [], args.prefill_tokens
        while left > 0:
            prompts.append((0, min(args.prompt, left)))
            left -= prompts[-1][1]
        step = make_step(_Cfg, decode_context_lens=[], prefills=prompts,
                         block_size=args.block_size, seed=args.seed)
    else:
        raise SystemExit(f"unknown case {phase!r}: choose decode or prefill")
    md = step.attn_metadata.to(dev)
    reqs = len(step.num_scheduled_tokens)
    if args.pad_requests > reqs:  # zero-length requests: qsl repeats its end, seq_lens 0
        extra = args.pad_requests - reqs
        md = dataclasses.replace(
            md, query_start_loc=torch.cat([md.query_start_loc,
                                           md.query_start_loc[-1:].expand(extra)]),
            seq_lens=torch.cat([md.seq_lens, md.seq_lens.new_zeros(extra)]),
            num_computed_tokens=torch.cat([md.num_computed_tokens,
                                           md.num_computed_tokens.new_zeros(extra)]),
            block_table=torch.cat([md.block_table,
                                   md.block_table.new_zeros(extra, md.block_table.shape[1])]))
    t, d = step.num_tokens, args.head_dim
    gen = torch.Generator(device=dev).manual_seed(args.seed + 1)
    q = torch.randn(t, args.hq, d, device=dev, dtype=dtype, generator=gen)
    k = torch.randn(t, args.hkv, d, device=dev, dtype=dtype, generator=gen)
    v = torch.randn(t, args.hkv, d, device=dev, dtype=dtype, generator=gen)
    cache = torch.randn(2, step.num_blocks, args.block_size, args.hkv, d, device=dev,
                        dtype=dtype, generator=gen)
    A.write_kv(cache, k, v, md.slot_mapping)
    seq = step.attn_metadata.seq_lens.long()
    qlen = torch.tensor(step.num_scheduled_tokens, dtype=torch.int64)
    # keys visible to all queries: query j of request i sees seq_i - q_i + j + 1 positions
    visible = int((qlen * (seq - qlen) + qlen * (qlen + 1) // 2).sum())
    elem = torch.empty(0, dtype=dtype).element_size()
    return {
        "phase": phase, "tokens": t, "reqs": int(md.seq_lens.shape[0]),
        "context_tokens": int(seq.sum()), "q": q, "k": k, "v": v, "cache": cache,
        "slots": md.slot_mapping, "meta": (md.query_start_loc, md.seq_lens, md.block_table),
        "scale": d ** -0.5,
        # K/V bytes of all contexts: what a decode step reads (once per KV head and request;
        # a prefill's query blocks re-read their causal prefix)
        "kv_bytes": int(seq.sum()) * args.hkv * d * 2 * elem,
        "flops": 4 * visible * args.hq * d,
    }


def time_us(fn, iters: int, warmup: int) -> float:
    """Median µs of ``iters`` calls, each between two CUDA events (the harness's timer)."""
    return harness.median_us(fn, iters, warmup=warmup, cuda=True)


def graph_us(fn, iters: int, warmup: int) -> tuple[float, torch.Tensor, torch.cuda.CUDAGraph]:
    """``fn`` captured in a CUDA graph: median µs of a replay, the graph's output, the graph."""
    graph, out = harness.capture(fn, warmup=2)
    return time_us(graph.replay, iters, warmup), out, graph


def bench_case(args, c: dict) -> dict:
    q, cache, meta, scale = c["q"], c["cache"], c["meta"], c["scale"]
    row = {k: c[k] for k in ("phase", "tokens", "reqs", "context_tokens")}
    row["errors"] = []

    def fused():
        return A.paged_attention_triton(q, cache, *meta, scale)

    def ref():
        return A.paged_attention(q, cache, *meta, scale)

    def write():
        A.write_kv(cache, c["k"], c["v"], c["slots"])

    outs = {}
    for name, fn, iters in (("fused", fused, args.iters), ("ref", ref, args.ref_iters)):
        try:
            row[f"{name}_eager_us"] = time_us(fn, iters, args.warmup)
            row[f"{name}_graph_us"], out, graph = graph_us(fn, iters, args.warmup)
            outs[name] = (out.clone(), graph)
        except Exception as e:  # noqa: BLE001
            row["errors"].append(f"{name}: {type(e).__name__}: {e}"[:500])
            traceback.print_exc()
    try:
        row["write_kv_graph_us"], _, _ = graph_us(write, args.iters, args.warmup)
    except Exception as e:  # noqa: BLE001
        row["errors"].append(f"write_kv: {type(e).__name__}: {e}"[:500])
    if "fused" in outs and "ref" in outs:
        out_f, out_r = outs["fused"][0].float(), outs["ref"][0].float()
        row["max_abs_diff"] = float((out_f - out_r).abs().max())
        row["ref_max_abs"] = float(out_r.abs().max())
    outs.clear()
    if "fused_graph_us" in row and "ref_graph_us" in row:
        row["ratio_graph"] = row["ref_graph_us"] / row["fused_graph_us"]
        row["ratio_eager"] = row["ref_eager_us"] / row["fused_eager_us"]
    if "fused_graph_us" in row:
        row["fused_GBps"] = c["kv_bytes"] / row["fused_graph_us"] / 1e3
        row["fused_TFLOPs"] = c["flops"] / row["fused_graph_us"] / 1e6
    if args.sweep:
        row["sweep"] = sweep(args, c)
    return row


def sweep(args, c: dict) -> list[dict]:
    import triton

    q, cache, meta, scale = c["q"], c["cache"], c["meta"], c["scale"]
    g_pad = triton.next_power_of_2(args.hq // args.hkv)
    ref = A.paged_attention_triton(q, cache, *meta, scale)  # the default config
    res = []
    for rows, tile_n, warps, stages in SWEEP:
        cfg = A.KernelConfig(max(1, rows // g_pad), tile_n, warps, stages)
        r = {"rows": rows, "block_m": cfg.block_m, "tile_n": tile_n, "num_warps": warps,
             "num_stages": stages}
        try:
            r["graph_us"], out, graph = graph_us(
                lambda cfg=cfg: A.paged_attention_triton(q, cache, *meta, scale, config=cfg),
                args.iters, args.warmup)
            r["max_abs_diff_vs_default"] = float((out.float() - ref.float()).abs().max())
            del graph
        except Exception as e:  # noqa: BLE001
            r["error"] = f"{type(e).__name__}: {e}"[:300]
        res.append(r)
        print(f"[sweep] {c['phase']} {r}", flush=True)
    return res


def _fmt(row: dict, key: str, spec: str = ",.0f") -> str:
    return format(row[key], spec) if key in row else "-"


def main(argv=None) -> int:
    args = parse(argv)
    if not torch.cuda.is_available():
        print("bench_attention needs a CUDA GPU", file=sys.stderr)
        return 2
    import triton

    torch.cuda.set_device(0)
    dev_name = harness.machine(1, 0)
    setup = (f"Hq={args.hq}, Hkv={args.hkv}, D={args.head_dim}, {args.dtype}, "
             f"block_size={args.block_size}, decode {args.decode_reqs} reqs ctx "
             f"[{args.decode_ctx}], prefill {args.prefill_tokens} tokens in {args.prompt}-token "
             f"prompts" + (f", request dim padded to {args.pad_requests}"
                           if args.pad_requests else ""))
    print(f"[bench_attention] {dev_name} torch {torch.__version__} triton {triton.__version__} "
          f"{setup}", flush=True)
    rows = []
    for phase in args.cases.split(","):
        c = build_case(args, phase)
        plan = A.launch_plan(c["tokens"], c["reqs"],
                             triton.next_power_of_2(args.hq // args.hkv), c["q"].dtype)
        row = bench_case(args, c)
        # the launches the op makes here (two, gated on the GPU, for decode shapes from
        # A.GATED_MIN_TOKENS tokens): config and gate (0 none, 1 prefill-like, 2 decode-like)
        row["launches"] = [{**dataclasses.asdict(cfg), "gate": gate} for cfg, gate in plan]
        rows.append(row)
        print("[bench_attention] " + json.dumps({k: v for k, v in row.items() if k != "sweep"}),
              flush=True)
        del c
        torch.cuda.empty_cache()
    head = ("| case | T | R | context tokens | fused µs (eager) | **fused µs** (graph) | ref µs "
            "(eager) | **ref µs** (graph) | **ref / fused** | fused GB/s | fused TFLOP/s | "
            "write_kv µs | max abs diff |")
    lines = [head, "|" + "---|" * 13]
    for r in rows:
        lines.append(
            f"| {r['phase']} | {r['tokens']} | {r['reqs']} | {r['context_tokens']:,} | "
            f"{_fmt(r, 'fused_eager_us')} | {_fmt(r, 'fused_graph_us')} | "
            f"{_fmt(r, 'ref_eager_us')} | {_fmt(r, 'ref_graph_us')} | "
            f"{_fmt(r, 'ratio_graph', '.1f')}× | {_fmt(r, 'fused_GBps')} | "
            f"{_fmt(r, 'fused_TFLOPs', '.1f')} | {_fmt(r, 'write_kv_graph_us')} | "
            f"{_fmt(r, 'max_abs_diff', '.2g')} |")
    print("\n".join(lines), flush=True)
    doc = {"machine": dev_name, "date": datetime.datetime.now().isoformat(timespec="seconds"),
           "torch": torch.__version__, "triton": triton.__version__, "setup": setup,
           "iters": args.iters, "ref_iters": args.ref_iters, "rows": rows}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1, default=str)
    print(f"[bench_attention] wrote {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
