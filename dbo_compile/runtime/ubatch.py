"""Cut one step into ubatches: token/request slices and per-ubatch attention metadata.

Host-side, run once per step after the DP vote (:mod:`dbo_compile.runtime.vote`) said "split".
The rules are vLLM DBO's (``--enable-dbo``), pinned by the golden cases of
docs/references.md §Slicing:

1. ``cu`` = cumulative scheduled tokens with a leading 0 (``cu[i]`` = first token of request i).
2. Split points are fixed on the **padded** token count, identical on every DP rank:
   ``b_k = k * num_tokens_padded // num_ubatches`` (for two ubatches: one split point at
   ``num_tokens_padded // 2``). Because they depend only on the voted padded count, every rank
   cuts its token dim into the same ubatch sizes, so the collectives of ubatch ``k`` have the
   same shapes everywhere and one CUDA graph per (bucket, split) serves all ranks.
3. Ubatch ``k`` owns the real tokens ``[min(b_k, T), min(b_{k+1}, T))`` (``T`` = real tokens)
   and the requests ``[searchsorted(cu, tok_start, right) - 1, searchsorted(cu, tok_stop,
   left))``. A request straddling a split point appears in both ubatches: the first part keeps
   the tokens before the split point (its query and ``seq_len`` are trimmed), the continuation
   the rest (full ``seq_len``, ``num_computed_tokens`` advanced by the tokens already placed).
4. Padded slices partition ``[0, num_tokens_padded)`` at the same split points: rows past the
   real tokens are padding (``slot_mapping == -1``). When ``T >= b_{n-1}`` all padding lands in
   the last ubatch; when a rank has fewer real tokens than that (DP padding to another rank's
   count), its earlier ubatches end in padding rows too and its last ubatches are empty.

Empty-ubatch rule
-----------------
A ubatch whose real-token slice is empty (``token_slice.start == token_slice.stop``, request
slice ``[R, R)``) is **not** dropped and does not abort the split (vLLM aborts instead): it runs
as padding, with its padded rows (or 0 rows), and still issues every dispatch/combine, so all
DP ranks stay in step and issue the same collectives in the same order (``docs/design.md``,
invariants 2 and 6). Its attention metadata has ``num_reqs == 0`` (``query_start_loc == [0]``)
and one ``slot_mapping == -1`` row per padded row. Empty ubatches arise only from DP padding: the vote
never splits a step in which any rank has fewer than ``num_ubatches`` real tokens (thresholds
are ``>= num_ubatches``, and ``split="always"`` checks that bound explicitly), so a step with
fewer real tokens than ``num_ubatches`` (a 1-token step, an idle rank) runs unsplit everywhere.
:func:`make_ubatch_slices` itself accepts any counts, so callers and tests can build such
slices.

Requests with zero scheduled tokens are rejected (:class:`MetadataError`): the searchsorted rule
cannot place them (vLLM's scheduler never schedules them).
"""

from __future__ import annotations

import bisect
import itertools
import logging
from dataclasses import dataclass
from typing import Sequence

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

#: ``slot_mapping`` value of a padding token (writes no KV), as in vLLM (``PAD_SLOT_ID``).
PAD_SLOT_ID = -1

__all__ = [
    "PAD_SLOT_ID",
    "UBatchSlice",
    "cut_step",
    "make_ubatch_slices",
    "make_ubatch_slices_at",
    "slice_token_tensor",
    "split_attn_metadata",
]


@dataclass(frozen=True)
class UBatchSlice:
    """The requests and token rows of one ubatch.

    Attributes:
        request_slice: ``slice(start, stop)`` over the request dim (step 1). A request cut by a
            split point is in the request slices of both ubatches.
        token_slice: ``slice(start, stop)`` over the token dim (step 1), in tokens.
    """

    request_slice: slice
    token_slice: slice

    @property
    def num_tokens(self) -> int:
        """Rows of the token dim in this ubatch (tokens)."""
        return self.token_slice.stop - self.token_slice.start

    @property
    def num_reqs(self) -> int:
        return self.request_slice.stop - self.request_slice.start

    def is_empty(self) -> bool:
        """True when the ubatch has no token rows (see the module's empty-ubatch rule)."""
        return self.num_tokens == 0


