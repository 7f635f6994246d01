"""Match a measured torch.profiler trace to a schedule: measured times beside predicted ones.

Input: the Chrome trace JSON that ``torch.profiler.profile(...).export_chrome_trace(path)``
writes from a GPU run (``.json`` or ``.json.gz``): ``traceEvents`` with GPU kernels as ``X``
events of ``cat == "kernel"`` whose ``args["stream"]`` (else ``tid``) is the CUDA stream, and
their launch correlation in ``args["correlation"]``.

Two ways to match, tried in this order:

1. **Annotations** (exact). Ranges opened by ``torch.profiler.record_function(name)`` with
   ``name = f"dbo.u{unit.id}.{unit.name}"`` (e.g. ``dbo.u5.L0.MLP0``; :func:`range_name`), one
   per unit, around the launches of that unit in the generated wrapper. Kineto records them
   on the host (``cat == "user_annotation"``) and, on CUDA, as ``gpu_user_annotation``
   events spanning the kernels launched inside. GPU annotations are used directly; with only
   host ranges, a unit's kernels are those whose launch (``cuda_runtime``/``cuda_driver``
   event with the same ``correlation``) lies inside its range. A trace with several steps
   holds several ranges per unit: the ``k``-th range of each unit is step ``k``.
2. **Kernel order** (fallback, no annotations; one step in the trace, e.g. a CUDA-graph
   replay, whose kernels carry no ranges). The comm stream is the stream whose kernel names
   look like collectives (``nccl``, ``all_to_all``, ``dispatch``, ``combine``, ``deep_ep``);
   its kernels are dealt to comm units in host order, the same number per unit (an error if
   the count does not divide). Where the comm ops' kernels have names of their own (the
   emulated backend's ``emulated_dispatch_*`` / ``emulated_combine_*``) they are found by
   name on any stream instead (a CUDA-graph replay runs its branches on streams of its own):
   each op from its first kernel (``..._route`` / ``..._flag``) to the last before the next. Compute kernels cannot
   be dealt to compute units without per-unit kernel counts (fusion decides them), so compute
   units stay unmeasured; the compute stream's kernels are still used as its busy time, so
   whether each comm really overlapped with compute is measured either way.

Overlap: a comm unit's measured hidden time is the part of its measured interval during
which the compute stream runs a kernel (the same definition as ``η_pred``, see
:mod:`dbo_compile.viz.common`).
"""

from __future__ import annotations

import gzip
import json
import logging
import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dbo_compile.schedule import COMM, COMPUTE, RANGE_PREFIX, Schedule, range_name
from dbo_compile.viz.common import Overlap, VizInputError, covered, fmt_pct, merge, predicted_overlap

log = logging.getLogger(__name__)

_RANGE_RE = re.compile(r"^" + re.escape(RANGE_PREFIX) + r"(\d+)(\.|$)")
#: kernel names that identify the comm stream when the trace has no named ranges
_COMM_KERNEL_RE = re.compile(r"nccl|all_?to_?all|alltoall|dispatch|combine|deep_?ep", re.I)
#: the first kernel of each comm op of a backend whose ops launch differently many kernels
#: (the emulated backend: a dispatch starts with its routing kernel, a combine with its flag
#: kernel); with these, the comm stream's kernels are dealt to comm units at each start
_COMM_START_RE = {"D": re.compile(r"emulated_dispatch_route"),
                  "C": re.compile(r"emulated_combine_flag")}
_COMM_NAMED_RE = re.compile(r"emulated_(dispatch|combine)_")


