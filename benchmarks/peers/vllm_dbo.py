"""vLLM-style dual batch overlap, written from its published description (docs/references.md
§vLLM DBO; the design page docs.vllm.ai/en/stable/design/dbo/), never from its code.

Two Python threads, one per ubatch, each run the whole forward of its ubatch
(:func:`layer_ops.layer_ops`) under its own per-ubatch context (:class:`UBatchThread`: its
ubatch, its events, its current stream). Only one thread runs at a time: they hand the CPU to
each other with CPU events at yields placed around the MoE layer's communication, as vLLM's
modular kernel places them:

- before each dispatch and combine: record "compute done" on the compute stream, yield, then
  switch to the comm stream and wait for that event there (yield-and-switch compute -> comm);
- after each dispatch send: yield (the other ubatch runs while the tokens travel), then the
  receive on the comm stream and switch back to compute (the compute stream waits for
  "comm done");
- after each combine send the shared experts run on the compute stream, then a yield, then the
  combine's receive (vLLM's schedule: the shared expert beside the combine).

Both threads start behind a barrier; ubatch 0 runs first. The ubatches' outputs are joined in
ubatch order. Split rule (:func:`should_split`): a uniform-decode step splits at >= 32 tokens,
any other at >= 512 (vLLM's decode / prefill token thresholds and their defaults, compared
with ``>=``, docs/references.md). CUDA graphs (vLLM's full graph of the ubatched model) are
captured with both threads running (``bench_peers.capture_peer``) and replayed with none.
The threads are started for every step (a choice of this benchmark: a pool of parked threads
would save their start, some tens of µs per step). The thread / event mechanics are this
module's reading of the published design.

Deviation, named: a thread that raises releases its sibling (vLLM's would hang at the yield),
so that a failed step fails the benchmark instead of hanging it.
"""

from __future__ import annotations

import threading

import torch

from layer_ops import Op, Streams, UBatch

__all__ = ["DECODE_THRESHOLD", "PREFILL_THRESHOLD", "VllmDbo", "should_split"]

#: vLLM's split thresholds (tokens in the step, compared with >=)
DECODE_THRESHOLD = 32
PREFILL_THRESHOLD = 512

_YIELD_BEFORE = frozenset({"dispatch", "combine"})
_YIELD_AFTER = frozenset({"dispatch", "shared"})


def should_split(num_tokens: int, uniform_decode: bool) -> bool:
    """vLLM's rule: the decode threshold for a uniform-decode step (one token per request),
    the prefill threshold for any other."""
    return num_tokens >= (DECODE_THRESHOLD if uniform_decode else PREFILL_THRESHOLD)


class _PingPong:
    """The CPU handoff between the two threads: one ``threading.Event`` per ubatch (set: its
    turn), and a thread that finished releases the other for good."""

    def __init__(self) -> None:
        self.events = [threading.Event(), threading.Event()]
        self.done = [False, False]
        self.lock = threading.Lock()

    def wait_turn(self, u: int) -> None:
        self.events[u].wait()
        self.events[u].clear()

    def yield_(self, u: int) -> None:
        with self.lock:
            if self.done[1 - u]:
                return
            self.events[1 - u].set()
        self.wait_turn(u)

    def finish(self, u: int) -> None:
        with self.lock:
            self.done[u] = True
            self.events[1 - u].set()


class UBatchThread(threading.Thread):
    """One ubatch's thread: its ubatch (the per-ubatch forward context), its current stream,
    the ops of the whole forward, run with the yields of the module docstring."""

    def __init__(self, u: UBatch, ops: list[Op], streams: Streams, pingpong: _PingPong,
                 barrier: threading.Barrier, device: torch.device):
        super().__init__(name=f"ubatch-{u.index}", daemon=True)
        self.u, self.ops, self.streams, self.pp = u, ops, streams, pingpong
        self.barrier, self.device = barrier, device
        self.error: BaseException | None = None

    def run(self) -> None:
        u, s, i = self.u, self.streams, self.u.index
        try:
            if s.cuda:
                torch.cuda.set_device(self.device)
            s.set_current("compute")
            self.barrier.wait()
            if i != 0:
                self.pp.wait_turn(i)
            with torch.no_grad():
                for op in self.ops:
                    if op.name in _YIELD_BEFORE:
                        s.record(i, op.waits)  # "compute done", before the CPU leaves
                        self.pp.yield_(i)
                        s.wait(i, op.waits, op.stream)
                    elif op.waits is not None:
                        s.record(i, op.waits)
                        s.wait(i, op.waits, op.stream)
                    s.set_current(op.stream)
                    op.fn(u)
                    if op.name in _YIELD_AFTER:
                        self.pp.yield_(i)
                s.set_current("compute")
        except BaseException as e:  # noqa: BLE001 - handed to the caller after the join
            self.error = e
        finally:
            self.pp.finish(i)


class VllmDbo:
    """The two-thread ping-pong over ``ops`` (:func:`layer_ops.layer_ops`) on ``streams``.

    ``run(ubatches)`` runs one step on the two :class:`UBatch` (threads started per step,
    joined before it returns) and returns the logits ``[T, vocab]`` fp32 in ubatch order.
    """

    name = "vllm_dbo"

    def __init__(self, ops: list[Op], streams: Streams, device: torch.device):
        self.ops, self.streams, self.device = ops, streams, device

    def run(self, ubatches: list[UBatch]) -> torch.Tensor:
        s = self.streams
        s.begin()
        pp = _PingPong()
        barrier = threading.Barrier(len(ubatches))
        threads = [UBatchThread(u, self.ops, s, pp, barrier, self.device) for u in ubatches]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        s.join()
        for t in threads:
            if t.error is not None:
                raise t.error
        out = torch.cat([u.out for u in ubatches])
        for u in ubatches:
            u.release()
        return out
