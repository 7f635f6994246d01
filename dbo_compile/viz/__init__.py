"""Views of a compiled DBO schedule: text lanes, Chrome/Perfetto trace, PNG Gantt chart.

Command line: ``python -m dbo_compile.viz --help``.

    >>> from dbo_compile.viz import load_schedule, render_text       # doctest: +SKIP
    >>> print(render_text(load_schedule("schedule.json")))           # doctest: +SKIP
"""

from dbo_compile.viz.chrome import to_chrome_trace
from dbo_compile.viz.common import VizInputError, load_schedule, predicted_overlap, schedule_from_dict
from dbo_compile.viz.png import to_png
from dbo_compile.viz.profile import Measured, load_trace, match_profile, range_name
from dbo_compile.viz.text import render_text

__all__ = [
    "Measured", "VizInputError", "load_schedule", "load_trace", "match_profile",
    "predicted_overlap", "range_name", "render_text", "schedule_from_dict", "to_chrome_trace",
    "to_png",
]
