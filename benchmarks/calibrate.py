"""Calibrate the cost model on measured times, store it with its machine, and check it.

Input: results files of ``bench_moe.py --emulate-ep ...`` (``benchmarks/bench_emulated.py``),
whose rows carry ``calib``: the cost-model features of every node of the unsplit program and
of the DBO graph's schedule units at the row's bucket, and the isolated replay times of the
DBO graph's units of layer 0 (compute stages and comm ops, each captured alone).

1. **Fit** the calibrated model's figures per node class (``dbo_compile/passes/cost_model.py``:
   ``t = launch + max(flops / tflops, bytes / gbps) + rows * us_per_row``) to the measured unit
   times: compute classes jointly (least squares on relative errors, log-parameters), comm
   ops separately (linear: ``launch + link bytes / gbps + device kB * us_per_row``).
2. **Check** it on whole steps of every row: predicted unsplit step (its nodes in turn) and
   predicted DBO step (the makespan of the DBO graph's schedule with the calibrated unit
   costs, compute overlapping comm slowed by one factor fitted on the ``--slowdown-from``
   rows' DBO graphs: units are timed alone) against the measured baseline and DBO graph;
   within 15 % is the target.
   ``--physical TFLOPS:GBPS`` bounds every class's figures by the device's peaks (dense bf16
   TFLOP/s, HBM GB/s) and fits attention by its bytes alone (no per-row term: the bytes of its
   new tokens' q / k / v / out scale with the heads as its context read does, a per-row
   term does not, so it cannot carry from one model to another); ``--fusion runs`` fits the
   Inductor stages' element-wise nodes as fused runs (``dbo_compile/passes/calibrate.py``:
   ``fuse_runs``, one ``fused`` class instead of ``other``); ``--fit-worlds W@GBPS,...``
   fits on those worlds' rows alone, the other rows held out (marked ``fitted: false``).
3. **Store** ``--out`` (the figures, the machine, the date, the sources, the fit's errors):
   ``DboConfig(calibration=PATH)`` points at it. ``--schedule-out`` writes the calibrated
   schedule of one row (``--row PHASE:TOKENS:W``) for ``python -m dbo_compile.viz SCHEDULE
   --profile TRACE`` (measured vs predicted).

Run::

    python benchmarks/calibrate.py benchmarks/results/emulated_h200_*.json \
        --out benchmarks/calibration/h200.json --md benchmarks/results/calibration.md
    python benchmarks/calibrate.py NEW_RESULTS.json --check benchmarks/calibration/h200.json
    python benchmarks/calibrate.py benchmarks/results/emulated_*_pipelined_h200_2026-12-01.json \
        --physical 989:4800 --fusion runs --fit-worlds 8@50 --out benchmarks/calibration/x.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys

import numpy as np
from scipy.optimize import least_squares, nnls

from dbo_compile.ops.emulated.link import MAX_CHUNKS
from dbo_compile.passes.calibrate import FUSED, fuse_runs, predict_split, predict_unsplit
from dbo_compile.testing.link_model import CHUNK_SETUP_US, link_us

#: fitted figures per compute class (the rest stay ``None`` / 0). Attention is fitted per
#: phase: its cost per row depends on the context it reads (decode: a cached context per
#: token; prefill: a block of queries over their prompt), which no compile-time feature knows;
#: the scheduler's cost model uses the decode figures as ``attention``.
FIT = {"gemm": ("tflops", "gbps", "launch_us"),
       "experts": ("tflops", "gbps", "launch_us"),
       "attention.decode": ("gbps", "launch_us", "us_per_row"),
       "attention.prefill": ("gbps", "launch_us", "us_per_row"),
       "other": ("gbps", "launch_us")}
START = {"tflops": 500.0, "gbps": 2500.0, "launch_us": 3.0, "us_per_row": 0.01}
BOUNDS = {"tflops": (20.0, 1500.0), "gbps": (50.0, 6000.0), "launch_us": (0.05, 500.0),
          "us_per_row": (1e-6, 10.0)}


def load_rows(paths: list[str], fusion: str | None = None) -> tuple[list[dict], list[dict]]:
    """The rows with calibration data; each gets ``link_eff_gbps``: its asked link speed or the
    hardware's measured duplex copy rate, whichever is lower. ``fusion="runs"``: their unsplit
    program's and units' features as fused runs (:func:`fuse_runs`), as the fit and the checks
    of such a calibration see them."""
    docs, rows = [], []
    for p in paths:
        with open(p) as f:
            doc = json.load(f)
        hw = min((v["copy_gbps"] for v in (doc.get("link") or {}).values()), default=None)
        docs.append({"path": p, "machine": doc.get("machine"), "date": doc.get("date"),
                     "link": doc.get("link")})
        for r in doc["rows"]:
            if r.get("calib") and r.get("t_dbo_graph_us"):
                r["link_eff_gbps"] = min(r["link_gbps"], hw or r["link_gbps"])
                if fusion == "runs":
                    c = r["calib"]
                    c["unsplit"] = fuse_runs([tuple(f) for f in c["unsplit"]])
                    c["features"] = {k: fuse_runs([tuple(f) for f in v])
                                     for k, v in c["features"].items()}
                rows.append(r)
    return docs, rows


def _row_features(r: dict, feats) -> list[tuple]:
    """A row's node features with the class the fit uses (attention by phase) and comm as
    ``("comm", 0, pipelined link µs at the row's link, device kB)``."""
    out = []
    for cls, f, b, rows in feats:
        if cls == "attention":
            cls = f"attention.{r['phase']}"
        elif cls == "comm":
            f, b = 0.0, link_us(b, r["link_eff_gbps"])
        out.append((cls, f, b, rows))
    return out


def unit_samples(rows: list[dict]) -> tuple[list, list]:
    """(features, measured µs) of every measured unit: compute stages and comm ops."""
    compute, comm = [], []
    for r in rows:
        c = r["calib"]
        kinds = {str(u["id"]): u["kind"] for u in c["schedule"]["units"]}
        for uid, us in c["measured_units_us"].items():
            feats = _row_features(r, c["features"][uid])
            if not feats or us <= 0:
                continue
            (comm if kinds[uid] == "comm" else compute).append((feats, us))
    return compute, comm


def fit_classes(physical: bool, fusion: str | None) -> dict[str, tuple[str, ...]]:
    """The fitted figures per class (:data:`FIT`): with ``physical``, attention by its bytes
    (no ``us_per_row``); with ``fusion="runs"``, ``fused`` runs instead of ``other`` nodes."""
    fit = dict(FIT)
    if physical:
        for c in ("attention.decode", "attention.prefill"):
            fit[c] = tuple(n for n in fit[c] if n != "us_per_row")
    if fusion == "runs":
        fit[FUSED] = fit.pop("other")
    return fit


def _figs_from(theta: np.ndarray, fit: dict) -> dict:
    figs, i = {}, 0
    for cls, names in fit.items():
        f = {"tflops": None, "gbps": None, "launch_us": 0.0, "us_per_row": 0.0}
        for n in names:
            f[n] = float(math.exp(theta[i]))
            i += 1
        figs[cls] = f
    return figs


def _cost(f: dict, flops, nbytes, rows) -> float:
    ft = flops / (f["tflops"] * 1e6) if f["tflops"] else 0.0
    bt = nbytes / (f["gbps"] * 1e3) if f["gbps"] else 0.0
    return f["launch_us"] + max(ft, bt) + rows * f["us_per_row"]


def fit_compute(samples: list, fit: dict | None = None,
                peaks: dict | None = None) -> tuple[dict, dict]:
    """Least squares on ``(pred - meas) / meas`` of the classes and figures ``fit`` (default
    :data:`FIT`), each within :data:`BOUNDS` and at most ``peaks`` (``{"tflops": ...,
    "gbps": ...}``, the device's); returns the figures and the fit's errors."""
    fit = FIT if fit is None else fit
    # with the device's peaks, an effective rate may go as low as it must: attention's bytes
    # are its new tokens', its context read is ~its context length times them
    bounds = {n: (1.0 if peaks and n == "gbps" else lo, min(hi, (peaks or {}).get(n, hi)))
              for n, (lo, hi) in BOUNDS.items()}
    x0 = np.log([min(START[n], bounds[n][1]) for names in fit.values() for n in names])
    lo = np.log([bounds[n][0] for names in fit.values() for n in names])
    hi = np.log([bounds[n][1] for names in fit.values() for n in names])

    def resid(theta):
        figs = _figs_from(theta, fit)
        return np.array([(sum(_cost(figs[c], f, b, r) for c, f, b, r in feats if c in figs) - us)
                         / us for feats, us in samples])

    sol = least_squares(resid, x0, bounds=(lo, hi), x_scale=1.0, max_nfev=4000)
    rel = resid(sol.x)
    return _figs_from(sol.x, fit), {"units": len(samples), "median_abs_rel": float(np.median(np.abs(rel))),
                               "max_abs_rel": float(np.max(np.abs(rel))), "nfev": int(sol.nfev)}


def fit_comm(samples: list) -> tuple[dict, dict]:
    """``t = launch + scale * link µs + kB * us_per_row`` (the link's round trip at its
    effective speed, :func:`link_us`) by non-negative least squares on relative errors."""
    a = np.array([[1.0, sum(f[2] for f in feats), sum(f[3] for f in feats)]
                  for feats, _ in samples])
    y = np.array([us for _, us in samples])
    w = 1.0 / y  # relative errors
    coef, _ = nnls(a * w[:, None], y * w)
    figs = {"launch_us": float(coef[0]), "link_scale": float(coef[1]),
            "us_per_row": float(coef[2])}
    rel = (a @ coef - y) / y
    return figs, {"units": len(samples), "median_abs_rel": float(np.median(np.abs(rel))),
                  "max_abs_rel": float(np.max(np.abs(rel)))}


def row_cost(r: dict, figures: dict):
    """The per-node cost function of a row (its phase's attention, its link)."""
    comm = figures["comm"]

    def cost(feat):
        (cls, f, b, rows), = _row_features(r, [feat])
        if cls == "comm":
            return comm["launch_us"] + comm["link_scale"] * b + comm["us_per_row"] * rows
        return _cost(figures[cls], f, b, rows) if cls in figures else 0.0
    return cost


def fit_slowdown(rows: list[dict], figures: dict) -> tuple[float, float]:
    """The slowdowns of compute and of comm units where they overlap the other stream
    (:func:`simulate_overlapped`) that best predict the DBO graphs of ``rows`` (least
    squares on relative errors; a grid from 1.00 to 2.00, then refined)."""
    def err(k):
        return sum((predict_split(row_cost(r, figures), r["calib"], slowdown=k)[0]
                    / r["t_dbo_graph_us"] - 1) ** 2 for r in rows)
    grid = [1.0 + i / 10 for i in range(11)]
    best = min(((a, b) for a in grid for b in grid), key=err)
    fine = [d / 100 for d in range(-5, 6)]
    best = min(((max(1.0, best[0] + a), max(1.0, best[1] + b)) for a in fine for b in fine),
               key=err)
    return round(best[0], 2), round(best[1], 2)


def check(rows: list[dict], figures: dict, slowdown: tuple[float, float],
          fitted: list[dict] | None = None) -> list[dict]:
    """Predicted vs measured steps of ``rows``; each marked ``fitted`` (one of ``fitted``,
    default all: its units were in the fit) or held out."""
    out = []
    fit_ids = {id(r) for r in (rows if fitted is None else fitted)}
    for r in rows:
        c = r["calib"]
        cost = row_cost(r, figures)
        pu = predict_unsplit(cost, c)
        ps, _ = predict_split(cost, c, slowdown=slowdown)
        pser, _ = predict_split(cost, c, serial=True)
        mu, ms = r["t_baseline_us"], r["t_dbo_graph_us"]
        out.append({"preset": r.get("preset"), "world_size": r.get("world_size"),
                    "link_gbps": r.get("link_gbps"), "phase": r["phase"],
                    "tokens_per_rank": r["tokens_per_rank"], "candidate": c["candidate"],
                    "unsplit_meas_us": mu, "unsplit_pred_us": pu, "unsplit_err": pu / mu - 1,
                    "dbo_meas_us": ms, "dbo_pred_us": ps, "dbo_err": ps / ms - 1,
                    "serial_meas_us": r.get("t_split_serial_us"), "serial_pred_us": pser,
                    "speedup_meas": mu / ms, "speedup_pred": pu / ps,
                    "fitted": id(r) in fit_ids})
    return out


def markdown(checks: list[dict], figures: dict, fit: dict, machine: str,
             label: str = "Unit fit") -> str:
    lines = [f"Calibrated on {machine}. Figures per class: " + "; ".join(
        f"{c}: " + ", ".join(f"{k} {v:.3g}" for k, v in f.items() if isinstance(v, float) and v)
        for c, f in figures.items()
        if isinstance(f, dict)),
        "", f"{label}: {json.dumps(fit)}", "",
        "| preset | W | GB/s | phase | tok/rank | unsplit meas | unsplit pred | err | DBO meas "
        "| DBO pred (schedule) | err | speedup meas | speedup pred |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in checks:
        held = "" if c.get("fitted", True) else " (held out)"
        lines.append(
            f"| {c['preset']}{held} | {c['world_size']} | {c['link_gbps']:g} | {c['phase']} | "
            f"{c['tokens_per_rank']} | {c['unsplit_meas_us']:,.0f} | {c['unsplit_pred_us']:,.0f} | "
            f"{c['unsplit_err']:+.1%} | {c['dbo_meas_us']:,.0f} | {c['dbo_pred_us']:,.0f} "
            f"({c['candidate']}) | {c['dbo_err']:+.1%} | {c['speedup_meas']:.3f}× | "
            f"{c['speedup_pred']:.3f}× |")
    worst = max(max(abs(c["unsplit_err"]), abs(c["dbo_err"])) for c in checks)
    within = sum(abs(c["unsplit_err"]) <= 0.15 and abs(c["dbo_err"]) <= 0.15 for c in checks)
    lines += ["", f"{within} of {len(checks)} rows within 15 % on both; worst |error| "
                  f"{worst:.1%}."]
    held = summary([c for c in checks if not c.get("fitted", True)])
    if held:
        lines[-1] += (f" Held out (not fitted on): {held['within_15pct']} of {held['rows']} "
                      f"within 15 %, worst {held['worst_abs_err']:.1%}.")
    return "\n".join(lines) + "\n"


def summary(checks: list[dict]) -> dict | None:
    """Rows, rows within 15 % on both steps, worst |error| of ``checks`` (``None``: none)."""
    if not checks:
        return None
    return {"rows": len(checks),
            "within_15pct": int(sum(abs(c["unsplit_err"]) <= 0.15 and abs(c["dbo_err"]) <= 0.15
                                    for c in checks)),
            "worst_abs_err": float(max(max(abs(c["unsplit_err"]), abs(c["dbo_err"]))
                                       for c in checks))}


def read_stored(p: argparse.ArgumentParser, path: str) -> dict:
    """The calibration ``--check`` checks: a JSON object with the ``figures`` and the
    ``overlap_slowdown`` (``compute``, ``comm``) that ``--out`` writes; anything else is a
    usage error naming what is missing (a missing slowdown is not taken as 1.0: that would
    check another model than the stored one)."""
    try:
        with open(path) as f:
            cal = json.load(f)
    except (OSError, ValueError) as e:
        p.error(f"--check {path}: cannot be read as JSON ({e})")
    slow = cal.get("overlap_slowdown") if isinstance(cal, dict) else None
    if not isinstance(cal, dict) or not isinstance(cal.get("figures"), dict):
        p.error(f"--check {path}: has no 'figures' object (not a calibration that "
                "calibrate.py --out wrote)")
    if not (isinstance(slow, dict) and all(isinstance(slow.get(k), (int, float))
                                           for k in ("compute", "comm"))):
        p.error(f"--check {path}: has no 'overlap_slowdown' {{'compute': ..., 'comm': ...}} "
                f"(found {slow!r}); refit it with --out")
    if cal.get("fusion") not in (None, "runs"):
        p.error(f"--check {path}: fusion {cal.get('fusion')!r} is not 'runs' or absent")
    return cal


def parse_physical(p: argparse.ArgumentParser, value: str | None) -> dict | None:
    """``--physical TFLOPS:GBPS`` as ``{"tflops": ..., "gbps": ...}``; malformed: a usage
    error."""
    if value is None:
        return None
    tf, _, gb = value.partition(":")
    try:
        peaks = {"tflops": float(tf), "gbps": float(gb)}
    except ValueError:
        peaks = None
    if peaks is None or min(peaks.values()) <= 0:
        p.error(f"--physical {value!r} is not TFLOPS:GBPS (the device's dense bf16 TFLOP/s and "
                "HBM GB/s, both > 0), e.g. 989:4800 for an H200")
    return peaks


def parse_worlds(p: argparse.ArgumentParser, value: str | None) -> set[tuple[int, float]] | None:
    """``--fit-worlds W@GBPS,...`` as ``{(W, GBPS)}``; malformed: a usage error."""
    if value is None:
        return None
    want = set()
    for w in value.split(","):
        ws, _, gb = w.partition("@")
        try:
            want.add((int(ws), float(gb)))
        except ValueError:
            p.error(f"--fit-worlds {value!r}: {w!r} is not W@GBPS (EP size @ link GB/s), "
                    "e.g. 8@50")
    return want


def parse_fit_only(p: argparse.ArgumentParser, value: str) -> set[tuple[str, int]]:
    """``--fit-only PHASE:TOKENS,...`` as ``{(phase, tokens)}``; a malformed entry is a usage
    error."""
    want = set()
    for b in value.split(","):
        ph, _, tok = b.partition(":")
        if ph not in ("decode", "prefill") or not tok.isdigit():
            p.error(f"--fit-only {value!r}: {b!r} is not PHASE:TOKENS (PHASE decode or "
                    "prefill, TOKENS an integer), e.g. decode:256,prefill:4096")
        want.add((ph, int(tok)))
    return want


def _bucket_key(r: dict) -> str:
    """A row as ``--row`` names it: ``PHASE:TOKENS:W``."""
    return f"{r['phase']}:{r['tokens_per_rank']}:{r.get('world_size')}"


def write_checks(args, md: str, checks: list[dict]) -> None:
    """``--md`` (the markdown table) and ``--checks-json`` (the per-row check), where given."""
    if args.md:
        with open(args.md, "w") as f:
            f.write(md)
    if args.checks_json:
        with open(args.checks_json, "w") as f:
            json.dump(checks, f, indent=1)


def check_stored(args, cal: dict, rows: list[dict]) -> int:
    """``--check``: the stored figures and overlap slowdown of ``cal`` on ``rows`` (loaded
    with its ``fusion``)."""
    figures = cal["figures"]
    slow = cal["overlap_slowdown"]
    slowdown = (slow["compute"], slow["comm"])
    checks = check(rows, figures, slowdown)
    md = markdown(checks, figures, {"checked": os.path.relpath(args.check),
                                    "overlap_slowdown": slowdown}, cal.get("machine", "?"),
                  label="Stored calibration (not refitted)")
    write_checks(args, md, checks)
    print(md)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", nargs="+")
    p.add_argument("--out", default=None, help="the calibration JSON to write (required "
                                                "unless --check)")
    p.add_argument("--check", default=None, metavar="CALIBRATION",
                   help="check a stored calibration (its figures and overlap slowdown) on "
                        "these results' rows, without fitting: predicted vs measured after "
                        "the code moved (rows measured after the fit)")
    p.add_argument("--md", default=None, help="markdown table of predicted vs measured")
    p.add_argument("--checks-json", default=None, help="the per-row check as JSON")
    p.add_argument("--holdout", default=None,
                   help="fit without the rows of this preset and check on them too")
    p.add_argument("--slowdown-from", default="deepseek-v2-lite:8:50",
                   metavar="PRESET:W:GBPS",
                   help="fit the slowdown of compute overlapping comm on these rows' DBO "
                        "graphs (the other rows check it)")
    p.add_argument("--fit-only", default=None, metavar="PHASE:TOKENS,...",
                   help="fit on these buckets' rows alone and check on every row (the others "
                        "held out)")
    p.add_argument("--physical", default=None, metavar="TFLOPS:GBPS",
                   help="bound every class's figures by the device's peaks (dense bf16 TFLOP/s, "
                        "HBM GB/s; an H200: 989:4800) and fit attention by its bytes alone")
    p.add_argument("--fusion", default=None, choices=["runs"],
                   help="runs: fit each run of element-wise nodes between extern kernels as "
                        "one fused kernel (Inductor stages), class 'fused' instead of 'other'")
    p.add_argument("--fit-worlds", default=None, metavar="W@GBPS,...",
                   help="fit on these worlds' rows alone (EP size @ link GB/s), the others "
                        "held out and checked")
    p.add_argument("--row", default=None, metavar="PHASE:TOKENS:W",
                   help="with --schedule-out: the row whose calibrated schedule to write")
    p.add_argument("--schedule-out", default=None)
    args = p.parse_args(argv)
    if (args.out is None) == (args.check is None):
        p.error("give --out (fit and store) or --check CALIBRATION (check a stored one), "
                "not both")
    if args.check:  # options of a fit: --check fits nothing, so they would be ignored
        given = [f"--{k.replace('_', '-')}" for k in ("holdout", "fit_only", "row", "schedule_out",
                                                      "physical", "fusion", "fit_worlds")
                 if getattr(args, k) is not None]
        given += ["--slowdown-from"] * (args.slowdown_from != p.get_default("slowdown_from"))
        if given:
            p.error(f"--check fits nothing: {', '.join(given)} only apply with --out")
        cal = read_stored(p, args.check)
    want = parse_fit_only(p, args.fit_only) if args.fit_only is not None else None
    peaks = parse_physical(p, args.physical)
    worlds = parse_worlds(p, args.fit_worlds)
    docs, rows = load_rows(args.results, cal.get("fusion") if args.check else args.fusion)
    if not rows:
        print("no rows with calibration data (run bench_moe.py --emulate-ep on a GPU)")
        return 2
    if args.check:
        return check_stored(args, cal, rows)
    if (args.schedule_out is None) != (args.row is None):
        p.error("--schedule-out and --row PHASE:TOKENS:W go together")
    sched_row = None
    if args.row is not None:
        sched_row = next((r for r in rows if _bucket_key(r) == args.row), None)
        if sched_row is None:
            p.error(f"--row {args.row}: no such row; the rows: "
                    + ", ".join(sorted({_bucket_key(r) for r in rows})))
    fit_rows = [r for r in rows if r.get("preset") != args.holdout] if args.holdout else rows
    if want is not None:
        fit_rows = [r for r in fit_rows if (r["phase"], r["tokens_per_rank"]) in want]
        if not fit_rows:
            p.error(f"--fit-only {args.fit_only}: no such rows")
    if worlds is not None:
        fit_rows = [r for r in fit_rows if (r.get("world_size"), r.get("link_gbps")) in worlds]
        if not fit_rows:
            p.error(f"--fit-worlds {args.fit_worlds}: no such rows; the worlds: " + ", ".join(
                sorted({f"{r.get('world_size')}@{r.get('link_gbps'):g}" for r in rows})))
    ph, w, g = args.slowdown_from.split(":")
    slow_rows = [r for r in fit_rows if (r.get("preset"), r.get("world_size"), r.get("link_gbps"))
                 == (ph, int(w), float(g))]
    if not slow_rows:  # a slowdown of 1.0 stored under this name would be no fit of it
        p.error(f"--slowdown-from {args.slowdown_from}: none of the rows fitted on (after "
                "--holdout / --fit-only) has that PRESET:W:GBPS; name one of theirs: "
                + ", ".join(sorted({f"{r.get('preset')}:{r.get('world_size')}:"
                                    f"{r.get('link_gbps'):g}" for r in fit_rows})))
    compute, comm = unit_samples(fit_rows)
    figures, fit_c = fit_compute(compute, fit_classes(peaks is not None, args.fusion), peaks)
    figures["comm"], fit_m = fit_comm(comm)
    slowdown = fit_slowdown(slow_rows, figures)
    checks = check(rows, figures, slowdown, fit_rows)
    hw = min(r["link_eff_gbps"] for r in rows if r["link_gbps"] >= max(x["link_gbps"] for x in rows))
    # for DboConfig(calibration=...): the scheduler's classes (attention: the decode figures,
    # the phase being unknown at compile time) and the link as the cost model's comm formula
    figures["attention"] = dict(figures["attention.decode"])
    figures["comm_link"] = {"copy_gbps": hw, "chunk_setup_us": CHUNK_SETUP_US,
                            "max_chunks": MAX_CHUNKS, "link_us": "launch_us + link_scale * "
                            "link_us(bytes, min(link, copy_gbps)) + kB * us_per_row"}
    machine = docs[0]["machine"]
    cal = {"machine": machine, "measured": [d["date"] for d in docs],
           "written": datetime.datetime.now().isoformat(timespec="seconds"),
           "sources": [os.path.relpath(d["path"]) for d in docs], "link": docs[0]["link"],
           "holdout": args.holdout,
           "fit_only": sorted([ph, tok] for ph, tok in want) if want is not None else None,
           "fit_worlds": sorted([w, g] for w, g in worlds) if worlds is not None else None,
           "physical": peaks, "fusion": args.fusion,
           "figures": figures,
           "overlap_slowdown": {"compute": slowdown[0], "comm": slowdown[1]},
           "overlap_slowdown_from": args.slowdown_from,
           "fit": {"compute": fit_c, "comm": fit_m},
           "check": {**summary(checks),
                     "held_out": summary([c for c in checks if not c["fitted"]])},
           "formula": "t = launch_us + max(flops / tflops, bytes / gbps) + rows * us_per_row "
                      "(per node class; dbo_compile/passes/cost_model.py"
                      + ("; 'fused': per run of element-wise nodes, passes/calibrate.py "
                         "fuse_runs)" if args.fusion else ")")}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(cal, f, indent=1)
    md = markdown(checks, figures, {"compute": fit_c, "comm": fit_m,
                                    "overlap_slowdown": slowdown}, machine)
    write_checks(args, md, checks)
    if sched_row is not None:
        _, sched = predict_split(row_cost(sched_row, figures), sched_row["calib"],
                                 slowdown=slowdown)
        with open(args.schedule_out, "w") as f:
            f.write(sched.to_json())
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
