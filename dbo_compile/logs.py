"""Logging setup of dbo_compile: ``TORCH_LOGS="+dbo_compile"`` shows our DEBUG logs.

Every module logs through ``logging.getLogger(__name__)``; graph and schedule dumps go through
``torch._logging.trace_structured`` (tlparse shows them).
"""

from __future__ import annotations

import logging
import os

try:  # private torch API: a torch without it only loses TORCH_LOGS="+dbo_compile"
    from torch._logging._internal import _init_logs, register_log
except ImportError:  # pragma: no cover
    _init_logs = register_log = None


def register_torch_log() -> None:
    """Register ``dbo_compile`` with ``torch._logging`` so that ``TORCH_LOGS="+dbo_compile"``
    shows our DEBUG logs (the generated wrapper, graphs); never raises."""
    if register_log is None:
        return
    try:
        register_log("dbo_compile", "dbo_compile")
        if "dbo_compile" in os.environ.get("TORCH_LOGS", ""):
            _init_logs()  # re-read TORCH_LOGS now that the name exists
        drop_duplicate_handlers(logging.getLogger("dbo_compile"))
    except Exception:  # noqa: BLE001 - logging setup must never break import
        pass


def drop_duplicate_handlers(logger: logging.Logger) -> None:
    """torch attaches its handler to our logger twice when ``TORCH_LOGS`` names us (it imports
    this package while parsing the variable, and our import registers the name and re-reads
    it): keep one of torch's handlers per stream/file; handlers of other origins stay."""
    seen = set()
    for h in list(logger.handlers):
        if type(h.formatter).__name__ != "TorchLogsFormatter":
            continue
        key = (type(h), getattr(h, "stream", None), getattr(h, "baseFilename", None))
        if key in seen:
            logger.removeHandler(h)
        seen.add(key)
