"""The schedule as a PNG Gantt chart (matplotlib, Agg backend; no display needed).

Rows: compute stream on top, comm stream below, the sends' transfers on the link under it
where the schedule has sends (with a profile: measured compute and comm rows under a gap).
Bars are coloured by ubatch (grey: shared prologue), labelled when wide enough; comm time
hidden under compute is shaded on the comm and link rows. The title gives the
predicted step time, the serial time (all units on one stream) and
``η_pred = hidden comm / total comm`` (see :mod:`dbo_compile.viz.common`).
"""

from __future__ import annotations

from pathlib import Path

from dbo_compile.schedule import COMM, COMPUTE, Schedule
from dbo_compile.viz.common import (LINK, fmt_pct, merge, predicted_overlap, short_label,
                                    transfers)

_COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b"]
_PROLOGUE = "#9e9e9e"


def _color(ubatch: int | None) -> str:
    return _PROLOGUE if ubatch is None else _COLORS[ubatch % len(_COLORS)]


def to_png(schedule: Schedule, path: str | Path, measured=None, dpi: int = 120) -> Path:
    """Write the Gantt chart to ``path`` and return it.

    Raises:
        ImportError: matplotlib is not installed (``pip install dbo_compile[dev]``).
    """
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    ov = predicted_overlap(schedule)
    link = transfers(schedule)
    rows = [("compute (pred)", COMPUTE, None), ("comm (pred)", COMM, None)]
    if link:
        rows.append(("link (pred)", LINK, None))
    if measured is not None:
        rows += [("compute (meas)", COMPUTE, measured), ("comm (meas)", COMM, measured)]
    span = max([schedule.predicted_step_us] + ([measured.step_us] if measured else []) + [1e-6])
    fig, ax = plt.subplots(figsize=(max(10, min(40, len(schedule.units) * 0.6)), 1.2 + 0.8 * len(rows)))
    ytick = []
    for r, (title, stream, m) in enumerate(rows):
        y = -r * 1.0
        ytick.append(y + 0.4)
        busy_compute = (merge((u.start_us, u.end_us) for u in schedule.units if u.stream == COMPUTE)
                        if m is None else m.busy.get(COMPUTE, []))
        if m is not None and m.method != "annotations" and stream == COMPUTE:
            ax.broken_barh([(s, e - s) for s, e in busy_compute], (y, 0.8), facecolor="#bbbbbb",
                           edgecolor="black", linewidth=0.3)
        for u in schedule.units:
            if (u.id not in link) if stream == LINK else u.stream != stream:
                continue
            if stream == LINK:
                s, e = link[u.id]
            elif m is None:
                s, e = u.start_us, u.end_us
            elif u.id in m.units:
                s, e = m.units[u.id]
            else:
                continue
            w = max(e - s, span * 0.001)
            ax.broken_barh([(s, w)], (y, 0.8), facecolor=_color(u.ubatch), edgecolor="black",
                           linewidth=0.4, alpha=0.9)
            if stream in (COMM, LINK):  # shade the hidden part
                for bs, be in busy_compute:
                    lo, hi = max(s, bs), min(e, be)
                    if hi > lo:
                        ax.broken_barh([(lo, hi - lo)], (y - 0.15, 0.12), facecolor="#2e7d32")
                        ax.axvspan(lo, hi, ymin=0, ymax=1, color="#2e7d32", alpha=0.08, lw=0)
            if w > span * 0.025:
                ax.text(s + w / 2, y + 0.4, short_label(u), ha="center", va="center", fontsize=7,
                        color="white" if u.ubatch is not None else "black")
    ax.set_yticks(ytick)
    ax.set_yticklabels([r[0] for r in rows])
    ax.set_xlim(0, span * 1.01)
    ax.set_xlabel("time from step start (µs)")
    title = (f"DBO schedule: predicted step {schedule.predicted_step_us:.1f} µs, serial "
             f"{schedule.serial_us:.1f} µs, η_pred = hidden/total comm = {fmt_pct(ov.eta()).strip()}")
    if measured is not None:
        title += (f"\nmeasured ({measured.method}): step {measured.step_us:.1f} µs, "
                  f"η_meas = {fmt_pct(measured.overlap.eta()).strip()}")
    ax.set_title(title, fontsize=9)
    ubatches = sorted({u.ubatch for u in schedule.units if u.ubatch is not None})
    handles = [Patch(color=_color(b), label=f"ubatch {b}") for b in ubatches]
    handles += [Patch(color=_PROLOGUE, label="prologue"),
                Patch(color="#2e7d32", label="comm hidden under compute")]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.28), fontsize=7,
              ncol=len(handles), frameon=False)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path
