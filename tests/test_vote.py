"""DP vote (local and over Gloo ranks) and the split vetoes."""

from __future__ import annotations

import random

import pytest
import torch

from dbo_compile.config import DboConfig
from dbo_compile.errors import DpVoteError, MetadataError
from dbo_compile.metadata import AttentionMetadata
from dbo_compile.runtime.ubatch import make_ubatch_slices
from dbo_compile.runtime.vetoes import VetoRegistry, check_vetoes, prefix_read_veto
from dbo_compile.runtime.vote import VoteResult, coordinate_across_dp, fingerprint_to_int64
from dbo_compile.testing import run_multirank

pytestmark = pytest.mark.quick

CFG = DboConfig()  # decode threshold 32, prefill 512, 2 ubatches


def vote(n, *, uniform=False, allow=True, config=CFG, **kw) -> VoteResult:
    return coordinate_across_dp(n, uniform_decode=uniform, allow_split=allow, config=config, group=None, **kw)


# --------------------------------------------------------------------------- local rules


@pytest.mark.parametrize(
    "tokens, uniform, split",
    [
        (31, True, False), (32, True, True), (33, True, True),  # decode threshold, >=
        (511, False, False), (512, False, True), (513, False, True),  # prefill threshold
        (100, False, False),  # mixed batch uses the prefill threshold
        (0, True, False), (1, True, False),
    ],
)
def test_local_thresholds(tokens, uniform, split):
    r = vote(tokens, uniform=uniform)
    assert r.should_split is split
    assert r.num_tokens_across_dp == [tokens]
    assert r.num_tokens_padded == (tokens + tokens % 2 if split else tokens)
    assert (r.reason == "") is split


def test_local_padding_rounds_up_only_when_splitting():
    assert vote(33, uniform=True).num_tokens_padded == 34
    assert vote(33, uniform=True, num_tokens_padded=40).num_tokens_padded == 40
    cfg3 = DboConfig(num_ubatches=3)
    assert vote(40, uniform=True, config=cfg3, num_tokens_padded=41).num_tokens_padded == 42
    assert vote(20, uniform=True, num_tokens_padded=25).num_tokens_padded == 25  # no split


def test_local_split_modes_veto_and_cost_model():
    assert not vote(600, allow=False).should_split
    assert "vetoed on ranks [0]" in vote(600, allow=False).reason
    assert not vote(600, prefer_split=False).should_split
    assert "cost model" in vote(600, prefer_split=False).reason
    never = CFG.replace(split="never")
    assert not vote(600, config=never).should_split
    always = CFG.replace(split="always")
    assert vote(2, config=always).should_split  # thresholds skipped
    assert vote(2, config=always, prefer_split=False).should_split  # cost model ignored
    assert not vote(1, config=always).should_split  # fewer tokens than ubatches
    assert not vote(0, config=always).should_split
    assert not vote(600, config=always, allow=False).should_split  # vetoes still apply


def test_local_invalid_inputs_raise():
    with pytest.raises(DpVoteError, match=r"ranks \[0\] passed invalid inputs"):
        vote(10, num_tokens_padded=5)
    with pytest.raises(DpVoteError, match="invalid inputs"):
        vote(-1)


def test_fingerprint_hash_is_stable():
    assert fingerprint_to_int64(None) == 0 and fingerprint_to_int64(7) == 7
    assert fingerprint_to_int64("abc") == fingerprint_to_int64(b"abc") != fingerprint_to_int64("abd")
    assert -(2**63) <= fingerprint_to_int64(2**70) < 2**63


# --------------------------------------------------------------------------- multi-rank
SMALL = dict(decode_token_threshold=8, prefill_token_threshold=24)


def _step_inputs(seed: int, step: int, rank: int):
    """What rank ``rank`` knows at ``step``: only its own inputs (seeded per step and rank).

    The step's regime (mostly decode or mostly mixed) is shared, like a real engine's load; the
    counts, zeros, vetoes and cost-model votes are per rank.
    """
    decode_step = random.Random(seed * 7 + step).random() < 0.5
    g = random.Random(seed * 1_000_003 + step * 1_009 + rank)
    uniform = g.random() < (0.9 if decode_step else 0.2)
    if g.random() < 0.04:
        tokens = 0
    elif uniform:
        tokens = g.randint(1, 48)  # decode threshold 8
    else:
        tokens = g.randint(1, 128)  # prefill threshold 24
    padded = tokens + g.choice([0, 0, 0, 1, 5])
    allow = g.random() > 0.03
    prefer = g.random() > 0.03
    return tokens, uniform, allow, prefer, padded


