"""Runtime guards through the compiled model: DP vote over Gloo, thresholds, vetoes, padding,
mismatched programs, and a failing ubatch (issue 4)."""

from __future__ import annotations

import random

import pytest
import torch

from conftest import last_artifact
from dbo_compile.models.batch import fill_kv_cache, make_step
from dbo_compile.models.deepseek import DeepseekMoEModel, get_config
from dbo_compile.runtime.engine import run_step
from dbo_compile.metadata import AttentionMetadata
from dbo_compile.testing import run_multirank
from moe_cases import eager_then_restore
from shared_ranks import SharedRanks

NUM_BLOCKS = 320


def _model(group=None, layers=1):
    cfg = get_config("tiny", num_layers=layers)
    model = DeepseekMoEModel(cfg, ep_group=group, seed=0)
    model.allocate_kv_cache(NUM_BLOCKS, 16)
    return cfg, model


def _random_step(cfg, rng: random.Random, seed: int, pad_to=None):
    kind = rng.choice(["zero", "decode", "decode", "mixed"])
    if kind == "zero":
        dec, pre = [], []
    elif kind == "decode":
        dec, pre = [rng.randint(1, 60) for _ in range(rng.randint(1, 48))], []
    else:
        dec = [rng.randint(1, 60) for _ in range(rng.randint(0, 12))]
        pre = [(rng.choice([0, 16, 21]), rng.randint(2, 30)) for _ in range(rng.randint(1, 2))]
    return make_step(cfg, decode_context_lens=dec, prefills=pre, block_size=16,
                     num_blocks=NUM_BLOCKS, seed=seed, pad_to=pad_to)


def _expected(counts, uniform, cfg):
    """The vote rule, recomputed independently from every rank's step."""
    thr = cfg["decode_token_threshold"] if all(uniform) else cfg["prefill_token_threshold"]
    return all(c >= thr for c in counts)


OPTIONS = {"decode_token_threshold": 8, "prefill_token_threshold": 24}


def _dp_steps_body(rank, world_size, num_steps, seed):
    import torch.distributed as dist

    from dbo_compile.backend import register
    from dbo_compile.runtime.program import last_called

    register()
    cfg, model = _model(dist.group.WORLD)
    compiled = torch.compile(model, backend="dbo", options=OPTIONS)
    decisions, max_err = [], 0.0
    for i in range(num_steps):
        rng = random.Random(seed * 100003 + i * 31 + rank)  # only this rank's own counts
        step = _random_step(cfg, rng, seed=i * 7 + rank)
        # eager reference: every rank pads to the group max, as the vote does
        n = torch.tensor([step.num_tokens])
        dist.all_reduce(n, op=dist.ReduceOp.MAX)
        ref_step = _random_step(cfg, random.Random(seed * 100003 + i * 31 + rank),
                                seed=i * 7 + rank, pad_to=int(n))
        fill_kv_cache(model, step, seed=i)
        eager, _ = eager_then_restore(model, ref_step)
        with torch.no_grad():
            out = run_step(compiled, step.input_ids, step.positions, step.attn_metadata,
                           step.num_scheduled_tokens, block_size=16)
        assert out.shape[0] == step.num_tokens
        if step.num_tokens:
            max_err = max(max_err, (out - eager[:step.num_tokens]).abs().max().item())
        vote = last_called().last_vote
        decisions.append((vote.should_split, vote.num_tokens_padded, step.num_actual_tokens,
                          step.is_uniform_decode))
    return {"decisions": decisions, "max_err": max_err}


@pytest.mark.multirank
@pytest.mark.parametrize("world_size,num_steps", [
    (2, 120), (4, 80),  # both paths, every guard; the soak (slow tier) runs thousands
    pytest.param(2, 500, marks=pytest.mark.slow), pytest.param(4, 500, marks=pytest.mark.slow)])
