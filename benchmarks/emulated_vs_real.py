"""The emulated EP-2 world against the real EP-2 world (issue 15, item 4), on CPU from JSON.

Run::

    python benchmarks/emulated_vs_real.py                         # 1. the link each real run measured
    python benchmarks/emulated_vs_real.py --emulated shm=EMU.json  # 2. side by side with an emulated run

**1. The link of the real runs.** ``benchmarks/results/latest.json`` (runs E/F: 2 ranks, the
``torch`` comm backend, links ``nvlink`` and ``shm`` = ``NCCL_P2P_DISABLE=1``) holds ``t_comm_us``
per bucket: the collectives of the split program alone (``bench_moe.comm_only_fn``: per MoE layer
the dispatches of both ubatches, then their combines; ``4 · layers`` ``all_to_all_single`` per
step). Each moves the ``torch`` backend's static-capacity rank-major buffer
(``dbo_compile/ops/comm/``): ``[W · T_u, P]`` dispatch payload rows (``P`` =
``payload_layout(H, bf16, K)`` columns: ``x[t]`` and the routing metadata) and ``[W · T_u, H]``
combine rows, ``T_u`` the tokens of the ubatch; of those, ``(W − 1) · T_u`` rows go to the peers
(what crosses the link, per direction) and ``T_u`` to the rank itself (a device copy). The derived
link is ``peer bytes / t_comm`` per bucket and a fit ``t_comm = ops · latency + bytes / GB/s`` per
link.

The emulated link (``dbo_compile/ops/emulated/``) moves only the remote share **by routing**:
``C(T_u) = min(T_u · F, ceil(m · T_u · 1.1))`` rows per dispatch / combine (``F = min(K, W − 1)``,
``m`` the expected remote ranks per token). At ``W = 2`` ``F = 1`` and ``m · 1.1 > 1``, so ``C(T_u)
= T_u``: the emulated link moves **the same bytes** as the torch backend's peer share (its static
buffer crosses whole, whether or not a row holds a slot; a token with no expert on the peer,
``comb(E/2, K) / comb(E, K)`` = 1.2 % of them at V2-Lite, is sent as zeros by both). What differs
is the path: NCCL's kernels (SMs; shm: through host memory, staged by NCCL's proxy) against a
chunked round trip to pinned host memory on the copy engines (no SM). The emulated comm's time
at an asked link ``X`` is modelled as ``ops · c + s · Σ link_us(bytes, min(X, copy GB/s))``
(``dbo_compile.testing.link_model.link_us``: the chunked round trip; ``c`` a fixed cost per op, ``s`` a
scale), ``c`` and ``s`` fitted here on the measured comm alone of the emulated runs of 2026-12-01
(``--emulator``); inverting it per bucket gives the ``--link-gbps`` whose emulated comm equals the
real ``t_comm``, and a grid search the single figure that fits every bucket of a link best. A
link faster than the copy engines (``--copy-gbps``) cannot be emulated: the table says so.

**2. Side by side** (``--emulated LINK=FILE``, a ``bench_moe.py --emulate-ep 2@X`` results file
whose rows emulate the real link ``LINK``; several allowed): per bucket the real and the emulated
baseline, DBO graph (its schedule), runtime pick, speedup, comm and split-without-comm, and
``emulated / real − 1``; step times more than ``--tolerance`` (15 %) apart are flagged. The setups
of both files are printed, and the fields where they differ (compute backend, attention, layers,
carve-out), which are the first reasons to look at.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

from dbo_compile.models import get_config
from dbo_compile.testing.link_model import (
    asked_link,
    compare,
    emulated_comm_bytes,
    emulated_comm_us,
    parse_setup,
    torch_comm_bytes,
)

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_RESULTS = os.path.join(_ROOT, "benchmarks", "results")
#: the emulated runs of 2026-12-01 (issue 14): their comm alone fits the emulator's scale k
EMULATOR_RUNS = [os.path.join(_RESULTS, f"emulated_{n}_h200_2026-12-01.json")
                 for n in ("v2lite_w8", "v2lite_worlds", "v3")]
#: the emulated link's duplex copy rate per direction on one H200 (benchmarks/calibration/
#: h200_2026-12-01.json, comm_link.copy_gbps; single runs measured 46.3-49.7)
COPY_GBPS = 46.3


def emulator_fit(paths: list[str]) -> tuple[tuple[float, float], list[dict]]:
    """``(c µs per op, s)`` of :func:`emulated_comm_us` fitted (least squares on relative error)
    to the measured comm alone of the rows of emulated runs, each at its asked link capped by
    the copy rate that run measured; and per row the measured / fitted ratio."""
    import numpy as np

    samples = []
    for p in paths:
        with open(p) as f:
            doc = json.load(f)
        hw = min((v["copy_gbps"] for v in (doc.get("link") or {}).values()), default=COPY_GBPS)
        for r in doc["rows"]:
            if not r.get("t_comm_us"):
                continue
            b = [n for _, n in emulated_comm_bytes(get_config(r["preset"]), r["layers"],
                                                   r["tokens_per_rank"], r["world_size"])]
            samples.append((r, b, hw))
    if not samples:
        raise SystemExit(f"no emulated rows with t_comm_us in {paths}")
    a = np.array([[sum(1 for n in b if n), emulated_comm_us(b, r["link_gbps"], hw)]
                  for r, b, hw in samples])
    y = np.array([r["t_comm_us"] for r, _, _ in samples])
    coef, *_ = np.linalg.lstsq(a / y[:, None], np.ones(len(y)), rcond=None)
    model = (float(coef[0]), float(coef[1]))
    fits = [{"preset": r["preset"], "world_size": r["world_size"], "link_gbps": r["link_gbps"],
             "phase": r["phase"], "tokens": r["tokens_per_rank"], "op_mb": max(b) / 1e6,
             "ratio": r["t_comm_us"] / emulated_comm_us(b, r["link_gbps"], hw, model)}
            for r, b, hw in samples]
    return model, fits


def _fit_latency_bw(rows: list[dict]) -> tuple[float, float]:
    """Least squares on relative error of ``t = ops · a + bytes / bw``: ``(a µs, bw GB/s)``."""
    a = np.array([[r["ops"], r["peer_bytes"] / 1e3] for r in rows]) / np.array(
        [[r["t_comm_us"]] for r in rows])
    coef, *_ = np.linalg.lstsq(a, np.ones(len(rows)), rcond=None)
    return float(coef[0]), float(1.0 / coef[1])


def derive(real: dict, copy_gbps: float, model: tuple[float, float]) -> tuple[list[dict], dict]:
    """Per real row: the peer bytes, the derived GB/s, the asked emulated link that matches it;
    per link: the latency / bandwidth fit and the single asked link that fits all buckets
    best (least squares on relative error of the modelled emulated comm)."""
    s = parse_setup(real["setup"])
    ep = int(s.get("EP", 2))
    cfg = get_config(s["preset"])
    rows = []
    for r in real["rows"]:
        if not r.get("t_comm_us"):
            continue
        ops = torch_comm_bytes(cfg, s["moe_layers"], r["tokens_per_rank"], ep)
        emu = [n for _, n in emulated_comm_bytes(cfg, s["moe_layers"], r["tokens_per_rank"], ep)]
        peer = sum(p for _, p, _ in ops)
        rows.append({"link": r.get("link"), "phase": r["phase"], "tokens": r["tokens_per_rank"],
                     "ops": len(ops), "peer_bytes": peer, "self_bytes": sum(s_ for *_, s_ in ops),
                     "emulated_bytes": sum(emu), "emu_ops": emu, "t_comm_us": r["t_comm_us"],
                     "gbps": peer / (r["t_comm_us"] * 1e3),
                     "asked_gbps": asked_link(emu, r["t_comm_us"], copy_gbps, model)})
    per_link = {}
    for link in sorted({r["link"] for r in rows}):
        lr = [r for r in rows if r["link"] == link]
        lat, bw = _fit_latency_bw(lr)
        grid = [g / 10 for g in range(5, int(copy_gbps * 10) + 1)]

        def err(g):
            return sum((emulated_comm_us(r["emu_ops"], g, copy_gbps, model) / r["t_comm_us"] - 1) ** 2
                       for r in lr)
        best = min(grid, key=err)
        per_link[link] = {"latency_us": lat, "bw_gbps": bw, "single_asked_gbps": best,
                          "single_errors": [emulated_comm_us(r["emu_ops"], best, copy_gbps, model)
                                            / r["t_comm_us"] - 1 for r in lr]}
    return rows, per_link


def _f(v, nd=0, pct=False):
    if v is None:
        return "–"
    if pct:
        return f"{v * 100:+.1f} %"
    return f"{v:,.{nd}f}"


def print_derived(real: dict, rows: list[dict], per_link: dict, model: tuple[float, float],
                  fits: list[dict], copy_gbps: float) -> None:
    s = parse_setup(real["setup"])
    print(f"Real: {real.get('machine')}, {real.get('date')}; {real['setup']}")
    ratios = [x["ratio"] for x in fits]
    print(f"Emulator's comm alone: ops × {model[0]:.1f} µs + {model[1]:.3f} × Σ link_us (fitted on "
          f"{len(fits)} emulated rows, {min(x['op_mb'] for x in fits):.2f}-"
          f"{max(x['op_mb'] for x in fits):.0f} MB per op: measured / fitted "
          f"{min(ratios):.3f}..{max(ratios):.3f}); copy engines {copy_gbps:g} GB/s per direction\n")
    print(f"Bytes per rank per step ({s['moe_layers']} MoE layers, 2 ubatches, "
          f"{rows[0]['ops'] if rows else 0} collectives): torch backend at EP={s.get('EP')} peer "
          "share (crosses the link) / self share (device copy); emulated W=2 link bytes "
          "(routed capacity).\n")
    print("| link | phase | tok/rank | peer MB | self MB | emulated MB | t_comm µs | derived GB/s "
          "| asked --link-gbps (this bucket) | modelled at the single figure |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for link, pl in per_link.items():
        lr = [r for r in rows if r["link"] == link]
        for r, e in zip(lr, pl["single_errors"]):
            asked = (_f(r["asked_gbps"], 1) if r["asked_gbps"] is not None
                     else f"unreachable (> {copy_gbps:g})")
            print(f"| {link} | {r['phase']} | {r['tokens']} | {r['peer_bytes'] / 1e6:.2f} | "
                  f"{r['self_bytes'] / 1e6:.2f} | {r['emulated_bytes'] / 1e6:.2f} | "
                  f"{_f(r['t_comm_us'])} | {r['gbps']:.1f} | {asked} | {_f(e, pct=True)} |")
    print()
    for link, pl in per_link.items():
        errs = pl["single_errors"]
        print(f"{link}: fit t_comm = ops × {pl['latency_us']:.1f} µs + bytes / "
              f"{pl['bw_gbps']:.1f} GB/s; single asked link {pl['single_asked_gbps']:g} GB/s "
              f"(modelled emulated comm {min(errs) * 100:+.0f} %..{max(errs) * 100:+.0f} % of the "
              "real)")


# -- 2. side by side ------------------------------------------------------------------------------


def _chosen_t(r: dict) -> float | None:
    return r.get("t_chosen_us")


def _chosen_name(r: dict) -> str:
    c = r.get("chosen_graph") or r.get("chosen")
    return c if c in ("unsplit", "unsplit-overlap") else f"split ({c})" if c != "split" else "split"


def print_compare(real: dict, emulated: list[tuple[str, dict]], rows: list[dict], tol: float) -> None:
    rs = parse_setup(real["setup"], real.get("machine", ""))
    for link, doc in emulated:
        es = parse_setup(doc["setup"], doc.get("machine", ""))
        print(f"Emulated ({link}): {doc.get('machine')}, {doc.get('date')}; {doc['setup']}")
        keys = ("preset", "moe_layers", "attention", "experts", "compute_backend", "carve-out")
        diff = [f"{k}: real {rs.get(k)} vs emulated {es.get(k)}" for k in keys
                if rs.get(k) != es.get(k)]
        print("  setup differs: " + ("; ".join(diff) if diff else "nothing of " + ", ".join(keys)))
    print(f"Real: {real.get('machine')}, {real.get('date')}; {real['setup']}\n")
    print("| link | phase | tok/rank | asked GB/s | baseline real / emu (Δ) | DBO graph real / emu (Δ) "
          "| runtime pick real / emu (Δ) | speedup real / emu | comm M real / emu (Δ) "
          "| split no comm real / emu (Δ) | flag |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for x in rows:
        r, e, d = x["real"], x["emu"], x["diff"]

        def pair(key):
            return f"{_f(r.get(key))} / {_f(e.get(key))} ({_f(d[key], pct=True)})"
        flag = f"**> {tol * 100:.0f} %: {', '.join(f[2:-3] for f in x['flags'])}**" if x["flags"] else ""
        print(f"| {x['link']} | {x['phase']} | {x['tokens']} | {_f(x['gbps'], 1)} | "
              f"{pair('t_baseline_us')} | {_f(r['t_dbo_graph_us'])} ({r.get('dbo_variant')}) / "
              f"{_f(e['t_dbo_graph_us'])} ({e.get('dbo_variant')}) ({_f(d['t_dbo_graph_us'], pct=True)}) | "
              f"{_chosen_name(r)} {_f(_chosen_t(r))} / {_chosen_name(e)} {_f(_chosen_t(e))} "
              f"({_f(d['t_chosen_us'], pct=True)}) | {_f(r.get('speedup'), 3)}× / "
              f"{_f(e.get('speedup'), 3)}× | {pair('t_comm_us')} | {pair('t_split_nocomm_us')} | {flag} |")
    n = sum(1 for x in rows if not x["flags"])
    print(f"\n{n} of {len(rows)} buckets with baseline, DBO graph and pick within {tol * 100:.0f} %.")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--real", default=os.path.join(_RESULTS, "latest.json"),
                   help="results of the real EP-2 runs (bench_moe.py under torchrun)")
    p.add_argument("--emulated", action="append", default=[], metavar="LINK=FILE",
                   help="an emulated run (bench_moe.py --emulate-ep 2@X) emulating the real LINK "
                        "(shm if no LINK= is given); repeatable")
    p.add_argument("--emulator", nargs="*", default=EMULATOR_RUNS,
                   help="emulated runs whose comm alone fits the emulator's scale k")
    p.add_argument("--copy-gbps", type=float, default=COPY_GBPS)
    p.add_argument("--tolerance", type=float, default=0.15)
    p.add_argument("--json", default=None, help="write the derived link table (and the comparison)")
    args = p.parse_args(argv)
    with open(args.real) as f:
        real = json.load(f)
    model, fits = emulator_fit(args.emulator)
    rows, per_link = derive(real, args.copy_gbps, model)
    print_derived(real, rows, per_link, model, fits, args.copy_gbps)
    out = {"emulator_model": model, "emulator_fits": fits, "copy_gbps": args.copy_gbps,
           "per_link": per_link,
           "rows": [{kk: v for kk, v in r.items() if kk != "emu_ops"} for r in rows]}
    if args.emulated:
        docs = []
        for spec in args.emulated:
            link, _, path = spec.rpartition("=")
            with open(path) as f:
                docs.append((link or "shm", json.load(f)))
        print()
        cmp_rows = compare(real, docs, args.tolerance)
        print_compare(real, docs, cmp_rows, args.tolerance)
        out["compare"] = [{kk: v for kk, v in x.items() if kk not in ("real", "emu")}
                          for x in cmp_rows]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
