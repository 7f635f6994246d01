"""The routed experts' CUDA paths side by side: the sorted path (sort, two
``torch._grouped_mm``) and the fused Triton path (``dbo_compile/ops/fused_moe.py``), per call,
in CUDA graphs, at the shapes one EP rank sees.

Run (one GPU)::

    python benchmarks/bench_experts.py                       # the default shapes
    python benchmarks/bench_experts.py --sweep               # also every fused tile shape

Shapes: ``T`` tokens per call (a ubatch), the emulated EP-``W`` receive layout (``T * (1 + F)``
rows of ``K`` slots, ``T * K`` of them local, spread uniformly over the ``E / W`` local
experts; ``ops/emulated/``) or EP = 1 (``T`` rows, every slot local). Each call is captured
``--reps`` times in one CUDA graph; the figure is the replay time / reps (µs, median of
``--iters`` replays). Both paths' outputs are checked against each other (bf16).

``--fp8-cast`` (issue 28, item 4): the ``deep_gemm`` backend's masked expert op on DeepEP
low-latency's expert-major receive layout (``[E_local, W*T, H]`` with per-expert counts, about
``T*K/E_local`` of the ``W*T`` rows valid), bf16 against FP8 with the masked Triton cast
(``dbo_compile/ops/fp8_cast.py``: the rows below the counts only) and against FP8 with the
reference cast of every row (the adapter before), plus both casts alone; needs DeepGEMM
(``pip install 'dbo_compile[deepgemm]'``)::

    python benchmarks/bench_experts.py --fp8-cast --tokens 64,256,1024 --json fp8_cast.json

(default shapes with ``--fp8-cast``: v2lite-ep8, v3-ep32; target: ``fp8_over_bf16`` <= 1.3).
Accuracy, on the rows below the counts only (the op writes no other row): each path's output
(the CUDA graph's, and one eager call's) against a float32 torch reference of the same SwiGLU
(``bf16_rel_err``, ``fp8_rel_err``, ``*_eager_rel_err``), and FP8 against bf16
(``fp8_rel_err_vs_bf16``): a wrong bf16 reference shows as a large ``bf16_rel_err``, not as an
FP8 error. ``--expected-m N`` passes DeepGEMM's ``expected_m`` to both paths (default: the
backend's, an eighth of the rows per expert).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness  # noqa: E402

from dbo_compile.ops import fused_moe  # noqa: E402
from dbo_compile.ops.experts import grouped_fused, grouped_triton  # noqa: E402
from dbo_compile.testing import moe as H  # noqa: E402
from dbo_compile.testing.bench_cli import given_flags, refuse_unread  # noqa: E402

# (name, H, I, local experts, K, fan-out F: rows per token 1 + F; 0 = EP 1)
SHAPES = {"v2lite-ep8": (2048, 1408, 8, 6, 6), "v2lite-ep1": (2048, 1408, 64, 6, 0),
          "v3-ep8": (7168, 2048, 32, 8, 7), "v3-ep32": (7168, 2048, 8, 8, 8)}
#: EP ranks W of the shapes with an expert-major layout (``--fp8-cast``)
EP_RANKS = {"v2lite-ep8": 8, "v3-ep8": 8, "v3-ep32": 32}


def make_expert_major(shape: str, tokens: int, device, seed: int = 0):
    """DeepEP low-latency's receive for ``tokens`` tokens per rank: ``x [E_local, W*T, H]``
    bf16 (rows past the counts NaN: undefined), ``counts [E_local]`` int32 (``T*K*W/E`` per
    expert on average, +-25 %), the ``[E_local, 1]`` ranges, ``w13``, ``w2``."""
    h, inter, e, k, _ = SHAPES[shape]
    w = EP_RANKS[shape]
    g = torch.Generator(device=device).manual_seed(seed)
    m = w * tokens
    mean = tokens * k / e  # W*T*K / (W*E_local) rows per local expert
    jitter = torch.rand(e, generator=g, device=device) * 0.5 + 0.75
    counts = (mean * jitter).round().clamp(max=m).to(torch.int32)
    x = torch.randn(e, m, h, generator=g, device=device, dtype=torch.bfloat16)
    valid = torch.arange(m, device=device)[None, :] < counts[:, None]
    x.masked_fill_(~valid[..., None], float("nan"))
    w13 = torch.randn(e, 2 * inter, h, generator=g, device=device, dtype=torch.bfloat16) / h ** 0.5
    w2 = torch.randn(e, h, inter, generator=g, device=device, dtype=torch.bfloat16) / inter ** 0.5
    ranges = torch.zeros(e, 1, dtype=torch.int64, device=device)
    return x, counts, ranges, w13, w2


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """``|got - want| / |want|`` (Frobenius norms), float32."""
    return float((got.float() - want).norm() / want.norm())


def swiglu_reference(x, counts, w13, w2) -> torch.Tensor:
    """The expert op on the expert-major rows below the counts, float32 torch (``[sum(counts),
    H]``, experts in order): ``silu(x W1^T) * (x W3^T) W2^T`` per expert."""
    inter = w2.shape[2]
    out = []
    for e, n in enumerate(counts.tolist()):
        h = x[e, :n].float() @ w13[e].float().t()
        out.append((torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]) @ w2[e].float().t())
    return torch.cat(out)


def write_rows(args, rows: list[dict], **meta) -> None:
    """``--json``: the rows so far, rewritten after each (a run stopped by a timeout keeps
    the rows it finished)."""
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": harness.machine(), "torch": torch.__version__, **meta,
                       "rows": rows}, f, indent=1)


def fp8_cast_rows(args) -> list[dict]:
    """``--fp8-cast`` (module docstring): per shape and tokens, µs per call in CUDA graphs."""
    from dbo_compile.ops import deep_gemm as dg
    from dbo_compile.ops.experts import get_experts_backend
    from dbo_compile.ops.fp8_cast import per_token_cast_fp8, per_token_cast_fp8_masked

    device = torch.device("cuda")
    extra = f",expected_m={args.expected_m}" if args.expected_m else ""
    bf16 = get_experts_backend("deep_gemm:fp8=false" + extra)
    fp8 = get_experts_backend("deep_gemm:fp8=true" + extra)
    rows = []
    for shape in args.shapes.split(","):
        for tokens in map(int, args.tokens.split(",")):
            x, counts, ranges, w13, w2 = make_expert_major(shape, tokens, device)
            row = {"shape": shape, "tokens": tokens, "rows": x.shape[1],
                   "valid_rows": int(counts.sum()), "experts": x.shape[0]}

            def t(fn):
                return H.time_graph(fn, args.iters, args.reps)

            row["bf16_us"], ref = t(lambda: bf16.run(x, counts, ranges, w13, w2))
            row["fp8_us"], got = t(lambda: fp8.run(x, counts, ranges, w13, w2))
            kernels = dg.fp8_cast_kernels
            dg.fp8_cast_kernels = lambda: None  # the adapter before: every row cast
            try:
                row["fp8_all_rows_us"], _ = t(lambda: fp8.run(x, counts, ranges, w13, w2))
            finally:
                dg.fp8_cast_kernels = kernels
            row["cast_masked_us"], _ = t(lambda: per_token_cast_fp8_masked(x, counts))
            row["cast_all_rows_us"], _ = t(lambda: per_token_cast_fp8(x))
            pick = [(e, int(n)) for e, n in enumerate(counts.tolist())]
            exact = swiglu_reference(x, counts, w13, w2)
            eager_ref = bf16.run(x, counts, ranges, w13, w2)
            eager_got = fp8.run(x, counts, ranges, w13, w2)
            a, b, ea, eb = (torch.cat([y[e, :n] for e, n in pick]).float()
                            for y in (ref, got, eager_ref, eager_got))
            row["fp8_rel_err_vs_bf16"] = rel_err(b, a)
            row["bf16_rel_err"] = rel_err(a, exact)
            row["fp8_rel_err"] = rel_err(b, exact)
            row["bf16_eager_rel_err"] = rel_err(ea, exact)
            row["fp8_eager_rel_err"] = rel_err(eb, exact)
            row["fp8_finite"] = bool(torch.isfinite(b).all())
            row["bf16_finite"] = bool(torch.isfinite(a).all())
            row["fp8_over_bf16"] = round(row["fp8_us"] / row["bf16_us"], 3)
            row["fp8_all_rows_over_bf16"] = round(row["fp8_all_rows_us"] / row["bf16_us"], 3)
            rows.append(row)
            write_rows(args, rows, mode="fp8-cast")
            print(json.dumps(row), flush=True)
    print(f"\n{'shape':12s} {'T':>5s} {'valid/rows':>12s} {'bf16':>8s} {'fp8':>8s} {'ratio':>6s} "
          f"{'fp8 all':>8s} {'ratio':>6s} {'cast':>7s} {'cast all':>8s} {'bf16 err':>8s} "
          f"{'fp8 err':>8s}")
    for r in rows:
        print(f"{r['shape']:12s} {r['tokens']:5d} {r['valid_rows']:>5d}/{r['rows'] * r['experts']:<6d} "
              f"{r['bf16_us']:8.1f} {r['fp8_us']:8.1f} {r['fp8_over_bf16']:6.2f} "
              f"{r['fp8_all_rows_us']:8.1f} {r['fp8_all_rows_over_bf16']:6.2f} "
              f"{r['cast_masked_us']:7.1f} {r['cast_all_rows_us']:8.1f} "
              f"{r['bf16_rel_err']:8.4f} {r['fp8_rel_err']:8.4f}")
    return rows


def make_call(shape: str, tokens: int, device, seed: int = 0):
    h, inter, e, k, fan = SHAPES[shape]
    g = torch.Generator(device=device).manual_seed(seed)
    rows_per_token = 1 + fan
    n = tokens * rows_per_token
    ids = torch.full((n, k), -1, dtype=torch.int64, device=device)
    local = torch.randint(0, e, (tokens, k), generator=g, device=device)
    row = torch.randint(0, rows_per_token, (tokens, k), generator=g, device=device)
    t = torch.arange(tokens, device=device)[:, None].expand(tokens, k)
    col = torch.arange(k, device=device)[None, :].expand(tokens, k)
    ids[t * rows_per_token + row, col] = local
    x = torch.randn(n, h, generator=g, device=device, dtype=torch.bfloat16)
    w = torch.rand(n, k, generator=g, device=device)
    w13 = torch.randn(e, 2 * inter, h, generator=g, device=device, dtype=torch.bfloat16) / h ** 0.5
    w2 = torch.randn(e, h, inter, generator=g, device=device, dtype=torch.bfloat16) / inter ** 0.5
    return x, ids, w, w13, w2


def configs(sweep: bool):
    if not sweep:
        return []
    out = []
    for bm, bn, bk in itertools.product((16, 32, 64), (32, 64, 128), (64, 128)):
        out.append(fused_moe.FusedConfig(bm, bn, bk, 4, 3))
    for bm, bn, bk, wa, st in ((32, 64, 128, 4, 4), (64, 64, 128, 4, 4), (32, 64, 64, 4, 4),
                               (64, 128, 64, 8, 3), (32, 128, 64, 8, 3), (64, 64, 64, 8, 4)):
        out.append(fused_moe.FusedConfig(bm, bn, bk, wa, st))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="v2lite-ep8,v2lite-ep1,v3-ep8")
    p.add_argument("--tokens", default="64,128,256,512,1024")
    p.add_argument("--sweep", action="store_true", help="every fused tile shape too")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--max-slots", type=int, default=1 << 20,
                   help="the fused path's slot limit for this run (the package's: "
                        f"{fused_moe.MAX_SLOTS}), so that the sweep sees where it loses")
    p.add_argument("--fp8-cast", action="store_true",
                   help="the deep_gemm masked expert op, bf16 vs FP8 with the masked cast "
                        "(shapes with an expert-major layout: " + ",".join(EP_RANKS) + ")")
    p.add_argument("--expected-m", type=int, default=None,
                   help="with --fp8-cast: DeepGEMM's expected_m for both paths (default: the "
                        "backend's)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    given = given_flags(p, argv)
    if not args.fp8_cast:
        refuse_unread(p, args, given, ("--expected-m",), "without --fp8-cast")
    if args.fp8_cast:
        refuse_unread(p, args, given, ("--sweep", "--max-slots"), "with --fp8-cast")
        if "shapes" not in given:
            args.shapes = "v2lite-ep8,v3-ep32"
        bad = [s for s in args.shapes.split(",") if s not in EP_RANKS]
        if bad:
            p.error(f"--fp8-cast: {bad} have no expert-major layout; use {sorted(EP_RANKS)}")
        fp8_cast_rows(args)
        return 0
    fused_moe.MAX_SLOTS = args.max_slots
    device = torch.device("cuda")
    rows = []
    for shape in args.shapes.split(","):
        for tokens in map(int, args.tokens.split(",")):
            x, ids, w, w13, w2 = make_call(shape, tokens, device)
            row = {"shape": shape, "tokens": tokens, "slots": ids.numel(),
                   "local_slots": int((ids >= 0).sum())}
            ref = grouped_triton(x, ids, w, w13, w2).float()
            row["sorted_us"] = H.time_graph(lambda: grouped_triton(x, ids, w, w13, w2),
                                            args.iters, args.reps)[0]
            if ids.numel() <= fused_moe.MAX_SLOTS:
                cands = [None] + configs(args.sweep)
                best = None
                for cfg in cands:
                    try:
                        got = grouped_fused(x, ids, w, w13, w2, cfg).float()
                        err = float((got - ref).abs().max() / ref.abs().max())
                        t = H.time_graph(lambda: grouped_fused(x, ids, w, w13, w2, cfg),
                                         args.iters, args.reps)[0]
                    except Exception as e:  # noqa: BLE001
                        print(f"  {shape} T={tokens} {cfg}: {type(e).__name__}: {e}"[:300])
                        continue
                    name = "default" if cfg is None else ",".join(map(str, (
                        cfg.block_m, cfg.block_n, cfg.block_k, cfg.num_warps, cfg.num_stages)))
                    if cfg is None:
                        row["fused_us"], row["fused_err"] = t, err
                    elif best is None or t < best[1]:
                        best = (name, t, err)
                if best:
                    row["best"], row["best_us"], row["best_err"] = best
            rows.append(row)
            write_rows(args, rows)
            print(json.dumps(row), flush=True)
    print(f"\n{'shape':12s} {'T':>5s} {'slots':>6s} {'sorted':>8s} {'fused':>8s} {'ratio':>6s} "
          f"{'best cfg':>16s} {'best':>8s}")
    for r in rows:
        f = r.get("fused_us")
        print(f"{r['shape']:12s} {r['tokens']:5d} {r['slots']:6d} {r['sorted_us']:8.1f} "
              f"{f or 0:8.1f} {(r['sorted_us'] / f) if f else 0:6.2f} {r.get('best', '-'):>16s} "
              f"{r.get('best_us', 0):8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
