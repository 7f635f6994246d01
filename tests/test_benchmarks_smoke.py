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
