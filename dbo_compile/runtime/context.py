"""The per-step facts an engine knows on the host and hands to the compiled model.

The compiled model can derive everything from its inputs, but only by reading
``query_start_loc`` back from the device (a host sync) and without the engine's vetoes. An
engine wraps each call in :func:`step_context` instead::

    with step_context(num_scheduled_tokens=[1, 1, 37], block_size=16, vetoes=my_vetoes):
        logits = compiled(input_ids, positions, attn_metadata)

or calls :func:`dbo_compile.runtime.engine.run_step`, which does exactly this.

Also the per-thread state of the compiled artifacts (the artifact called last, recorded calls,
uncounted warm-up steps, :func:`traced_only` blocks), which the CUDA-graph runner and the
compiled stages read through the functions here.
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence


@dataclass(frozen=True)
class StepContext:
    """Host-side facts of one step.

    Attributes:
        num_scheduled_tokens: tokens scheduled per request this step (host ints, request
            order); ``None``: read them from ``query_start_loc``.
        block_size: KV-cache block size (tokens) for the prefix-read veto; ``None``: the block
            size of the graph's KV caches (the veto runs on every step with metadata).
        vetoes: engine vetoes, ``(metadata, num_scheduled_tokens) -> reason | None``.
        allow_split: ``False`` vetoes the split on this rank outright.
        step_id: a number unique to the step in this process (set by :func:`step_context`):
            a graph called several times in one step (graph breaks) counts one step in its
            ``stats``. ``None`` (a call outside any step context): every call is a step.
        real_rows / padded_rows: ``run_step`` padded the step's ``real_rows`` token rows to
            ``padded_rows`` (Dynamo specialises sizes 0 and 1): a graph called with
            ``padded_rows`` rows then knows which are padding.
    """

    num_scheduled_tokens: Sequence[int] | None = None
    block_size: int | None = None
    vetoes: Sequence[Any] = field(default_factory=tuple)
    allow_split: bool = True
    step_id: int | None = None
    real_rows: int | None = None
    padded_rows: int | None = None


_CURRENT: contextvars.ContextVar[StepContext | None] = contextvars.ContextVar(
    "dbo_step_context", default=None)
_STEP_IDS = itertools.count()


@contextlib.contextmanager
def step_context(**facts: Any) -> Iterator[StepContext]:
    """Make ``StepContext(**facts)`` visible to compiled models called inside the block."""
    facts.setdefault("step_id", next(_STEP_IDS))
    ctx = StepContext(**facts)
    token = _CURRENT.set(ctx)
    try:
        yield ctx
    finally:
        _CURRENT.reset(token)


def current_step_context() -> StepContext:
    return _CURRENT.get() or StepContext()


# -- per-thread state of the compiled artifacts -------------------------------------------


class _PerThread(threading.local):
    """Per thread (a server may step several models from several threads): the artifact
    called last; while not None (inside :func:`record_calls`) the list every artifact call
    appends ``(artifact, args)`` to; whether calls count in the artifacts' stats; the depth of
    :func:`traced_only` blocks; the last call's outputs and their specs (:func:`note_outputs`);
    the engine's per-ubatch step-state switch (:func:`ubatch_scope`)."""

    last_called: Any = None
    ubatch_hook: Any = None
    recorded: list | None = None
    counting: bool = True
    traced_only: int = 0
    static_stages: int = 0
    stage_calls: dict | None = None
    last_outputs: tuple | None = None


_THREAD = _PerThread()


def last_called() -> Any:
    """The compiled artifact that ran the most recent step in this thread (Dynamo may hold
    several for one model: a static and a dynamic graph); its ``last_vote`` is that step's."""
    return _THREAD.last_called


def note_call(artifact: Any, args: Sequence[Any] | None = None) -> None:
    """Record that ``artifact`` runs this thread's step: it becomes :func:`last_called`, and
    inside :func:`record_calls` ``(artifact, args)`` is appended (``args`` ``None``: only the
    former, for a step whose call was recorded already)."""
    _THREAD.last_called = artifact
    if args is not None and _THREAD.recorded is not None:
        _THREAD.recorded.append((artifact, tuple(args)))


def note_outputs(outputs: tuple, specs: Any) -> None:
    """Record the flat outputs an artifact call returned (and their ``OutputSpec`` tuple,
    ``None``: unclassified): :func:`~dbo_compile.runtime.engine.run_step` and the CUDA-graph
    runner find the model's outputs among them by identity."""
    _THREAD.last_outputs = (outputs, specs)


def last_outputs() -> tuple | None:
    """``(flat outputs, specs)`` of this thread's last artifact call (:func:`note_outputs`)."""
    return _THREAD.last_outputs


