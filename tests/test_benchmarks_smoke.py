"""The benchmarks' CPU smoke paths run end to end: ``bench_moe.py --emulate-ep`` on the tiny
preset (eager stand-ins for the CUDA graphs) produces a row with every figure and no error.
The benchmarks call the runner's internals (the split program over a bucket's inputs); when
their signature changed, every GPU run of the emulated benchmark failed with a TypeError that
no CPU test reached."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from dbo_compile.testing.bench_cli import (
    all_rows_failed,
    failed_cell,
    given_flags,
    link_label,
    md_cell,
    moe_parser,
    parse_moe,
    parse_soak,
    timing_note,
    world_options,
)
from scripts import run_scripts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_emulated_benchmark_measures_a_bucket_on_cpu(tmp_path):
    out = tmp_path / "emulated.json"
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "bench_moe.py"), "--emulate-ep", "2",
           "--buckets", "decode:32", "--layers", "1", "--iters", "1", "--warmup", "0",
           "--timing-iters", "1", "--no-calib", "--json", str(out)]
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    (row,) = json.loads(out.read_text())["rows"]
    assert row["errors"] == [], row["errors"]
    for key in ("t_baseline_us", "t_split_serial_us", "t_split_nocomm_us", "t_comm_us",
                "t_comm_ops_us",
                "t_dbo_graph_us"):
        assert row[key] > 0, key
    err = row["num_eager_vs_reference"]  # the eager split step against the one-device model
    assert err["finite"] and err["max_rel"] < 0.05  # bf16 (the benchmark's dtype)


def test_calibrate_check_reproduces_the_stored_calibration_check(tmp_path):
    """``calibrate.py --check CAL`` predicts the rows with the stored figures and slowdown,
    without fitting: on the calibration's own sources it gives the check stored beside it
    (``benchmarks/results/calibration_check_*``), so on rows measured after the code moved it
    says how far the stored model now is; ``--out`` and ``--check`` exclude each other."""
    cal_path = os.path.join(ROOT, "benchmarks", "calibration", "h200_2026-12-01.json")
    cal = json.load(open(cal_path))
    got = tmp_path / "checks.json"
    script = os.path.join(ROOT, "benchmarks", "calibrate.py")
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    srcs = [os.path.join(ROOT, s) for s in cal["sources"]]
    r = subprocess.run([sys.executable, script, *srcs, "--check", cal_path, "--checks-json",
                        str(got)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    want = json.load(open(os.path.join(ROOT, "benchmarks", "results",
                                       "calibration_check_h200_2026-12-01.json")))
    rows = json.loads(got.read_text())
    assert len(rows) == len(want) == cal["check"]["rows"]
    for a, b in zip(rows, want):
        for key in ("unsplit_pred_us", "dbo_pred_us", "unsplit_meas_us", "dbo_meas_us"):
            assert abs(a[key] - b[key]) <= 1e-6 * max(1.0, abs(b[key])), (key, a, b)
    assert f"{cal['check']['within_15pct']} of {len(want)} rows within 15 %" in r.stdout
    r = subprocess.run([sys.executable, script, *srcs], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and "--out" in r.stderr and "--check" in r.stderr
    r = subprocess.run([sys.executable, script, *srcs, "--out", str(tmp_path / "c.json"),
                        "--fit-only", "decode:99999"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and "no such rows" in r.stderr


CALIBRATE = os.path.join(ROOT, "benchmarks", "calibrate.py")
CALIBRATE_RESULTS = os.path.join(ROOT, "benchmarks", "results",
                                 "emulated_v2lite_w8_calib_inductor_h200_2026-12-01.json")
#: (the command line's tail, what its usage error says)
CALIBRATE_REFUSALS = [
    (["--fit-only", "decode"], "'decode' is not PHASE:TOKENS"),
    (["--fit-only", "decode:x"], "'decode:x' is not PHASE:TOKENS"),
    (["--fit-only", "decode:256,"], "'' is not PHASE:TOKENS"),
    (["--fit-only", ""], "'' is not PHASE:TOKENS"),
    (["--check", "CAL", "--holdout", "deepseek-v3"], "--check fits nothing: --holdout"),
    (["--check", "CAL", "--fit-only", "decode:256"], "--check fits nothing: --fit-only"),
    (["--check", "CAL", "--schedule-out", "s.json", "--row", "decode:256:8"],
     "--check fits nothing: --row, --schedule-out"),
    (["--check", "CAL", "--slowdown-from", "deepseek-v3:8:50"],
     "--check fits nothing: --slowdown-from"),
    (["--check", "NOSLOW"], "has no 'overlap_slowdown'"),
    (["--check", "NOFIG"], "has no 'figures' object"),
    (["--check", "MISSING"], "cannot be read as JSON"),
    (["--schedule-out", "s.json"], "--schedule-out and --row PHASE:TOKENS:W go together"),
    (["--row", "decode:256:8"], "--schedule-out and --row PHASE:TOKENS:W go together"),
    (["--schedule-out", "s.json", "--row", "decode:99:8"], "--row decode:99:8: no such row"),
]


@pytest.fixture(scope="module")
def calibrate_refusals(tmp_path_factory):
    """``(folder, run)`` per :data:`CALIBRATE_REFUSALS`: ``calibrate.py`` run on the stored
    results with that tail (files named in it written to the case's own folder), all in one
    interpreter (:func:`scripts.run_scripts`)."""
    cal = json.load(open(os.path.join(ROOT, "benchmarks", "calibration", "h200_2026-12-01.json")))
    runs, folders = [], []
    for extra, _match in CALIBRATE_REFUSALS:
        tmp_path = tmp_path_factory.mktemp("refusal")
        paths = {"CAL": tmp_path / "cal.json", "NOSLOW": tmp_path / "noslow.json",
                 "NOFIG": tmp_path / "nofig.json", "MISSING": tmp_path / "missing.json"}
        paths["CAL"].write_text(json.dumps(cal))
        paths["NOSLOW"].write_text(json.dumps({k: v for k, v in cal.items()
                                               if k != "overlap_slowdown"}))
        paths["NOFIG"].write_text(json.dumps({k: v for k, v in cal.items() if k != "figures"}))
        paths["s.json"] = tmp_path / "s.json"
        argv = [str(paths.get(a, a)) for a in extra]
        if "--check" not in argv:
            argv += ["--out", str(tmp_path / "out.json")]
        runs.append((CALIBRATE, [CALIBRATE_RESULTS, *argv]))
        folders.append(tmp_path)
    return list(zip(folders, run_scripts(runs)))


@pytest.mark.parametrize("extra, match", CALIBRATE_REFUSALS)
def test_calibrate_refuses_what_it_would_ignore_or_misread(calibrate_refusals, extra, match):
    """A malformed ``--fit-only`` was a traceback (ValueError), a fit option beside ``--check``
    was silently ignored (``--schedule-out`` wrote nothing, rc 0), and a calibration without
    its overlap slowdown was checked with 1.0 (4 of 5 rows within 15 % where the stored model
    gives 2), and --schedule-out without --row wrote nothing (rc 0), with a --row of no row
    it raised StopIteration after the fit: each is now a usage error (rc 2) saying what to
    give."""
    tmp_path, ran = calibrate_refusals[CALIBRATE_REFUSALS.index((extra, match))]
    assert ran.returncode == 2
    assert match in ran.stderr
    assert not (tmp_path / "out.json").exists() and not (tmp_path / "s.json").exists()


def test_calibrate_fit_only_is_recorded_and_its_slowdown_fitted(tmp_path):
    """A calibration fitted on ``--fit-only`` rows said so nowhere (``holdout: None``, its
    ``check`` over every row as for a full fit); and a fit whose rows lack the
    ``--slowdown-from`` rows stored ``overlap_slowdown`` 1.0 / 1.0 under that name as if
    fitted. Now the file names the buckets it was fitted on, and the second is a usage error."""
    results = CALIBRATE_RESULTS
    out, refused_out = tmp_path / "cal.json", tmp_path / "refused.json"
    refused, fitted = run_scripts([  # one interpreter for both runs
        (CALIBRATE, [results, "--out", str(refused_out), "--fit-only", "decode:256",
                     "--slowdown-from", "deepseek-v3:8:50"]),
        (CALIBRATE, [results, "--out", str(out), "--fit-only", "prefill:2048,decode:256"])])
    assert refused.returncode == 2 and not refused_out.exists()
    assert "none of the rows fitted on" in refused.stderr
    assert fitted.returncode == 0, fitted.stderr[-2000:]
    cal = json.loads(out.read_text())
    assert cal["fit_only"] == [["decode", 256], ["prefill", 2048]] and cal["check"]["rows"] == 5
    assert cal["overlap_slowdown_from"] == "deepseek-v2-lite:8:50"


def test_comm_ops_alone_run_whole_ops_in_the_dbo_order(monkeypatch):
    """``comm_ops_fn`` (``bench_emulated``'s ``comm ops``): per MoE layer the ubatches'
    dispatches, then their combines, each a whole op of the emulated backend (its packing and
    one round trip of its capacity), so ``comm ops`` times what the comm stream carries."""
    import torch

    from dbo_compile.models import get_config
    from dbo_compile.ops import emulated as E
    from dbo_compile.ops.comm import payload_layout
    from dbo_compile.testing.moe import comm_ops_fn

    cfg = get_config("tiny")
    world = E.EmulatedWorld(4, cfg.num_experts, cfg.top_k)
    fn = comm_ops_fn(world, cfg, torch.bfloat16, [5, 7], torch.device("cpu"))
    sent = []
    real = E.LINK.send

    def spy(src, wld):
        sent.append(tuple(src.shape))
        return real(src, wld)

    monkeypatch.setattr(E.LINK, "send", spy)
    fn()
    _, cols = payload_layout(cfg.hidden_size, torch.bfloat16, cfg.top_k)
    one_layer = [(world.capacity(5), cols), (world.capacity(7), cols),
                 (world.capacity(5), cfg.hidden_size), (world.capacity(7), cfg.hidden_size)]
    assert sent == one_layer * cfg.num_moe_layers


@pytest.mark.parametrize("argv, refused", [
    (["--emulate-ep", "8", "--vote-group", "world"], "--vote-group: not read with --emulate-ep"),
    (["--emulate-ep", "8", "--link", "shm"], "--link: not read with --emulate-ep"),
    (["--emulate-ep", "8", "--inductor"], "--inductor: not read with --emulate-ep"),
    (["--timing-iters", "3", "--no-check"],
     "--timing-iters, --no-check: not read without --emulate-ep"),
    (["--link-gbps", "50"], "--link-gbps: not read without --emulate-ep"),
    (["--kernels", "5"], "--kernels: not read without --emulate-ep"),
])
def test_a_flag_the_mode_does_not_read_is_refused(argv, refused, capsys):
    """``bench_moe.py --emulate-ep 8 --comm-sms 24`` ran without the carve-out (the emulated
    world never received the option): every flag is now read by the mode it is given in,
    or refused with a usage error naming it."""
    with pytest.raises(SystemExit) as info:
        parse_moe(argv)
    assert info.value.code == 2 and refused in capsys.readouterr().err


def test_a_flag_given_at_its_default_value_counts_as_given():
    assert given_flags(moe_parser(), ["--link-gbps", "50", "--no-eager"]) == {
        "link_gbps", "eager"}
    assert given_flags(moe_parser(), []) == set()


def test_the_emulated_world_compiles_with_every_option_flag_it_was_given():
    """The emulated world's options carry ``--scheduler``, ``--comm-sms`` (the split program's
    SM carve-out: the SMs the comm kernels would hold), ``--dense-layers`` (the model) and
    ``--candidates default`` (the package default: it was taken for a candidate name)."""
    from dbo_compile import DboConfig
    from dbo_compile.testing.moe import candidate_names

    args = parse_moe(["--emulate-ep", "8", "--scheduler", "naive", "--candidates", "default"])
    args.comm_sms = 24  # (refused without CUDA; the GPU run passes it)
    args.carveouts, args.candidate_names = (), candidate_names(args.candidates)
    options = world_options(args, 8, 50.0)
    assert options["scheduler"] == "naive" and options["comm_sms"] == 24
    assert options["schedule_candidates"] == DboConfig().schedule_candidates
    DboConfig(**options)  # every option is one the backend takes


def test_the_soak_refuses_the_flags_of_the_other_mode(capsys):
    for argv, flag in ((["--gpu", "--contents", "8"], "--contents"),
                       (["--check-every", "5"], "--check-every"),
                       (["--gpu", "--world-sizes", "2"], "--world-sizes")):
        with pytest.raises(SystemExit):
            parse_soak(argv)
        assert f"{flag}: not read" in capsys.readouterr().err


def test_the_emulated_world_takes_the_experts_backend_and_fp8():
    """FP8 expert GEMMs in the emulated world (issue 28 item 4): ``--experts-backend deep_gemm
    --fp8`` reach the compile options, which the backend takes; ``--fp8`` without DeepGEMM's
    backend is a usage error (only DeepGEMM serves FP8 experts), never a bf16 run labelled FP8."""
    from dbo_compile import DboConfig
    from dbo_compile.testing.moe import candidate_names

    args = parse_moe(["--emulate-ep", "32"])
    args.experts_backend, args.fp8 = "deep_gemm", True  # (refused without CUDA; a GPU run's)
    args.carveouts, args.candidate_names = (), candidate_names(args.candidates)
    options = world_options(args, 32, 50.0)
    assert options["experts_backend"] == "deep_gemm"
    assert dict(options["experts_backend_options"]) == {"fp8": True}
    DboConfig(**options)
    args = parse_moe(["--emulate-ep", "8"])
    args.carveouts, args.candidate_names = (), candidate_names(args.candidates)
    assert "experts_backend" not in world_options(args, 8, 50.0)  # the package default


@pytest.mark.parametrize("argv, refused", [
    (["--emulate-ep", "8", "--fp8"], "--fp8 needs --experts-backend deep_gemm"),
    (["--emulate-ep", "8", "--experts-backend", "torch", "--fp8"],
     "--fp8 needs --experts-backend deep_gemm"),
])
def test_fp8_without_deep_gemm_is_refused(argv, refused, capsys):
    with pytest.raises(SystemExit) as info:
        parse_moe(argv)
    assert info.value.code == 2 and refused in capsys.readouterr().err


def test_deep_gemm_without_cuda_is_refused(monkeypatch, capsys):
    """``--emulate-ep 8 --experts-backend deep_gemm`` on a machine without CUDA ran, failed
    every row (DeepGEMM is not importable there) and exited 0: now a usage error."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for argv in (["--emulate-ep", "8", "--experts-backend", "deep_gemm"],
                 ["--emulate-ep", "8", "--experts-backend", "deep_gemm", "--fp8"]):
        with pytest.raises(SystemExit) as info:
            parse_moe(argv)
        err = capsys.readouterr().err
        assert info.value.code == 2 and "DeepGEMM needs a CUDA GPU" in err, err
    with pytest.raises(SystemExit):  # the fp8 check still comes first
        parse_moe(["--emulate-ep", "8", "--fp8"])
    assert "--fp8 needs --experts-backend deep_gemm" in capsys.readouterr().err
    assert parse_moe(["--emulate-ep", "8", "--experts-backend", "torch"]).experts_backend == "torch"


