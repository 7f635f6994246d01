"""Measurement aids that patch a compiled artifact: the split program over static inputs, and
the split program with its comm on the compute stream.

- :class:`SplitStep`: the split program of a :class:`~dbo_compile.runtime.program.SplitArtifact`
  as a zero-argument callable over *static* per-ubatch inputs. It records the split inputs of one
  eager step (token-indexed inputs are views of the caller's buffers, so copying new tokens into
  those buffers is enough), runs the split program and concatenates the outputs in ubatch order.
  :meth:`SplitStep.refresh` re-cuts new attention metadata (same shapes) and copies it into the
  recorded per-ubatch tensors, so a captured graph replays a new step without recapture.
- :func:`serial_comm`: run a split program with the comm stream replaced by the compute stream
  ("split serial": the same kernels in the same order on one stream, the denominator of η).
- :func:`graph_us`: calls captured as one CUDA graph by the runtime's ``capture`` and timed by
  replay (the benchmarks' graph timer, ``benchmarks/harness.py``).

Capture either with :func:`dbo_compile.runtime.capture.capture`.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Sequence

import torch

from dbo_compile.runtime import capture as cg_capture
from dbo_compile.runtime.context import uncounted
from dbo_compile.runtime.padding import join_ubatch_outputs
from dbo_compile.timing import graph_median_us

__all__ = ["SplitStep", "graph_us", "serial_comm"]


class _Recorder:
    def __init__(self, inner: Callable[..., Any]):
        self.inner = inner
        self.args: tuple[Any, ...] | None = None

    def __call__(self, *args: Any) -> Any:
        self.args = args
        return self.inner(*args)

    def __getattr__(self, name: str) -> Any:  # schedule, code, streams, units ...
        return getattr(self.inner, name)


class SplitStep:
    """The split program of ``compiled`` over the inputs of one recorded step.

    Args:
        compiled: a ``SplitArtifact`` (``dbo_compile.backend.compiled_artifacts()[-1]``).
        run_step: runs one eager step through the compiled model (e.g.
            ``lambda: cmodel(ids, pos, md)`` on static buffers); it must take the split path.

    Raises:
        RuntimeError: the recorded step did not split.
    """

    def __init__(self, compiled: Any, run_step: Callable[[], Any]):
        self.compiled = compiled
        self.program = compiled.split_program
        rec_prog = _Recorder(self.program)
        orig_split_args = compiled.split_args
        seen: dict[str, Any] = {}

        def split_args(args: Sequence[Any], qlens: list[int]) -> list[Any]:
            seen["graph_args"], seen["qlens"] = list(args), list(qlens)
            return orig_split_args(args, qlens)

        compiled.split_program = rec_prog
        compiled.split_args = split_args
        try:
            run_step()
        finally:
            compiled.split_program = self.program
            del compiled.split_args  # back to the class method
        if rec_prog.args is None:
            raise RuntimeError(f"the recorded step did not split ({compiled.stats.last_decision})")
        self.split_args = list(rec_prog.args)
        self.graph_args = seen["graph_args"]
        self.outputs = compiled.signature.outputs

    def __call__(self) -> tuple[Any, ...]:
        return join_ubatch_outputs(self.program(*self.split_args), self.outputs)

    def refresh(self) -> None:
        """Re-cut the (already updated, same-shaped) graph inputs into the static split inputs.

        Call after copying a new step's tokens and metadata into the caller's static buffers.

        Raises:
            RuntimeError: the new cut has other shapes (needs a new capture for this layout).
        """
        with uncounted():  # not a served step
            decision = self.compiled.decide_step(self.graph_args)
        if not decision.should_split:
            raise RuntimeError(f"new step does not split: {decision.reason}")
        new = self.compiled.split_args(self.graph_args, decision.qlens)
        for i, (old, val) in enumerate(zip(self.split_args, new)):
            if isinstance(old, torch.Tensor):
                if old.shape != val.shape:
                    raise RuntimeError(f"split input {i}: shape {tuple(val.shape)} != captured "
                                       f"{tuple(old.shape)}; capture a graph for this layout")
                if old.data_ptr() != val.data_ptr():
                    old.copy_(val)
            elif old != val:
                raise RuntimeError(f"split input {i}: {val!r} != captured {old!r}")


class _SameStream:
    """A StreamSet whose comm stream is the compute stream."""

    def __init__(self, inner: Any):
        self.inner = inner

    def get(self, device: Any) -> tuple[Any, Any, list[Any]]:
        compute, _comm, events = self.inner.get(device)
        return compute, compute, events

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@contextlib.contextmanager
def serial_comm(program: Any):
    """Within the block, ``program`` (a ``SplitProgram``) issues its comm on the compute stream.

    Same generated code, same kernels, same order; only the stream switch is gone, so every
    collective serialises with the compute around it.
    """
    old = program.streams
    program.streams = _SameStream(old)
    try:
        yield program
    finally:
        program.streams = old


def graph_us(fn: Callable[[], Any], iters: int, reps: int = 1, replays: int = 3,
             warmup: int = 2) -> tuple[float, Any]:
    """``reps`` calls of ``fn`` captured as one CUDA graph (after ``warmup`` eager calls, by
    the runtime's :func:`~dbo_compile.runtime.capture.capture`: warm-up on a side stream, the
    comm drained on failure): the median µs per call of ``iters`` replays timed after
    ``replays`` untimed ones (:func:`dbo_compile.timing.graph_median_us`), and the graph's
    static output. Needs CUDA.

    Raises:
        TimingError: ``iters`` or ``reps`` below 1.
    """
    return graph_median_us(fn, iters, reps=reps, replays=replays,
                           capture=lambda calls: cg_capture.capture(calls, warmup=warmup))
