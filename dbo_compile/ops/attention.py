"""``dbo.attention``: paged causal attention with a KV-cache write, flattened-token layout.

This is the CPU **reference** implementation (dense gather of each query's context through the
block table, softmax in fp32). It is written in tensor ops only: no ``.item()``, no
``.tolist()``, no host synchronisation, no Python branch on tensor values (branches on *shapes*
only), so it is CUDA-graph capturable, but it materialises ``[T, max_blocks * block_size, Hkv,
D]`` per chunk of queries and is meant to be replaced on GPU by a fused paged-attention kernel
behind the same op schema.

Shapes (``T`` = token dim, ``R`` = requests, ``Hq``/``Hkv`` query/KV heads, ``D`` head dim)::

    q            [T, Hq, D]                       any float dtype
    k, v         [T, Hkv, D]                      cast to kv_cache.dtype when written
    kv_cache     [2, num_blocks, block_size, Hkv, D]   mutated: k/v of each token written
    slot_mapping [T] int64                        block * block_size + offset; -1 = padding
    query_start_loc [R+1] int32, seq_lens [R] int32, block_table [R, max_blocks] int32
    out          [T, Hq, D]                       q.dtype; rows >= query_start_loc[-1] are 0
"""

import logging

import torch

from dbo_compile.errors import DboError

log = logging.getLogger(__name__)

__all__ = ["AttentionOpError", "attention"]

#: Upper bound on elements of one gathered context chunk ``[chunk, L, Hkv, D]`` (memory cap).
_GATHER_ELEMS = 1 << 24


class AttentionOpError(DboError, ValueError):
    """Arguments of ``dbo.attention`` have inconsistent shapes or dtypes."""


def _check_args(q, k, v, kv_cache, slot_mapping, query_start_loc, seq_lens, block_table) -> None:
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise AttentionOpError(
            f"dbo.attention: q/k/v must be [num_tokens, heads, head_dim], got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        )
    t, hq, d = q.shape
    if k.shape != v.shape or k.shape[0] != t or k.shape[2] != d:
        raise AttentionOpError(
            f"dbo.attention: k {tuple(k.shape)} / v {tuple(v.shape)} do not match q {tuple(q.shape)}"
        )
    hkv = k.shape[1]
    if hkv == 0 or hq % hkv != 0:
        raise AttentionOpError(f"dbo.attention: Hq={hq} is not a multiple of Hkv={hkv} (GQA)")
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or tuple(kv_cache.shape[3:]) != (hkv, d):
        raise AttentionOpError(
            f"dbo.attention: kv_cache has shape {tuple(kv_cache.shape)}, expected "
            f"[2, num_blocks, block_size, {hkv}, {d}]"
        )
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != t or slot_mapping.dtype != torch.int64:
        raise AttentionOpError(
            f"dbo.attention: slot_mapping must be int64 [{t}], got {slot_mapping.dtype} "
            f"{tuple(slot_mapping.shape)}"
        )
    r = seq_lens.shape[0]
    if (query_start_loc.dim() != 1 or query_start_loc.shape[0] != r + 1 or block_table.dim() != 2
            or block_table.shape[0] != r):
        raise AttentionOpError(
            f"dbo.attention: query_start_loc {tuple(query_start_loc.shape)}, seq_lens "
            f"{tuple(seq_lens.shape)}, block_table {tuple(block_table.shape)} disagree on num_reqs"
        )
    for name, x in (("query_start_loc", query_start_loc), ("seq_lens", seq_lens),
                    ("block_table", block_table)):
        if x.dtype not in (torch.int32, torch.int64):
            raise AttentionOpError(f"dbo.attention: {name} must be int32, got {x.dtype}")


def _write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              slot_mapping: torch.Tensor) -> None:
    """Write k/v rows to their slots without a host sync, skipping slot -1.

    Padding rows are redirected to the slot of the last real row and write that row's values
    (duplicate indices then carry identical values, so the result is deterministic); if no row
    is real, they rewrite slot 0 with its own contents.
    """
    t = k.shape[0]
    if t == 0:
        return
    if not kv_cache.is_contiguous():
        raise AttentionOpError("dbo.attention: kv_cache must be contiguous")
    _, nb, bs, hkv, d = kv_cache.shape
    flat = kv_cache.view(2, nb * bs, hkv, d)
    valid = slot_mapping >= 0
    rows = torch.arange(t, device=k.device)
    last = torch.where(valid, rows, -1).amax()
    has_valid = last >= 0
    last = last.clamp(min=0)
    src = torch.where(valid, rows, last)
    idx = torch.where(has_valid, slot_mapping[src], torch.zeros_like(slot_mapping))
    for i, x in enumerate((k, v)):
        new = x[src].to(kv_cache.dtype)
        new = torch.where(has_valid, new, flat[i, idx])
        flat[i].index_put_((idx,), new)