def test_a_failed_rows_error_stays_on_one_table_line():
    """An error with newlines and pipes (a traceback, a shape list) broke the markdown table
    of ``bench_moe.py --emulate-ep`` into several lines and columns."""
    assert md_cell("a\nb |c\r\n  d") == "a b \\|c d"
    assert md_cell("x" * 300, limit=200) == "x" * 200
    cell = failed_cell({"errors": ["ExpertsOpError: needs\nthe package | deep_gemm", "two"]})
    assert cell == "failed: ExpertsOpError: needs the package \\| deep_gemm; two"
    line = "| " + " | ".join(["p", "8", cell]) + " |"
    assert "\n" not in line and line.replace("\\|", "").count("|") == 4
    # a bucket not split is an outcome, not a failure: its reason alone
    assert failed_cell({"errors": ["not split: 8 tokens per rank is below"]}) == (
        "not split: 8 tokens per rank is below")


def test_a_run_whose_every_row_failed_is_a_failed_run():
    """Every row of a run failing (an exception per bucket or world: only ``errors``) made the
    emulated benchmark exit 0; a row not split (a measured outcome) is no failure."""
    failed = {"phase": "decode", "tokens_per_rank": 32, "errors": ["RuntimeError: x"]}
    ok = {"phase": "decode", "tokens_per_rank": 64, "errors": [], "t_dbo_graph_us": 10.0,
          "t_baseline_us": 12.0}
    not_split = {"phase": "decode", "tokens_per_rank": 8, "errors": ["not split: below"]}
    assert all_rows_failed([failed, dict(failed)])
    assert not all_rows_failed([failed, ok])
    assert not all_rows_failed([failed, not_split])
    assert not all_rows_failed([])


