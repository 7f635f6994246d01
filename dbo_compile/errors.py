"""Exception types of dbo_compile, all of them (ground floor: imported by every stage).

Every error says what was found, where (node name, op, shape, rank) and what the user can do.
Each class is also importable from the module that raises it (``dbo_compile.ops``,
``dbo_compile.runtime.cudagraph_runner``, ...), where users have imported it so far.
"""


class DboError(Exception):
    """Base class of every error raised by dbo_compile."""


# -- compile time -------------------------------------------------------------------------


class DboConfigError(DboError, ValueError):
    """An option passed through ``torch.compile(..., options=...)`` or ``DboConfig`` is invalid.

    Raised inside ``torch.compile`` it reaches the caller wrapped in Dynamo's
    ``BackendCompilerFailed``, as its ``inner_exception`` (Dynamo raises it ``from None``:
    ``__cause__`` is ``None``); :func:`dbo_error_of` finds it.
    """


class UnknownOptionError(DboConfigError, TypeError):
    """An option name that is not a field of ``DboConfig`` (also a ``TypeError``, what the
    dataclass's own ``__init__`` raised before)."""


class UnsplittableGraphError(DboError):
    """The graph cannot be cut into ubatches without changing its results.

    The backend catches it, compiles the graph unsplit and logs the message; it reaches the user
    only from the pass-level APIs or with ``DboConfig(on_unsplittable="raise")``.

    Attributes:
        row_local: the token-dim analysis showed that padding rows cannot change the real
            rows' results (set by the raiser; the CUDA-graph runner may then pad the unsplit
            graph to a bucket).
        state_inputs: graph-input indices of the shared inputs the graph writes in place
            (:func:`~dbo_compile.passes.state_threads.state_inputs`; set by the raiser where
            the graph was lowered), which runs that are no served step put back.
        folds_token_rows: the graph folds token rows into a buffer it updates (an
            expert-load counter; set by the raiser where the state threads were found):
            Dynamo's graph, which the way out runs, would count padding rows in it.
    """

    row_local: bool = False
    state_inputs: tuple[int, ...] = ()
    folds_token_rows: bool = False


class ScheduleError(DboError):
    """The scheduler or codegen found an inconsistency (a cycle, a missing event edge)."""


class PipelineError(DboError):
    """A pass list cannot run as declared (:mod:`dbo_compile.passes.manager`): a pass reads a
    fact no earlier pass wrote, writes one it does not declare, or a user pass names no pass
    to run after, or a name taken."""


# -- ops ----------------------------------------------------------------------------------


class CommOpError(DboError, ValueError):
    """Arguments of ``dbo.dispatch`` / ``dbo.combine`` are inconsistent (shapes, dtypes, sharding)."""


class CommBackendError(DboError, RuntimeError):
    """A communication backend is unknown or cannot be loaded (its package is missing)."""


class ExpertsOpError(DboError):
    """Bad arguments to ``dbo.grouped_experts`` (shapes or dtypes)."""


class AttentionOpError(DboError, ValueError):
    """Arguments of ``dbo.attention`` have inconsistent shapes or dtypes."""


# -- run time -----------------------------------------------------------------------------


class MetadataError(DboError, ValueError):
    """Attention metadata is inconsistent (lengths, dtypes, offsets)."""


class DpVoteError(DboError, RuntimeError):
    """The DP ranks disagree on something that must be identical (compiled schedule, bucket)."""


class UBatchExecutionError(DboError, RuntimeError):
    """An op inside one ubatch's compute or communication raised; the step was aborted."""


class GraphRunnerError(DboError):
    """The model cannot be run as per-bucket CUDA graphs (e.g. it compiled into several graphs),
    or the runner was used before :meth:`CudaGraphRunner.capture`."""


# -- models, tools ------------------------------------------------------------------------


class ModelConfigError(DboError, ValueError):
    """A model config or preset name is invalid, or the model is used before it is ready."""


class UnsupportedModelError(DboError, ValueError):
    """The model's family or layout cannot be made expert-parallel; the message says what is
    missing (family, block class, router or expert tensors) and what is supported."""


class VizInputError(DboError, ValueError):
    """A schedule or profile file given to the viz tools is missing or malformed."""


class TimingError(DboError, ValueError):
    """A timer of :mod:`dbo_compile.timing` was asked for no samples (``iters`` or ``reps``
    below 1, ``warmup`` below 0)."""


class MultirankError(DboError, RuntimeError):
    """A spawned rank raised, or the ranks did not finish within the timeout."""


def dbo_error_of(exc: BaseException) -> DboError | None:
    """The :class:`DboError` that ``exc`` is or wraps, or ``None``.

    Dynamo wraps a backend's exception in ``BackendCompilerFailed`` with ``from None``, so
    ``exc.__cause__`` is ``None``: the error is ``exc.inner_exception`` (and ``__context__``).
    This follows ``inner_exception``, ``__cause__`` and ``__context__``, nearest first::

        try:
            compiled(*inputs)
        except Exception as e:
            err = dbo_error_of(e)   # e.g. the DboConfigError of a bad option
    """
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, DboError):
            return e
        todo += [getattr(e, "inner_exception", None), e.__cause__, e.__context__]
    return None
