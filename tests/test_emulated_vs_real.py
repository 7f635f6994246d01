"""benchmarks/emulated_vs_real.py and its link model (``dbo_compile.testing.link_model``): at
W = 2 the emulated link moves the torch backend's peer share (the premise of matching the
emulated EP-2 world to the real one), the inversion of the emulated link's time, and the
side-by-side table of a real (bench_moe under torchrun) and an emulated (bench_moe
--emulate-ep) results file."""

from __future__ import annotations

import json
import os

import pytest

from dbo_compile.models import get_config
from dbo_compile.testing import link_model as X
from scripts import ROOT, run_scripts

REAL_SETUP = ("deepseek-v2-lite, 4 layers (4 MoE), vocab 4096, bf16, EP=2, experts=grouped, "
              "attention=fused, scheduler=list, carve-out candidates default, "
              "compute_backend=auto (16,); rows from runs E, F (see 'runs')")
EMU_SETUP = ("deepseek-v2-lite, 4 MoE layers, vocab 4096, bf16, emulated EP world "
             "(comm_backend=emulated), experts=grouped, attention=fused, compute_backend=auto, "
             "candidates=all, no carve-out candidates")


@pytest.mark.parametrize("tokens", [1, 64, 1023, 8192])
def test_at_world_size_2_the_emulated_link_moves_the_torch_backends_peer_bytes(tokens):
    cfg = get_config("deepseek-v2-lite")
    peer = [p for _, p, _ in X.torch_comm_bytes(cfg, 4, tokens, 2)]
    emu = [b for _, b in X.emulated_comm_bytes(cfg, 4, tokens, 2)]
    assert len(emu) == 16 and emu == peer
    # at W = 8 the emulated link moves the routed volume, less than the fixed capacity
    assert (sum(b for _, b in X.emulated_comm_bytes(cfg, 4, tokens, 8))
            < sum(p for _, p, _ in X.torch_comm_bytes(cfg, 4, tokens, 8)))


def test_the_asked_link_reproduces_its_target_and_knows_the_copy_engines_floor():
    nbytes, model, hw = [2_000_000] * 16, (12.0, 0.96), 46.3
    target = X.emulated_comm_us(nbytes, 20.0, hw, model)
    assert X.asked_link(nbytes, target, hw, model) == pytest.approx(20.0, rel=1e-3)
    floor = X.emulated_comm_us(nbytes, hw, hw, model)
    assert X.asked_link(nbytes, 0.9 * floor, hw, model) is None


def _row(phase, tokens, base, dbo, t_chosen, **kw):
    return {"phase": phase, "tokens_per_rank": tokens, "t_baseline_us": base,
            "t_dbo_graph_us": dbo, "t_chosen_us": t_chosen, "speedup": base / dbo,
            "dbo_variant": "list+join", "t_comm_us": 1765.0, "t_split_nocomm_us": 4126.0, **kw}


def _docs():
    real = {"machine": "2x NVIDIA H200", "date": "2026-11-30", "setup": REAL_SETUP, "rows": [
        _row("decode", 1024, 5296.0, 5185.0, 5185.0, link="shm", chosen="split",
             chosen_graph="list+join"),
        _row("decode", 1024, 3992.0, 4358.0, 3992.0, link="nvlink", chosen="unsplit",
             chosen_graph="unsplit", t_comm_us=443.0)]}
    emu = {"machine": "1x NVIDIA H200 (x86_64)", "date": "2026-12-02", "setup": EMU_SETUP,
           "rows": [_row("decode", 1024, 5500.0, 6200.0, 6200.0, world_size=2, link_gbps=27.8,
                         chosen="list+join"),
                    _row("decode", 1024, 8306.0, 6055.0, 6055.0, world_size=8, link_gbps=50.0,
                         chosen="list"),
                    _row("prefill", 4096, 1.0, 1.0, 1.0, world_size=2, link_gbps=27.8,
                         chosen="unsplit")]}
    return real, emu


def test_side_by_side_pairs_world_size_2_rows_with_the_real_link_and_flags_past_tolerance():
    real, emu = _docs()
    rows = X.compare(real, [("shm", emu)], 0.15)
    # the W = 8 row and the bucket without a real row are left out
    assert [(r["link"], r["phase"], r["tokens"]) for r in rows] == [("shm", "decode", 1024)]
    (r,) = rows
    assert r["real"]["t_baseline_us"] == 5296.0
    assert r["diff"]["t_baseline_us"] == pytest.approx(5500 / 5296 - 1)
    assert r["flags"] == ["t_dbo_graph_us", "t_chosen_us"]  # +19.6 %; the baseline +3.9 % is not
    assert X.compare(real, [("shm", emu)], 0.25)[0]["flags"] == []


def test_setups_resolve_auto_per_machine_and_name_what_differs():
    rs = X.parse_setup(REAL_SETUP, "2x NVIDIA H200")
    es = X.parse_setup(EMU_SETUP, "1x NVIDIA H200 (x86_64)")
    assert (rs["preset"], rs["moe_layers"], rs["EP"]) == ("deepseek-v2-lite", 4, "2")
    assert rs["compute_backend"] == es["compute_backend"] == "inductor"
    assert X.parse_setup(EMU_SETUP, "CPU (x86_64)")["compute_backend"] == "aten"
    assert (rs["carve-out"], es["carve-out"]) == ("default", "none")


def test_the_command_prints_the_derived_link_and_the_table(tmp_path):
    real, emu = _docs()
    paths = []
    for name, doc in (("real", real), ("emu", emu)):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(doc))
    (ran,) = run_scripts([(os.path.join(ROOT, "benchmarks", "emulated_vs_real.py"),
                           ["--real", str(paths[0]), "--emulated", f"shm={paths[1]}",
                            "--json", str(tmp_path / "out.json")])])
    assert ran.returncode == 0, ran.stderr[-2000:]
    out = ran.stdout
    assert "| shm | decode | 1024 | 33.75 | 33.75 | 33.75 | 1,765 | 19.1 |" in out
    assert "unreachable" in out  # nvlink decode 1024: 76 GB/s, faster than the copy engines
    assert "0 of 1 buckets" in out and "setup differs: carve-out: real default vs emulated none" in out
    saved = json.loads((tmp_path / "out.json").read_text())
    assert saved["compare"][0]["flags"] == ["t_dbo_graph_us", "t_chosen_us"]