def test_dp_ranks_agree_every_step_and_match_eager(world_size, num_steps):
    results = run_multirank(_dp_steps_body, world_size, args=(num_steps, world_size),
                            timeout_s=600)
    splits = 0
    for i in range(num_steps):
        per_rank = [r["decisions"][i] for r in results]
        assert len({(d[0], d[1]) for d in per_rank}) == 1, (i, per_rank)  # one decision
        counts = [d[2] for d in per_rank]
        uniform = [d[3] for d in per_rank]
        expected = _expected(counts, uniform, OPTIONS)
        assert per_rank[0][0] == expected, (i, per_rank)
        assert per_rank[0][1] >= max(counts)
        splits += expected
    assert 2 <= splits <= num_steps - 2, splits  # both paths exercised (splits are rarer at 4 ranks)
    for r in results:
        assert r["max_err"] <= 1e-5


@pytest.mark.parametrize("tokens,split", [(31, False), (32, True), (33, True)])
def test_decode_threshold_boundary(tokens, split):
    cfg, model = _model()
    step = make_step(cfg, decode_context_lens=[40] * tokens, prefills=[], block_size=16,
                     num_blocks=NUM_BLOCKS)
    compiled = torch.compile(model, backend="dbo")
    with torch.no_grad():
        run_step(compiled, step.input_ids, step.positions, step.attn_metadata,
                 step.num_scheduled_tokens)
    assert last_artifact().stats.split_steps == int(split)


def test_prefix_read_veto_keeps_the_step_unsplit():
    cfg, model = _model()
    step = make_step(cfg, decode_context_lens=[40] * 40, prefills=[], block_size=16,
                     num_blocks=NUM_BLOCKS)
    md = step.attn_metadata
    # request 0 reads (as cached prefix) a whole block that request 39 writes this step
    written_block = int(md.slot_mapping[39]) // 16
    own_block = int(md.block_table[0, 0])
    md.block_table[0, 0] = written_block
    compiled = torch.compile(model, backend="dbo")
    with torch.no_grad():
        run_step(compiled, step.input_ids, step.positions, md, step.num_scheduled_tokens,
                 block_size=16)
    art = last_artifact()
    assert art.stats.unsplit_steps == 1 and "prefix_read" in art.stats.last_decision
    # an engine veto works the same way (on a step the prefix-read veto, which now runs
    # without block_size too, passes)
    md.block_table[0, 0] = own_block
    with torch.no_grad():
        run_step(compiled, step.input_ids, step.positions, md, step.num_scheduled_tokens,
                 vetoes=[lambda m, n: "engine says no"])
    assert art.stats.unsplit_steps == 2 and "engine says no" in art.stats.last_decision


def _mismatch_body(rank, world_size):
    import torch.distributed as dist

    from dbo_compile import DpVoteError
    from dbo_compile.backend import register

    register()
    cfg, model = _model(dist.group.WORLD, layers=1 + rank)  # different programs per rank
    step = make_step(cfg, decode_context_lens=[40] * 40, prefills=[], block_size=16,
                     num_blocks=NUM_BLOCKS)
    compiled = torch.compile(model, backend="dbo")
    try:
        with torch.no_grad():
            run_step(compiled, step.input_ids, step.positions, step.attn_metadata,
                     step.num_scheduled_tokens)
    except Exception as e:  # noqa: BLE001
        cause = e
        while cause is not None and not isinstance(cause, DpVoteError):
            cause = cause.__cause__ or cause.__context__
        return type(cause).__name__ if cause is not None else repr(e)
    return "no error"


@pytest.mark.multirank
def test_rank_with_a_different_program_fails_loudly(request):
    results = RANKS.results(request, _mismatch_body)
    assert results == ["DpVoteError", "DpVoteError"]


def test_bad_metadata_is_a_clear_error_not_a_wrong_answer():
    cfg, model = _model()
    step = make_step(cfg, decode_context_lens=[40] * 40, prefills=[], block_size=16,
                     num_blocks=NUM_BLOCKS)
    md = step.attn_metadata
    seq_lens = md.seq_lens.clone()
    seq_lens[3] = 0  # shorter than its query
    bad = AttentionMetadata(md.query_start_loc, seq_lens, md.num_computed_tokens,
                            md.block_table, md.slot_mapping, md.max_query_len, md.max_seq_len)
    compiled = torch.compile(model, backend="dbo")
    with pytest.raises(Exception, match="seq_lens .* shorter than the query lens"):
        with torch.no_grad():
            run_step(compiled, step.input_ids, step.positions, bad, step.num_scheduled_tokens)


