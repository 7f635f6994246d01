"""dbo_compile: a ``torch.compile`` backend for dual batch overlap (DBO) of MoE all-to-all.

``torch.compile(model, backend="dbo", options={...})`` cuts each step into ubatches along the
token dim and schedules one ubatch's dispatch/combine beside the other ubatch's compute.
"""

from dbo_compile.config import DboConfig
from dbo_compile.errors import (
    DboConfigError,
    DboError,
    DpVoteError,
    MetadataError,
    ScheduleError,
    UBatchExecutionError,
    UnsplittableGraphError,
)

__all__ = [
    "DboConfig",
    "DboConfigError",
    "DboError",
    "DpVoteError",
    "MetadataError",
    "ScheduleError",
    "UBatchExecutionError",
    "UnsplittableGraphError",
]
import logging  # noqa: E402

__version__ = "0.1.0"


def _register_torch_log() -> None:
    """Make ``TORCH_LOGS="+dbo_compile"`` show our DEBUG logs (the generated wrapper, graphs)."""
    import os

    try:
        from torch._logging._internal import _init_logs, register_log

        register_log("dbo_compile", "dbo_compile")
        if "dbo_compile" in os.environ.get("TORCH_LOGS", ""):
            _init_logs()  # re-read TORCH_LOGS now that the name exists
        _drop_duplicate_handlers(logging.getLogger("dbo_compile"))
    except Exception:  # noqa: BLE001 - logging setup must never break import
        pass


def _drop_duplicate_handlers(logger: logging.Logger) -> None:
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


_register_torch_log()
