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
#: one MoE layer's ops of one ubatch, in the order each ubatch issues them (both peers)
LAYER_OPS = ["attn", "dispatch", "d_recv", "experts", "combine", "shared", "c_recv", "post"]


def _runs(order):
    """``order`` ("UBATCH:OP", host order) as runs of consecutive ops of one ubatch."""
    runs = []
    for entry in order:
        u, op = entry.split(":")
        if runs and runs[-1][0] == u:
            runs[-1][1].append(op)
        else:
            runs.append((u, [op]))
    return runs


def _check_host_order(phase, name, order):
    for u in "01":  # each ubatch issues its own ops in the model's order
        assert [e.split(":")[1] for e in order if e.startswith(u + ":")] == LAYER_OPS, order
    pos = {e: i for i, e in enumerate(order)}
    for op in LAYER_OPS:  # ubatch 0 first at every op (its KV writes before ubatch 1 reads)
        assert pos["0:" + op] < pos["1:" + op], (name, order)
    if name == "vllm_dbo":
        # two threads ping-pong: the ubatches alternate, and the CPU changes hands only at
        # the yields (before a dispatch / combine, after a dispatch / the shared experts)
        runs = _runs(order)
        assert [u for u, _ in runs] == ["0", "1"] * (len(runs) // 2), order
        for _, ops in runs[:-2]:
            assert ops[-1] in ("dispatch", "shared") or ops[-1] in ("attn", "experts"), order
        assert pos["1:dispatch"] < pos["0:d_recv"], order  # hidden behind the other's send
    elif phase == "decode":  # SGLang's head start: ubatch 0 runs 2 stages before ubatch 1
        assert pos["1:attn"] > pos["0:shared"], order
    else:  # no head start in prefill: ubatch 1's first stage right after ubatch 0's
        assert order[:4] == ["0:attn", "0:dispatch", "1:attn", "1:dispatch"], order


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
        # ours' warm-up timing of every graph it chose among, the chosen one included
        assert row["ours_choice"] in row["ours_warmup_us"] and "list" in row["ours_warmup_us"]
        assert sorted(row["peers"]) == sorted(PEERS)
        for name, peer in row["peers"].items():
            num = peer["num_eager"]
            assert num["ok"] and num["finite"] and num["max_rel"] <= num["rel_tol"], (name, num)
            assert peer["t_eager_us"] > 0 and peer["t_as_runs_us"] > 0, (name, peer)
            assert peer["ours_vs_peer_as_runs"] > 0, (name, peer)
            assert "t_graph_us" not in peer  # the CPU smoke captures no graphs
            _check_host_order(row["phase"], name, peer["host_order_first_moe_layer"])
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


def test_no_pair_rounds_is_a_usage_error(tmp_path):
    """``--pair-rounds 0`` would time no ratio side by side: refused before anything runs."""
    r, doc = _run(tmp_path, "--pair-rounds", "0")
    assert r.returncode == 2 and "--pair-rounds 0" in r.stderr and doc is None