_FAIL = {"on": False}


@torch.library.custom_op("dbo_test::maybe_fail", mutates_args=())
def maybe_fail(x: torch.Tensor) -> torch.Tensor:
    if _FAIL["on"] and x.shape[0] < 48:  # only inside a ubatch
        raise RuntimeError("injected failure in one ubatch")
    return x.clone()


@maybe_fail.register_fake
def _(x):
    return torch.empty_like(x)


def test_exception_in_one_ubatch_surfaces_and_next_step_works():
    from dbo_compile import UBatchExecutionError
    from dbo_compile.ops.registry import register_row_local

    register_row_local(torch.ops.dbo_test.maybe_fail.default)
    cfg, model = _model()
    orig = model.norm.forward
    model.norm.forward = lambda x: orig(torch.ops.dbo_test.maybe_fail(x))
    step = make_step(cfg, decode_context_lens=[40] * 64, prefills=[], block_size=16,
                     num_blocks=NUM_BLOCKS)
    compiled = torch.compile(model, backend="dbo")
    with torch.no_grad():
        ref = model(step.input_ids, step.positions, step.attn_metadata)
        _FAIL["on"] = True
        try:
            with pytest.raises(UBatchExecutionError, match="injected failure"):
                compiled(step.input_ids, step.positions, step.attn_metadata)
        finally:
            _FAIL["on"] = False
        out = compiled(step.input_ids, step.positions, step.attn_metadata)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    assert last_artifact().stats.split_steps == 2


class _MixesTokens(DeepseekMoEModel):
    """Unsplittable (normalises over the token dim) but still issues EP collectives."""

    def forward(self, input_ids, positions, attn_metadata):
        out = super().forward(input_ids, positions, attn_metadata)
        return out - out.amax(dim=0, keepdim=True)


def _unsplittable_uneven_body(rank, world_size):
    import torch.distributed as dist

    from dbo_compile.backend import register
    from dbo_compile.errors import DpVoteError
    from dbo_compile.runtime.program import last_called

    register()
    cfg = get_config("tiny", num_layers=1)
    model = _MixesTokens(cfg, ep_group=dist.group.WORLD, seed=0)
    model.allocate_kv_cache(NUM_BLOCKS, 16)
    compiled = torch.compile(model, backend="dbo")
    done = []
    for n in ([3, 8], [8, 5], [6, 6]):
        step = make_step(cfg, decode_context_lens=[40] * n[rank], prefills=[], block_size=16,
                         num_blocks=NUM_BLOCKS)
        try:
            with torch.no_grad():
                out = run_step(compiled, step.input_ids, step.positions, step.attn_metadata,
                               step.num_scheduled_tokens)
        except DpVoteError as e:
            done.append(("DpVoteError", str(e)))
            continue
        art = last_called()
        done.append((out.shape[0], type(art).__name__, art.last_vote.num_tokens_padded))
    check = torch.tensor([rank + 1.0])
    dist.all_reduce(check)  # every rank left each step at the same collective
    return done, float(check)


@pytest.mark.multirank
def test_unsplittable_graph_still_votes_and_refuses_padding_that_would_change_it(request):
    """A graph compiled unsplit still issues collectives: it must vote like the split ones, or
    ranks with different token counts crash or deadlock in all_to_all. This one mixes tokens
    (``amax`` over the token dim), so padding a rank's rows to the group's count changes its
    real rows (it was padded, nothing said: issue 29): every rank raises the same
    ``DpVoteError`` naming the padded rank, none hangs; equal counts run."""
    results = RANKS.results(request, _unsplittable_uneven_body)
    for rank, (done, check) in enumerate(results):
        assert check == 3.0
        for (kind, msg), padded in zip(done[:2], ([0], [1])):
            assert kind == "DpVoteError" and f"ranks {padded}" in msg, msg
            assert ("this rank cannot be padded" in msg) == (padded == [rank]), msg
        assert done[2] == (6, "UnsplitArtifact", 6), done