def _expected(inputs, config: DboConfig):
    """Independent re-statement of the vote rules, from all ranks' inputs."""
    tokens = [i[0] for i in inputs]
    padded = max(i[4] for i in inputs)
    n = config.num_ubatches
    if config.split == "never" or not all(i[2] for i in inputs):
        split = False
    elif config.split == "always":
        split = min(tokens) >= n
    else:
        th = config.decode_token_threshold if all(i[1] for i in inputs) else config.prefill_token_threshold
        split = min(tokens) >= th and all(i[3] for i in inputs)
    if split:
        padded = (padded + n - 1) // n * n
    return split, padded, tokens


def _random_steps_worker(rank, world_size, seed, steps, split_mode):
    import torch.distributed as dist

    group = dist.new_group(backend="gloo")
    config = DboConfig(split=split_mode, **SMALL)
    out = []
    for step in range(steps):
        tokens, uniform, allow, prefer, padded = _step_inputs(seed, step, rank)
        r = coordinate_across_dp(
            tokens, uniform_decode=uniform, allow_split=allow, config=config, group=group,
            fingerprint="schedule-v1", prefer_split=prefer, num_tokens_padded=padded,
        )
        bounds = None
        if r.should_split:
            counts = [1] * tokens if uniform else ([tokens] if tokens else [])
            _, padded_slices = make_ubatch_slices(counts, r.num_tokens_padded, config.num_ubatches)
            bounds = [(p.token_slice.start, p.token_slice.stop) for p in padded_slices]
        out.append((r.should_split, r.num_tokens_padded, r.num_tokens_across_dp, bounds))
    return out


