"""Ubatch slicing: golden cases of docs/references.md §Slicing, properties, errors."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dbo_compile.errors import MetadataError
from dbo_compile.metadata import AttentionMetadata
from dbo_compile.runtime.ubatch import (
    UBatchSlice,
    make_ubatch_slices,
    make_ubatch_slices_at,
    slice_token_tensor,
    split_attn_metadata,
)

BLOCK = 16


def make_metadata(query_lens, seq_lens, num_tokens=None, max_blocks=None) -> AttentionMetadata:
    """Consistent metadata: request i's blocks are distinct ids, slots follow its positions."""
    r = len(query_lens)
    qsl = [0]
    for q in query_lens:
        qsl.append(qsl[-1] + q)
    t = qsl[-1] if num_tokens is None else num_tokens
    max_blocks = max_blocks or max([-(-s // BLOCK) for s in seq_lens] + [1])
    block_table = torch.zeros(r, max_blocks, dtype=torch.int32)
    slots = torch.full((t,), -1, dtype=torch.int64)
    for i, (q, s) in enumerate(zip(query_lens, seq_lens)):
        nb = -(-s // BLOCK)
        block_table[i, :nb] = torch.arange(nb, dtype=torch.int32) + 1000 * (i + 1)
        for j in range(q):
            pos = s - q + j
            slots[qsl[i] + j] = int(block_table[i, pos // BLOCK]) * BLOCK + pos % BLOCK
    md = AttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        num_computed_tokens=torch.tensor([s - q for q, s in zip(query_lens, seq_lens)], dtype=torch.int32),
        block_table=block_table,
        slot_mapping=slots,
        max_query_len=max(query_lens, default=0),
        max_seq_len=max(seq_lens, default=0),
    )
    return md.validate()


def L(t: torch.Tensor) -> list:
    return t.tolist()


# --------------------------------------------------------------------------- golden cases


def test_golden_split_12_cuts_second_request():
    md = make_metadata([8, 8], [32, 40])
    slices, padded = make_ubatch_slices([8, 8], 24)  # split point 24 // 2 = 12
    assert slices[0] == UBatchSlice(slice(0, 2), slice(0, 12))
    assert slices[1] == UBatchSlice(slice(1, 2), slice(12, 16))
    u0, u1 = split_attn_metadata(slices, md)
    assert L(u0.query_start_loc) == [0, 8, 12] and L(u0.seq_lens) == [32, 36]
    assert L(u0.num_computed_tokens) == [24, 32]
    assert L(u1.query_start_loc) == [0, 4] and L(u1.seq_lens) == [40]
    assert L(u1.num_computed_tokens) == [36]
    assert (u0.max_query_len, u0.max_seq_len, u1.max_query_len, u1.max_seq_len) == (8, 36, 4, 40)


def test_golden_split_4_cuts_first_request():
    md = make_metadata([8, 8], [32, 40])
    slices, _ = make_ubatch_slices_at([8, 8], [4])
    assert slices[0] == UBatchSlice(slice(0, 1), slice(0, 4))
    assert slices[1] == UBatchSlice(slice(0, 2), slice(4, 16))
    u0, u1 = split_attn_metadata(slices, md)
    assert L(u0.query_start_loc) == [0, 4] and L(u0.seq_lens) == [28]
    assert L(u1.query_start_loc) == [0, 4, 12] and L(u1.seq_lens) == [32, 40]
    # continuation: query 4 of seq 32 -> 28 computed (docs/references.md, last golden case)
    assert L(u1.num_computed_tokens) == [28, 32]
    assert L(u0.num_computed_tokens) == [24]


def test_golden_slice_reqs_1_to_3_toks_1_to_7():
    md = make_metadata([1, 1, 5, 5], [32, 40, 48, 56])
    (u,) = split_attn_metadata([UBatchSlice(slice(1, 3), slice(1, 7))], md)
    assert u.num_reqs == 2 and u.num_tokens == 6 and u.max_query_len == 5
    assert L(u.query_start_loc) == [0, 1, 6] and L(u.seq_lens) == [40, 48]
    assert torch.equal(u.block_table, md.block_table[1:3])
    assert torch.equal(u.slot_mapping, md.slot_mapping[1:7])


@pytest.mark.parametrize(
    "reqs, toks, expected", [((1, 3), (5, 20), [0, 7, 15]), ((4, 5), (35, 50), [0, 15])]
)
def test_golden_query_start_loc_by_requests(reqs, toks, expected):
    qlens = [5, 7, 8, 15, 15]  # query_start_loc [0, 5, 12, 20, 35, 50]
    md = make_metadata(qlens, [q + 3 for q in qlens])
    assert L(md.query_start_loc) == [0, 5, 12, 20, 35, 50]
    (u,) = split_attn_metadata([UBatchSlice(slice(*reqs), slice(*toks))], md)
    assert L(u.query_start_loc) == expected


def test_golden_32_decodes_halve():
    md = make_metadata([1] * 32, [2048] * 32)
    slices, padded = make_ubatch_slices([1] * 32, 32)
    assert [s.request_slice for s in slices] == [slice(0, 16), slice(16, 32)]
    assert slices == padded
    for u in split_attn_metadata(slices, md):
        assert u.num_reqs == 16 and L(u.seq_lens) == [2048] * 16
        assert L(u.query_start_loc) == list(range(17))
        assert L(u.num_computed_tokens) == [2047] * 16


def test_golden_continuation_num_computed():
    md = make_metadata([8], [32])
    slices, _ = make_ubatch_slices_at([8], [4])
    u0, u1 = split_attn_metadata(slices, md)
    assert (L(u0.query_start_loc), L(u0.seq_lens), L(u0.num_computed_tokens)) == ([0, 4], [28], [24])
    assert (L(u1.query_start_loc), L(u1.seq_lens), L(u1.num_computed_tokens)) == ([0, 4], [32], [28])


def test_request_starting_exactly_at_split_is_only_in_second_ubatch():
    slices, _ = make_ubatch_slices([4, 4], 8)
    assert slices[0].request_slice == slice(0, 1) and slices[1].request_slice == slice(1, 2)


# --------------------------------------------------------------------------- padding / empty


def test_padded_slices_partition_and_pad_slots():
    md = make_metadata([8, 8], [32, 40])
    slices, padded = make_ubatch_slices([8, 8], 21)
    assert [p.token_slice for p in padded] == [slice(0, 10), slice(10, 21)]
    assert [s.token_slice for s in slices] == [slice(0, 10), slice(10, 16)]
    u0, u1 = split_attn_metadata(padded, md)
    assert u0.num_tokens == 10 and u1.num_tokens == 11
    assert L(u1.slot_mapping[6:]) == [-1] * 5
    assert torch.equal(torch.cat([u0.slot_mapping, u1.slot_mapping])[:16], md.slot_mapping)
    # same request metadata with or without padding
    r0, r1 = split_attn_metadata(slices, md)
    for a, b in ((u0, r0), (u1, r1)):
        assert torch.equal(a.query_start_loc, b.query_start_loc)
        assert torch.equal(a.seq_lens, b.seq_lens)


def test_zero_token_ubatch_from_dp_padding():
    # this rank has 6 tokens, another rank 40: padded 40, split point 20 -> ubatch 1 is empty
    md = make_metadata([2, 4], [10, 20])
    slices, padded = make_ubatch_slices([2, 4], 40)
    assert slices[1].is_empty() and slices[1].request_slice == slice(2, 2)
    assert not padded[1].is_empty() and padded[1].num_tokens == 20
    u0, u1 = split_attn_metadata(padded, md)
    assert u1.num_reqs == 0 and L(u1.query_start_loc) == [0]
    assert u1.block_table.shape == (0, md.block_table.shape[1])
    assert L(u1.slot_mapping) == [-1] * 20 and (u1.max_query_len, u1.max_seq_len) == (0, 0)
    assert u0.num_tokens == 20 and L(u0.slot_mapping[6:]) == [-1] * 14
    assert L(u0.query_start_loc) == [0, 2, 6]
    (e0, e1) = split_attn_metadata(slices, md)
    assert e1.num_tokens == 0 and e1.slot_mapping.shape == (0,)


def test_one_token_step_and_idle_rank():
    slices, padded = make_ubatch_slices([1], 1)
    assert [s.num_tokens for s in slices] == [0, 1]  # split point 1 // 2 = 0
    assert slices[0].request_slice == slice(0, 0) and slices[1].request_slice == slice(0, 1)
    slices, padded = make_ubatch_slices([], 8)
    assert all(s.is_empty() and s.request_slice == slice(0, 0) for s in slices)
    assert [p.num_tokens for p in padded] == [4, 4]
    md = make_metadata([], [], num_tokens=0, max_blocks=3)
    parts = split_attn_metadata(padded, md)
    assert [L(p.slot_mapping) for p in parts] == [[-1] * 4] * 2
    assert all(p.num_reqs == 0 for p in parts)


def test_tensor_counts_and_three_ubatches():
    counts = torch.tensor([3, 5, 4], dtype=torch.int32)
    slices, padded = make_ubatch_slices(counts, 13, num_ubatches=3)
    assert [p.token_slice for p in padded] == [slice(0, 4), slice(4, 8), slice(8, 13)]
    assert [s.request_slice for s in slices] == [slice(0, 2), slice(1, 2), slice(2, 3)]


def test_slice_token_tensor_pads_and_copies():
    x = torch.arange(12.0).reshape(6, 2)
    y = slice_token_tensor(x, slice(4, 8), num_real_tokens=5, pad_value=-7)
    assert y.tolist() == [[8.0, 9.0], [-7, -7], [-7, -7], [-7, -7]]
    assert y.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()


# --------------------------------------------------------------------------- errors


def test_padded_smaller_than_real_raises():
    with pytest.raises(MetadataError, match="num_tokens_padded=10 is smaller than the real token count 16"):
        make_ubatch_slices([8, 8], 10)


def test_zero_or_negative_counts_raise():
    with pytest.raises(MetadataError, match=">= 1 for every request"):
        make_ubatch_slices([4, 0, 4], 8)
    with pytest.raises(MetadataError, match=">= 1"):
        make_ubatch_slices([4, -1], 8)


def test_inconsistent_metadata_raises():
    md = make_metadata([8, 8], [32, 40])
    md.num_computed_tokens = torch.tensor([24, 31], dtype=torch.int32)
    slices, _ = make_ubatch_slices([8, 8], 16)
    with pytest.raises(MetadataError, match="num_computed_tokens must equal"):
        split_attn_metadata(slices, md)
    md = make_metadata([8, 8], [32, 40])
    md.seq_lens = md.seq_lens.to(torch.int64)
    with pytest.raises(MetadataError, match="seq_lens must be torch.int32"):
        split_attn_metadata(slices, md)


def test_slices_not_matching_metadata_raise():
    md = make_metadata([8, 8], [32, 40])
    with pytest.raises(MetadataError, match=r"request_slice \[0, 1\) does not match token_slice \[0, 12\)"):
        split_attn_metadata([UBatchSlice(slice(0, 1), slice(0, 12))], md)
    slices, _ = make_ubatch_slices([4, 4, 8], 16)  # built for other requests
    with pytest.raises(MetadataError, match="does not match"):
        split_attn_metadata(slices, md)


# --------------------------------------------------------------------------- properties


@st.composite
def steps(draw):
    qlens = draw(st.lists(st.integers(1, 40), min_size=0, max_size=12))
    seq = [q + draw(st.integers(0, 100)) for q in qlens]
    extra = draw(st.integers(0, 50))
    n = draw(st.integers(2, 4))
    padded_input = draw(st.booleans())
    return qlens, seq, sum(qlens) + extra, n, padded_input


def _storages(md: AttentionMetadata) -> list[int]:
    return [t.untyped_storage().data_ptr() for t in md.tensors().values() if t.untyped_storage().nbytes()]


@settings(max_examples=300, deadline=None)
@given(steps())
def test_split_properties(step):
    qlens, seq, num_padded, n, padded_input = step
    md = make_metadata(qlens, seq, num_tokens=num_padded if padded_input else None)
    slices, padded = make_ubatch_slices(qlens, num_padded, n)
    t = sum(qlens)
    # token slices: padded partition [0, padded); real ones partition [0, T)
    assert padded[0].token_slice.start == 0 and padded[-1].token_slice.stop == num_padded
    assert slices[0].token_slice.start == 0 and slices[-1].token_slice.stop == t
    for k in range(n - 1):
        assert padded[k].token_slice.stop == padded[k + 1].token_slice.start
        assert slices[k].token_slice.stop == slices[k + 1].token_slice.start
    assert max(p.num_tokens for p in padded) - min(p.num_tokens for p in padded) <= 1
    parts = split_attn_metadata(padded, md)
    real_parts = split_attn_metadata(slices, md)
    # per request: query lens add up; the last part has the full seq_len; seq_lens grow by the query
    per_req: dict[int, list[tuple[int, int, int]]] = {}
    for s, u in zip(slices, parts):
        assert u.num_reqs == s.request_slice.stop - s.request_slice.start
        q = L(u.query_lens())
        assert sum(q) == s.num_tokens
        assert L(u.num_computed_tokens) == [a - b for a, b in zip(L(u.seq_lens), q)]
        assert torch.equal(u.block_table, md.block_table[s.request_slice])
        for j, i in enumerate(range(s.request_slice.start, s.request_slice.stop)):
            per_req.setdefault(i, []).append((q[j], int(u.seq_lens[j]), int(u.num_computed_tokens[j])))
    assert sorted(per_req) == list(range(len(qlens)))
    for i, pieces in per_req.items():
        assert sum(p[0] for p in pieces) == qlens[i]
        assert pieces[-1][1] == seq[i]
        assert pieces[0][2] == seq[i] - qlens[i]
        for prev, nxt in zip(pieces, pieces[1:]):
            assert nxt[2] == prev[1]  # a continuation has computed what the previous part reached
    # slot mappings concatenated == original, padded with -1
    expected = torch.full((num_padded,), -1, dtype=torch.int64)
    expected[:t] = md.slot_mapping[:t]
    assert torch.equal(torch.cat([u.slot_mapping for u in parts]), expected)
    assert torch.equal(torch.cat([u.slot_mapping for u in real_parts]), md.slot_mapping[:t])
    # no shared storage between ubatches or with the input
    seen = _storages(md)
    for u in parts + real_parts:
        mine = _storages(u)
        assert len(set(mine)) == len(mine)
        assert not set(mine) & set(seen)
        seen += mine
    # the split metadata is consistent
    for u in parts:
        u.validate()


def test_ubatch_metadata_mutation_does_not_leak():
    md = make_metadata([8, 8], [32, 40])
    before = {k: v.clone() for k, v in md.tensors().items()}
    u0, u1 = split_attn_metadata(make_ubatch_slices([8, 8], 16)[1], md)
    for u in (u0, u1):
        for t in u.tensors().values():
            t.fill_(7)
    for k, v in md.tensors().items():
        assert torch.equal(v, before[k]), k


def test_explicit_split_points_match_padded_rule_and_are_checked():
    assert make_ubatch_slices_at([8, 8], [12], 24) == make_ubatch_slices([8, 8], 24)
    with pytest.raises(MetadataError, match="non-decreasing"):
        make_ubatch_slices_at([8, 8], [12, 4])
    with pytest.raises(MetadataError, match="non-decreasing"):
        make_ubatch_slices_at([8, 8], [20])


def test_split_reads_the_device_once():
    """Every device read is a host sync on CUDA: the split reads the step's counts once and
    validates the ubatch parts from the host lists it built them from (which must agree with
    the parts' device tensors)."""
    from dbo_compile.testing import count_host_reads

    md = make_metadata([8, 1, 1, 20], [32, 9, 17, 20])
    slices, padded = make_ubatch_slices([8, 1, 1, 20], 32)
    with count_host_reads(*md.tensors().values()) as reads:
        parts = split_attn_metadata(padded, md)
    assert reads.count == 1, reads.calls
    for p in parts:
        p.check_host_mirrors()  # the host counts the parts were validated from are theirs


def test_validate_reads_three_fields_in_one_copy():
    md = make_metadata([3, 1], [3, 9])
    assert md.host_fields() == ([0, 3, 4], [3, 9], [0, 8])
    with pytest.raises(MetadataError, match="num_computed_tokens must equal"):
        md.validate(host=([0, 3, 4], [3, 9], [0, 7]))  # checks the host copy it is given


def test_split_with_host_mirrors_reads_nothing_and_matches():
    """With host mirrors (vLLM's ``*_cpu`` fields) the split reads no device tensor; its parts
    are those of the device-only metadata, and the host counts may be given as CPU tensors."""
    from dbo_compile.testing import count_host_reads

    md = make_metadata([8, 1, 1, 20], [32, 9, 17, 20])
    slices, padded = make_ubatch_slices([8, 1, 1, 20], 32)
    expected = split_attn_metadata(padded, md)
    mirrored = md.with_host_mirrors()
    assert mirrored.seq_lens_cpu is not md.seq_lens and torch.equal(mirrored.seq_lens_cpu, md.seq_lens)
    with count_host_reads(*md.tensors().values()) as reads:
        host = mirrored.host_fields()
        parts = split_attn_metadata(padded, mirrored)
    assert reads.calls == []
    assert host == md.host_fields()
    for given in (None, md.host_counts(), md.host_fields()):
        again = split_attn_metadata(padded, md, host=given)
        for p, q, e in zip(parts, again, expected):
            for k in e.tensors():
                assert torch.equal(getattr(p, k), getattr(e, k)), k
                assert torch.equal(getattr(q, k), getattr(e, k)), k
            assert (p.max_query_len, p.max_seq_len) == (e.max_query_len, e.max_seq_len)


def test_host_mirrors_are_checked_on_the_host():
    md = make_metadata([3, 1], [3, 9]).with_host_mirrors()
    with pytest.raises(MetadataError, match="seq_lens_cpu .*shape"):
        dataclasses.replace(md, seq_lens_cpu=md.seq_lens_cpu[:1]).validate()
    with pytest.raises(MetadataError, match="slot_mapping_cpu .*int64"):
        dataclasses.replace(md, slot_mapping_cpu=md.slot_mapping_cpu.int()).validate()
    with pytest.raises(MetadataError, match="num_computed_tokens must equal"):
        dataclasses.replace(md, num_computed_tokens_cpu=md.num_computed_tokens_cpu + 1).validate()
    one = torch.tensor([1, 0], dtype=torch.int32)
    stale = dataclasses.replace(md, seq_lens_cpu=md.seq_lens_cpu + one,
                                num_computed_tokens_cpu=md.num_computed_tokens_cpu + one)
    stale.validate()  # consistent on the host: trusted (the device is not read)
    with pytest.raises(MetadataError, match=r"seq_lens_cpu disagrees with seq_lens at \[0\]"):
        stale.check_host_mirrors()
    md.check_host_mirrors()
