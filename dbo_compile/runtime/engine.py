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

import contextlib
import dataclasses
from typing import Any, Callable, Sequence

import torch
from torch.fx.experimental import _config as _fx_config
import torch.utils._pytree as pytree

from dbo_compile.errors import MetadataError
from dbo_compile.metadata import AttentionMetadata
from dbo_compile.runtime.context import last_outputs, step_context


def run_step(compiled: Callable[..., Any], input_ids: torch.Tensor | None,
             positions: torch.Tensor | None, attn_metadata: AttentionMetadata,
             num_scheduled_tokens: Sequence[int], *, block_size: int | None = None,
             vetoes: Sequence[Any] = (), allow_split: bool = True,
             token_kwargs: Sequence[str] = (), **model_kwargs: Any) -> Any:
    """Run one step of a model compiled with ``backend="dbo"``.

    Args:
        compiled: ``torch.compile(model, backend="dbo", ...)``.
        input_ids: ``[num_tokens]`` int64 (token dim first; padding rows allowed at the end),
            or ``None`` when the model takes ``inputs_embeds``.
        positions: ``[num_tokens]`` int64 (or ``None``, if the model allows it).
        attn_metadata: the step's metadata (validated here).
        num_scheduled_tokens: tokens per request (host ints); sums to the real token count.
        block_size: KV-cache block size (tokens) for the prefix-read veto; default the block
            size of the graph's KV caches (which the veto runs with on every step). A value
            that disagrees with the caches raises ``DpVoteError``.
        vetoes: engine vetoes ``(metadata, num_scheduled_tokens) -> reason | None``.
        allow_split: ``False`` vetoes the split on this rank (every rank then runs unsplit).
        token_kwargs: names of further keyword arguments indexed by token (dim 0 = the token
            dim, like ``inputs_embeds`` ``[num_tokens, hidden]``, which always is one): marked
            dynamic and padded with the token inputs.
        model_kwargs: passed to the model.

    Returns:
        Whatever the model returns, in its own structure (tuples, lists, dicts, ints), for
        the real tokens only.

    Raises:
        MetadataError: the token inputs disagree on the token count (all ``None``: no count).
        DpVoteError: on every rank, when one rank's metadata is inconsistent or the DP ranks
            run different compiled programs or configs (never a hang).
        UBatchExecutionError: an op raised in one rank's step; on every rank (the step
            transaction); the next step runs normally.
    """
    named = {"input_ids": input_ids, "positions": positions}
    for name in ("inputs_embeds", *token_kwargs):
        if name in model_kwargs:
            named[name] = model_kwargs[name]
    tokens = {k: v for k, v in named.items() if isinstance(v, torch.Tensor)}
    rows = {k: int(v.shape[0]) for k, v in tokens.items()}
    if not rows or len(set(rows.values())) > 1:
        raise MetadataError(
            f"run_step: the token inputs must share their dim 0 (the token count), got {rows} "
            "(input_ids, positions, inputs_embeds and token_kwargs; None ones are skipped)")
    num_rows = next(iter(rows.values()))
    # At least two token rows (padding rows write nothing): Dynamo specialises sizes 0 and 1,
    # and a graph specialised to its token count could not be padded by the DP vote.
    padded = num_rows < 2
    if padded:
        tokens, attn_metadata = _pad_rows(tokens, attn_metadata, 2)
    # contiguous rows from offset 0: a strided or offset view would give Dynamo stride and
    # offset symbols, and the graph could not be split
    tokens = {k: _dense(v) for k, v in tokens.items()}
    # One Dynamo graph for every step: a rank whose Dynamo ran out of recompiles would fall back
    # to eager, skip the DP vote and issue different collectives than its peers (a deadlock).
    for t in (*tokens.values(), attn_metadata.slot_mapping, attn_metadata.query_start_loc,
              attn_metadata.seq_lens, attn_metadata.num_computed_tokens,
              attn_metadata.block_table):
        torch._dynamo.maybe_mark_dynamic(t, 0)
    torch._dynamo.maybe_mark_dynamic(attn_metadata.block_table, 1)
    call_kwargs = dict(model_kwargs)
    call_kwargs.update({k: v for k, v in tokens.items() if k not in ("input_ids", "positions")})
    with step_context(num_scheduled_tokens=list(num_scheduled_tokens), block_size=block_size,
                      vetoes=tuple(vetoes), allow_split=allow_split,
                      real_rows=num_rows if padded else None, padded_rows=2 if padded else None), \
            one_graph_for_all_sizes():
        out = compiled(tokens.get("input_ids", input_ids), tokens.get("positions", positions),
                       attn_metadata, **call_kwargs)
    return _real_outputs(out, num_rows, 2) if padded else out


