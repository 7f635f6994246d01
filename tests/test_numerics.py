"""Invariant 1: the split program's outputs equal eager (1 and 2 EP ranks, fp32 and bf16)."""

from __future__ import annotations

import pytest
import torch

from conftest import last_artifact
from moe_cases import DECODE_64, MIXED_CHUNKED, MIXED_CUT, build, eager_and_compiled
from shared_ranks import SharedRanks

CASES = {"decode64": DECODE_64, "mixed_cut": MIXED_CUT, "mixed_chunked": MIXED_CHUNKED}
TOL = {torch.float32: dict(rtol=0, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=6e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.quick) if c == "decode64" else c
                                  for c in sorted(CASES)])
def test_one_rank_split_equals_eager(case, dtype):
    model, step = build(CASES[case], dtype=dtype)
    eager, out, eager_kv, out_kv = eager_and_compiled(model, step, {"split": "always"})
    art = last_artifact()
    assert art.stats.split_steps == 1 and art.stats.unsplit_steps == 0
    assert [s.num_tokens for s in art.last_slices] == [step.num_tokens // 2,
                                                       step.num_tokens - step.num_tokens // 2]
    torch.testing.assert_close(out, eager, **TOL[dtype])
    for a, b in zip(out_kv, eager_kv):  # the KV cache is written exactly as eager writes it
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.quick
def test_mixed_case_really_cuts_a_request():
    from dbo_compile.runtime.ubatch import make_ubatch_slices

    _, step = build(MIXED_CUT)
    _, padded = make_ubatch_slices(step.num_scheduled_tokens, step.num_tokens, 2)
    assert padded[0].request_slice.stop - 1 == padded[1].request_slice.start  # shared request


def test_default_thresholds_split_decode_but_not_small_mixed():
    model, step = build(DECODE_64)
    eager, out, _, _ = eager_and_compiled(model, step, None)
    assert last_artifact().stats.split_steps == 1  # 64 uniform-decode tokens >= 32
    torch.testing.assert_close(out, eager, rtol=0, atol=1e-5)
    torch._dynamo.reset()
    model, step = build(MIXED_CUT)
    eager, out, _, _ = eager_and_compiled(model, step, None)
    assert last_artifact().stats.unsplit_steps == 1  # 64 mixed tokens < 512
    torch.testing.assert_close(out, eager, rtol=0, atol=1e-5)


def _two_rank_body(rank, world_size, case, dtype_name, options=None):
    import torch.distributed as dist

    from dbo_compile.backend import compiled_artifacts, register

    register()
    dtype = getattr(torch, dtype_name)
    model, step = build(CASES[case], dtype=dtype, group=dist.group.WORLD, seed=rank)
    eager, out, _, _ = eager_and_compiled(model, step, {"split": "always", **(options or {})})
    art = compiled_artifacts()[-1]
    return {"units": [u.name for u in art.schedule.units],"err": (out.float() - eager.float()).abs().max().item(),
            "ok": bool(torch.allclose(out.float(), eager.float(), **TOL[dtype])),
            "split": art.stats.split_steps, "code": art.code,
            "comm": art.schedule.meta["comm_ops_per_ubatch"]}


@pytest.mark.multirank
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", ["decode64", "mixed_cut"])
def test_two_ranks_split_equals_eager(request, case, dtype):
    results = RANKS.results(request, _two_rank_body, case, dtype)
    for r in results:
        assert r["split"] == 1 and r["comm"] == 4
        assert r["ok"], r["err"]
    # one collective order: the generated code is byte-identical on both ranks
    assert results[0]["code"] == results[1]["code"]


@pytest.mark.multirank
@pytest.mark.parametrize("case,dtype", [("decode64", "float32"), ("mixed_cut", "bfloat16")])
def test_two_ranks_joined_experts_equal_eager(request, case, dtype):
    """``join_experts``: one routed-expert call per layer on both ubatches' rows, over Gloo."""
    results = RANKS.results(request, _two_rank_body, case, dtype, JOINED)
    for r in results:
        assert r["split"] == 1 and r["ok"], r["err"]
        assert sum(n.endswith("MLP") for n in r["units"]) == 2  # one per layer, no ubatch
    assert results[0]["code"] == results[1]["code"]


# the two-rank tests' bodies run on one group of 2 ranks, launched once (tests/shared_ranks.py)
JOINED = {"join_experts": True, "schedule_candidates": False}
RANKS = SharedRanks(2, timeout_s=300, calls={
    **{f"test_two_ranks_split_equals_eager[{c}-{d}]": (_two_rank_body, (c, d))
       for c in ("decode64", "mixed_cut") for d in ("float32", "bfloat16")},
    **{f"test_two_ranks_joined_experts_equal_eager[{c}-{d}]": (_two_rank_body, (c, d, JOINED))
       for c, d in [("decode64", "float32"), ("mixed_cut", "bfloat16")]},
})