def _as_int_list(num_scheduled_tokens: Sequence[int] | torch.Tensor) -> list[int]:
    if isinstance(num_scheduled_tokens, torch.Tensor):
        if num_scheduled_tokens.dim() != 1:
            raise MetadataError(
                "num_scheduled_tokens must be 1-D [num_reqs], got shape "
                f"{tuple(num_scheduled_tokens.shape)}"
            )
        if num_scheduled_tokens.dtype.is_floating_point or num_scheduled_tokens.dtype == torch.bool:
            raise MetadataError(
                f"num_scheduled_tokens must be an integer tensor, got {num_scheduled_tokens.dtype}"
            )
    return int_list(num_scheduled_tokens)


def _request_slice(cu: list[int], tok_start: int, tok_stop: int) -> slice:
    """vLLM's rule: requests overlapping ``[tok_start, tok_stop)``; ``[R, R)`` when empty."""
    if tok_start >= tok_stop:
        r = len(cu) - 1 if tok_start >= cu[-1] else bisect.bisect_right(cu, tok_start) - 1
        return slice(r, r)
    return slice(bisect.bisect_right(cu, tok_start) - 1, bisect.bisect_left(cu, tok_stop))


def make_ubatch_slices(
    num_scheduled_tokens: Sequence[int] | torch.Tensor,
    num_tokens_padded: int,
    num_ubatches: int = 2,
) -> tuple[list[UBatchSlice], list[UBatchSlice]]:
    """Cut one step into ``num_ubatches`` ubatches at split points on the padded token count.

    Args:
        num_scheduled_tokens: tokens of each request this step, ``[num_reqs]`` (list or integer
            tensor, any device; read on the host). Every entry must be ``>= 1``.
        num_tokens_padded: token rows of the step after padding (the DP vote's
            ``num_tokens_padded``), ``>= sum(num_scheduled_tokens)``.
        num_ubatches: number of ubatches (``>= 1``).

    Returns:
        ``(slices, padded_slices)``, each a list of ``num_ubatches`` :class:`UBatchSlice`.
        ``slices`` cover the real tokens (``[0, T)``, possibly empty per ubatch: see the
        empty-ubatch rule in the module docstring); ``padded_slices`` have the same request
        slices and token slices that partition ``[0, num_tokens_padded)`` at
        ``k * num_tokens_padded // num_ubatches``.

    Raises:
        MetadataError: a count is negative or zero, ``num_tokens_padded`` is smaller than the
            real token count, or ``num_ubatches < 1``.

    Example::

        >>> s, p = make_ubatch_slices([8, 8], 24)
        >>> s[0]
        UBatchSlice(request_slice=slice(0, 2, None), token_slice=slice(0, 12, None))
        >>> s[1].token_slice, p[1].token_slice
        (slice(12, 16, None), slice(12, 24, None))
    """
    return make_ubatch_slices_at(num_scheduled_tokens,
                                 _split_points(num_tokens_padded, num_ubatches), num_tokens_padded)


