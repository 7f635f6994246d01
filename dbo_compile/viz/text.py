"""The schedule as two text lanes per layer, in the field's notation.

Example (tiny model, 2 layers; one block per layer)::

    Layer 0  ·  0.0 … 1142.3 µs  ·  overlap 100.0% (61.0 of 61.0 µs comm hidden)
    Comp: |P|-A₀-|----A₁----|-----MLP₀-----|...
    Comm:      |D₀|         |D₁|

Layout: every block has its own time axis, proportional to the predicted ``start_us``/
``end_us`` of its units, so a comm segment sits under the compute segments that run while it
is in flight. Each segment is stretched to at least ``|-label-|`` so short units stay
readable (the axis is then piecewise linear, and a line may exceed ``width``). Zero-length
units (the shared prologue when it costs nothing) get that minimum width too. ``·`` marks
time a stream spends on a unit shown in another layer's block. Units without a layer (``P``)
are shown in the block of the next unit in host order that has one.
"""

from __future__ import annotations

import bisect
import dataclasses
import textwrap
from dataclasses import dataclass

from dbo_compile.schedule import COMM, COMPUTE, Schedule, Unit
from dbo_compile.viz.common import (LINK, Overlap, fmt_pct, predicted_overlap, short_label,
                                    transfers)
from dbo_compile.viz.profile import render_measured_table

LANE_PREFIX = {COMPUTE: "Comp: ", COMM: "Comm: ", LINK: "Link: "}
LEGEND = ("Legend: A = attention part, S = shared experts, MLP = routed experts, D = dispatch, "
          "C = combine, T = final tail, P = shared prologue, X = other; rD / rC = a receive; "
          "Link = a send's transfer, in flight after its issue; subscripts = ubatch; "
          "· = stream busy with a unit of another layer's block.")

#: unit ids of the link lane's segments: the send's id plus this
_LINK_ID = 1 << 20


def _link_units(schedule: Schedule) -> dict[int, Unit]:
    """The sends' transfers as units of the link lane (ids offset by :data:`_LINK_ID`), by
    the send's id."""
    return {i: dataclasses.replace(schedule.units[i], id=i + _LINK_ID, stream=LINK,
                                   start_us=s, end_us=e)
            for i, (s, e) in transfers(schedule).items()}


def _t(x: float) -> float:
    return round(x, 6)  # predicted times are sums of rounded costs: drop float noise


def layer_blocks(schedule: Schedule) -> list[tuple[int | None, list[Unit]]]:
    """Units grouped into per-layer blocks ``[(layer, units in host order)]``, by layer.

    A unit with ``layer=None`` joins the block of the next unit in host order that has a
    layer (else the previous one); without any layer there is one block ``(None, units)``.
    """
    units = schedule.units
    assigned: list[int | None] = [u.layer for u in units]
    nxt: int | None = None
    for i in range(len(units) - 1, -1, -1):
        if assigned[i] is None:
            assigned[i] = nxt
        else:
            nxt = assigned[i]
    prev: int | None = None
    for i in range(len(units)):
        if assigned[i] is None:
            assigned[i] = prev
        else:
            prev = assigned[i]
    layers = sorted({a for a in assigned if a is not None})
    if not layers:
        return [(None, list(units))]
    return [(layer, [u for u, a in zip(units, assigned) if a == layer]) for layer in layers]


@dataclass
class _Seg:
    unit: Unit
    label: str
    s: int = 0
    e: int = 0


def _layout(units: list[Unit], scale: float, t0: float) -> tuple[dict[int, _Seg], list]:
    """Columns of each unit's bars; returns (segments by id, [(time, col)] anchor points)."""
    segs = {u.id: _Seg(u, short_label(u)) for u in units}
    keys: list[tuple[tuple, int, str]] = []  # (sort key, unit id, "s"|"e")
    for u in units:
        s, e = _t(u.start_us), _t(u.end_us)
        if e > s:
            keys.append(((s, 2, 0, 0), u.id, "s"))
            keys.append(((e, 0, 0, 0), u.id, "e"))
        else:
            keys.append(((s, 1, u.id, 0), u.id, "s"))
            keys.append(((s, 1, u.id, 1), u.id, "e"))
    keys.sort()
    col, prev_t = 0, t0
    anchors: list[tuple[float, int]] = []
    i = 0
    while i < len(keys):
        key = keys[i][0]
        group = []
        while i < len(keys) and keys[i][0] == key:
            group.append(keys[i])
            i += 1
        t = key[0]
        c = col + round((t - t0) * scale) - round((prev_t - t0) * scale)
        for _, uid, which in group:
            if which == "e":
                seg = segs[uid]
                c = max(c, seg.s + len(seg.label) + 3)
        for _, uid, which in group:
            if which == "s":
                segs[uid].s = c
            else:
                segs[uid].e = c
        col, prev_t = c, t
        anchors.append((t, c))
    return segs, anchors