def test_the_multi_rank_mode_outside_torchrun_is_a_usage_error(monkeypatch, capsys):
    """``python benchmarks/bench_moe.py`` (no torchrun, no ``--emulate-ep``) crashed in
    ``init_process_group`` with "environment variable RANK expected, but not set"."""
    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(SystemExit) as info:
        parse_moe([])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "runs under torchrun" in err and "--emulate-ep W" in err
    assert parse_moe(["--emulate-ep", "2"]).emulate_ep == "2"  # one process: no torchrun
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert parse_moe([]).emulate_ep is None


def test_a_cpu_run_is_labelled_gloo_and_wall_clock():
    """The CPU Gloo rows of ``torchrun ... bench_moe.py`` were labelled ``nvlink`` and their
    footer said CUDA-event-timed graph replays."""
    assert link_label(None, cuda=False, environ={}) == "gloo (CPU)"
    assert link_label(None, cuda=True, environ={}) == "nvlink"
    assert link_label(None, cuda=True, environ={"NCCL_P2P_DISABLE": "1"}) == "shm"
    assert link_label("shm", cuda=True, environ={}) == "shm"
    cpu, gpu = timing_note(False), timing_note(True)
    assert "wall-clock" in cpu and "CUDA-event" not in cpu and "CUDA graph" not in cpu
    assert "CUDA-event-timed graph replays" in gpu and "in one CUDA graph" in gpu


