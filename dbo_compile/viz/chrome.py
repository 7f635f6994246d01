"""The schedule as a Chrome / Perfetto trace (open it in https://ui.perfetto.dev).

Layout: ``pid`` = rank (process "rank R (predicted)"), ``tid`` 1 = compute stream, 2 = comm
stream, 3 = the link (the sends' transfers, :func:`~dbo_compile.viz.common.transfers`; named by
``M`` metadata events). One ``X`` slice per unit, times in µs from the step
start, ``args`` = unit id, name, label, ubatch, layer, cost, node count. Every event edge is a
flow (``s`` at the producer's slice end, ``f`` with ``bp: "e"`` at the consumer's slice
start, both inside their slice, ``id`` = edge index) — Perfetto draws it as an arrow.
With a measured profile, measured units are a second process ``pid = MEASURED_PID_OFFSET +
rank`` ("rank R (measured)") with the same tids.
"""

from __future__ import annotations

from typing import Any

from dbo_compile.schedule import COMM, COMPUTE, Schedule
from dbo_compile.viz.common import LINK, predicted_overlap, transfers

TID = {COMPUTE: 1, COMM: 2, LINK: 3}
MEASURED_PID_OFFSET = 1000


def _ns(x: float) -> int:
    return round(x * 1000)


def _slices(pid: int, spans: list[tuple[str, float, float, str, dict]]) -> list[dict[str, Any]]:
    """X events per stream with integer-ns clamping so slices on one tid never overlap."""
    out = []
    last_end: dict[str, int] = {}
    for name, s, e, stream, args in sorted(spans, key=lambda x: (x[3], x[1], x[4].get("unit_id", 0))):
        s_ns = max(_ns(s), last_end.get(stream, 0))
        e_ns = max(_ns(e), s_ns)
        last_end[stream] = e_ns
        out.append({"ph": "X", "name": name, "cat": stream, "pid": pid, "tid": TID[stream],
                    "ts": s_ns / 1000, "dur": (e_ns - s_ns) / 1000, "args": args})
    return out


def _meta(pid: int, pname: str, sort: int) -> list[dict[str, Any]]:
    ev = [{"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": pname}},
          {"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": sort}}]
    for stream, tid in TID.items():
        ev.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                   "args": {"name": f"{stream} stream"}})
        ev.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid,
                   "args": {"sort_index": tid}})
    return ev


def to_chrome_trace(schedule: Schedule, rank: int = 0, measured=None) -> dict[str, Any]:
    """Chrome trace JSON object (``{"traceEvents": [...], "displayTimeUnit": "ns", ...}``).

    Args:
        schedule: the schedule; ``start_us``/``end_us`` give slice times (µs).
        rank: EP/DP rank, used as ``pid``.
        measured: optional :class:`~dbo_compile.viz.profile.Measured`, drawn as another pid.
    """
    ov = predicted_overlap(schedule)
    spans = []
    for u in schedule.units:
        args = {"unit_id": u.id, "unit": u.name, "label": u.label, "ubatch": u.ubatch,
                "layer": u.layer, "stream": u.stream, "cost_us": u.cost_us,
                "num_nodes": len(u.nodes)}
        if u.stream == COMM:
            args["hidden_us"] = round(ov.hidden_us[u.id], 3)
        spans.append((u.name, u.start_us, u.end_us, u.stream, args))
    for i, (s, e) in transfers(schedule).items():
        u = schedule.units[i]
        spans.append((f"{u.name} transfer", s, e, LINK,
                      {"send_id": u.id, "unit": u.name, "latency_us": u.latency_us}))
    events = _meta(rank, f"rank {rank} (predicted)", 0) + _slices(rank, spans)
    pos = {e["args"]["unit_id"]: e for e in events if e["ph"] == "X" and "unit_id" in e["args"]}
    for i, (a, b) in enumerate(schedule.event_edges):
        sa, sb = pos[a], pos[b]
        # inside the producer's slice (at its end) and inside the consumer's (at its start)
        ts_s = max(sa["ts"], round(sa["ts"] + sa["dur"] - 0.001, 3))
        ts_f = min(round(sb["ts"] + 0.001, 3), sb["ts"] + sb["dur"]) if sb["dur"] > 0 else sb["ts"]
        common = {"name": "event", "cat": "event_edge", "id": i, "pid": rank,
                  "args": {"src": schedule.units[a].name, "dst": schedule.units[b].name}}
        events.append({**common, "ph": "s", "tid": sa["tid"], "ts": ts_s})
        events.append({**common, "ph": "f", "bp": "e", "tid": sb["tid"], "ts": ts_f})
    if measured is not None:
        mpid = MEASURED_PID_OFFSET + rank
        mspans = []
        for u in schedule.units:
            if u.id in measured.units:
                s, e = measured.units[u.id]
                mspans.append((u.name, s, e, u.stream, {"unit_id": u.id, "unit": u.name,
                                                        "predicted_us": round(u.end_us - u.start_us, 3)}))
        if measured.method != "annotations":  # compute units unmatched: show busy time
            for s, e in measured.busy.get(COMPUTE, []):
                mspans.append(("compute kernels", s, e, COMPUTE, {}))
        events += _meta(mpid, f"rank {rank} (measured, {measured.method})", 1) + _slices(mpid, mspans)
    return {"traceEvents": events, "displayTimeUnit": "ns",
            "otherData": {"predicted_step_us": schedule.predicted_step_us,
                          "serial_us": schedule.serial_us, "eta_pred": ov.eta(),
                          "scheduler": schedule.scheduler,
                          "config_fingerprint": schedule.config_fingerprint}}
