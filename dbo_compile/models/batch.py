"""Builders of realistic steps (decodes with long contexts, chunked prefills, padding).

Requests are laid out decodes first, then prefills (the order of vLLM's scheduler). Each request
gets disjoint KV-cache blocks, shuffled with the seed so that block tables really indirect.

Example::

    step = make_step(cfg, decode_context_lens=[300, 41], prefills=[(0, 12), (64, 7)],
                     block_size=16, pad_to=32, seed=0)
    model.allocate_kv_cache(step.num_blocks, step.block_size)
    fill_kv_cache(model, step, seed=1)      # contexts of the requests get K/V values
    logits = model(step.input_ids, step.positions, step.attn_metadata)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from dbo_compile.errors import MetadataError
from dbo_compile.metadata import AttentionMetadata

log = logging.getLogger(__name__)

__all__ = ["Step", "context_slots", "fill_kv_cache", "make_step"]


@dataclass
class Step:
    """One scheduled step in the flattened-token layout.

    Attributes:
        input_ids: ``[T]`` int64 (``T`` = token dim, padding included; padding ids are 0).
        positions: ``[T]`` int64 absolute positions (padding 0).
        attn_metadata: validated :class:`AttentionMetadata`.
        num_scheduled_tokens: query length of each request (decodes first).
        context_lens: tokens already in the KV cache for each request (``num_computed_tokens``).
        block_size: tokens per KV-cache block.
        num_blocks: blocks the KV cache must have (at least).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: AttentionMetadata
    num_scheduled_tokens: list[int]
    context_lens: list[int]
    block_size: int
    num_blocks: int

    @property
    def num_tokens(self) -> int:
        """Rows of the token dim, padding included."""
        return int(self.input_ids.shape[0])

    @property
    def num_actual_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    @property
    def is_uniform_decode(self) -> bool:
        return bool(self.num_scheduled_tokens) and all(q == 1 for q in self.num_scheduled_tokens)

    def to(self, device: torch.device | str) -> Step:
        return Step(self.input_ids.to(device), self.positions.to(device),
                    self.attn_metadata.to(device), list(self.num_scheduled_tokens),
                    list(self.context_lens), self.block_size, self.num_blocks)


