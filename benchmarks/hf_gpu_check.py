"""transformers MoE models under EP=2 with backend="dbo" on GPUs (NCCL, bf16): same answers?

The GPU counterpart of tests/test_hf.py: for each family, every rank builds the same tiny
random-weight model (dbo_compile.testing.hf), keeps an unmodified copy as the reference, makes
the model expert-parallel over the 2 GPUs (dbo_compile.models.hf.make_expert_parallel), compiles
it with ``backend="dbo", options={"split": "always"}`` and compares

- a prefill forward (``use_cache=False``, ``[batch, seq]`` requests, request dim marked dynamic),
- ``--decode-steps`` decode steps on a transformers ``StaticCache`` (eager prefill first),

against the reference, and prints per family and phase: max abs error of the logits vs the
unmodified bf16 model, the bf16 noise scale (unmodified bf16 vs unmodified fp32), split/unsplit
step counts, comm ops (dbo.dispatch + dbo.combine) in the lowered and in the split graph, and
the number of compiled graphs. One JSON line per family and phase follows the table.

Run (2 GPUs)::

    torchrun --nproc-per-node 2 benchmarks/hf_gpu_check.py
    torchrun --nproc-per-node 2 benchmarks/hf_gpu_check.py --families qwen3_moe mixtral \\
        --batch 8 --seq 64 --decode-steps 4
    torchrun --nproc-per-node 2 benchmarks/hf_gpu_check.py --device cpu   # smoke test, Gloo

bf16 through the layers: the EP block sums expert outputs in fp32 (then one bf16 rounding)
where transformers accumulates in bf16 token by token, so the hidden states differ by bf16
rounding after the first MoE layer and a near-tie in a later router's top-k can flip a token's
experts. Compare the error with the noise column, not with 0.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import inspect
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import harness  # noqa: E402


def _comm_ops(gm) -> int:
    targets = (torch.ops.dbo.dispatch.default, torch.ops.dbo.combine.default,
               torch.ops.dbo.moe_dispatch.default, torch.ops.dbo.moe_combine.default)
    return sum(1 for n in gm.graph.nodes if n.target in targets) if gm is not None else 0


def _device_name(device: torch.device) -> str:
    return harness.machine(1, device) if device.type == "cuda" else "CPU (Gloo)"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _cache_kwarg(model) -> str:
    """transformers >= 5.24 calls it ``cache`` (``past_key_values`` deprecated)."""
    params = inspect.signature(type(model).forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _facts(arts) -> dict:
    return {
        "graphs": len(arts),
        "kinds": sorted({type(a).__name__ for a in arts}),
        "reasons": sorted({a.reason for a in arts if getattr(a, "reason", None)}),
        "split_steps": sum(a.stats.split_steps for a in arts),
        "unsplit_steps": sum(a.stats.unsplit_steps for a in arts),
        "comm_lowered": [_comm_ops(getattr(a, "lowered_gm", None)) for a in arts],
        "comm_split": [_comm_ops(getattr(a, "split_gm", None)) for a in arts],
    }


def _check_family(model_type: str, args, device: torch.device, group) -> list[dict]:
    from transformers import StaticCache

    from dbo_compile.backend import compiled_artifacts, reset_artifacts
    from dbo_compile.models.hf import make_expert_parallel
    from dbo_compile.testing.hf import tiny_hf_model

    rank = dist.get_rank()
    dtype = getattr(torch, args.dtype)
    model = tiny_hf_model(model_type, seed=0, dtype=dtype, device=device)
    reference = copy.deepcopy(model)
    reference_fp32 = copy.deepcopy(model).float()
    make_expert_parallel(model, group)
    kw = _cache_kwarg(model)
    vocab = model.config.vocab_size
    gen = torch.Generator(device="cpu").manual_seed(1000 + rank)  # each rank its own requests
    rows = []

    # -- prefill --------------------------------------------------------------------------
    torch._dynamo.reset()
    reset_artifacts()
    ids = torch.randint(0, vocab, (args.batch, args.seq), generator=gen).to(device)
    with torch.no_grad():
        expected = reference(input_ids=ids, use_cache=False).logits.float()
        exact = reference_fp32(input_ids=ids, use_cache=False).logits.float()
        compiled = torch.compile(model, backend="dbo", options={"split": "always"})
        torch._dynamo.mark_dynamic(ids, 0)
        out = compiled(input_ids=ids, use_cache=False).logits.float()
    _sync(device)
    rows.append({"family": model_type, "phase": "prefill", "rank": rank,
                 "max_abs_err": (out - expected).abs().max().item(),
                 "bf16_noise": (expected - exact).abs().max().item(),
                 "err_vs_fp32": (out - exact).abs().max().item(),
                 **_facts(compiled_artifacts())})

    # -- decode on a StaticCache ------------------------------------------------------------
    if args.decode_steps <= 0:
        return rows
    torch._dynamo.reset()
    reset_artifacts()
    max_cache = args.seq + args.decode_steps
    prompt = torch.randint(0, vocab, (args.batch, args.seq), generator=gen).to(device)
    errs, noise, kv_err = [], [], 0.0
    with torch.no_grad():
        ref_cache = StaticCache(config=reference.config, max_cache_len=max_cache)
        fp32_cache = StaticCache(config=reference_fp32.config, max_cache_len=max_cache)
        cache = StaticCache(config=model.config, max_cache_len=max_cache)
        reference(input_ids=prompt, use_cache=True, **{kw: ref_cache})
        reference_fp32(input_ids=prompt, use_cache=True, **{kw: fp32_cache})
        model(input_ids=prompt, use_cache=True, **{kw: cache})
        for layer in cache.layers:  # the cache is indexed by request, like input_ids
            torch._dynamo.mark_dynamic(layer.keys, 0)
            torch._dynamo.mark_dynamic(layer.values, 0)
        compiled = torch.compile(model, backend="dbo", options={"split": "always"})
        for _ in range(args.decode_steps):
            token = torch.randint(0, vocab, (args.batch, 1), generator=gen).to(device)
            expected = reference(input_ids=token, use_cache=True, **{kw: ref_cache}).logits.float()
            exact = reference_fp32(input_ids=token, use_cache=True, **{kw: fp32_cache}).logits.float()
            torch._dynamo.mark_dynamic(token, 0)
            out = compiled(input_ids=token, use_cache=True, **{kw: cache}).logits.float()
            errs.append((out - expected).abs().max().item())
            noise.append((expected - exact).abs().max().item())
        for a, b in zip(ref_cache.layers, cache.layers):
            kv_err = max(kv_err, (a.keys.float() - b.keys.float()).abs().max().item())
    _sync(device)
    rows.append({"family": model_type, "phase": f"decode x{args.decode_steps}", "rank": rank,
                 "max_abs_err": max(errs), "bf16_noise": max(noise),
                 "kv_cache_err": kv_err, **_facts(compiled_artifacts())})
    return rows


def main() -> None:
    from dbo_compile.testing.hf import TINY_MODEL_TYPES

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--families", nargs="+", default=list(TINY_MODEL_TYPES),
                   choices=list(TINY_MODEL_TYPES))
    p.add_argument("--batch", type=int, default=8,
                   help="requests per rank (even: the DP vote pads odd batches, see README)")
    p.add_argument("--seq", type=int, default=32, help="prompt length (tokens per request)")
    p.add_argument("--decode-steps", type=int, default=4)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="cpu: a smoke test of this script over Gloo")
    args = p.parse_args()

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    timeout = datetime.timedelta(seconds=600)
    if args.device == "cuda":
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off (KINDS.md)
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        dist.init_process_group("nccl", device_id=device, timeout=timeout)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timeout)
    if dist.get_world_size() != 2:
        raise SystemExit("run with torchrun --nproc-per-node 2")
    import transformers

    from dbo_compile.backend import register

    register()
    rows = []
    for family in args.families:
        try:
            rows += _check_family(family, args, device, dist.group.WORLD)
        except Exception as e:  # noqa: BLE001 - report and go on with the next family
            rows.append({"family": family, "phase": "error", "rank": dist.get_rank(),
                         "error": f"{type(e).__name__}: {e}"})
        dist.barrier()
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, rows)
    if dist.get_rank() == 0:
        print(f"torch {torch.__version__}, transformers {transformers.__version__}, "
              f"{_device_name(device)} x2, {args.dtype}, batch {args.batch}/rank, "
              f"seq {args.seq}")
        head = (f"{'family':12} {'phase':10} {'rank':>4} {'max_abs_err':>11} {'bf16_noise':>10} "
                f"{'split':>5} {'unsplit':>7} {'graphs':>6}  comm lowered->split")
        print(head)
        flat = [r for per_rank in gathered for r in per_rank]
        flat.sort(key=lambda r: (r["family"], r["phase"], r["rank"]))
        for r in flat:
            if r["phase"] == "error":
                print(f"{r['family']:12} ERROR rank {r['rank']}: {r['error']}")
                continue
            print(f"{r['family']:12} {r['phase']:10} {r['rank']:>4} {r['max_abs_err']:>11.4g} "
                  f"{r['bf16_noise']:>10.4g} {r['split_steps']:>5} {r['unsplit_steps']:>7} "
                  f"{r['graphs']:>6}  {r['comm_lowered']}->{r['comm_split']}"
                  + (f"  reasons: {r['reasons']}" if r["reasons"] else ""))
        for r in flat:
            print(json.dumps(r, sort_keys=True))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
