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

# (name, H, I, local experts, K, fan-out F: rows per token 1 + F; 0 = EP 1)
SHAPES = {"v2lite-ep8": (2048, 1408, 8, 6, 6), "v2lite-ep1": (2048, 1408, 64, 6, 0),
          "v3-ep8": (7168, 2048, 32, 8, 7), "v3-ep32": (7168, 2048, 8, 8, 8)}


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
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
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
            print(json.dumps(row), flush=True)
    print(f"\n{'shape':12s} {'T':>5s} {'slots':>6s} {'sorted':>8s} {'fused':>8s} {'ratio':>6s} "
          f"{'best cfg':>16s} {'best':>8s}")
    for r in rows:
        f = r.get("fused_us")
        print(f"{r['shape']:12s} {r['tokens']:5d} {r['slots']:6d} {r['sorted_us']:8.1f} "
              f"{f or 0:8.1f} {(r['sorted_us'] / f) if f else 0:6.2f} {r.get('best', '-'):>16s} "
              f"{r.get('best_us', 0):8.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": harness.machine(), "torch": torch.__version__,
                       "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