def make_step(config: Any, *, decode_context_lens: list[int],
              prefills: list[tuple[int, int]], block_size: int = 16,
              num_blocks: int | None = None, seed: int = 0,
              device: torch.device | str = "cpu", pad_to: int | None = None,
              host_mirrors: bool = False) -> Step:
    """Build one step: decodes (1 token after ``context_len`` cached tokens), then prefills.

    Args:
        config: anything with ``vocab_size`` (e.g. ``DeepseekConfig``).
        decode_context_lens: cached tokens of each decode request (query length 1).
        prefills: ``(context_len, query_len)`` of each prefill; ``context_len > 0`` is a
            chunked-prefill continuation, ``query_len >= 1``.
        block_size: tokens per KV-cache block.
        num_blocks: KV-cache blocks; default = exactly what the requests need.
        seed: seeds the input ids and the block shuffle.
        device: where the tensors go.
        pad_to: pad the token dim to this many rows (slot -1, id 0, position 0).
        host_mirrors: the metadata carries host mirrors of its tensor fields (``*_cpu``, see
            :mod:`dbo_compile.metadata`): copies of the CPU tensors it is built from,
            as a scheduler would pass them.

    Returns:
        A :class:`Step` whose metadata has been validated.

    Raises:
        MetadataError: negative lengths, an empty prefill query, too few blocks, or
            ``pad_to`` below the real token count.
    """
    reqs = [(int(c), 1) for c in decode_context_lens] + [(int(c), int(q)) for c, q in prefills]
    for c, q in reqs:
        if c < 0 or q < 1:
            raise MetadataError(f"bad request (context_len={c}, query_len={q}): need ctx >= 0, q >= 1")
    if block_size < 1:
        raise MetadataError(f"block_size must be >= 1, got {block_size}")
    seq_lens = [c + q for c, q in reqs]
    blocks_per_req = [-(-s // block_size) for s in seq_lens]
    needed = sum(blocks_per_req)
    if num_blocks is None:
        num_blocks = max(needed, 1)
    if needed > num_blocks:
        raise MetadataError(f"requests need {needed} KV blocks, only num_blocks={num_blocks}")
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(num_blocks, generator=gen)[:needed]
    max_blocks = max(blocks_per_req, default=1)
    block_table = torch.zeros(len(reqs), max_blocks, dtype=torch.int32)
    off = 0
    for i, nb in enumerate(blocks_per_req):
        block_table[i, :nb] = perm[off:off + nb].to(torch.int32)
        off += nb
    num_actual = sum(q for _, q in reqs)
    num_tokens = num_actual if pad_to is None else pad_to
    if num_tokens < num_actual:
        raise MetadataError(f"pad_to={pad_to} is below the {num_actual} scheduled tokens")
    positions = torch.zeros(num_tokens, dtype=torch.int64)
    slot_mapping = torch.full((num_tokens,), -1, dtype=torch.int64)
    input_ids = torch.zeros(num_tokens, dtype=torch.int64)
    vocab = int(config.vocab_size)
    if num_actual:
        input_ids[:num_actual] = torch.randint(1 if vocab > 1 else 0, vocab, (num_actual,),
                                               generator=gen)
    t = 0
    for i, (c, q) in enumerate(reqs):
        pos = torch.arange(c, c + q, dtype=torch.int64)
        positions[t:t + q] = pos
        slot_mapping[t:t + q] = block_table[i].long()[pos // block_size] * block_size + pos % block_size
        t += q
    qsl = torch.zeros(len(reqs) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor([q for _, q in reqs], dtype=torch.int32), 0)
    md = AttentionMetadata(
        query_start_loc=qsl,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        num_computed_tokens=torch.tensor([c for c, _ in reqs], dtype=torch.int32),
        block_table=block_table,
        slot_mapping=slot_mapping,
        max_query_len=max((q for _, q in reqs), default=0),
        max_seq_len=max(seq_lens, default=0),
    ).validate()
    if host_mirrors:
        md = md.with_host_mirrors()
    step = Step(input_ids, positions, md, [q for _, q in reqs], [c for c, _ in reqs],
                block_size, num_blocks)
    return step.to(device)


def context_slots(step: Step) -> torch.Tensor:
    """``[sum(context_lens)]`` int64 cache slots of every request's already-cached tokens."""
    bt = step.attn_metadata.block_table.cpu().long()
    out = []
    for i, c in enumerate(step.context_lens):
        pos = torch.arange(c, dtype=torch.int64)
        out.append(bt[i][pos // step.block_size] * step.block_size + pos % step.block_size)
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.int64)


@torch.no_grad()
def fill_kv_cache(model: Any, step: Step, seed: int = 0, std: float = 1.0) -> None:
    """Write seeded random K/V (``N(0, std)``) into the cached context of each request.

    Only the slots of positions ``0..context_len-1`` through each request's block table are
    written, in every layer (layer ``l`` uses generator seed ``seed + l``), so two models
    (e.g. EP and non-EP) filled with the same seed see the same cache.

    Args:
        model: a model with ``kv_caches()`` (``DeepseekMoEModel``), caches allocated.
        step: the step whose contexts are filled.
        seed: generator seed (values are drawn in fp32 on CPU, then cast).
        std: standard deviation of the values.

    Raises:
        MetadataError: a slot lies outside the cache (allocate more blocks).
    """
    slots = context_slots(step)
    for layer_idx, cache in enumerate(model.kv_caches()):
        _, nb, bs, hkv, d = cache.shape
        if bs != step.block_size:
            raise MetadataError(f"KV cache block_size {bs} != step.block_size {step.block_size}")
        if slots.numel() and int(slots.max()) >= nb * bs:
            raise MetadataError(
                f"context slot {int(slots.max())} outside the KV cache of {nb} x {bs} slots")
        gen = torch.Generator().manual_seed(seed + layer_idx)
        vals = torch.randn(2, slots.numel(), hkv, d, generator=gen) * std
        cache.view(2, nb * bs, hkv, d)[:, slots.to(cache.device)] = vals.to(cache.device, cache.dtype)