@dataclass
class Measured:
    """Measured unit times of one step, relative to the step's first GPU activity (µs).

    Attributes:
        method: ``"annotations"`` or ``"kernel-order"``.
        units: ``unit id -> (start_us, end_us)`` for every unit that could be matched.
        busy: ``stream -> disjoint busy intervals`` (µs) of the compute and comm streams.
        step_us: first to last GPU activity of the step (µs).
        overlap: measured hidden comm time per comm unit.
        streams: ``stream -> CUDA stream id`` in the trace (``None`` if unknown).
        notes: what could not be matched, for the reader.
    """

    method: str
    units: dict[int, tuple[float, float]]
    busy: dict[str, list[tuple[float, float]]]
    step_us: float
    overlap: Overlap
    streams: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def load_trace(path: str | Path) -> dict[str, Any]:
    """Read a Chrome trace (``.json`` or ``.json.gz``).

    Raises:
        VizInputError: missing file, not JSON, or no ``traceEvents`` list.
    """
    p = Path(path)
    try:
        raw = p.read_bytes()
        if raw[:2] == b"\x1f\x8b":
            raw = gzip.decompress(raw)
        d = json.loads(raw)
    except OSError as e:
        raise VizInputError(f"cannot read profile {str(p)!r}: {e.strerror or e}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise VizInputError(f"profile {str(p)!r} is not valid JSON: {e}") from None
    if isinstance(d, list):
        d = {"traceEvents": d}
    if not isinstance(d, dict) or not isinstance(d.get("traceEvents"), list):
        raise VizInputError(f"profile {str(p)!r} has no 'traceEvents' list "
                            "(expected torch.profiler's export_chrome_trace output)")
    return d


def _x_events(trace: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for ev in trace["traceEvents"]:
        if isinstance(ev, dict) and ev.get("ph") == "X" and "ts" in ev:
            out.append(ev)
    return out


def _stream_of(ev: dict[str, Any]) -> Any:
    args = ev.get("args") or {}
    return args.get("stream", ev.get("tid"))


def _span(ev: dict[str, Any]) -> tuple[float, float]:
    ts = float(ev["ts"])
    return ts, ts + float(ev.get("dur", 0.0))


def match_profile(schedule: Schedule, trace: dict[str, Any], step: int = -1) -> Measured:
    """Measured times of ``schedule``'s units in ``trace`` (see the module docstring).

    Args:
        schedule: the schedule the traced program ran.
        trace: from :func:`load_trace`.
        step: which step to take when annotations show several (``-1``: the last).

    Raises:
        VizInputError: no kernels, or kernels that cannot be matched to the schedule.
    """
    events = _x_events(trace)
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: float(e["ts"]))
    if not kernels:
        raise VizInputError("profile has no GPU kernels (events with cat 'kernel'); "
                            "record it with ProfilerActivity.CUDA on a GPU run")
    annotated = [e for e in events if e.get("cat") in ("gpu_user_annotation", "user_annotation")
                 and _RANGE_RE.match(str(e.get("name", "")))]
    if annotated:
        return _match_annotations(schedule, events, kernels, annotated, step)
    return _match_order(schedule, kernels)


def _pick_step(per_unit: dict[int, list], step: int) -> int:
    n = min(len(v) for v in per_unit.values())
    if not -n <= step < n:
        raise VizInputError(f"profile holds {n} annotated step(s); step {step} does not exist")
    return step


def _match_annotations(schedule: Schedule, events, kernels, annotated, step: int) -> Measured:
    gpu = [e for e in annotated if e.get("cat") == "gpu_user_annotation"]
    notes: list[str] = []
    by_unit: dict[int, list[tuple[float, float, Any]]] = defaultdict(list)
    if gpu:
        for e in sorted(gpu, key=lambda e: float(e["ts"])):
            s, t = _span(e)
            by_unit[int(_RANGE_RE.match(e["name"]).group(1))].append((s, t, _stream_of(e)))
    else:
        launch = {}
        for e in events:
            if e.get("cat") in ("cuda_runtime", "cuda_driver"):
                c = (e.get("args") or {}).get("correlation")
                if c is not None:
                    launch[c] = (float(e["ts"]), e.get("pid"), e.get("tid"))
        ks = [(launch.get((k.get("args") or {}).get("correlation")), k) for k in kernels]
        for e in sorted(annotated, key=lambda e: float(e["ts"])):
            s, t = _span(e)
            mine = [k for lt, k in ks if lt is not None and lt[1:] == (e.get("pid"), e.get("tid"))
                    and s <= lt[0] <= t]
            uid = int(_RANGE_RE.match(e["name"]).group(1))
            if mine:
                by_unit[uid].append((min(_span(k)[0] for k in mine),
                                     max(_span(k)[1] for k in mine), _stream_of(mine[0])))
            else:
                by_unit[uid].append(None)
    unknown = sorted(set(by_unit) - {u.id for u in schedule.units})
    if unknown:
        raise VizInputError(f"profile has ranges for units {unknown[:5]} that the schedule "
                            f"(with {len(schedule.units)} units) does not have: wrong schedule?")
    step = _pick_step(by_unit, step)
    units = {uid: v[step] for uid, v in by_unit.items() if v[step] is not None}
    missing = [u.name for u in schedule.units if u.id not in units]
    if missing:
        notes.append(f"{len(missing)} unit(s) without measured kernels: {', '.join(missing[:8])}")
    streams: dict[str, Any] = {}
    for u in schedule.units:
        if u.id in units and units[u.id][2] is not None:
            streams.setdefault(u.stream, units[u.id][2])
    spans = {uid: (s, t) for uid, (s, t, _) in units.items()}
    # busy time from the kernels of the step window on each schedule stream
    lo = min(s for s, _ in spans.values())
    hi = max(t for _, t in spans.values())
    busy = {}
    for name in (COMPUTE, COMM):
        sid = streams.get(name)
        ivs = [_span(k) for k in kernels if sid is not None and _stream_of(k) == sid]
        ivs = [(max(s, lo), min(t, hi)) for s, t in ivs if t > lo and s < hi]
        if not ivs:  # no stream ids: the units' own spans
            ivs = [spans[u.id] for u in schedule.units if u.stream == name and u.id in spans]
        busy[name] = merge(ivs)
    return _finish(schedule, "annotations", spans, busy, lo, hi, streams, notes)


def _match_named(schedule: Schedule, kernels, named) -> Measured:
    """Comm ops found by their backend's kernel names across every stream (a CUDA-graph
    replay runs a graph's branches on streams of its own, so the comm stream is not one
    stream id): a comm op spans from its start kernel to the last named kernel before the
    next start; the compute busy time is every other kernel."""
    comm_units = [u for u in schedule.units if u.stream == COMM]
    starts = [i for i, k in enumerate(named)
              if any(r.search(str(k.get("name", ""))) for r in _COMM_START_RE.values())]
    kinds = [next(lab for lab, r in _COMM_START_RE.items()
                  if r.search(str(named[i].get("name", "")))) for i in starts]
    if kinds != [u.label for u in comm_units]:
        raise VizInputError(f"the profile's comm ops ({''.join(kinds)}) are not the "
                            f"schedule's ({''.join(u.label for u in comm_units)}): profile "
                            "exactly one step of this schedule")
    spans: dict[int, tuple[float, float]] = {}
    for u, a, b in zip(comm_units, starts, starts[1:] + [len(named)]):
        ks = named[a:b]
        spans[u.id] = (_span(ks[0])[0], max(_span(k)[1] for k in ks))
    ids = {id(k) for k in named}
    lo = min(_span(k)[0] for k in kernels)
    hi = max(_span(k)[1] for k in kernels)
    busy = {COMM: merge(spans.values()),
            COMPUTE: merge(_span(k) for k in kernels if id(k) not in ids)}
    notes = ["kernel-name matching (e.g. a CUDA-graph replay): comm ops by their kernels' "
             "names on any stream; compute units are not matched (their busy time is every "
             "other kernel, the comm ops' own torch kernels included)"]
    return _finish(schedule, "kernel-names", spans, busy, lo, hi, {}, notes)


def _match_order(schedule: Schedule, kernels) -> Measured:
    named = sorted((k for k in kernels if _COMM_NAMED_RE.search(str(k.get("name", "")))),
                   key=lambda k: float(k["ts"]))
    if named and any(u.stream == COMM for u in schedule.units):
        return _match_named(schedule, kernels, named)
    by_stream: dict[Any, list] = defaultdict(list)
    for k in kernels:
        by_stream[_stream_of(k)].append(k)
    comm_units = [u for u in schedule.units if u.stream == COMM]
    score = {sid: sum(bool(_COMM_KERNEL_RE.search(str(k.get("name", "")))) for k in ks)
             for sid, ks in by_stream.items()}
    comm_sid = max(sorted(score, key=str), key=lambda s: score[s]) if score else None
    if comm_units and (comm_sid is None or score[comm_sid] == 0):
        raise VizInputError("profile has no annotation ranges (dbo.u<ID>.<name>) and no stream "
                            "with collective kernels (nccl/all_to_all/...): cannot find the "
                            "comm stream")
    others = sorted((s for s in by_stream if s != comm_sid), key=lambda s: -len(by_stream[s]))
    compute_sid = others[0] if others else None
    comm_k = by_stream.get(comm_sid, [])
    notes = ["kernel-order matching: compute units are not matched to kernels (add "
             "record_function ranges named dbo.u<ID>.<name> for per-unit compute times)"]
    spans: dict[int, tuple[float, float]] = {}
    if comm_units:
        if len(comm_k) % len(comm_units):
            raise VizInputError(f"cannot deal {len(comm_k)} comm-stream kernels to "
                                f"{len(comm_units)} comm units evenly; profile exactly one step "
                                "or add record_function ranges named dbo.u<ID>.<name>")
        per = len(comm_k) // len(comm_units)
        for i, u in enumerate(comm_units):
            ks = comm_k[i * per:(i + 1) * per]
            spans[u.id] = (_span(ks[0])[0], max(_span(k)[1] for k in ks))
    lo = min(_span(k)[0] for k in kernels)
    hi = max(_span(k)[1] for k in kernels)
    busy = {COMM: merge(_span(k) for k in comm_k),
            COMPUTE: merge(_span(k) for k in by_stream.get(compute_sid, []))}
    if len(others) > 1:
        notes.append(f"kernels on {len(others) - 1} other stream(s) ignored")
    return _finish(schedule, "kernel-order", spans, busy, lo, hi,
                   {COMPUTE: compute_sid, COMM: comm_sid}, notes)


def _finish(schedule, method, spans, busy, lo, hi, streams, notes) -> Measured:
    rel = {uid: (s - lo, t - lo) for uid, (s, t) in spans.items()}
    rbusy = {k: [(s - lo, t - lo) for s, t in v] for k, v in busy.items()}
    comm = [u.id for u in schedule.units if u.stream == COMM and u.id in rel]
    ov = Overlap({i: covered(*rel[i], rbusy[COMPUTE]) for i in comm},
                 {i: rel[i][1] - rel[i][0] for i in comm})
    return Measured(method, rel, rbusy, hi - lo, ov, streams, notes)


def render_measured_table(schedule: Schedule, m: Measured) -> list[str]:
    """Per unit: predicted vs measured start/duration (µs); per comm unit: hidden share."""
    pred = predicted_overlap(schedule)
    lines = [f"Measured ({m.method}): step {m.step_us:.1f} µs vs predicted "
             f"{schedule.predicted_step_us:.1f} µs; η_meas {fmt_pct(m.overlap.eta()).strip()} "
             f"vs η_pred {fmt_pct(pred.eta()).strip()}"]
    for note in m.notes:
        lines.append(f"  note: {note}")
    lines.append(f"  {'id':>3} {'unit':<10} {'stream':<7} {'pred start':>10} {'pred dur':>9} "
                 f"{'meas start':>10} {'meas dur':>9} {'dur ×':>6}  comm hidden pred → meas")
    for u in schedule.units:
        pd = u.end_us - u.start_us
        if u.id in m.units:
            s, t = m.units[u.id]
            meas = f"{s:10.1f} {t - s:9.1f} " + (f"{(t - s) / pd:6.2f}" if pd > 0 else f"{'-':>6}")
        else:
            meas = f"{'-':>10} {'-':>9} {'-':>6}"
        hid = ""
        if u.stream == COMM:
            p = pred.hidden_us[u.id] / pd if pd > 0 else None
            if u.id in m.overlap.comm_us:
                mc = m.overlap.comm_us[u.id]
                q = m.overlap.hidden_us[u.id] / mc if mc > 0 else None
                verdict = ("overlapped" if q is not None and q >= 0.95 else
                           "partly overlapped" if q and q > 0.05 else "NOT overlapped")
                hid = f"  {fmt_pct(p)} → {fmt_pct(q)}  {verdict}"
            else:
                hid = f"  {fmt_pct(p)} → (unmatched)"
        lines.append(f"  {u.id:>3} {u.name:<10} {u.stream:<7} {u.start_us:10.1f} {pd:9.1f} "
                     f"{meas}{hid}")
    return lines