@pytest.mark.multirank
@pytest.mark.parametrize("world_size, split_mode", [(2, "auto"), (4, "auto"), (4, "always")])
def test_multirank_random_steps_agree(world_size, split_mode):
    seed, steps = 1234 + world_size, 500
    results = run_multirank(_random_steps_worker, world_size, args=(seed, steps, split_mode), timeout_s=90)
    config = DboConfig(split=split_mode, **SMALL)
    n_split = 0
    for step in range(steps):
        inputs = [_step_inputs(seed, step, r) for r in range(world_size)]
        split, padded, tokens = _expected(inputs, config)
        per_rank = [results[r][step] for r in range(world_size)]
        assert all(p == per_rank[0] for p in per_rank), (step, inputs, per_rank)
        got_split, got_padded, got_tokens, bounds = per_rank[0]
        assert (got_split, got_padded, got_tokens) == (split, padded, tokens), (step, inputs)
        if split:
            n_split += 1
            assert bounds == [(0, padded // 2), (padded // 2, padded)]
    # both outcomes must be exercised, or the test proves nothing
    assert 20 <= n_split <= steps - 20, n_split


def _mismatch_worker(rank, world_size):
    import torch.distributed as dist

    group = dist.new_group(backend="gloo")
    cfg = DboConfig(**SMALL)
    outcomes = []
    scenarios = [
        ("fingerprint", dict(fingerprint="B" if rank == 2 else "A")),
        ("config", dict(config=cfg.replace(prefill_token_threshold=30) if rank == 1 else cfg)),
        ("invalid", dict(num_tokens_padded=3 if rank == 3 else None)),
    ]
    for name, kw in scenarios:
        kw.setdefault("config", cfg)
        try:
            coordinate_across_dp(10, uniform_decode=True, allow_split=True, group=group, **kw)
            outcomes.append((name, None))
        except DpVoteError as e:
            outcomes.append((name, str(e)))
    # the group is still in step after every rank raised
    r = coordinate_across_dp(10 + rank, uniform_decode=True, allow_split=True, config=cfg, group=group)
    outcomes.append(("after", (r.should_split, r.num_tokens_padded)))
    return outcomes


@pytest.mark.multirank
def test_multirank_mismatch_raises_on_every_rank():
    results = run_multirank(_mismatch_worker, 4, timeout_s=60)
    for rank, outcomes in enumerate(results):
        got = dict(outcomes)
        assert got["fingerprint"] is not None and "ranks [2] have" in got["fingerprint"], (rank, got)
        assert "ranks [0, 1, 3] have" in got["fingerprint"]
        assert got["config"] is not None and "DboConfig fingerprints" in got["config"]
        assert "ranks [1] have" in got["config"]
        assert got["invalid"] is not None and "ranks [3] passed invalid inputs" in got["invalid"]
        assert got["after"] == (True, 14)


# --------------------------------------------------------------------------- vetoes
BS = 4


def _md(qlens, computed, block_table, slots) -> AttentionMetadata:
    qsl = [0]
    for q in qlens:
        qsl.append(qsl[-1] + q)
    seq = [c + q for c, q in zip(computed, qlens)]
    return AttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq, dtype=torch.int32),
        num_computed_tokens=torch.tensor(computed, dtype=torch.int32),
        block_table=torch.tensor(block_table, dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        max_query_len=max(qlens), max_seq_len=max(seq),
    ).validate()


def _slots(block, start, n):
    return [block * BS + start + i for i in range(n)]


def test_prefix_read_veto_fires_when_another_request_writes_a_read_block():
    # request 0 computes block 7 (a shared prefix) while request 1 already reads blocks 7, 8
    md = _md([4, 2], [0, 8], [[7, 0, 0], [7, 8, 9]], _slots(7, 0, 4) + _slots(9, 0, 2))
    reason = prefix_read_veto(md, [4, 2], BS)
    assert reason is not None and "request 1 reads KV block 7" in reason and "request 0 writes" in reason


def test_prefix_read_veto_takes_the_callers_host_counts(monkeypatch):
    """The vote already read the counts (one device read, a host sync on CUDA): the veto reads
    them from the host copy it is given, with the same reason."""
    md = _md([4, 2], [0, 8], [[7, 0, 0], [7, 8, 9]], _slots(7, 0, 4) + _slots(9, 0, 2))
    host = md.host_fields()
    expected = check_vetoes(md, [4, 2], block_size=BS)
    monkeypatch.setattr(type(md), "host_fields", lambda self: pytest.fail("read the device"))
    assert expected is not None
    assert check_vetoes(md, [4, 2], block_size=BS, host=host) == expected


def test_prefix_read_veto_partial_block_own_blocks_and_padding_do_not_fire():
    # request 1 has 6 computed tokens: only block 7 is whole; request 0 writes block 8 -> no veto
    md = _md([4, 2], [0, 6], [[8, 0, 0], [7, 8, 0]], _slots(8, 0, 4) + _slots(8, 2, 2))
    assert prefix_read_veto(md, [4, 2], BS) is None
    # each request writes its own next block: no veto
    md = _md([3, 2], [8, 4], [[1, 2, 3], [5, 6, 0]], _slots(3, 0, 3) + _slots(6, 0, 2))
    assert prefix_read_veto(md, [3, 2], BS) is None
    # padding rows (-1) write nothing, block -1 // BS never matches
    md = _md([1, 1], [4, 4], [[0, 1], [5, 6]], _slots(1, 0, 1) + _slots(6, 0, 1) + [-1, -1])
    assert prefix_read_veto(md, [1, 1], BS) is None
    # one request: nothing else writes
    md = _md([2], [8], [[1, 2, 3]], _slots(3, 0, 2))
    assert prefix_read_veto(md, [2], BS) is None


def test_prefix_read_veto_rejects_bad_inputs():
    md = _md([4, 2], [0, 8], [[7, 0, 0], [7, 8, 9]], _slots(7, 0, 4) + _slots(9, 0, 2))
    with pytest.raises(MetadataError, match="disagree"):
        prefix_read_veto(md, [3, 3], BS)
    with pytest.raises(MetadataError, match="block_size"):
        prefix_read_veto(md, [4, 2], 0)


def test_check_vetoes_order_registry_and_vote():
    clash = _md([4, 2], [0, 8], [[7, 0, 0], [7, 8, 9]], _slots(7, 0, 4) + _slots(9, 0, 2))
    fine = _md([3, 2], [8, 4], [[1, 2, 3], [5, 6, 0]], _slots(3, 0, 3) + _slots(6, 0, 2))
    registry = VetoRegistry()
    calls = []

    @registry.add
    def lora(md, n):
        calls.append("lora")
        return "lora adapters in batch" if md.num_reqs == 2 and n == [4, 2] else None

    def broken(md, n):
        raise RuntimeError("boom")

    assert check_vetoes(fine, [3, 2], block_size=BS, vetoes=registry) is None
    assert calls == ["lora"]
    first = check_vetoes(clash, [4, 2], block_size=BS, vetoes=registry)
    assert first.startswith("prefix_read:")
    assert check_vetoes(clash, [4, 2], vetoes=registry) == "lora: lora adapters in batch"
    registry.add(broken)
    reason = check_vetoes(fine, [3, 2], vetoes=registry)
    assert reason == "broken: veto raised RuntimeError: boom"
    registry.remove("broken")
    assert registry.names() == ["lora"]
    with pytest.raises(KeyError):
        registry.remove("broken")
    # the reason feeds allow_split: a veto stops an otherwise splittable step
    allow = check_vetoes(clash, [4, 2], block_size=BS) is None
    assert vote(600, allow=True).should_split and not vote(600, allow=allow).should_split


def test_prefix_read_veto_reads_the_host_mirrors_only():
    """With the host mirrors of slot_mapping and block_table (and the counts), the veto reads
    no device tensor, and finds the same reason (or none) as from the device."""
    from dbo_compile.testing import count_host_reads

    clash = _md([4, 2], [0, 8], [[7, 0, 0], [7, 8, 9]], _slots(7, 0, 4) + _slots(9, 0, 2))
    fine = _md([3, 2], [8, 4], [[1, 2, 3], [5, 6, 0]], _slots(3, 0, 3) + _slots(6, 0, 2))
    for md, counts in ((clash, [4, 2]), (fine, [3, 2])):
        expected = prefix_read_veto(md, counts, BS)
        mirrored = md.with_host_mirrors()
        with count_host_reads(*md.tensors().values()) as reads:
            got = prefix_read_veto(mirrored, counts, BS)
        assert reads.calls == [] and got == expected
    assert prefix_read_veto(clash, [4, 2], BS) is not None


@pytest.mark.parametrize("bs", [BS, 3])  # a power of two (shifts) and not
def test_prefix_read_veto_matches_a_brute_force_search(bs):
    """The veto's vector search (a marker over block ids; torch.isin for negative or huge ids)
    against the rule spelled out per request and block, on random steps with shared blocks."""
    rng = random.Random(bs)
    outcomes = set()
    for case in range(300):
        num_reqs = rng.randint(2, 6)
        qlens = [rng.randint(1, 6) for _ in range(num_reqs)]
        computed = [rng.randint(0, 12) for _ in range(num_reqs)]
        width = max(-(-(c + q) // bs) for c, q in zip(computed, qlens))
        pool = [rng.randint(0, 9) for _ in range(6)] + ([2**30] if case % 5 == 0 else [])
        pad = -1 if case % 7 == 0 else 0
        table = [[rng.choice(pool) for _ in range(-(-(c + q) // bs))] for c, q in zip(computed, qlens)]
        table = [row + [pad] * (width - len(row)) for row in table]
        slots = [table[i][p // bs] * bs + p % bs
                 for i, (c, q) in enumerate(zip(computed, qlens)) for p in range(c, c + q)]
        slots = [s if rng.random() > 0.1 else -1 for s in slots]
        md = _md(qlens, computed, table, slots)
        writers = {}
        t = 0
        for i, q in enumerate(qlens):
            for s in slots[t:t + q]:
                if s >= 0:
                    writers.setdefault(s // bs, set()).add(i)
            t += q
        clash = any(writers.get(table[i][k], set()) - {i}
                    for i in range(num_reqs) for k in range(computed[i] // bs))
        got = prefix_read_veto(md, qlens, bs)
        assert (got is not None) == clash, (case, got)
        assert prefix_read_veto(md.with_host_mirrors(), qlens, bs) == got
        outcomes.add(clash)
    assert outcomes == {True, False}
