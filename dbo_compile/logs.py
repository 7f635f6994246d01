"""Logging setup of dbo_compile: ``TORCH_LOGS="+dbo_compile"`` shows our DEBUG logs.

Every module logs through ``logging.getLogger(__name__)``; graph and schedule dumps go through
``torch._logging.trace_structured`` (tlparse shows them).
"""

from __future__ import annotations

import logging
import os
import re
import sys

try:  # private torch API: a torch without it only loses TORCH_LOGS="+dbo_compile"
    from torch._logging import _internal as _torch_logs
    from torch._logging._internal import _init_logs, register_log
except ImportError:  # pragma: no cover
    _torch_logs = _init_logs = register_log = None

LOG_NAME = "dbo_compile"


def register_torch_log() -> None:
    """Register ``dbo_compile`` with ``torch._logging`` so that ``TORCH_LOGS="+dbo_compile"``
    (DEBUG) or ``TORCH_LOGS=dbo_compile`` (INFO) shows our logs through torch's handler, each
    record once, and ``torch._logging.set_logs(modules={"dbo_compile": level})`` works.
    Called once, at ``import dbo_compile``; never raises.

    torch imports this package while it resolves a name of ``TORCH_LOGS`` (at ``import
    torch``) or of ``set_logs``: it registers the name it resolves itself and attaches its
    handler once the import returns. Registering ``dbo_compile`` here too would make torch
    also take it for a child of itself (a child is let propagate at the next reading of the
    settings: a root handler then printed every record a second time), and reading the
    settings again from here attached a second handler to it (every record printed twice)."""
    if register_log is None:
        return
    try:
        resolving = _name_torch_is_resolving()
        if resolving is not None:
            # torch's reset, which stops its registered logs propagating, ran before this name
            # existed; its handler prints our records, a root handler must not print them again
            logging.getLogger(LOG_NAME).propagate = False
            if resolving == LOG_NAME:
                return  # torch registers "dbo_compile" itself right after this import
        register_log(LOG_NAME, LOG_NAME)
        if resolving is None and LOG_NAME in _torch_logs_names():
            _init_logs()  # TORCH_LOGS was read before the name existed: read it again
    except Exception:  # noqa: BLE001 - logging setup must never break import
        pass


def _torch_logs_names() -> set[str]:
    """The log names of ``TORCH_LOGS`` without their ``+``/``-`` verbosity marks
    (``"+dbo_compile,dynamo"`` -> ``{"dbo_compile", "dynamo"}``)."""
    settings = re.sub(r"\s+", "", os.environ.get("TORCH_LOGS", ""))
    return {name.lstrip("+-") for name in settings.split(",") if name}


def _name_torch_is_resolving() -> str | None:
    """The module name ``torch._logging`` is looking up while this import runs (it imports a
    module of ``TORCH_LOGS`` or ``set_logs`` to list its submodules: a caller frame runs its
    ``_is_valid_module`` or ``_get_module_and_submodules``, argument ``qname``); ``None``
    when no such lookup is under way."""
    codes = {getattr(getattr(_torch_logs, name, None), "__code__", None)
             for name in ("_is_valid_module", "_get_module_and_submodules")} - {None}
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code in codes:
            return str(frame.f_locals.get("qname", ""))
        frame = frame.f_back
    return None