def _paged_attention(q, kv_cache, query_start_loc, seq_lens, block_table, scale) -> torch.Tensor:
    t, hq, d = q.shape
    r = seq_lens.shape[0]
    if t == 0 or r == 0:
        return torch.zeros_like(q)
    _, nb, bs, hkv, _ = kv_cache.shape
    g = hq // hkv
    flat = kv_cache.reshape(2, nb * bs, hkv, d)
    qsl = query_start_loc.to(torch.int64)
    seq = seq_lens.to(torch.int64)
    bt = block_table.to(torch.int64).clamp(min=0)
    ctx_len = bt.shape[1] * bs
    kpos = torch.arange(ctx_len, device=q.device)
    rows = torch.arange(t, device=q.device)
    # request of each token row; rows past query_start_loc[-1] are padding
    req = torch.searchsorted(qsl[1:].contiguous(), rows, right=True).clamp(max=r - 1)
    valid_row = rows < qsl[-1]
    start = qsl[req]
    qlen = qsl[req + 1] - start
    pos = seq[req] - qlen + (rows - start)  # absolute position of each query
    # padding rows attend to everything (finite softmax), then are zeroed
    mask = (kpos.unsqueeze(0) <= pos.unsqueeze(1)) | ~valid_row.unsqueeze(1)  # [T, L]
    slots = bt[req][:, kpos // bs] * bs + kpos % bs  # [T, L]
    out = torch.empty((t, hkv, g, d), dtype=torch.float32, device=q.device)
    qf = q.to(torch.float32).view(t, hkv, g, d)
    chunk = max(1, _GATHER_ELEMS // max(1, ctx_len * hkv * d))
    for c0 in range(0, t, chunk):
        c1 = min(t, c0 + chunk)
        m = mask[c0:c1]
        keys = flat[0][slots[c0:c1]].to(torch.float32)  # [c, L, Hkv, D]
        vals = flat[1][slots[c0:c1]].to(torch.float32)
        vals = torch.where(m[:, :, None, None], vals, 0.0)  # garbage in unused slots stays out
        s = torch.einsum("thgd,tlhd->thgl", qf[c0:c1], keys) * scale
        s = s.masked_fill(~m[:, None, None, :], float("-inf"))
        p = torch.softmax(s, dim=-1)
        out[c0:c1] = torch.einsum("thgl,tlhd->thgd", p, vals)
    out = torch.where(valid_row[:, None, None, None], out, 0.0)
    return out.view(t, hq, d).to(q.dtype)


@torch.library.custom_op("dbo::attention", mutates_args=("kv_cache",))
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
              slot_mapping: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
              block_table: torch.Tensor, scale: float) -> torch.Tensor:
    """Write this step's K/V into the paged cache, then paged causal attention.

    Request ``i`` owns query rows ``query_start_loc[i]:query_start_loc[i+1]`` (``q_i`` rows);
    they are the last ``q_i`` positions of its ``seq_lens[i]``-token sequence, so query ``j``
    sits at position ``seq_lens[i] - q_i + j`` and attends to cache positions ``0..`` that
    position, read through ``block_table[i]`` (position ``p`` -> slot
    ``block_table[i, p // block_size] * block_size + p % block_size``). Works for prefill,
    decode and chunked prefill mixed in one step, GQA (``Hq`` a multiple of ``Hkv``),
    ``T == 0`` and ``R == 0``.

    Args:
        q: ``[T, Hq, D]`` queries (``T`` = token dim, padding rows included).
        k: ``[T, Hkv, D]`` keys of this step's tokens.
        v: ``[T, Hkv, D]`` values of this step's tokens.
        kv_cache: ``[2, num_blocks, block_size, Hkv, D]``, contiguous; ``[0]`` keys, ``[1]``
            values. Mutated in place.
        slot_mapping: ``[T]`` int64 cache slot of each token, ``-1`` = padding (not written).
        query_start_loc: ``[R+1]`` int32 cumulative query lengths, ``[0] == 0``.
        seq_lens: ``[R]`` int32 sequence length of each request including this step's tokens.
        block_table: ``[R, max_blocks]`` int32 cache blocks of each request.
        scale: softmax scale (usually ``D ** -0.5``).

    Returns:
        ``[T, Hq, D]`` of ``q.dtype`` (softmax in fp32); rows ``>= query_start_loc[-1]`` are 0.

    Raises:
        AttentionOpError: inconsistent shapes or dtypes.
    """
    _check_args(q, k, v, kv_cache, slot_mapping, query_start_loc, seq_lens, block_table)
    _write_kv(kv_cache, k, v, slot_mapping)
    return _paged_attention(q, kv_cache, query_start_loc, seq_lens, block_table, scale)


@attention.register_fake
def _attention_fake(q, k, v, kv_cache, slot_mapping, query_start_loc, seq_lens, block_table,
                    scale):
    _check_args(q, k, v, kv_cache, slot_mapping, query_start_loc, seq_lens, block_table)
    return torch.empty_like(q)