def test_link_without_cuda_is_refused(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit) as info:
        parse_moe(["--link", "nvlink"])
    assert info.value.code == 2 and "--link: not read without CUDA" in capsys.readouterr().err


def test_a_bucket_without_a_split_graph_says_why():
    """``bench_moe --emulate-ep 2 --buckets decode:8`` printed "not split: None": the bucket
    was below the split threshold, which no row said. Every reason a bucket has no split graph
    is named: the graph cannot split, the threshold, the pruning, the memory."""
    from types import SimpleNamespace

    from dbo_compile import DboConfig
    from dbo_compile.runtime.prune import PrunePlan
    from dbo_compile.testing.bench_cli import no_split_reason

    def bucket(tokens, reason=None, prune=None, dropped=None, **cfg):
        art = SimpleNamespace(reason=reason, config=DboConfig(**cfg))
        return SimpleNamespace(tokens=tokens, artifact=art, prune=prune, dropped=dropped or {})

    assert "no all-to-all" in no_split_reason(bucket(8, reason="no all-to-all found"))
    why = no_split_reason(bucket(8))
    assert "8 tokens" in why and "threshold" in why and "32" in why, why
    assert "multiple of 2" in no_split_reason(bucket(33, split="always"))
    why = no_split_reason(bucket(64, prune=PrunePlan(timed=(), skip_split="cannot win by 3 %")))
    assert "cannot win by 3 %" in why, why
    why = no_split_reason(bucket(64, prune=PrunePlan(timed=()),
                                 dropped={"list": "bucket 64: list ran out of GPU memory"}))
    assert "out of GPU memory" in why, why


