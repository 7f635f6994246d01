"""Exception types of dbo_compile.

Every error says what was found, where (node name, op, shape, rank) and what the user can do.
"""


class DboError(Exception):
    """Base class of every error raised by dbo_compile."""


class DboConfigError(DboError, ValueError):
    """An option passed through ``torch.compile(..., options=...)`` or ``DboConfig`` is invalid."""


class UnsplittableGraphError(DboError):
    """The graph cannot be cut into ubatches without changing its results.

    The backend catches it, compiles the graph unsplit and logs the message; it reaches the user
    only from the pass-level APIs or with ``DboConfig(on_unsplittable="raise")``.
    """


class ScheduleError(DboError):
    """The scheduler or codegen found an inconsistency (a cycle, a missing event edge)."""


class MetadataError(DboError, ValueError):
    """Attention metadata is inconsistent (lengths, dtypes, offsets)."""


class DpVoteError(DboError, RuntimeError):
    """The DP ranks disagree on something that must be identical (compiled schedule, bucket)."""


class UBatchExecutionError(DboError, RuntimeError):
    """An op inside one ubatch's compute or communication raised; the step was aborted."""
