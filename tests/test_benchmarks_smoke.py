"""The benchmarks' CPU smoke paths run end to end: ``bench_moe.py --emulate-ep`` on the tiny
preset (eager stand-ins for the CUDA graphs) produces a row with every figure and no error.
The benchmarks call the runner's internals (the split program over a bucket's inputs); when
their signature changed, every GPU run of the emulated benchmark failed with a TypeError that
no CPU test reached."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

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


def _calibrate_script():
    spec = importlib.util.spec_from_file_location(
        "_calibrate_script", os.path.join(ROOT, "benchmarks", "calibrate.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("extra, match", [
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
])
def test_calibrate_refuses_what_it_would_ignore_or_misread(tmp_path, capsys, extra, match):
    """A malformed ``--fit-only`` was a traceback (ValueError), a fit option beside ``--check``
    was silently ignored (``--schedule-out`` wrote nothing, rc 0), and a calibration without
    its overlap slowdown was checked with 1.0 (4 of 5 rows within 15 % where the stored model
    gives 2), and --schedule-out without --row wrote nothing (rc 0), with a --row of no row
    it raised StopIteration after the fit: each is now a usage error (rc 2) saying what to
    give."""
    cal = json.load(open(os.path.join(ROOT, "benchmarks", "calibration", "h200_2026-12-01.json")))
    paths = {"CAL": tmp_path / "cal.json", "NOSLOW": tmp_path / "noslow.json",
             "NOFIG": tmp_path / "nofig.json", "MISSING": tmp_path / "missing.json"}
    paths["CAL"].write_text(json.dumps(cal))
    paths["NOSLOW"].write_text(json.dumps({k: v for k, v in cal.items() if k != "overlap_slowdown"}))
    paths["NOFIG"].write_text(json.dumps({k: v for k, v in cal.items() if k != "figures"}))
    paths["s.json"] = tmp_path / "s.json"
    argv = [str(paths.get(a, a)) for a in extra]
    if "--check" not in argv:
        argv += ["--out", str(tmp_path / "out.json")]
    results = os.path.join(ROOT, "benchmarks", "results",
                           "emulated_v2lite_w8_calib_inductor_h200_2026-12-01.json")
    with pytest.raises(SystemExit) as e:
        _calibrate_script().main([results, *argv])
    assert e.value.code == 2
    assert match in capsys.readouterr().err
    assert not (tmp_path / "out.json").exists() and not (tmp_path / "s.json").exists()


def test_calibrate_fit_only_is_recorded_and_its_slowdown_fitted(tmp_path, capsys):
    """A calibration fitted on ``--fit-only`` rows said so nowhere (``holdout: None``, its
    ``check`` over every row as for a full fit); and a fit whose rows lack the
    ``--slowdown-from`` rows stored ``overlap_slowdown`` 1.0 / 1.0 under that name as if
    fitted. Now the file names the buckets it was fitted on, and the second is a usage error."""
    mod = _calibrate_script()
    results = os.path.join(ROOT, "benchmarks", "results",
                           "emulated_v2lite_w8_calib_inductor_h200_2026-12-01.json")
    out = tmp_path / "cal.json"
    with pytest.raises(SystemExit) as e:
        mod.main([results, "--out", str(out), "--fit-only", "decode:256",
                  "--slowdown-from", "deepseek-v3:8:50"])
    assert e.value.code == 2 and not out.exists()
    assert "none of the rows fitted on" in capsys.readouterr().err
    assert mod.main([results, "--out", str(out), "--fit-only", "prefill:2048,decode:256"]) == 0
    cal = json.loads(out.read_text())
    assert cal["fit_only"] == [["decode", 256], ["prefill", 2048]] and cal["check"]["rows"] == 5
    assert cal["overlap_slowdown_from"] == "deepseek-v2-lite:8:50"


def test_comm_ops_alone_run_whole_ops_in_the_dbo_order(monkeypatch):
    """``bench_emulated.comm_ops_fn``: per MoE layer the ubatches' dispatches, then their
    combines, each a whole op of the emulated backend (its packing and one round trip of its
    capacity), so ``comm ops`` times what the comm stream carries."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import bench_emulated as B
    import torch

    from dbo_compile.models import get_config

    cfg = get_config("tiny")
    world = B.E.EmulatedWorld(4, cfg.num_experts, cfg.top_k)
    fn = B.comm_ops_fn(world, cfg, torch.bfloat16, [5, 7], torch.device("cpu"))
    sent = []
    real = B.E.LINK.send

    def spy(src, wld):
        sent.append(tuple(src.shape))
        return real(src, wld)

    monkeypatch.setattr(B.E.LINK, "send", spy)
    fn()
    _, cols = B.payload_layout(cfg.hidden_size, torch.bfloat16, cfg.top_k)
    one_layer = [(world.capacity(5), cols), (world.capacity(7), cols),
                 (world.capacity(5), cfg.hidden_size), (world.capacity(7), cfg.hidden_size)]
    assert sent == one_layer * cfg.num_moe_layers


def _bench_module(name):
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    return importlib.import_module(name)


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
    B = _bench_module("bench_moe")
    with pytest.raises(SystemExit) as info:
        B.parse(argv)
    assert info.value.code == 2 and refused in capsys.readouterr().err


def test_a_flag_given_at_its_default_value_counts_as_given():
    F = _bench_module("flags")
    B = _bench_module("bench_moe")
    assert F.given_flags(B.parser(), ["--link-gbps", "50", "--no-eager"]) == {
        "link_gbps", "eager"}
    assert F.given_flags(B.parser(), []) == set()


def test_the_emulated_world_compiles_with_every_option_flag_it_was_given():
    """The emulated world's options carry ``--scheduler``, ``--comm-sms`` (the split program's
    SM carve-out: the SMs the comm kernels would hold), ``--dense-layers`` (the model) and
    ``--candidates default`` (the package default: it was taken for a candidate name)."""
    from dbo_compile import DboConfig

    B = _bench_module("bench_moe")
    E = _bench_module("bench_emulated")
    H = _bench_module("moe_harness")
    args = B.parse(["--emulate-ep", "8", "--scheduler", "naive", "--candidates", "default"])
    args.comm_sms = 24  # (refused without CUDA; the GPU run passes it)
    args.carveouts, args.candidate_names = (), H.candidate_names(args.candidates)
    options = E.world_options(args, 8, 50.0)
    assert options["scheduler"] == "naive" and options["comm_sms"] == 24
    assert options["schedule_candidates"] == DboConfig().schedule_candidates
    DboConfig(**options)  # every option is one the backend takes


def test_the_soak_refuses_the_flags_of_the_other_mode(capsys):
    S = _bench_module("soak")
    for argv, flag in ((["--gpu", "--contents", "8"], "--contents"),
                       (["--check-every", "5"], "--check-every"),
                       (["--gpu", "--world-sizes", "2"], "--world-sizes")):
        with pytest.raises(SystemExit):
            S.parse(argv)
        assert f"{flag}: not read" in capsys.readouterr().err