#: per path, the compiled program of each rank's step: split (``split="always"``), the split
#: artifact's unsplit program (``"never"``), an artifact compiled unsplit (``_MixesTokens``)
_PATHS = {"split": "always", "unsplit": "never", "unsplittable": "always"}


def _collectives_body(rank, world_size, path):
    """Per scenario: this rank's model, one step per ``(tokens, allow_split)`` of it, then an
    all-reduce that would hang or mismatch if a rank had entered a collective of the step
    the other did not. Returns ``{scenario: [outcome per step]}``."""
    import torch.distributed as dist

    from dbo_compile.backend import register
    from dbo_compile.errors import DboError
    from dbo_compile.runtime.program import last_called

    register()
    unsplittable = path == "unsplittable"
    # a graph compiled unsplit that mixes tokens cannot be padded to another rank's count
    # (test_unsplittable_graph_still_votes_and_refuses_padding_that_would_change_it): its
    # ranks get equal counts
    uneven = 0 if unsplittable else rank
    scenarios = {  # name: (class, dtype, hidden size) of this rank's model, steps
        "same": ((_MixesTokens if unsplittable else DeepseekMoEModel, torch.float32, 64),
                 [(32 + uneven, True), ((0, 33)[rank] if not unsplittable else 24, True),
                  (40, rank == 0)]),
        "dtype": ((_MixesTokens if unsplittable else DeepseekMoEModel,
                   (torch.float32, torch.bfloat16)[rank], 64), [(32 + uneven, True)]),
        "hidden": ((_MixesTokens if unsplittable else DeepseekMoEModel, torch.float32,
                    (64, 96)[rank]), [(32 + uneven, True)]),
    }
    if unsplittable:  # rank 0 compiled unsplit, rank 1 split: the same collectives
        scenarios["mixed"] = (((_MixesTokens, DeepseekMoEModel)[rank], torch.float32, 64),
                              [(32, True), (20, True)])
    results = {}
    for name, ((cls, dtype, hidden), steps) in scenarios.items():
        torch._dynamo.reset()
        cfg = get_config("tiny", num_layers=1, hidden_size=hidden)
        model = cls(cfg, ep_group=dist.group.WORLD, dtype=dtype, seed=0)
        model.allocate_kv_cache(NUM_BLOCKS, 16)
        compiled = torch.compile(model, backend="dbo", options={
            "split": _PATHS[path], "schedule_candidates": False})
        done = []
        for tokens, allow in steps:
            step = make_step(cfg, decode_context_lens=[40] * (tokens // 2),
                             prefills=[(0, tokens - tokens // 2)] if tokens else [],
                             block_size=16, num_blocks=NUM_BLOCKS)
            try:
                with torch.no_grad():
                    out = run_step(compiled, step.input_ids, step.positions, step.attn_metadata,
                                   step.num_scheduled_tokens, allow_split=allow)
                art = last_called()
                done.append(("ran", type(art).__name__, art.last_vote.should_split,
                             tuple(out.shape)))
            except DboError as e:
                done.append((type(e).__name__, str(e)))
        check = torch.tensor([rank + 1.0])
        dist.all_reduce(check)  # every rank left the step at the same collective
        results[name] = (done, float(check))
    return results


@pytest.mark.multirank
@pytest.mark.parametrize("path", sorted(_PATHS))
def test_ranks_whose_models_differ_in_dtype_or_hidden_size_fail_the_vote(request, path):
    """Two ranks whose models differ in dtype (fp32 / bf16) or hidden size (64 / 96) issue
    the same order of collectives, which is all the vote compared: Gloo then aborted one
    process in the first all-to-all (``EnforceNotMet``, SIGABRT) and the other got a
    connection reset. Now every rank raises the same ``DpVoteError`` before the step's first
    collective, on the split path, the unsplit one and a graph compiled unsplit; equal models
    still run, also when a rank has 0 tokens or vetoes the split, and a rank compiled unsplit
    runs with one compiled split (the same collectives)."""
    results = RANKS.results(request, _collectives_body, path)
    for name in ("dtype", "hidden"):
        outcomes = [r[name][0] for r in results]
        assert outcomes[0] == outcomes[1], (name, outcomes)  # the same error on every rank
        (kind, msg), = outcomes[0]
        assert kind == "DpVoteError" and "collectives" in msg and "same model" in msg, msg
    for name in ("same", "mixed") if path == "unsplittable" else ("same",):
        for rank, r in enumerate(results):
            done = r[name][0]
            assert all(d[0] == "ran" for d in done), (name, rank, done)
            if path == "split" and name == "same":
                assert [d[2] for d in done] == [True, False, False], done
    assert all(check == 3.0 for r in results for _, check in r.values()), results


def _shared_prefix_step(cfg):
    """Request 0 reads as cached prefix 2 whole blocks (32 of its 36 tokens) that request 1, a
    fresh 32-token prompt, writes this step: split, the read (ubatch 0) could run before the
    write (ubatch 1)."""
    step = make_step(cfg, decode_context_lens=[], prefills=[(32, 4), (0, 32)], block_size=16,
                     num_blocks=NUM_BLOCKS, seed=0)
    step.attn_metadata.block_table[0, :2] = step.attn_metadata.block_table[1, :2]
    return step


@pytest.mark.parametrize("entry", ["run_step", "direct", "runner"])
def test_prefix_read_veto_takes_the_block_size_from_the_kv_cache(entry):
    """Without ``block_size`` the veto used not to run at all (run_step's default, the
    README's direct call, CudaGraphRunner's default): the step split and the reader's rows
    were wrong. The block size is dim 2 of the graph's KV cache."""
    from dbo_compile.runtime.cudagraph_runner import CudaGraphRunner
    from dbo_compile.runtime.program import last_called

    cfg, model = _model(layers=2)
    step = _shared_prefix_step(cfg)
    fill_kv_cache(model, step, seed=1)  # stale values in the shared blocks
    eager, _ = eager_then_restore(model, step)
    compiled = torch.compile(model, backend="dbo",
                             options={"split": "always", "schedule_candidates": False})
    ids, pos, md, q = step.input_ids, step.positions, step.attn_metadata, step.num_scheduled_tokens
    saved = [c.clone() for c in model.kv_caches()]
    with torch.no_grad():
        if entry == "run_step":
            out = run_step(compiled, ids, pos, md, q)
        elif entry == "direct":
            out = compiled(ids, pos, md)
        else:
            runner = CudaGraphRunner(compiled, buckets=[36], timing_iters=1, device="cpu",
                                     max_blocks_per_req=md.block_table.shape[1])
            runner.capture()
            for c, s in zip(model.kv_caches(), saved):
                c.copy_(s)
            out = runner(ids, pos, md, q)
    vote = last_called().last_vote
    print(entry, vote.should_split, last_called().stats.last_decision[:90])
    assert last_called().kv_block_sizes == (16,)
    assert not vote.should_split and "prefix-read veto" in last_called().stats.last_decision
    torch.testing.assert_close(out, eager, rtol=0, atol=1e-5)


def test_block_size_that_disagrees_with_the_kv_cache_is_a_vote_error():
    from dbo_compile import DpVoteError

    cfg, model = _model()
    step = _shared_prefix_step(cfg)
    compiled = torch.compile(model, backend="dbo", options={"split": "always"})
    with torch.no_grad(), pytest.raises(DpVoteError, match="block_size=32 passed.*block size 16"):
        run_step(compiled, step.input_ids, step.positions, step.attn_metadata,
                 step.num_scheduled_tokens, block_size=32)


def test_unknown_block_size_vetoes_steps_with_cached_prefixes_and_warns(monkeypatch, caplog):
    """A graph reading the block table through an op whose block size is unknown: a step of
    several requests with cached tokens runs unsplit (conservative) and a WARNING says what to
    pass; a step of fresh prompts still splits."""
    import dataclasses
    import logging

    from dbo_compile.ops import registry

    op = torch.ops.dbo.attention.default
    monkeypatch.setitem(registry._REGISTRY, op,
                        dataclasses.replace(registry.op_info(op), kv_cache_arg=None))
    cfg, model = _model()
    step = _shared_prefix_step(cfg)
    fresh = make_step(cfg, decode_context_lens=[], prefills=[(0, 20), (0, 20)], block_size=16,
                      num_blocks=NUM_BLOCKS)
    compiled = torch.compile(model, backend="dbo", options={"split": "always"})
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="dbo_compile"):
        run_step(compiled, step.input_ids, step.positions, step.attn_metadata,
                 step.num_scheduled_tokens)
        art = last_artifact()
        assert art.kv_block_sizes == () and art.stats.unsplit_steps == 1
        assert "without a KV block size" in art.stats.last_decision
        run_step(compiled, fresh.input_ids, fresh.positions, fresh.attn_metadata,
                 fresh.num_scheduled_tokens)
        assert art.stats.split_steps == 1
    assert caplog.text.count("needs the KV block size") == 1


class _BreakingModel(DeepseekMoEModel):
    """A graph break after every decoder layer (a print, a host read, an unsupported call)."""

    def forward(self, input_ids, positions, attn_metadata):
        import torch.nn.functional as F

        x = F.embedding(input_ids, self.embed_tokens)
        for layer in self.layers:
            x = layer(x, positions, attn_metadata)
            torch._dynamo.graph_break()
        return F.linear(self.norm(x), self.lm_head).to(torch.float32)


def test_graph_break_counts_steps_not_calls():
    """The loop body after a break is one artifact called once per layer: one step of 4
    layers counted split_steps=[4, 0]; steps count once per artifact, calls separately."""
    from dbo_compile.backend import compiled_artifacts

    cfg = get_config("tiny", num_layers=4)
    model = _BreakingModel(cfg, seed=0)
    model.allocate_kv_cache(NUM_BLOCKS, 16)
    step = make_step(cfg, decode_context_lens=[30] * 8, prefills=[(0, 24)], block_size=16,
                     num_blocks=NUM_BLOCKS)
    fill_kv_cache(model, step, seed=1)
    eager, _ = eager_then_restore(model, step)
    compiled = torch.compile(model, backend="dbo", options={"split": "always",
                                                            "schedule_candidates": False})
    with torch.no_grad():
        for _ in range(2):
            out = run_step(compiled, step.input_ids, step.positions, step.attn_metadata,
                           step.num_scheduled_tokens)
    stats = [a.stats for a in compiled_artifacts()]
    print([(s.split_steps, s.unsplit_steps, s.calls) for s in stats])
    assert all(s.split_steps + s.unsplit_steps == 2 for s in stats)
    assert max(s.calls for s in stats) >= 6  # the layer graph ran 3-4 times per step
    torch.testing.assert_close(out, eager, rtol=0, atol=1e-5)


def test_runner_refuses_a_model_with_graph_breaks():
    """Under run_step each graph of a broken model votes and runs on its own (above); a FULL
    CUDA graph needs the whole step in one graph, so capture refuses it with the way out,
    before capturing anything (not a replay that serves part of the step)."""
    from dbo_compile.runtime.cudagraph_runner import CudaGraphRunner, GraphRunnerError

    cfg = get_config("tiny", num_layers=2)
    model = _BreakingModel(cfg, seed=0)
    model.allocate_kv_cache(NUM_BLOCKS, 16)
    compiled = torch.compile(model, backend="dbo", options={"schedule_candidates": False})
    runner = CudaGraphRunner(compiled, buckets=[16], max_blocks_per_req=8, block_size=16,
                             timing_iters=1, device="cpu")
    with pytest.raises(GraphRunnerError, match=r"one step ran [3-9] compiled graphs.*remove "
                                               r"the graph breaks"):
        runner.capture()
    assert not runner.graphs


# the two-rank tests' bodies run on one group of 2 ranks, launched once (tests/shared_ranks.py)
RANKS = SharedRanks(2, timeout_s=600, calls={
    "test_rank_with_a_different_program_fails_loudly": (_mismatch_body, ()),
    "test_unsplittable_graph_still_votes_and_refuses_padding_that_would_change_it":
        (_unsplittable_uneven_body, ()),
    **{f"test_ranks_whose_models_differ_in_dtype_or_hidden_size_fail_the_vote[{p}]":
       (_collectives_body, (p,)) for p in sorted(_PATHS)},
})