def one_graph_for_all_sizes() -> contextlib.AbstractContextManager:
    """Dynamo traces the dims marked dynamic as sizes of any value, 0 and 1 included.

    By default Dynamo specialises a size 0 or 1 into the graph (and gives the others a symbol
    of range ``[2, inf)``), so steps with 0, 1 and more requests, or block tables 1 and more
    blocks wide, each compiled their own graph: 5 graphs over a 12-step sweep (issue 17).
    torch's size-oblivious reasoning for backed sizes (``torch.fx.experimental._config.
    backed_size_oblivious``: range ``[0, inf)``, no 0/1 guards; vLLM's Spyre worker sets it
    for the same reason, decode batches of 1) gives them one graph. It holds while Dynamo
    traces, inside the compiled call; the token dim stays at >= 2 rows (padding), so only the
    request and block-table dims rely on it. A torch without the option traces as before.
    """
    if not hasattr(_fx_config, "backed_size_oblivious"):
        return contextlib.nullcontext()
    return _fx_config.patch(backed_size_oblivious=True)


def _dense(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() and t.storage_offset() == 0 else t.clone(
        memory_format=torch.contiguous_format)


def _real_outputs(out: Any, real: int, rows: int) -> Any:
    """``out`` with the padding rows ``run_step`` added dropped, in the model's own structure:
    each leaf that is an output of the step's last compiled call (by identity; ints by their
    value at ``rows``) is restored at ``real`` tokens by its ``OutputSpec``."""
    record = last_outputs()
    if record is None:
        return out
    flat, specs = record
    specs = specs if specs is not None and len(specs) == len(flat) else [None] * len(flat)
    by_id = {id(o): spec for o, spec in zip(flat, specs) if isinstance(o, torch.Tensor)}
    sizes = {spec.size(rows): spec for spec in specs
             if spec is not None and spec.kind == "size"}
    leaves, tree = pytree.tree_flatten(out)
    fixed = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor) and id(leaf) in by_id:
            spec = by_id[id(leaf)]
            coef = spec.coef if spec is not None and spec.kind == "token" else 1
            if (spec is None or spec.kind in ("token", "unknown")) and leaf.dim() and \
                    leaf.shape[0] == coef * rows:
                leaf = leaf[: coef * real]
        elif isinstance(leaf, int) and not isinstance(leaf, bool) and leaf in sizes:
            leaf = sizes[leaf].size(real)
        fixed.append(leaf)
    return pytree.tree_unflatten(fixed, tree)


def _pad_rows(tokens: dict[str, torch.Tensor], md: AttentionMetadata, rows: int
              ) -> tuple[dict[str, torch.Tensor], AttentionMetadata]:
    """Pad the token dim to ``rows`` with rows that write nothing (slot -1, zeros: id 0,
    position 0, a zero embedding)."""
    n = rows - next(iter(tokens.values())).shape[0]

    def pad_slots(slots: torch.Tensor | None) -> torch.Tensor | None:
        return None if slots is None else torch.cat([slots, slots.new_full((n,), -1)])

    padded = {k: torch.cat([t, t.new_zeros((n, *t.shape[1:]))]) for k, t in tokens.items()}
    return padded, dataclasses.replace(md, slot_mapping=pad_slots(md.slot_mapping),
                                       slot_mapping_cpu=pad_slots(md.slot_mapping_cpu))
