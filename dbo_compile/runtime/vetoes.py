"""Per-rank vetoes on splitting a step; the first reason found feeds ``allow_split`` of the vote.

A veto is a callable ``(metadata, num_scheduled_tokens) -> str | None`` returning a reason not to
split this step (``None``: no objection). The built-in one is :func:`prefix_read_veto` (vLLM DBO,
../shared/REFERENCES.md §"vLLM DBO", "Veto"); an engine registers its own in a
:class:`VetoRegistry`. A veto only turns ``allow_split`` off on its rank; the DP vote then makes
every rank run unsplit (DESIGN.md invariant 5).

Example::

    registry = VetoRegistry()
    registry.add(lambda md, n: "lora batch" if engine.has_lora else None, name="lora")
    reason = check_vetoes(metadata, num_scheduled_tokens, block_size=16, vetoes=registry)
    vote = coordinate_across_dp(..., allow_split=reason is None, ...)
"""

from __future__ import annotations

import logging
from typing import Callable, Iterable, Iterator, Sequence

import torch

from dbo_compile.errors import MetadataError
from dbo_compile.runtime.metadata import AttentionMetadata, query_lens_from

log = logging.getLogger(__name__)

__all__ = ["Veto", "VetoRegistry", "check_vetoes", "prefix_read_veto"]

#: ``(metadata, num_scheduled_tokens [num_reqs]) -> reason or None``.
Veto = Callable[[AttentionMetadata, Sequence[int]], "str | None"]


def _counts(num_scheduled_tokens: Sequence[int] | torch.Tensor) -> list[int]:
    if isinstance(num_scheduled_tokens, torch.Tensor):
        return [int(x) for x in num_scheduled_tokens.tolist()]
    return [int(x) for x in num_scheduled_tokens]