def _col_at(anchors: list[tuple[float, int]], t: float, right: bool) -> int:
    """Column of time ``t`` (piecewise linear between anchors); ``right`` picks the last
    anchor at an equal time, else the first."""
    ts = [a[0] for a in anchors]
    if not anchors:
        return 0
    if t <= ts[0]:
        return anchors[0][1]
    if t >= ts[-1]:
        return anchors[-1][1]
    i = bisect.bisect_right(ts, t) if right else bisect.bisect_left(ts, t)
    if not right and ts[i] == t:
        return anchors[i][1]
    if right and ts[i - 1] == t:
        return anchors[i - 1][1]
    (ta, ca), (tb, cb) = anchors[i - 1], anchors[i]
    return round(ca + (cb - ca) * (t - ta) / (tb - ta))


def _render_block(schedule: Schedule, layer: int | None, units: list[Unit], width: int,
                  overlap: Overlap, links: dict[int, Unit]) -> list[str]:
    comm_ids = [u.id for u in units if u.stream == COMM]
    units = units + [links[i] for i in comm_ids if i in links]
    t0 = min(_t(u.start_us) for u in units)
    t1 = max(_t(u.end_us) for u in units)
    avail = max(20, width - len(LANE_PREFIX[COMPUTE]) - 1)
    span = max(t1 - t0, 1e-9)
    scale = avail / span
    for _ in range(8):  # shrink the proportional part until the minimum widths fit
        segs, anchors = _layout(units, scale, t0)
        total = max((s.e for s in segs.values()), default=0)
        if total <= avail or scale < 1e-9:
            break
        extra = total - round(span * scale)
        scale = max(scale * 0.5, (avail - extra) / span) if avail > extra else scale * 0.5
    ncols = max((s.e for s in segs.values()), default=0) + 1
    ids = {u.id for u in units}
    lines = []
    h, tot = overlap.total(comm_ids)
    name = "Layers (none)" if layer is None else f"Layer {layer}"
    lines.append(f"{name}  ·  {t0:.1f} … {t1:.1f} µs  ·  overlap {fmt_pct(overlap.eta(comm_ids)).strip()} "
                 f"({h:.1f} of {tot:.1f} µs comm hidden)")
    everything = list(schedule.units) + list(links.values())
    for stream in (COMPUTE, COMM) + ((LINK,) if links else ()):
        lane = [" "] * ncols
        mine = sorted((segs[u.id] for u in units if u.stream == stream), key=lambda s: s.unit.id)
        for seg in mine:
            inner = seg.e - seg.s - 1
            pad = inner - len(seg.label)
            body = "-" * (pad // 2) + seg.label + "-" * (pad - pad // 2)
            lane[seg.s] = "|"
            lane[seg.e] = "|"
            lane[seg.s + 1:seg.e] = list(body)
        # time this stream spends on units of other blocks, inside this block's window
        for u in everything:
            if u.stream != stream or u.id in ids or _t(u.end_us) <= t0 or _t(u.start_us) >= t1:
                continue
            a = _col_at(anchors, max(_t(u.start_us), t0), right=True)
            b = _col_at(anchors, min(_t(u.end_us), t1), right=False)
            for c in range(a, min(b + 1, ncols)):
                if lane[c] == " ":
                    lane[c] = "·"
        lines.append((LANE_PREFIX[stream] + "".join(lane)).rstrip())
    return lines


def summary_line(schedule: Schedule, overlap: Overlap | None = None) -> str:
    """Predicted step, serial time, unit and event-edge counts, and η_pred."""
    overlap = overlap or predicted_overlap(schedule)
    n_comm = sum(1 for u in schedule.units if u.kind == COMM)  # DeepEP LL's are on compute
    speed = (f" (×{schedule.serial_us / schedule.predicted_step_us:.2f} vs serial)"
             if schedule.predicted_step_us > 0 else "")
    h, tot = overlap.total()
    return (f"DBO schedule ({schedule.scheduler}, {schedule.num_ubatches} ubatches): "
            f"predicted step {schedule.predicted_step_us:.1f} µs, serial {schedule.serial_us:.1f} µs"
            f"{speed}, {len(schedule.units)} units ({len(schedule.units) - n_comm} compute, "
            f"{n_comm} comm), {len(schedule.event_edges)} event edges, "
            f"η_pred {fmt_pct(overlap.eta()).strip()} ({h:.1f} of {tot:.1f} µs comm hidden)")


def render_text(schedule: Schedule, width: int = 100, measured=None) -> str:
    """The schedule as text: a summary line, one block per layer (compute and comm lanes, and
    a link lane of the sends' transfers where the schedule has sends), the legend.

    Args:
        schedule: a compiled :class:`~dbo_compile.passes.stream_assign.Schedule`.
        width: target line width in characters (a block with many short units may exceed it,
            since every segment keeps room for its label).
        measured: optional :class:`~dbo_compile.viz.profile.Measured` (from a profiler trace);
            adds a per-unit predicted-vs-measured table.

    Returns:
        The text, lines joined by ``\\n``, no trailing newline.
    """
    overlap = predicted_overlap(schedule)
    links = _link_units(schedule)
    out = [summary_line(schedule, overlap), ""]
    for layer, units in layer_blocks(schedule):
        out.extend(_render_block(schedule, layer, units, width, overlap, links))
        out.append("")
    out.extend(textwrap.wrap(LEGEND, width=max(width, 40), subsequent_indent="  "))
    if measured is not None:
        out.append("")
        out.extend(render_measured_table(schedule, measured))
    return "\n".join(out)
