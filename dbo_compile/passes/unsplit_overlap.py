"""The unsplit program on two streams: one ubatch, scheduled by the split program's machinery.

The unsplit program runs every op in graph order on one stream, so a MoE layer's shared
experts wait for its dispatch although they do not read it. SGLang's single-batch overlap and
DeepSeek's inference system run them beside it. This module builds that program from the
lowered graph with the passes of the split program at ``num_ubatches=1``
(``DboConfig.unsplit_overlap``)::

    lowered graph  ──split_ubatch(1)──►  one copy of the body, ubatch 0 (the inputs in the
                                         split signature's order: shared first)
                   ──insert_yields──►    comm ops -> issue + wait
                   ──stream_assign──►    units: the comm ops on the comm stream, the stages
                                         on the compute stream; list order; event edges only
                                         where data crosses the streams
                   ──codegen──►          :class:`~dbo_compile.codegen.wrapper.SplitProgram`

A stage is keyed by the waits it depends on and the first comm op depending on it
(:mod:`~dbo_compile.passes.units`): the shared experts (no dispatch wait, no dispatch
depending on them) are a stage apart from the router and the routed experts, so the list
scheduler may place them after the dispatch's issue, on the compute stream while the dispatch
is in flight on the comm stream, and no event edge orders the two.

:class:`OverlappedUnsplit` takes the unsplit program's arguments and returns its outputs: the
CUDA-graph runner captures it beside the serial unsplit graph at every bucket and keeps the
faster (:mod:`~dbo_compile.runtime.bucket_timing`). Every collective of the graph is issued
once, in the graph's data order (each comm op depends on the one before through the layer's
compute), as by the serial program.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch.fx as fx

from dbo_compile.candidates import UNSPLIT_OVERLAP, Candidate
from dbo_compile.codegen.wrapper import SplitProgram
from dbo_compile.errors import UnsplittableGraphError
from dbo_compile.passes import stream_assign
from dbo_compile.passes.insert_yields import insert_yields
from dbo_compile.passes.manager import CompileState, PassManager
from dbo_compile.passes.split_ubatch import split_ubatch
from dbo_compile.schedule import Schedule
from dbo_compile.signature import SplitSignature

log = logging.getLogger(__name__)

__all__ = ["UNSPLIT_OVERLAP", "OverlappedUnsplit", "overlapped_unsplit", "unsplit_overlap"]

class OverlappedUnsplit:
    """The unsplit program scheduled on the comm and compute streams (one ubatch).

    Called as the unsplit program: the graph's inputs in their order (token rows ``[T, ...]``
    at any token count ``T`` the graph takes), returning its outputs in their order (a tuple).

    Attributes:
        program: the one-ubatch :class:`~dbo_compile.codegen.wrapper.SplitProgram`.
        signature: its :class:`~dbo_compile.signature.SplitSignature` (``num_ubatches`` 1).
    """

    name = UNSPLIT_OVERLAP

    def __init__(self, program: SplitProgram, signature: SplitSignature):
        self.program = program
        self.signature = signature
        self._inputs = [index for index, _ in signature.inputs]
        self._outputs = [idx[0] for idx in signature.outputs]

    @property
    def schedule(self) -> Schedule:
        return self.program.schedule

    @property
    def code(self) -> str:
        return self.program.code

    def __call__(self, *args: Any) -> tuple[Any, ...]:
        outs = self.program(*(args[i] for i in self._inputs))
        return tuple(outs[i] for i in self._outputs)


def unsplit_overlap(lowered_gm: fx.GraphModule, state: CompileState,
                    compile_stage: Callable[[fx.GraphModule, Any], Callable] | None
                    ) -> OverlappedUnsplit:
    """The overlapped unsplit program of ``lowered_gm`` (steps of the module docstring),
    scheduled by ``state.config``'s scheduler at its own figures, unjoined (one ubatch has
    nothing to join), without an SM carve-out. ``lowered_gm`` is left as it is.

    Args:
        lowered_gm: the lowered graph (after ``find_comm``).
        state: the compile state (``specs``, ``threads``, ``token_symbols`` written).
        compile_stage: each stage's callable from its GraphModule (``None``: the GraphModule).

    Raises:
        UnsplittableGraphError: no one-ubatch order honours a comm backend's result pool
            (the caller drops the program).
        ScheduleError: the unit graph has a cycle.
    """
    config = state.config
    gm, signature = split_ubatch(lowered_gm, state.specs, 1, state.threads)
    insert_yields(gm.graph)
    gm.recompile()
    cand = Candidate(config.scheduler, config.scheduler)
    schedule = stream_assign.stream_assign(gm.graph, cand.apply(config), state.token_symbols, 1)
    stream_assign.annotate_streams(gm.graph, schedule)
    schedule.meta.update(candidate=UNSPLIT_OVERLAP)
    program = SplitProgram(gm, schedule, compile_stage)
    log.info("dbo: %s: %d units, %d event edges, predicted %.1f us (serial %.1f us)",
             UNSPLIT_OVERLAP, len(schedule.units), len(schedule.event_edges),
             schedule.predicted_step_us, schedule.serial_us)
    return OverlappedUnsplit(program, signature)


def overlapped_unsplit(lowered_gm: fx.GraphModule, state: CompileState, manager: PassManager,
                       compile_stage: Callable[[fx.GraphModule, Any], Callable] | None
                       ) -> OverlappedUnsplit | None:
    """:func:`unsplit_overlap` as the pipeline runs it: ``None`` unless
    ``state.config.unsplit_overlap``, timed by ``manager`` as ``unsplit_overlap``, and
    dropped (``None``, logged) where no one-ubatch order honours a comm backend's result pool.

    Raises:
        ScheduleError: the unit graph has a cycle.
    """
    if not state.config.unsplit_overlap:
        return None
    try:
        return manager.time("unsplit_overlap", unsplit_overlap, lowered_gm, state, compile_stage)
    except UnsplittableGraphError as e:  # a result pool no one-ubatch order honours
        log.info("dbo: %s dropped: %s", UNSPLIT_OVERLAP, e)
        return None
