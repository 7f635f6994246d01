"""The soak (issues 16, 29): its step mix and KV check (fast), and its slow tier: a few hundred
random steps over 2 and 4 Gloo ranks with random token counts (0 and 1 included), request
mixes, shared prefixes, engine vetoes and injected per-rank failures, at least half of them
split; 0 hangs, 0 divergent decisions, every output equal to the reference or the project's
own error on every rank. The full soak (10,000 steps per world size) is ``python
benchmarks/soak.py --steps 10000 --world-sizes 2,4``."""

from __future__ import annotations

import json
import random

import pytest
import torch

from dbo_compile.models.deepseek import get_config
from dbo_compile.testing import soak
from dbo_compile.testing.soak import run_soak


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_the_mix_aims_more_than_half_the_steps_at_a_split(world_size):
    """The free mix rarely split at 4 ranks (2 of 60 steps: a veto or a step below the
    threshold on any rank keeps every rank unsplit). A step aimed at a split gives every
    rank a step past its threshold (uniform decode on every rank at the decode threshold,
    else the prefill threshold) with no shared prefix and no veto."""
    cfg = get_config("tiny", num_layers=2)
    d, p = 8, 24
    aimed = 0
    for i in range(200):
        plan = soak.draw_plan(0, i, world_size, 0.7, 0.02)
        aimed += plan.aim_split
        for rank in range(world_size):
            rng = random.Random(f"rank/0/{i}/{rank}")
            key = soak.content_key(plan, rng, i, None)
            step, shared = soak.draw_rank_step(
                cfg, key, rng, max_tokens=96, thresholds=(d, p), marks=[0, 1, 2],
                p_share=0.5, num_blocks=1024, seed=i)
            if plan.aim_split:
                assert not shared
                if plan.decode_only:
                    assert step.is_uniform_decode and step.num_tokens >= d
                else:
                    assert step.num_tokens >= p
    assert aimed / 200 >= 0.6


def _caches(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 4, 2, 1, 3, generator=gen) for _ in range(2)]  # 8 slots each


@pytest.mark.parametrize("fault, ok", [
    (None, (True, True)),
    ("stray", (True, False)),  # a write to a slot the step does not own (a padding row's)
    ("value", (False, True)),  # a wrong value at a written slot
    ("missing", (False, True)),  # a slot the step should have written, left as it was
])
def test_kv_check_finds_wrong_stray_and_missing_writes(fault, ok):
    base = _caches()
    slots = torch.tensor([1, 5, 6])
    expected = [torch.randn(2, 3, 3) for _ in base]
    caches = [b.clone() for b in base]
    for c, e in zip(caches, expected):
        c.view(2, -1, 3)[:, slots] = e
    if fault == "stray":
        caches[1].view(2, -1, 3)[0, 7] += 1.0
    elif fault == "value":
        caches[0].view(2, -1, 3)[1, 5] += 1e-3
    elif fault == "missing":
        caches[1].view(2, -1, 3)[:, 6] = base[1].view(2, -1, 3)[:, 6]
    assert soak.check_kv_writes(caches, base, slots, expected, atol=1e-4) == ok
    if ok[1]:  # the written slots put back: the caches are the base again
        assert all(torch.equal(c, b) for c, b in zip(caches, base))


def test_kv_check_skips_the_writes_it_is_told_to_and_may_skip_values():
    base = _caches()
    slots = torch.tensor([0, 3])
    expected = [torch.zeros(2, 2, 3) for _ in base]
    caches = [b.clone() for b in base]
    for c in caches:
        c.view(2, -1, 3)[:, 3] = 7.0  # slot 3 is off; slot 0 is left alone: also off
    keep = torch.tensor([False, False])
    assert soak.check_kv_writes(caches, base, slots, expected, keep=keep) == (True, True)
    caches = [b.clone() for b in base]
    caches[0].view(2, -1, 3)[:, 3] = 7.0
    assert soak.check_kv_writes(caches, base, slots) == (None, True)
    caches[0].view(2, -1, 3)[:, 2] = 7.0
    assert soak.check_kv_writes(caches, base, slots) == (None, False)


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.parametrize("world_size, steps", [(2, 300), (4, 200)])
def test_soak(world_size, steps):
    counts = run_soak(world_size, steps, seed=world_size, p_fail=0.05)
    print(json.dumps({k: v for k, v in counts.items() if k != "examples"}))
    assert "error" not in counts, counts.get("error")
    for key in ("hangs", "divergences", "wrong_outputs", "foreign_errors"):
        assert counts[key] == 0, (key, counts["examples"])
    assert counts["splits"] > 0 and counts["unsplit"] > 0
    assert counts["split_share"] >= 0.5
    for key in ("vetoes", "prefix_shared", "idle_rank_steps", "one_token_rank_steps"):
        assert counts[key] > 0, key
    assert counts["injected_failures"] > 0 and counts["agreed_failures"] >= counts["injected_failures"]


@pytest.mark.slow
@pytest.mark.multirank
def test_soak_stops_every_rank_after_the_same_step_when_its_budget_is_spent():
    counts = run_soak(2, 10_000, seed=1, budget_s=5.0)
    print(json.dumps({k: v for k, v in counts.items() if k != "examples"}))
    assert "error" not in counts, counts.get("error")
    assert 1 <= counts["steps"] < counts["steps_planned"] == 10_000
    assert counts["divergences"] == 0 and counts["hangs"] == 0
    assert counts["splits"] + counts["unsplit"] + counts["agreed_failures"] == counts["steps"]