def counting() -> bool:
    """Whether calls in this thread count in the artifacts' ``stats`` (see :func:`uncounted`)."""
    return _THREAD.counting


@contextlib.contextmanager
def record_calls() -> Iterator[list[tuple[Any, tuple[Any, ...]]]]:
    """Within the block, every call of a compiled artifact in this thread appends
    ``(artifact, graph args)`` to the yielded list (the CUDA-graph runner records a step's
    graph inputs with it)."""
    calls: list[tuple[Any, tuple[Any, ...]]] = []
    old, _THREAD.recorded = _THREAD.recorded, calls
    try:
        yield calls
    finally:
        _THREAD.recorded = old


@contextlib.contextmanager
def uncounted() -> Iterator[None]:
    """Within the block, calls in this thread are no served steps (the CUDA-graph runner's
    synthetic warm-up steps): they do not count in the artifacts' ``stats``, and leave the
    buffers the programs write in place as they were (``CompiledArtifact.state_inputs``)."""
    old, _THREAD.counting = _THREAD.counting, False
    try:
        yield
    finally:
        _THREAD.counting = old


@contextlib.contextmanager
def traced_only() -> Iterator[None]:
    """Within the block, a compiled stage called with an input signature it has not compiled
    runs its traced ATen ops instead of compiling (and records nothing, so a later call
    compiles as usual); signatures compiled before keep their compiled code. For calls whose
    results are thrown away, such as :class:`~dbo_compile.runtime.cudagraph_runner.CudaGraphRunner`'s
    layout probe."""
    _THREAD.traced_only += 1
    try:
        yield
    finally:
        _THREAD.traced_only -= 1


def in_traced_only() -> bool:
    """Whether this thread is inside a :func:`traced_only` block."""
    return _THREAD.traced_only > 0


@contextlib.contextmanager
def static_stages() -> Iterator[None]:
    """Within the block, a compiled stage meeting an input signature for the first time
    compiles it for its static shapes, not as a symbolic-size compilation shared by every
    signature (:class:`~dbo_compile.codegen.inductor.InductorStage`): the runner's
    ``static_buckets``, as vLLM's ``compile_sizes``."""
    _THREAD.static_stages += 1
    try:
        yield
    finally:
        _THREAD.static_stages -= 1


def in_static_stages() -> bool:
    """Whether this thread is inside a :func:`static_stages` block."""
    return _THREAD.static_stages > 0


@contextlib.contextmanager
def record_stage_calls() -> Iterator[dict[str, str]]:
    """Within the block, each compiled stage call in this thread records the kind of code it
    ran in the yielded dict, ``{stage name: kind}`` (``"dynamic"``: compiled with symbolic
    sizes; ``"static"``: compiled for this signature; ``"aten"``: the traced ATen ops, e.g.
    past the compile limit): the CUDA-graph runner reports it per bucket."""
    calls: dict[str, str] = {}
    old, _THREAD.stage_calls = _THREAD.stage_calls, calls
    try:
        yield calls
    finally:
        _THREAD.stage_calls = old


def note_stage_call(name: str, kind: str) -> None:
    """What a compiled stage calls at every call: recorded inside :func:`record_stage_calls`
    (a later kind of the same stage wins only over ``"dynamic"``/``"static"`` if it is
    ``"aten"``, so that a fallback is never hidden)."""
    calls = _THREAD.stage_calls
    if calls is not None and calls.get(name) != "aten":
        calls[name] = kind


@contextlib.contextmanager
def ubatch_scope(enter: Callable[[int], None]) -> Iterator[None]:
    """Within the block, the split program calls ``enter(u)`` before each unit of ubatch ``u``
    that runs an op keyed to step state outside the graph
    (:func:`~dbo_compile.ops.registry.register_step_state_op`: vLLM's attention reads its
    metadata from vLLM's forward context), so that the engine installs ubatch ``u``'s state
    (vLLM: its per-ubatch attention metadata). The engine restores its own state after the
    block; ``enter`` runs on the host, between units."""
    old, _THREAD.ubatch_hook = _THREAD.ubatch_hook, enter
    try:
        yield
    finally:
        _THREAD.ubatch_hook = old


def in_ubatch_scope() -> bool:
    """Whether an engine's per-ubatch step-state switch (:func:`ubatch_scope`) is installed."""
    return _THREAD.ubatch_hook is not None


def enter_ubatch(ubatch: int) -> None:
    """What the generated split program calls before a unit of ``ubatch`` that reads step
    state: the engine's switch of :func:`ubatch_scope`, if any (none: the program runs outside
    an engine that keeps such state, and the op reads what the caller set)."""
    hook = _THREAD.ubatch_hook
    if hook is not None:
        hook(ubatch)
