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
