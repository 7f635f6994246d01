"""dbo_compile: a ``torch.compile`` backend for dual batch overlap (DBO) of MoE all-to-all.

``torch.compile(model, backend="dbo", options={...})`` cuts each step into ubatches along the
token dim and schedules one ubatch's dispatch/combine beside the other ubatch's compute. The
package's floors and what each may import: ``docs/architecture.md``.
"""

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
]

__version__ = "0.1.0"

register_torch_log()
