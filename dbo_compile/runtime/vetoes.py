"""Per-rank vetoes on splitting a step; the first reason found feeds ``allow_split`` of the vote.

A veto is a callable ``(metadata, num_scheduled_tokens) -> str | None`` returning a reason not to
split this step (``None``: no objection). The built-in one is :func:`prefix_read_veto` (vLLM DBO,
docs/references.md §"vLLM DBO", "Veto"); an engine registers its own in a
:class:`VetoRegistry`. A veto only turns ``allow_split`` off on its rank; the DP vote then makes
every rank run unsplit (``docs/design.md``, invariant 5).

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
from dbo_compile.metadata import (
    AttentionMetadata,
    HostCounts,
    host_tensor,
    int_list,
    query_lens_from,
)

log = logging.getLogger(__name__)

__all__ = ["Veto", "VetoRegistry", "check_vetoes", "prefix_read_veto", "unknown_block_size_veto"]

#: ``(metadata, num_scheduled_tokens [num_reqs]) -> reason or None``.
Veto = Callable[[AttentionMetadata, Sequence[int]], "str | None"]


def prefix_read_veto(
    metadata: AttentionMetadata,
    num_scheduled_tokens: Sequence[int] | torch.Tensor,
    block_size: int,
    host: HostCounts | None = None,
) -> str | None:
    """Veto a step in which a request reads, as cached prefix, KV blocks another request writes.

    Request ``i`` reads as cached prefix the whole blocks before its ``num_computed_tokens``:
    ``block_table[i, : num_computed_tokens[i] // block_size]`` (a partly filled last block is
    not counted). Request ``j`` writes the blocks ``slot_mapping[t] // block_size`` of its
    tokens ``t`` (padding slots ``-1`` write nothing). If some block is read by ``i`` and
    written by ``j != i`` in the same step, splitting could put the read in ubatch 0 before
    ubatch 1 has written the block (rule of vLLM DBO, docs/references.md). A request reading its own
    earlier tokens is not vetoed: the split program orders ubatch 0's KV writes before ubatch
    1's attention (``docs/design.md``, invariant 3).

    Reads no device tensor when ``metadata`` has its host mirrors (``slot_mapping_cpu``,
    ``block_table_cpu`` and the counts, or ``host``); else the counts in one copy (unless
    ``host`` is given) and the slots and table in another.

    Args:
        metadata: the step's metadata (block ids in ``block_table`` int32 ``[num_reqs,
            max_blocks]``, slots ``block_id * block_size + offset`` in ``slot_mapping`` int64
            ``[num_tokens]``).
        num_scheduled_tokens: tokens per request ``[num_reqs]``; must match the metadata.
        block_size: tokens per KV block (> 0).
        host: the metadata's :meth:`~AttentionMetadata.host_counts` (CPU tensors) or
            :meth:`~AttentionMetadata.host_fields` (lists) when the caller has them (one device
            read fewer without mirrors: each is a host sync on CUDA).

    Returns:
        A reason naming the requests and the block, or ``None``.

    Raises:
        MetadataError: ``block_size <= 0``, or ``num_scheduled_tokens`` disagrees with
            ``query_start_loc``.
    """
    return _prefix_read_veto(metadata, int_list(num_scheduled_tokens), block_size, host)


def _prefix_read_veto(metadata: AttentionMetadata, counts: list[int], block_size: int,
                      host: HostCounts | None) -> str | None:
    """:func:`prefix_read_veto` on counts already converted to ints."""
    if not isinstance(block_size, int) or block_size <= 0:
        raise MetadataError(
            f"block_size must be a positive int (tokens per KV block), got {block_size!r}"
        )
    qsl, _, computed = (host_tensor(h) for h in (host if host is not None
                                                   else metadata.host_counts()))
    qlens = query_lens_from(qsl)
    if counts != qlens:
        raise MetadataError(
            f"num_scheduled_tokens {counts[:16]} disagree with the query lens of "
            f"query_start_loc {qlens[:16]}"
        )
    if len(counts) < 2 or int(computed.max()) < block_size:
        return None  # no request reads a whole cached block (e.g. fresh prompts)
    slots, table = _slots_and_table(metadata, int(qsl[-1]))
    # whole blocks before each request's query: [R, max_blocks]
    prefix = torch.arange(table.shape[1]) < _blocks(computed, block_size)[:, None]
    if not _reads_a_written_block(_blocks(slots, block_size), table, prefix):
        return None  # the usual case
    return _first_prefix_read(slots, table, prefix, counts, computed, block_size)


def _blocks(positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """``positions // block_size`` (a shift for a power of two: integer division is slow on
    the host); -1 stays -1."""
    if block_size & (block_size - 1) == 0:
        return positions >> (block_size.bit_length() - 1)
    return positions // block_size


def _slots_and_table(metadata: AttentionMetadata, num_real: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """The real tokens' slots int64 ``[num_real]`` and the block table ``[R, max_blocks]`` on
    the host: their host mirrors, else read from the device in one copy."""
    slots, table = metadata.slot_mapping_cpu, metadata.block_table_cpu
    if slots is None or table is None:
        dev = metadata.block_table
        both = torch.cat([metadata.slot_mapping[:num_real],
                          dev.reshape(-1).to(metadata.slot_mapping.dtype)]).cpu()
        return both[:num_real], both[num_real:].view(dev.shape)
    return slots[:num_real], table


def _reads_a_written_block(written: torch.Tensor, table: torch.Tensor,
                           prefix: torch.Tensor) -> bool:
    """Whether a block of ``table`` inside ``prefix`` is among ``written`` (negative: padding,
    writes nothing), with a marker array over the block ids (a fixed number of vector ops, no
    sort), unless the ids are negative or too large for one (then ``torch.isin``)."""
    if written.numel() == 0 or table.numel() == 0:
        return False
    lowest, highest = (int(v) for v in table.aminmax())
    top = max(highest, int(written.max()))
    if lowest < 0 or top >= 1 << 24:
        return bool(torch.isin(table[prefix].to(torch.int64), written[written >= 0]).any())
    marker = torch.zeros(top + 2, dtype=torch.bool)  # marker[b + 1]: block b is written
    marker.index_fill_(0, written.clamp(min=-1) + 1, True)  # padding lands on 0
    hit = marker[1:].index_select(0, table.reshape(-1)).view(table.shape)
    return bool((hit & prefix).any())


def _first_prefix_read(slots: torch.Tensor, table: torch.Tensor, prefix: torch.Tensor,
                       counts: list[int], computed: torch.Tensor, block_size: int) -> str | None:
    """The veto's reason: the first request that reads, as prefix, a block another request
    writes (``None``: only its own)."""
    num_reqs = len(counts)
    writer = [i for i, q in enumerate(counts) for _ in range(q)]
    writers_of: dict[int, set[int]] = {}
    for s, w in zip(slots.tolist(), writer):
        if s >= 0:
            writers_of.setdefault(s // block_size, set()).add(w)
    read = table[prefix].to(torch.int64)
    reader = torch.arange(num_reqs)[:, None].expand_as(table)[prefix]
    hit = torch.isin(read, torch.tensor(sorted(writers_of), dtype=torch.int64))
    for b, r in zip(read[hit].tolist(), reader[hit].tolist()):
        others = sorted(w for w in writers_of.get(b, ()) if w != r)
        if others:
            return (
                f"prefix-read veto: request {r} reads KV block {b} as cached prefix "
                f"(num_computed_tokens={int(computed[r])}, block_size={block_size}) while "
                f"request {others[0]} writes it in this step; split, the read could run in "
                "ubatch 0 before ubatch 1 writes the block"
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


def unknown_block_size_veto(metadata: AttentionMetadata, num_scheduled_tokens: Sequence[int],
                            host: HostCounts | None = None) -> str | None:
    """The prefix-read veto when the KV block size cannot be known (the graph reads the block
    table through an op not declared with :func:`~dbo_compile.ops.register_paged_kv_op`, and
    the caller passed no ``block_size``): any request with cached tokens might read, as
    prefix, a block another request writes, so a step of two or more requests where one has
    ``num_computed_tokens > 0`` is vetoed. Conservative: DBO off for such steps, never a wrong
    answer. Reads the counts only (``host``, else the mirrors or one device copy)."""
    if len(num_scheduled_tokens) < 2:
        return None
    computed = host_tensor((host if host is not None else metadata.host_counts())[2])
    if computed.numel() == 0 or int(computed.max()) <= 0:
        return None
    r = int(torch.argmax((computed > 0).to(torch.int8)))
    return (f"prefix-read veto without a KV block size: request {r} has "
            f"num_computed_tokens={int(computed[r])} and the step has "
            f"{len(num_scheduled_tokens)} requests; pass block_size= (run_step, "
            "CudaGraphRunner, step_context) or declare the attention op with "
            "dbo_compile.ops.register_paged_kv_op so that only real prefix reads veto")


def check_vetoes(
    metadata: AttentionMetadata,
    num_scheduled_tokens: Sequence[int] | torch.Tensor,
    *,
    block_size: int | Sequence[int] | None = None,
    vetoes: VetoRegistry | Iterable[Veto] = (),
    host: HostCounts | None = None,
    unknown_block_size: bool = False,
) -> str | None:
    """The first reason not to split this step on this rank, or ``None``.

    Runs :func:`prefix_read_veto` first when ``block_size`` is given (an int, or several: a
    model whose KV caches differ, each is checked; with ``host``, the metadata's host counts
    when the caller has them), or :func:`unknown_block_size_veto` with
    ``unknown_block_size``, then each engine veto in order, each with ``(metadata,
    num_scheduled_tokens as a list of ints)``. A veto that raises counts as a veto (its
    exception is logged and named in the reason): raising here, before the DP vote, would leave
    the other ranks waiting in it.

    Returns:
        ``"<name>: <reason>"`` of the first veto that objects, or ``None``.
    """
    return _check_vetoes(metadata, int_list(num_scheduled_tokens), block_size, vetoes, host,
                         unknown_block_size)


def _check_vetoes(metadata: AttentionMetadata, counts: list[int],
                  block_size: int | Sequence[int] | None,
                  vetoes: VetoRegistry | Iterable[Veto], host: HostCounts | None,
                  unknown_block_size: bool = False) -> str | None:
    """:func:`check_vetoes` on counts already converted to ints (the compiled model's vote has
    them)."""
    named: list[tuple[str, Veto]]
    if isinstance(vetoes, VetoRegistry):
        named = vetoes.items()
    else:
        named = [(getattr(v, "__name__", repr(v)), v) for v in vetoes]
    sizes = [] if block_size is None else (
        [block_size] if isinstance(block_size, int) else list(block_size))
    prefix = [("prefix_read", lambda md, n, bs=bs: _prefix_read_veto(md, n, bs, host))
              for bs in sizes]
    if unknown_block_size and not sizes:
        prefix = [("prefix_read", lambda md, n: unknown_block_size_veto(md, n, host))]
    named = prefix + named
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
