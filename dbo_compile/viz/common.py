"""Shared helpers of the viz package: loading a schedule, interval arithmetic, overlap figures.

Overlap is measured the same way everywhere (text, chrome args, PNG title): a comm unit's time
is *hidden* where the compute stream is busy at the same time (any compute unit, any layer,
any ubatch); a send's comm time is also its transfer on the link (:func:`transfers`: the
emulated link, DeepEP low-latency), in flight after its issue. ``η_pred = hidden comm time /
total comm time`` over the step. This is the
schedule-level figure; the benchmark's η (docs/design.md, "Where performance comes from") needs
three measured programs and is not derivable from one schedule.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from dbo_compile.errors import VizInputError
from dbo_compile.schedule import COMM, COMPUTE, Schedule, Unit

log = logging.getLogger(__name__)

SUBSCRIPTS = str.maketrans("0123456789", "₀₁₂₃₄₅₆₇₈₉")
STREAMS = (COMPUTE, COMM)
#: the lane of the sends' transfers (:func:`transfers`), drawn beside the two streams
LINK = "link"


def short_label(unit: Unit) -> str:
    """``A₀``, ``MLP₁``, ``D₀``, ``rD₀`` (a receive), ``P`` — label with the ubatch as a
    subscript (no layer)."""
    sub = "" if unit.ubatch is None else str(unit.ubatch).translate(SUBSCRIPTS)
    phase = "r" if unit.phase == "receive" else ""
    return f"{phase}{unit.label}{sub}"


def load_schedule(path: str | Path) -> Schedule:
    """Read a schedule written by :meth:`Schedule.to_json`.

    Raises:
        VizInputError: the file is missing, not JSON, or not a schedule (message names the
            file and the first problem found).
    """
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise VizInputError(f"cannot read schedule file {str(p)!r}: {e.strerror or e}") from None
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise VizInputError(f"schedule file {str(p)!r} is not valid JSON "
                            f"(line {e.lineno}, column {e.colno}: {e.msg})") from None
    return schedule_from_dict(d, source=str(p))


def schedule_from_dict(d: Any, source: str = "<dict>") -> Schedule:
    """:meth:`Schedule.from_dict` with the checks a viewer needs (ids, streams, edges).

    Raises:
        VizInputError: a required key is missing or a value is inconsistent.
    """
    if not isinstance(d, dict) or "units" not in d:
        raise VizInputError(f"{source!r} is not a dbo schedule (expected a JSON object with "
                            "'units', written by Schedule.to_json())")
    try:
        sched = Schedule.from_dict(d)
    except (KeyError, TypeError, ValueError) as e:
        raise VizInputError(f"{source!r} is not a valid dbo schedule: "
                            f"{type(e).__name__}: {e}") from None
    ids = [u.id for u in sched.units]
    if ids != list(range(len(ids))):
        raise VizInputError(f"{source!r}: unit ids must be 0..n-1 in host order, got {ids[:8]}...")
    for u in sched.units:
        if u.stream not in STREAMS:
            raise VizInputError(f"{source!r}: unit {u.id} has stream {u.stream!r}, "
                                f"expected one of {STREAMS}")
        if not u.end_us >= u.start_us:
            raise VizInputError(f"{source!r}: unit {u.id} ends ({u.end_us}) before it starts "
                                f"({u.start_us})")
    for a, b in list(sched.event_edges) + list(sched.deps):
        if not (0 <= a < len(ids) and 0 <= b < len(ids)):
            raise VizInputError(f"{source!r}: edge ({a}, {b}) names a unit that does not exist")
    return sched


# ------------------------------------------------------------------------------------------
# intervals
# ------------------------------------------------------------------------------------------


def merge(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Union of closed intervals as sorted disjoint intervals (empty ones dropped)."""
    out: list[list[float]] = []
    for s, e in sorted((s, e) for s, e in intervals if e > s):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def covered(s: float, e: float, busy: list[tuple[float, float]]) -> float:
    """Length of ``[s, e]`` covered by the disjoint sorted intervals ``busy``."""
    return sum(max(0.0, min(e, be) - max(s, bs)) for bs, be in busy)


@dataclass
class Overlap:
    """Comm time hidden under compute, per comm unit and summed (µs)."""

    hidden_us: dict[int, float]
    comm_us: dict[int, float]

    def total(self, ids: Iterable[int] | None = None) -> tuple[float, float]:
        keys = self.comm_us.keys() if ids is None else [i for i in ids if i in self.comm_us]
        return sum(self.hidden_us[i] for i in keys), sum(self.comm_us[i] for i in keys)

    def eta(self, ids: Iterable[int] | None = None) -> float | None:
        """hidden / total comm time, ``None`` when there is no comm time."""
        h, t = self.total(ids)
        return h / t if t > 0 else None


def transfers(schedule: Schedule) -> dict[int, tuple[float, float]]:
    """Per send (a unit with ``latency_us``: the issue of a comm op whose receive is a unit of
    its own), its transfer's ``(start, end)`` on the rank's one link, µs: as
    :class:`~dbo_compile.schedule.Timeline` places them, one at a time in host order, each
    from its issue's end or the previous transfer's end."""
    out, free = {}, 0.0
    for u in schedule.units:
        if u.latency_us > 0:
            start = max(u.end_us, free)
            free = start + u.latency_us
            out[u.id] = (start, free)
    return out


def predicted_overlap(schedule: Schedule) -> Overlap:
    busy = merge((u.start_us, u.end_us) for u in schedule.units if u.stream == COMPUTE)
    comm = [u for u in schedule.units if u.stream == COMM]
    link = transfers(schedule)
    hidden = {u.id: covered(u.start_us, u.end_us, busy) for u in comm}
    total = {u.id: u.end_us - u.start_us for u in comm}
    for i, (s, e) in link.items():
        hidden[i] = hidden.get(i, 0.0) + covered(s, e, busy)
        total[i] = total.get(i, 0.0) + e - s
    return Overlap(hidden, total)


def fmt_pct(x: float | None) -> str:
    return "  n/a" if x is None else f"{100 * x:5.1f}%"