INDUCTOR_RESULTS = [os.path.join(ROOT, "benchmarks", "results", f"{name}_h200_2026-12-01.json")
                    for name in ("emulated_v2lite_w8_pipelined", "emulated_v2lite_worlds_pipelined",
                                 "emulated_v3_pipelined")]


def test_calibrate_fits_physical_figures_on_fused_runs_and_holds_out_worlds(tmp_path):
    """``--physical TFLOPS:GBPS --fusion runs --fit-worlds W@GBPS``: every class's figures
    within the device's peaks, attention by its bytes alone (its per-row term does not scale
    with the heads, so it cannot carry from one model to another), element-wise runs as one
    ``fused`` class; fitted on the named worlds' rows only, checked on every row with the
    held-out ones marked; ``--check`` of the stored file fuses the rows as the fit did."""
    cal, fit, again = tmp_path / "cal.json", tmp_path / "fit.json", tmp_path / "check.json"
    r1, r2, *bad = run_scripts([
        (CALIBRATE, [*INDUCTOR_RESULTS, "--physical", "989:4800", "--fusion", "runs",
                     "--fit-worlds", "8@50", "--out", str(cal), "--checks-json", str(fit)]),
        (CALIBRATE, [*INDUCTOR_RESULTS, "--check", str(cal), "--checks-json", str(again)]),
        (CALIBRATE, [*INDUCTOR_RESULTS, "--physical", "989", "--out", str(cal)]),
        (CALIBRATE, [*INDUCTOR_RESULTS, "--fit-worlds", "12@50", "--out", str(cal)]),
        (CALIBRATE, [*INDUCTOR_RESULTS, "--fusion", "kernels", "--out", str(cal)])])
    assert r1.returncode == 0 and r2.returncode == 0, r1.stderr[-3000:] + r2.stderr[-3000:]
    stored = json.loads(cal.read_text())
    figs = stored["figures"]
    assert stored["fusion"] == "runs" and "fused" in figs and "other" not in figs
    assert stored["physical"] == {"tflops": 989.0, "gbps": 4800.0}
    assert stored["fit_worlds"] == [[8, 50.0]]
    for c in ("gemm", "experts", "attention.decode", "attention.prefill", "fused"):
        assert (figs[c]["tflops"] or 0) <= 989.0 + 1e-6 and figs[c]["gbps"] <= 4800.0 + 1e-6, c
    assert figs["attention.decode"]["us_per_row"] == figs["attention.prefill"]["us_per_row"] == 0
    rows = json.loads(fit.read_text())
    assert {(c["world_size"], c["link_gbps"]) for c in rows if c["fitted"]} == {(8, 50.0)}
    assert sum(not c["fitted"] for c in rows) >= 20
    assert stored["check"]["held_out"]["rows"] == sum(not c["fitted"] for c in rows)
    for a, b in zip(rows, json.loads(again.read_text())):
        assert a["dbo_pred_us"] == pytest.approx(b["dbo_pred_us"], rel=1e-9)
        assert a["unsplit_pred_us"] == pytest.approx(b["unsplit_pred_us"], rel=1e-9)
    assert [b.returncode for b in bad] == [2, 2, 2]
    assert "--physical '989' is not TFLOPS:GBPS" in bad[0].stderr
    assert "--fit-worlds 12@50: no such rows" in bad[1].stderr
    assert "invalid choice: 'kernels'" in bad[2].stderr


def test_hold_bound_orders_its_figures_on_the_stored_row(tmp_path):
    """``benchmarks/hold_bound.py`` on the stored 24-SM-held EP-8 row: the one-link floor is
    below every model makespan, the hold model is slower than no holds, and holds that start
    at their issue lie between; a JSON without such a row is a usage error."""
    script = os.path.join(ROOT, "benchmarks", "hold_bound.py")
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    row = os.path.join(ROOT, "benchmarks", "results",
                       "emulated_ep8_hold24sms_holdmodel_green_h100_2026-12-07.json")
    r = subprocess.run([sys.executable, script, row], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    (b,) = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert b["hold_fraction"] == pytest.approx(24 / 132, abs=1e-3)
    assert b["floor_us"] <= b["model_no_holds_us"] < b["model_holds_at_issue_us"]
    assert b["model_holds_at_issue_us"] <= b["model_holds_us"]
    assert b["measured_speedup"] == pytest.approx(b["t_unsplit_us"] / b["t_measured_us"],
                                                  abs=1e-3)
    bad = tmp_path / "no_rows.json"
    bad.write_text(json.dumps({"rows": [{"phase": "decode"}]}))
    r = subprocess.run([sys.executable, script, str(bad)], env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and "no row with calib" in r.stderr
