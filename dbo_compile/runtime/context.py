"""The per-step facts an engine knows on the host and hands to the compiled model.

The compiled model can derive everything from its inputs, but only by reading
``query_start_loc`` back from the device (a host sync) and without the engine's vetoes. An
engine wraps each call in :func:`step_context` instead::

    with step_context(num_scheduled_tokens=[1, 1, 37], block_size=16, vetoes=my_vetoes):
        logits = compiled(input_ids, positions, attn_metadata)

or calls :func:`dbo_compile.runtime.engine.run_step`, which does exactly this.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence


@dataclass(frozen=True)
class StepContext:
    """Host-side facts of one step.

    Attributes:
        num_scheduled_tokens: tokens scheduled per request this step (host ints, request
            order); ``None``: read them from ``query_start_loc``.
        block_size: KV-cache block size (tokens) for the prefix-read veto; ``None`` skips it.
        vetoes: engine vetoes, ``(metadata, num_scheduled_tokens) -> reason | None``.
        allow_split: ``False`` vetoes the split on this rank outright.
    """

    num_scheduled_tokens: Sequence[int] | None = None
    block_size: int | None = None
    vetoes: Sequence[Any] = field(default_factory=tuple)
    allow_split: bool = True


_CURRENT: contextvars.ContextVar[StepContext | None] = contextvars.ContextVar(
    "dbo_step_context", default=None)


@contextlib.contextmanager
def step_context(**facts: Any) -> Iterator[StepContext]:
    """Make ``StepContext(**facts)`` visible to compiled models called inside the block."""
    ctx = StepContext(**facts)
    token = _CURRENT.set(ctx)
    try:
        yield ctx
    finally:
        _CURRENT.reset(token)


def current_step_context() -> StepContext:
    return _CURRENT.get() or StepContext()
