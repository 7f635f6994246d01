"""The per-step entry a serving engine calls on every DP rank.

Example (one engine step on each DP/EP rank; ranks with no work call it too, with zero tokens)::

    import torch
    from dbo_compile.runtime.engine import run_step

    compiled = torch.compile(model, backend="dbo", options={"dp_group_name": cpu_group.group_name})
    logits = run_step(compiled, input_ids, positions, attn_metadata,
                      num_scheduled_tokens=[1, 1, 1, 57], block_size=16)

``run_step`` passes the host-side facts the engine already has (tokens per request, KV block
size, its own vetoes) to the compiled model, which then votes with the other DP ranks (split?
padded token count?), pads, cuts the inputs and attention metadata per ubatch, runs the split
or the unsplit program and returns the logits of the real tokens.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import torch

from dbo_compile.runtime.context import step_context
from dbo_compile.metadata import AttentionMetadata


def run_step(compiled: Callable[..., Any], input_ids: torch.Tensor, positions: torch.Tensor,
             attn_metadata: AttentionMetadata, num_scheduled_tokens: Sequence[int], *,
             block_size: int | None = None, vetoes: Sequence[Any] = (),
             allow_split: bool = True, **model_kwargs: Any) -> Any:
    """Run one step of a model compiled with ``backend="dbo"``.

    Args:
        compiled: ``torch.compile(model, backend="dbo", ...)``.
        input_ids: ``[num_tokens]`` int64 (token dim first; padding rows allowed at the end).
        positions: ``[num_tokens]`` int64.
        attn_metadata: the step's metadata (validated here).
        num_scheduled_tokens: tokens per request (host ints); sums to the real token count.
        block_size: KV-cache block size (tokens) for the prefix-read veto; default the block
            size of the graph's KV caches (which the veto runs with on every step). A value
            that disagrees with the caches raises ``DpVoteError``.
        vetoes: engine vetoes ``(metadata, num_scheduled_tokens) -> reason | None``.
        allow_split: ``False`` vetoes the split on this rank (every rank then runs unsplit).

    Returns:
        Whatever the model returns, for the real tokens only.

    Raises:
        DpVoteError: on every rank, when one rank's metadata is inconsistent or the DP ranks
            run different compiled programs or configs (never a hang).
        UBatchExecutionError: an op of one ubatch raised; the next step runs normally.
    """
    # At least two token rows (padding rows write nothing): Dynamo specialises sizes 0 and 1,
    # and a graph specialised to its token count could not be padded by the DP vote.
    orig_rows = None
    if input_ids.shape[0] < 2:
        orig_rows = input_ids.shape[0]
        input_ids, positions, attn_metadata = _pad_rows(input_ids, positions, attn_metadata, 2)
    # One Dynamo graph for every step: a rank whose Dynamo ran out of recompiles would fall back
    # to eager, skip the DP vote and issue different collectives than its peers (a deadlock).
    for t in (input_ids, positions, attn_metadata.slot_mapping, attn_metadata.query_start_loc,
              attn_metadata.seq_lens, attn_metadata.num_computed_tokens,
              attn_metadata.block_table):
        torch._dynamo.maybe_mark_dynamic(t, 0)
    torch._dynamo.maybe_mark_dynamic(attn_metadata.block_table, 1)
    num_real = input_ids.shape[0] if orig_rows is None else orig_rows
    with step_context(num_scheduled_tokens=list(num_scheduled_tokens), block_size=block_size,
                      vetoes=tuple(vetoes), allow_split=allow_split):
        out = compiled(input_ids, positions, attn_metadata, **model_kwargs)
    if orig_rows is not None and isinstance(out, torch.Tensor):
        out = out[:num_real]
    return out


def _pad_rows(input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata,
              rows: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Pad the token dim to ``rows`` with rows that write nothing (slot -1, id 0, position 0)."""
    n = rows - input_ids.shape[0]

    def pad_slots(slots: torch.Tensor | None) -> torch.Tensor | None:
        return None if slots is None else torch.cat([slots, slots.new_full((n,), -1)])

    return (torch.cat([input_ids, input_ids.new_zeros(n)]),
            torch.cat([positions, positions.new_zeros(n)]),
            dataclasses.replace(md, slot_mapping=pad_slots(md.slot_mapping),
                                slot_mapping_cpu=pad_slots(md.slot_mapping_cpu)))