def prefix_read_veto(
    metadata: AttentionMetadata,
    num_scheduled_tokens: Sequence[int] | torch.Tensor,
    block_size: int,
    host: tuple[list[int], list[int], list[int]] | None = None,
) -> str | None:
    """Veto a step in which a request reads, as cached prefix, KV blocks another request writes.

    Request ``i`` reads as cached prefix the whole blocks before its ``num_computed_tokens``:
    ``block_table[i, : num_computed_tokens[i] // block_size]`` (a partly filled last block is
    not counted). Request ``j`` writes the blocks ``slot_mapping[t] // block_size`` of its
    tokens ``t`` (padding slots ``-1`` write nothing). If some block is read by ``i`` and
    written by ``j != i`` in the same step, splitting could put the read in ubatch 0 before
    ubatch 1 has written the block (rule of vLLM DBO, REFERENCES.md). A request reading its own
    earlier tokens is not vetoed: the split program orders ubatch 0's KV writes before ubatch
    1's attention (DESIGN.md invariant 3).

    Args:
        metadata: the step's metadata (block ids in ``block_table`` int32 ``[num_reqs,
            max_blocks]``, slots ``block_id * block_size + offset`` in ``slot_mapping`` int64
            ``[num_tokens]``).
        num_scheduled_tokens: tokens per request ``[num_reqs]``; must match the metadata.
        block_size: tokens per KV block (> 0).
        host: the metadata's :meth:`~AttentionMetadata.host_fields` when the caller has them
            (one device read fewer: each is a host sync on CUDA).

    Returns:
        A reason naming the requests and the block, or ``None``.

    Raises:
        MetadataError: ``block_size <= 0``, or ``num_scheduled_tokens`` disagrees with
            ``query_start_loc``.
    """
    if not isinstance(block_size, int) or block_size <= 0:
        raise MetadataError(
            f"block_size must be a positive int (tokens per KV block), got {block_size!r}"
        )
    counts = _counts(num_scheduled_tokens)
    # device reads are host syncs on CUDA: the counts in one copy, slots and table in another
    qsl, _, host_computed = host if host is not None else metadata.host_fields()
    qlens = query_lens_from(qsl)
    if counts != qlens:
        raise MetadataError(
            f"num_scheduled_tokens {counts[:16]} disagree with the query lens of "
            f"query_start_loc {qlens[:16]}"
        )
    num_reqs = len(counts)
    if num_reqs < 2:
        return None
    num_real = qsl[-1]
    table_dev = metadata.block_table
    both = torch.cat([metadata.slot_mapping[:num_real],
                      table_dev.reshape(-1).to(metadata.slot_mapping.dtype)]).cpu()
    slots = both[:num_real]
    table = both[num_real:].view(table_dev.shape).to(torch.int64)
    writer = torch.repeat_interleave(torch.arange(num_reqs), torch.tensor(counts))
    valid = slots >= 0
    written = slots[valid] // block_size
    writer = writer[valid]
    if written.numel() == 0:
        return None
    computed = torch.tensor(host_computed, dtype=torch.int64)
    full = (computed // block_size).clamp(max=table.shape[1])  # whole blocks before the query
    mask = torch.arange(table.shape[1])[None, :] < full[:, None]
    read = table[mask]
    reader = torch.arange(num_reqs)[:, None].expand_as(table)[mask]
    hit = torch.isin(read, written)
    if not bool(hit.any()):
        return None
    writers_of: dict[int, set[int]] = {}
    for b, w in zip(written.tolist(), writer.tolist()):
        writers_of.setdefault(b, set()).add(w)
    for b, r in zip(read[hit].tolist(), reader[hit].tolist()):
        others = sorted(w for w in writers_of.get(b, ()) if w != r)
        if others:
            return (
                f"prefix-read veto: request {r} reads KV block {b} as cached prefix "
                f"(num_computed_tokens={int(metadata.num_computed_tokens[r])}, block_size="
                f"{block_size}) while request {others[0]} writes it in this step; split, the "
                "read could run in ubatch 0 before ubatch 1 writes the block"
            )
    return None


class VetoRegistry:
    """An ordered, named list of engine vetoes, checked in registration order."""

    def __init__(self, vetoes: Iterable[Veto] = ()) -> None:
        self._vetoes: list[tuple[str, Veto]] = []
        for v in vetoes:
            self.add(v)

    def add(self, veto: Veto, name: str | None = None) -> Veto:
        """Register ``veto`` (usable as a decorator); ``name`` defaults to its ``__name__``."""
        if not callable(veto):
            raise TypeError(
                "a veto must be callable (metadata, num_scheduled_tokens) -> str | None, "
                f"got {veto!r}"
            )
        self._vetoes.append((name or getattr(veto, "__name__", repr(veto)), veto))
        return veto

    def remove(self, name: str) -> None:
        """Remove every veto registered under ``name``; KeyError if there is none."""
        kept = [(n, v) for n, v in self._vetoes if n != name]
        if len(kept) == len(self._vetoes):
            raise KeyError(f"no veto named {name!r}; registered: {self.names()}")
        self._vetoes = kept

    def names(self) -> list[str]:
        return [n for n, _ in self._vetoes]

    def items(self) -> list[tuple[str, Veto]]:
        return list(self._vetoes)

    def __iter__(self) -> Iterator[Veto]:
        return iter([v for _, v in self._vetoes])

    def __len__(self) -> int:
        return len(self._vetoes)

    def check(self, metadata: AttentionMetadata, num_scheduled_tokens: Sequence[int]) -> str | None:
        return check_vetoes(metadata, num_scheduled_tokens, vetoes=self)


def check_vetoes(
    metadata: AttentionMetadata,
    num_scheduled_tokens: Sequence[int] | torch.Tensor,
    *,
    block_size: int | None = None,
    vetoes: VetoRegistry | Iterable[Veto] = (),
    host: tuple[list[int], list[int], list[int]] | None = None,
) -> str | None:
    """The first reason not to split this step on this rank, or ``None``.

    Runs :func:`prefix_read_veto` first when ``block_size`` is given (with ``host``, the
    metadata's host counts when the caller has them), then each engine veto in order. A veto that raises counts as a veto (its exception is logged and named in the
    reason): raising here, before the DP vote, would leave the other ranks waiting in it.

    Returns:
        ``"<name>: <reason>"`` of the first veto that objects, or ``None``.
    """
    counts = _counts(num_scheduled_tokens)
    named: list[tuple[str, Veto]]
    if isinstance(vetoes, VetoRegistry):
        named = vetoes.items()
    else:
        named = [(getattr(v, "__name__", repr(v)), v) for v in vetoes]
    if block_size is not None:
        named = [("prefix_read",
                  lambda md, n: prefix_read_veto(md, n, block_size, host=host))] + named
    for name, veto in named:
        try:
            reason = veto(metadata, counts)
        except Exception as e:  # noqa: BLE001 - a veto must not desynchronise the DP ranks
            log.warning("veto %s raised %s: %s; not splitting this step", name, type(e).__name__, e)
            reason = f"veto raised {type(e).__name__}: {e}"
        if reason:
            log.debug("split vetoed by %s: %s", name, reason)
            return f"{name}: {reason}"
    return None