def _split_points(num_tokens_padded: int, num_ubatches: int) -> list[int]:
    """``k * num_tokens_padded // num_ubatches`` for ``k`` in ``1 .. num_ubatches - 1``."""
    if not isinstance(num_ubatches, int) or num_ubatches < 1:
        raise MetadataError(f"num_ubatches must be an int >= 1, got {num_ubatches!r}")
    num_tokens_padded = int(num_tokens_padded)
    return [k * num_tokens_padded // num_ubatches for k in range(1, num_ubatches)]


def make_ubatch_slices_at(
    num_scheduled_tokens: Sequence[int] | torch.Tensor,
    split_points: Sequence[int],
    num_tokens_padded: int | None = None,
) -> tuple[list[UBatchSlice], list[UBatchSlice]]:
    """Like :func:`make_ubatch_slices`, with explicit split points (tokens).

    ``len(split_points) + 1`` ubatches; the points must be non-decreasing and within
    ``[0, num_tokens_padded]`` (``num_tokens_padded`` defaults to the real token count). This is
    the form of vLLM's ``create_ubatch_slices(num_scheduled_tokens, split_point)`` and of the
    golden cases; :func:`make_ubatch_slices` calls it with ``k * num_tokens_padded //
    num_ubatches``.

    Raises:
        MetadataError: a count is ``< 1``, ``num_tokens_padded`` is smaller than the real token
            count, or a split point is out of order or out of range.
    """
    counts = _as_int_list(num_scheduled_tokens)
    if counts and min(counts) < 1:
        bad = [(i, c) for i, c in enumerate(counts) if c < 1]
        raise MetadataError(
            f"num_scheduled_tokens must be >= 1 for every request; (request, tokens) {bad[:8]} "
            "are not (drop requests with no tokens before slicing)"
        )
    return _slices_at_offsets(list(itertools.accumulate(counts, initial=0)), split_points,
                              num_tokens_padded)


def _slices_at_offsets(cu: list[int], split_points: Sequence[int],
                       num_tokens_padded: int | None) -> tuple[list[UBatchSlice], list[UBatchSlice]]:
    """:func:`make_ubatch_slices_at` from the request offsets ``cu`` ``[R+1]`` (the host
    ``query_start_loc``: the cumulative counts, which the vote has already checked)."""
    num_tokens = cu[-1]
    num_tokens_padded = num_tokens if num_tokens_padded is None else int(num_tokens_padded)
    if num_tokens_padded < num_tokens:
        raise MetadataError(
            f"num_tokens_padded={num_tokens_padded} is smaller than the real token count "
            f"{num_tokens} (sum of num_scheduled_tokens over {len(cu) - 1} requests)"
        )
    bounds = [0, *(int(p) for p in split_points), num_tokens_padded]
    if any(b > c for b, c in zip(bounds, bounds[1:])):
        raise MetadataError(
            f"split points {list(split_points)} must be non-decreasing within "
            f"[0, num_tokens_padded={num_tokens_padded}]"
        )
    slices: list[UBatchSlice] = []
    padded: list[UBatchSlice] = []
    for k in range(len(bounds) - 1):
        start, stop = min(bounds[k], num_tokens), min(bounds[k + 1], num_tokens)
        req = _request_slice(cu, start, stop)
        slices.append(UBatchSlice(req, slice(start, stop)))
        padded.append(UBatchSlice(req, slice(bounds[k], bounds[k + 1])))
    log.debug(
        "ubatch slices: %d reqs, %d tokens padded to %d -> %s", len(cu) - 1, num_tokens,
        num_tokens_padded, [(s.request_slice, s.token_slice) for s in padded],
    )
    return slices, padded


def slice_token_tensor(
    t: torch.Tensor,
    token_slice: slice,
    *,
    num_real_tokens: int | None = None,
    pad_value: int | float = 0,
    dim: int = 0,
) -> torch.Tensor:
    """Rows ``token_slice`` of ``t`` along its token dim, padded, as a fresh tensor.

    Rows at or past ``num_real_tokens`` (default: ``t.shape[dim]``), including rows beyond the
    end of ``t``, are filled with ``pad_value``. The result never shares storage with ``t``.

    Args:
        t: any tensor whose ``dim`` is the token dim ``[num_tokens, ...]``.
        token_slice: ``slice(start, stop)`` in tokens, ``0 <= start <= stop``.
        num_real_tokens: rows of ``t`` that are real tokens.
        pad_value: value of the padding rows.
        dim: the token dim of ``t``.

    Returns:
        A tensor of ``t``'s dtype and device with ``stop - start`` rows along ``dim``.

    Raises:
        MetadataError: the slice is negative or reversed.
    """
    start, stop = token_slice.start, token_slice.stop
    if start is None or stop is None or start < 0 or stop < start:
        raise MetadataError(f"token slice {token_slice} must have 0 <= start <= stop")
    real = t.shape[dim] if num_real_tokens is None else min(int(num_real_tokens), t.shape[dim])
    shape = list(t.shape)
    shape[dim] = stop - start
    out = torch.full(shape, pad_value, dtype=t.dtype, device=t.device)
    n = max(0, min(stop, real) - start)
    if n:
        out.narrow(dim, 0, n).copy_(t.narrow(dim, start, n))
    return out


def _check_slice(s: UBatchSlice, cu: list[int], index: int) -> tuple[int, int, int, int]:
    """Validate one slice against the metadata; returns (tok_start, real_stop, r0, r1)."""
    ts, rs = s.token_slice, s.request_slice
    if (ts.start is None or ts.stop is None or ts.start < 0 or ts.stop < ts.start
            or ts.step not in (None, 1)):
        raise MetadataError(
            f"ubatch {index}: token_slice {ts} must be slice(start, stop) with 0 <= start <= stop"
        )
    if rs.start is None or rs.stop is None or rs.step not in (None, 1):
        raise MetadataError(f"ubatch {index}: request_slice {rs} must be slice(start, stop)")
    num_real = cu[-1]
    start, real_stop = min(ts.start, num_real), min(ts.stop, num_real)
    expected = _request_slice(cu, start, real_stop)
    if (rs.start, rs.stop) != (expected.start, expected.stop):
        raise MetadataError(
            f"ubatch {index}: request_slice [{rs.start}, {rs.stop}) does not match token_slice "
            f"[{ts.start}, {ts.stop}) of a step with query_start_loc {cu}: the requests of those "
            f"tokens are [{expected.start}, {expected.stop}) (build slices with make_ubatch_slices)"
        )
    return start, real_stop, rs.start, rs.stop


def split_attn_metadata(
    slices: Sequence[UBatchSlice], metadata: AttentionMetadata,
    host: HostCounts | None = None,
) -> list[AttentionMetadata]:
    """One :class:`AttentionMetadata` per ubatch, following docs/references.md §Slicing (vLLM DBO).

    For ubatch ``k`` with requests ``[r0, r1)`` and real tokens ``[a, b)``:

    - ``query_start_loc`` int32 ``[r1 - r0 + 1]``: the original offsets clamped to ``[a, b]``
      and rebased to 0;
    - ``seq_lens`` int32 ``[r1 - r0]``: a request cut after this part loses the tokens that come
      later (``seq_len - tokens after b``); a continuation keeps its full ``seq_len``;
    - ``num_computed_tokens`` int32: ``seq_lens - query_lens`` of this part (a continuation's is
      advanced by the tokens already placed in earlier ubatches);
    - ``block_table`` int32 ``[r1 - r0, max_blocks]``: the rows of its requests;
    - ``slot_mapping`` int64 ``[token_slice rows]``: the rows of its token slice; rows at or past
      the real tokens (padding of padded slices) are ``-1``, even if the input held other
      values there;
    - ``max_query_len`` / ``max_seq_len``: recomputed (0 for an empty ubatch);
    - host mirrors of the three counts (``query_start_loc_cpu``, ``seq_lens_cpu``,
      ``num_computed_tokens_cpu``): the host values they were built from.

    An empty ubatch (no real tokens) gets ``num_reqs == 0``, ``query_start_loc == [0]`` and one
    ``-1`` slot per token row. Every tensor is freshly allocated (no storage is shared with the
    input or another ubatch) on the device of the corresponding input field. The counts are
    computed on the host, from ``host`` or the metadata's host mirrors (trusted: see
    :mod:`~dbo_compile.metadata`), and copied to the device in one copy per ubatch
    (on CUDA from pinned memory, without blocking).

    Args:
        slices: from :func:`make_ubatch_slices` (real or padded), or any slices whose request
            slice matches their token slice by the searchsorted rule.
        metadata: the step's metadata; validated first.
        host: its ``(query_start_loc, seq_lens, num_computed_tokens)`` on the host when the
            caller has them (:meth:`AttentionMetadata.host_counts`: CPU tensors, or
            ``host_fields``: lists); else :meth:`AttentionMetadata.host_counts` here: the
            host mirrors, or one copy from the device (the split's only device read).

    Returns:
        A list with one validated metadata per slice, in ubatch order.

    Raises:
        MetadataError: the metadata is inconsistent (see :meth:`AttentionMetadata.validate`), a
            request has zero query tokens, or a slice does not match the metadata.
    """
    counts = tuple(host_tensor(h) for h in (host if host is not None else metadata.host_counts()))
    metadata.validate(host=counts)
    return _split_validated(slices, metadata, counts)  # type: ignore[arg-type]


def _split_validated(slices: Sequence[UBatchSlice], metadata: AttentionMetadata,
                     host: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                     qsl: list[int] | None = None, check_parts: bool = True
                     ) -> list[AttentionMetadata]:
    """:func:`split_attn_metadata` of metadata already validated with the host counts ``host``
    (CPU tensors); ``qsl``: ``host[0]`` as a list, when the caller has it; ``check_parts``:
    validate the parts (they are valid by construction: the serving path skips it)."""
    qsl_h, seq_h, ctx_h = host
    qsl = qsl_h.tolist() if qsl is None else qsl
    qlens = query_lens_from(qsl_h)
    if 0 in qlens:
        zero = [i for i, q in enumerate(qlens) if q == 0]
        raise MetadataError(
            f"requests {zero[:8]} have zero query tokens (query_start_loc {qsl[:16]}...); "
            "ubatch slicing needs >= 1 token per request"
        )
    num_real = qsl[-1]
    devices = [metadata.query_start_loc.device, metadata.seq_lens.device,
               metadata.num_computed_tokens.device]
    out: list[AttentionMetadata] = []
    for k, s in enumerate(slices):
        a, b, r0, r1 = _check_slice(s, qsl, k)
        new_qsl = qsl_h[r0:r1 + 1].clamp(a, b) - a if r1 > r0 else qsl_h.new_zeros(1)
        # a request cut after this part loses the tokens after b
        new_seq = seq_h[r0:r1] - (qsl_h[r0 + 1:r1 + 1] - b).clamp(min=0)
        new_qlens = new_qsl[1:] - new_qsl[:-1]
        new_ctx = new_seq - new_qlens
        slot = slice_token_tensor(
            metadata.slot_mapping, s.token_slice, num_real_tokens=num_real, pad_value=PAD_SLOT_ID
        )
        counts = [t.to(torch.int32) for t in (new_qsl, new_seq, new_ctx)]  # fresh tensors
        on_device = _to_devices(counts, devices)
        part = AttentionMetadata(
            query_start_loc=on_device[0],
            seq_lens=on_device[1],
            num_computed_tokens=on_device[2],
            block_table=metadata.block_table[r0:r1].clone(),
            slot_mapping=slot,
            max_query_len=int(new_qlens.max()) if r1 > r0 else 0,
            max_seq_len=int(new_seq.max()) if r1 > r0 else 0,
            query_start_loc_cpu=counts[0],
            seq_lens_cpu=counts[1],
            num_computed_tokens_cpu=counts[2],
        )
        out.append(part.validate() if check_parts else part)
    return out


def _to_devices(host: list[torch.Tensor], devices: list[torch.device]) -> list[torch.Tensor]:
    """1-D host tensors of one dtype, each on its device: in one copy (views of one fresh
    tensor) where they share one. On CUDA the copy goes from pinned memory without blocking: a
    blocking copy from pageable memory synchronises with the stream, a host sync like a device
    read."""
    device = devices[0]
    if any(d != device for d in devices):
        return [t.to(d) for t, d in zip(host, devices)]
    if device.type == "cpu":
        return host
    flat = torch.cat(host)
    if device.type == "cuda":
        flat = flat.pin_memory().to(device, non_blocking=True)
    else:
        flat = flat.to(device)
    return list(flat.split([t.numel() for t in host]))


def cut_step(metadata: AttentionMetadata, host: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
             num_tokens_padded: int, num_ubatches: int, *, check_parts: bool = True
             ) -> tuple[list[UBatchSlice], list[AttentionMetadata]]:
    """The padded ubatch slices of a step and the per-ubatch metadata, for metadata already
    validated with its host counts ``host`` (CPU tensors: ``query_start_loc``, ``seq_lens``,
    ``num_computed_tokens``; the DP vote read them). The split points are on
    ``num_tokens_padded`` (rule 2 of the module docstring). ``check_parts=False`` skips
    validating the parts (valid by construction; the serving path skips it).

    Raises:
        MetadataError: a request has no query token.
    """
    cu = host[0].tolist()
    _, padded = _slices_at_offsets(cu, _split_points(num_tokens_padded, num_ubatches),
                                   num_tokens_padded)
    return padded, _split_validated(padded, metadata, host, cu, check_parts=check_parts)
