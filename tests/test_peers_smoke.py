"""The peer benchmark (``benchmarks/peers/bench_peers.py``) runs end to end on CPU and its
numerics check means something: the vLLM-style two-thread ping-pong and the SGLang-style
staged executor, run on the model's own ops over the emulated EP world, equal the unsplit
model; a schedule that loses a ubatch's combine is reported as failed (exit status 1), not
timed as if it were a peer. Run as subprocesses: tests import no benchmark script."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "peers", "bench_peers.py")
PEERS = ("vllm_dbo", "sglang_tbo")


def _run(tmp_path, *extra):
    out = tmp_path / "peers.json"
    cmd = [sys.executable, SCRIPT, "--smoke", "--layers", "1", "--iters", "1", "--warmup", "0",
           "--timing-iters", "1", "--candidates", "none", "--json", str(out), *extra]
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    doc = json.loads(out.read_text()) if out.exists() else None
    return r, doc


def test_both_peers_equal_the_unsplit_model_and_every_row_is_complete(tmp_path):
    r, doc = _run(tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = doc["rows"]
    assert [(row["phase"], row["tokens_per_rank"]) for row in rows] == [("decode", 32),
                                                                        ("prefill", 64)]
    for row in rows:
        assert row["errors"] == [] and row["numerics_ok"] is True, row
        assert row["num_ours"]["ok"], row["num_ours"]
        for key in ("t_baseline_us", "t_ours_graph_us", "t_ours_step_us"):
            assert row[key] > 0, key
        assert sorted(row["peers"]) == sorted(PEERS)
        for name, peer in row["peers"].items():
            num = peer["num_eager"]
            assert num["ok"] and num["finite"] and num["max_rel"] <= num["rel_tol"], (name, num)
            assert peer["t_eager_us"] > 0 and peer["t_as_runs_us"] > 0, (name, peer)
            assert peer["ours_vs_peer_as_runs"] > 0, (name, peer)
            assert "t_graph_us" not in peer  # the CPU smoke captures no graphs
    decode, prefill = rows
    # the peers' own split rules: vLLM splits at >= 32 decode / >= 512 prefill tokens, so
    # prefill 64 runs unsplit (the baseline); SGLang splits whatever has two halves, with a
    # head start of 2 stages in decode and 0 in prefill
    assert decode["peers"]["vllm_dbo"]["split"] is True
    assert prefill["peers"]["vllm_dbo"]["split"] is False
    assert prefill["peers"]["vllm_dbo"]["t_as_runs_us"] == prefill["t_baseline_us"]
    assert [row["peers"]["sglang_tbo"]["delta"] for row in rows] == [2, 0]
    assert all(row["peers"]["sglang_tbo"]["split"] for row in rows)
    md = (tmp_path / "peers.md").read_text()
    assert "| tiny | 8 | decode | 32 |" in md and "FAILED" not in md


def test_a_schedule_that_skips_a_combine_fails_the_numerics(tmp_path):
    r, doc = _run(tmp_path, "--buckets", "decode:32", "--fault", "skip-combine")
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    (row,) = doc["rows"]
    assert row["numerics_ok"] is False
    assert row["num_ours"]["ok"]  # the fault is planted in the peers' schedules only
    for name in PEERS:
        num = row["peers"][name]["num_eager"]
        assert not num["ok"] and num["max_rel"] > num["rel_tol"], (name, num)
    assert "FAILED" in (tmp_path / "peers.md").read_text()
