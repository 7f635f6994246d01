"""How fast can a split step be when its comm holds SMs? A bound from a measured row.

Reads a ``bench_moe.py`` row that carries the chosen candidate's schedule and its units timed
alone on the GPU (the JSON's ``calib``: ``schedule`` and ``measured_units_us``, layer 0's units;
every other layer's unit takes its layer-0 namesake's time) and prints, in µs:

- ``floor``: what no schedule on one link beats. The transfers run one after another on the
  link (each send's time alone less its issue: packing, transfer and hold), the first after the
  compute that feeds it, the compute that waits for the last one after it:
  ``head + sum(transfers) + tail``. ``unsplit / floor`` is the best speedup any order could
  reach on this row.
- ``model``: the list schedule's makespan on :class:`dbo_compile.schedule.Timeline` with those
  unit times, three ways: without holds (``hold_fraction`` 0), with the hold model (a hold waits
  for the compute unit running at its issue, compute beside a hold runs at ``1 - held / SMs``)
  and with every hold starting at its issue (what gating the compute stream on the comm issue,
  or GEMMs limited to the other SMs while a hold runs, would give at best).

Run (CPU; no GPU needed)::

    python benchmarks/hold_bound.py benchmarks/results/emulated_ep8_hold24sms_holdmodel_green_h100_2026-12-07.json

Exits 2 when a row has no ``calib`` (``bench_moe.py`` writes it for the chosen split candidate
where the row is split) or no ``hold_sms``.
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import sys

from dbo_compile.schedule import COMPUTE, Schedule, Timeline, placed_timeline, predecessors

#: H100 / H200 SXM (the rows' ``device_sms`` where the JSON does not say)
DEFAULT_SMS = 132


class _HoldAtIssue(Timeline):
    """The hold model with every hold starting at its transfer's begin (or the previous
    hold's end): as if the compute running then left the held SMs at once."""

    def _hold(self, begin: float, duration: float) -> tuple[float, float]:
        h = max(begin, self._hold_ends[-1] if self._hold_ends else 0.0)
        self._hold_starts.append(h)
        self._hold_ends.append(h + duration)
        return h, h + duration


def timed_schedule(calib: dict) -> Schedule:
    """The row's schedule with each unit's ``cost_us`` (compute, comm issue) or
    ``latency_us`` (a send: its whole time alone less its issue's) from
    ``measured_units_us``; a unit of layer ``k > 0`` takes its ``L0.`` namesake's time."""
    sched = Schedule.from_dict(copy.deepcopy(calib["schedule"]))
    measured = {int(k): v for k, v in calib["measured_units_us"].items() if v is not None}
    by_name = {u.name: u.id for u in sched.units}
    for u in sched.units:
        t = measured.get(u.id)
        if t is None:
            t = measured.get(by_name.get(re.sub(r"^L\d+\.", "L0.", u.name), -1))
        if t is None or u.phase == "receive":
            continue
        if u.latency_us > 0:
            u.latency_us = max(0.0, t - u.cost_us)
        else:
            u.cost_us = t
    return sched


def floor_us(sched: Schedule) -> float:
    """``head + sum(transfers) + tail`` (module docstring): ``head`` the longest chain of
    compute units the first send waits for, ``tail`` the longest chain of compute units that
    wait for the last send (units in host order, a topological order)."""
    units = sched.units
    preds = predecessors(units, sched.deps)
    succs: dict[int, list[int]] = {u.id: [] for u in units}
    for a, b in sched.deps:
        succs[a].append(b)
    own = {u.id: (u.cost_us if u.stream == COMPUTE else 0.0) for u in units}
    to: dict[int, float] = {}
    for u in units:
        to[u.id] = own[u.id] + max((to[p] for p in preds[u.id]), default=0.0)
    frm: dict[int, float] = {}
    for u in reversed(units):
        frm[u.id] = own[u.id] + max((frm[q] for q in succs[u.id]), default=0.0)
    sends = [u for u in units if u.latency_us > 0]
    head = max((to[p] for p in preds[sends[0].id]), default=0.0)
    tail = max((frm[q] for q in succs[sends[-1].id]), default=0.0)
    return head + sum(u.latency_us for u in sends) + tail


def bound_row(row: dict, sms: int) -> dict:
    """The figures of one row (module docstring), µs."""
    f = row["hold_sms"] / sms
    out = {"phase": row["phase"], "tokens_per_rank": row["tokens_per_rank"],
           "candidate": row["calib"]["candidate"], "hold_fraction": round(f, 4),
           "t_unsplit_us": row["t_baseline_us"], "t_measured_us": row["t_chosen_us"]}
    sched = timed_schedule(row["calib"])
    out["floor_us"] = floor_us(sched)
    for name, frac, cls in (("model_no_holds_us", 0.0, Timeline), ("model_holds_us", f, Timeline),
                            ("model_holds_at_issue_us", f, _HoldAtIssue)):
        s = copy.deepcopy(sched)
        if cls is Timeline:
            out[name] = placed_timeline(s.units, s.deps, frac).makespan
        else:
            tl = cls(predecessors(s.units, s.deps), frac)
            for u in s.units:
                tl.place(u)
            out[name] = tl.makespan
    for k in [k for k in out if k.endswith("_us") and k != "t_unsplit_us"]:
        out[k.removeprefix("t_").removesuffix("_us") + "_speedup"] = out["t_unsplit_us"] / out[k]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("json", help="a bench_moe.py results JSON with --hold-sms rows")
    p.add_argument("--device-sms", type=int, default=DEFAULT_SMS)
    args = p.parse_args(argv)
    rows = json.load(open(args.json))["rows"]
    usable = [r for r in rows if r.get("calib") and r.get("hold_sms")]
    if not usable:
        p.error(f"{args.json}: no row with calib (the chosen split candidate's units) and "
                "hold_sms; run bench_moe.py --hold-sms N on a bucket where it splits")
    for r in usable:
        b = bound_row(r, args.device_sms)
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in b.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
