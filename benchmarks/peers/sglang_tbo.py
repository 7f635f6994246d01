"""SGLang-style two-batch overlap (TBO), written from its published description
(docs/references.md §SGLang two-batch overlap), never from its code.

One thread. Each ubatch's forward is an op list (:func:`layer_ops.layer_ops`) cut into *stages*
at fixed yield points: after each dispatch send and after each combine send (with the shared
experts placed before the yield, beside the combine in flight). A stage executor per ubatch
runs its stages one at a time; the two executors are interleaved, the first one given a head
start of ``delta`` stages (:data:`DELTA`: 2 in decode, 0 in prefill), then taking turns (ubatch
0, ubatch 1, ...): ubatch 1 runs its stage ``k`` once ubatch 0 finished its stage ``k +
delta``, so that ubatch 0's ops of a layer always come first (its KV-cache writes before ubatch
1's attention reads them, DESIGN.md invariant 3). Each ubatch keeps its own comm state (its
dispatch / combine in flight). Each op runs on its stream (comm ops on the comm stream, the
rest on the compute stream) with an event edge where it reads what the other stream made
(:attr:`Op.waits`).

Split rule (:func:`split_point`): decode splits by request count (the halves of a
uniform-decode step); prefill at the request boundary nearest the token midpoint, or inside a
request at the midpoint when that boundary leaves less than 0.48 of the tokens on one side
(the references' figure). A step splits when both ubatches get tokens (the references name no
token threshold). CUDA graphs: SGLang captures decode batches only (up to its
``cuda_graph_max_bs``, ~160 per docs/references.md), prefill runs eagerly by default.
"""

from __future__ import annotations

import itertools

import torch

from layer_ops import Op, Streams, UBatch

__all__ = ["DELTA", "SglangTbo", "TOKEN_DISTRIBUTION_THRESHOLD", "split_point", "stages"]

#: the head start (in stages) of ubatch 0 over ubatch 1
DELTA = {"decode": 2, "prefill": 0}
#: the smallest share of the tokens a request-boundary split may leave on one side
TOKEN_DISTRIBUTION_THRESHOLD = 0.48

#: ops after which a stage ends (the yield markers)
_STAGE_END = frozenset({"dispatch", "shared"})


def split_point(num_scheduled_tokens: list[int], uniform_decode: bool) -> int | None:
    """The token at which SGLang's rule cuts the step, ``None`` when it does not split (one
    ubatch would be empty)."""
    total = sum(num_scheduled_tokens)
    if uniform_decode:
        n = len(num_scheduled_tokens) // 2
        return n if 0 < n < len(num_scheduled_tokens) else None
    cu = list(itertools.accumulate(num_scheduled_tokens, initial=0))
    best = min(cu[1:-1], key=lambda c: (abs(2 * c - total), c), default=None)
    if best is None or min(best, total - best) < TOKEN_DISTRIBUTION_THRESHOLD * total:
        best = total // 2  # a two-chunk split inside the request at the midpoint
    return best if 0 < best < total else None


def stages(ops: list[Op]) -> list[list[Op]]:
    """``ops`` cut after each yield marker (:data:`_STAGE_END`)."""
    out, cur = [], []
    for op in ops:
        cur.append(op)
        if op.name in _STAGE_END:
            out.append(cur)
            cur = []
    if cur:
        out.append(cur)
    return out


class _Executor:
    """Runs one ubatch's stages in order."""

    def __init__(self, u: UBatch, stage_list: list[list[Op]], streams: Streams):
        self.u, self.stages, self.streams = u, stage_list, streams
        self.next_stage = 0

    @property
    def done(self) -> bool:
        return self.next_stage >= len(self.stages)

    def step(self) -> None:
        s, i = self.streams, self.u.index
        for op in self.stages[self.next_stage]:
            if op.waits is not None:
                s.record(i, op.waits)
                s.wait(i, op.waits, op.stream)
            with s.use(op.stream):
                op.fn(self.u)
        self.next_stage += 1


class SglangTbo:
    """The staged two-ubatch executor over ``ops`` on ``streams`` with a head start of
    ``delta`` stages. ``run(ubatches)`` runs one step and returns the logits ``[T, vocab]``
    fp32 in ubatch order."""

    name = "sglang_tbo"

    def __init__(self, ops: list[Op], streams: Streams, delta: int):
        self.stages, self.streams, self.delta = stages(ops), streams, delta

    def run(self, ubatches: list[UBatch]) -> torch.Tensor:
        s = self.streams
        s.begin()
        e0, e1 = (_Executor(u, self.stages, s) for u in ubatches)
        with torch.no_grad():
            for _ in range(self.delta):
                if not e0.done:
                    e0.step()
            while not (e0.done and e1.done):
                for e in (e0, e1):
                    if not e.done:
                        e.step()
        s.join()
        out = torch.cat([u.out for u in ubatches])
        for u in ubatches:
            u.release()
        return out
