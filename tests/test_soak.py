"""The soak's slow tier (issue 16): a few hundred random steps over 2 and 4 Gloo ranks with
random token counts (0 and 1 included), request mixes, shared prefixes, engine vetoes and
injected per-rank failures; 0 hangs, 0 divergent decisions, every output equal to eager or
the project's own error on every rank. The full soak (10,000 steps per world size) is
``python benchmarks/soak.py --steps 10000 --world-sizes 2,4``."""

from __future__ import annotations

import json

import pytest

from dbo_compile.testing.soak import run_soak


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
