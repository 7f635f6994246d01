"""dbo_compile: a ``torch.compile`` backend for dual batch overlap (DBO) of MoE all-to-all.

``torch.compile(model, backend="dbo", options={...})`` cuts each step into ubatches along the
token dim and schedules one ubatch's dispatch/combine beside the other ubatch's compute. The
package's floors and what each may import: ``docs/architecture.md``.
"""

import importlib
from typing import Any

from dbo_compile.config import DboConfig
from dbo_compile.errors import (
    DboConfigError,
    DboError,
    DpVoteError,
    MetadataError,
    ScheduleError,
    UBatchExecutionError,
    UnknownOptionError,
    UnsplittableGraphError,
    dbo_error_of,
)
from dbo_compile.logs import register_torch_log

__all__ = [
    "DboConfig",
    "DboConfigError",
    "DboError",
    "DpVoteError",
    "MetadataError",
    "ScheduleError",
    "UBatchExecutionError",
    "UnknownOptionError",
    "UnsplittableGraphError",
    "dbo_error_of",
    "register",
]

__version__ = "0.1.0"


def _dbo_backend(gm: Any, example_inputs: Any, **kwargs: Any) -> Any:
    """``backend="dbo"`` as ``import dbo_compile`` registers it: the compiler
    (:func:`dbo_compile.backend.dbo_backend`) is imported at its first call."""
    return importlib.import_module("dbo_compile.backend").dbo_backend(gm, example_inputs, **kwargs)


def register() -> None:
    """Register ``backend="dbo"`` with Dynamo (``import dbo_compile`` does, so that it is
    enough where the package is not installed: ``PYTHONPATH=$PWD``, no
    ``torch_dynamo_backends`` entry point; installed, the entry point names the same
    compiler). Idempotent."""
    registry = importlib.import_module("torch._dynamo.backends.registry")
    if "dbo" not in registry._BACKENDS:
        registry.register_backend(name="dbo")(_dbo_backend)


register_torch_log()
register()
