"""Per-bucket graphs and the measured split decision (runtime/cudagraph_runner.py), on CPU.

On CPU a "graph" re-runs its program on the captured static buffers, so these tests check the
plumbing a CUDA graph depends on: every input of a new step reaches the static buffers (tokens
padded to the bucket, requests padded with zero-length ones, metadata cut per ubatch), the
output equals eager, nothing is captured after warm-up, and every DP rank holds the same table.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import random

import pytest
import torch

from dbo_compile.models.batch import fill_kv_cache, make_step
from dbo_compile.models.deepseek import DeepseekMoEModel, get_config
from dbo_compile.runtime.cudagraph_runner import CudaGraphRunner, GraphRunnerError
from moe_cases import CountingModel, eager_then_restore, model_state
from shared_ranks import SharedRanks

NUM_BLOCKS = 320
BUCKETS = [16, 48]


def _model(group=None, layers=2):
    cfg = get_config("tiny", num_layers=layers)
    model = DeepseekMoEModel(cfg, ep_group=group, seed=0)
    model.allocate_kv_cache(NUM_BLOCKS, 16)
    return cfg, model


def _step(cfg, rng, seed, pad_to=None):
    kind = rng.choice(["zero", "decode", "mixed", "big"])
    if kind == "zero":
        dec, pre = [], []
    elif kind == "decode":
        dec, pre = [rng.randint(1, 60) for _ in range(rng.randint(1, 40))], []
    elif kind == "mixed":
        dec = [rng.randint(1, 60) for _ in range(rng.randint(0, 10))]
        pre = [(rng.choice([0, 16, 21]), rng.randint(2, 14)) for _ in range(rng.randint(1, 2))]
    else:  # larger than the largest bucket: eager path
        dec, pre = [], [(0, 60)]
    return make_step(cfg, decode_context_lens=dec, prefills=pre, block_size=16,
                     num_blocks=NUM_BLOCKS, seed=seed, pad_to=pad_to)


def _runner_body(rank, world_size, split, num_steps):
    import torch.distributed as dist

    from dbo_compile.backend import compiled_artifacts, register

    register()
    cfg, model = _model(dist.group.WORLD)
    compiled = torch.compile(model, backend="dbo", options={"split": split})
    runner = CudaGraphRunner(compiled, BUCKETS, max_blocks_per_req=8, block_size=16,
                             timing_iters=2)
    runner.capture()
    table = {t: b.use_split for t, b in runner.graphs.items()}
    max_err, choices, graph_step_compiles = 0.0, [], 0
    for i in range(num_steps):
        rng = random.Random(1000 * i + rank)
        step = _step(cfg, rng, seed=i * 7 + rank)
        n = torch.tensor([step.num_tokens])
        dist.all_reduce(n, op=dist.ReduceOp.MAX)
        ref_step = _step(cfg, random.Random(1000 * i + rank), seed=i * 7 + rank, pad_to=int(n))
        fill_kv_cache(model, step, seed=i)
        eager, eager_kv = eager_then_restore(model, ref_step)
        with torch.no_grad():
            eager_before, arts_before = runner.eager_steps, len(compiled_artifacts())
            runner.last_choice = None
            out = runner(step.input_ids, step.positions, step.attn_metadata,
                         step.num_scheduled_tokens)
            if runner.eager_steps == eager_before:
                graph_step_compiles += len(compiled_artifacts()) - arts_before
        assert out.shape[0] == step.num_tokens
        if step.num_tokens:
            max_err = max(max_err, (out - eager[:step.num_tokens]).abs().max().item())
        for c, e in zip(model.kv_caches(), eager_kv):
            max_err = max(max_err, (c - e).abs().max().item())
        choices.append("eager" if runner.eager_steps > eager_before else runner.last_choice)
    return {"max_err": max_err, "choices": choices, "table": table,
            "graph_step_compiles": graph_step_compiles,
            "times": {t: (b.t_unsplit_us, b.t_split_us) for t, b in runner.graphs.items()}}


@pytest.mark.multirank
def test_runner_matches_eager_and_never_recaptures(request):
    results = RANKS.results(request, _runner_body, "always", 14)
    kinds = set()
    for r in results:
        assert r["max_err"] <= 1e-5, r["max_err"]
        assert r["table"] == {16: True, 48: True}
    for i in range(len(results[0]["choices"])):
        per_rank = [r["choices"][i] for r in results]
        assert len(set(map(str, per_rank))) == 1, (i, per_rank)  # same graph on every rank
        kinds.add(per_rank[0] if per_rank[0] == "eager" else per_rank[0][1])
    assert {"split", "eager"} <= kinds
    # steps served by a graph never reach Dynamo (no compile, no capture after warm-up)
    assert all(r["graph_step_compiles"] == 0 for r in results)


@pytest.mark.multirank
def test_measured_table_is_identical_on_every_rank(request):
    results = RANKS.results(request, _runner_body, "auto", 3)
    assert results[0]["table"] == results[1]["table"]
    assert results[0]["times"] == results[1]["times"]  # max over the DP group
    for r in results:
        assert r["max_err"] <= 1e-5


@pytest.mark.parametrize("min_gain, split_us, choice", [
    (None, 98.0, "unsplit"),  # 2 % faster: inside the default margin (MIN_GAIN, 3 %)
    (None, 96.0, "split"),
    (0.0, 99.9, "split"),
    (0.05, 96.0, "unsplit")])
def test_auto_splits_only_past_the_min_gain(monkeypatch, min_gain, split_us, choice):
    """``split="auto"`` keeps a bucket unsplit unless its fastest split candidate beat the
    unsplit graph at warm-up by ``min_gain`` (default 3 %: the timing's noise)."""
    from dbo_compile.runtime import cudagraph_runner as R

    _, model = _model(layers=1)
    compiled = torch.compile(model, backend="dbo", options={
        "split": "auto", "decode_token_threshold": 2, "prefill_token_threshold": 2,
        "schedule_candidates": False})
    runner = CudaGraphRunner(compiled, [32], max_blocks_per_req=8, timing_iters=1,
                             **({} if min_gain is None else {"min_gain": min_gain}))
    assert runner.min_gain == (R.MIN_GAIN if min_gain is None else min_gain)
    monkeypatch.setattr(runner, "_time", lambda b, names: {
        n: 100.0 if n == "unsplit" else split_us for n in names})
    runner.capture()
    b = runner.graphs[32]
    assert b.best_candidate is not None and ("split" if b.use_split else "unsplit") == choice


@pytest.mark.parametrize("bad", [-0.1, 1.0, True, False, "0.5", float("nan"), [0.1]])
def test_a_min_gain_outside_0_1_is_refused(bad):
    _, model = _model(layers=1)
    with pytest.raises(GraphRunnerError, match="min_gain"):
        CudaGraphRunner(torch.compile(model, backend="dbo"), [32], max_blocks_per_req=8,
                        min_gain=bad)


def test_a_failed_replay_leaves_no_deferred_call_in_flight():
    """The CPU stand-in of a graph replays the split program outside a step transaction: a
    step failing between an emulated op's send and its receive left the call in flight, and
    every later step was refused ("2 calls are in flight"). The replay now drains it."""
    from dbo_compile.models.batch import fill_kv_cache
    from dbo_compile.ops import emulated as E
    from dbo_compile.testing import faults
    from moe_cases import faulty_emulated_runner

    cfg, model, ref, runner = faulty_emulated_runner(layers=2, schedule_candidates=False)
    runner.capture()
    step = make_step(cfg, decode_context_lens=[20, 37, 5, 60], prefills=[(0, 20)],
                     block_size=16, num_blocks=64)
    with torch.no_grad():
        faults.arm("experts", 0)  # the first routed experts: their dispatch is in flight
        try:
            with pytest.raises(Exception):
                runner(step.input_ids, step.positions, step.attn_metadata,
                       step.num_scheduled_tokens)
        finally:
            faults.disarm()
        assert not any(any(b) for b in E.LINK.busy.values())
        for _ in range(2):
            fill_kv_cache(ref, step, seed=0)
            want = ref(step.input_ids, step.positions, step.attn_metadata)
            fill_kv_cache(model, step, seed=0)
            out = runner(step.input_ids, step.positions, step.attn_metadata,
                         step.num_scheduled_tokens)
            torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def test_split_never_keeps_every_bucket_unsplit_and_matches_eager():
    cfg, model = _model()
    compiled = torch.compile(model, backend="dbo", options={"split": "never"})
    runner = CudaGraphRunner(compiled, [8, 32], max_blocks_per_req=8, timing_iters=1)
    runner.capture()
    assert not any(b.use_split for b in runner.graphs.values())
    art = runner.graphs[32].artifact
    assert (art.stats.split_steps, art.stats.unsplit_steps) == (0, 0)  # warm-up not counted
    step = make_step(cfg, decode_context_lens=[5, 40, 17], prefills=[(16, 9)], block_size=16,
                     num_blocks=NUM_BLOCKS)
    with torch.no_grad():
        ref = model(step.input_ids, step.positions, step.attn_metadata)
        out = runner(step.input_ids, step.positions, step.attn_metadata,
                     step.num_scheduled_tokens)
    assert runner.last_choice == (32, "unsplit")
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert (art.stats.split_steps, art.stats.unsplit_steps) == (0, 1)


@pytest.mark.parametrize("static_buckets", [(), (16,)])
def test_inductor_compiles_each_program_once_for_every_bucket(monkeypatch, static_buckets):
    """Every program (the unsplit one, each distinct stage) is compiled once, with a symbolic
    token dim, and serves every bucket (issue 26); a bucket of ``static_buckets`` compiles
    its own static-shape code (as vLLM's compile_sizes). The prefill-shaped probe step of each
    bucket (it only checks that Dynamo reaches the same graph) compiles nothing; the runner
    reports per bucket which code its stages run, and served steps match eager."""
    import torch._inductor

    from dbo_compile.backend import compiled_artifacts
    from dbo_compile.codegen import inductor as ind
    from dbo_compile.codegen.inductor import InductorStage

    compiles = []
    monkeypatch.setattr(torch._inductor, "compile",
                        lambda gm, inputs: compiles.append(inputs) or gm.forward)
    cfg, model = _model(layers=1)
    compiled = torch.compile(model, backend="dbo",
                             options={"split": "always", "compute_backend": "inductor"})
    runner = CudaGraphRunner(compiled, BUCKETS, max_blocks_per_req=8, block_size=16,
                             timing_iters=1, static_buckets=static_buckets)
    runner.capture()
    art = compiled_artifacts()[-1]
    stages = {id(fn): fn for p in art.candidates.values() for fn in p.units
              if isinstance(fn, InductorStage)}.values()
    per_program = 1 + len(static_buckets)
    assert len(art.unsplit.compiled) == len(BUCKETS)
    assert art.unsplit.cache.compiles == per_program
    cache = next(iter(stages)).cache
    static_compiles = len(static_buckets) * len({s._program for s in stages if ind._symbolic_dims(s.gm) is not None})
    assert stages and all(len(s.compiled) <= len(BUCKETS) for s in stages)
    assert len(compiles) == art.unsplit.cache.compiles + cache.compiles
    assert cache.compiles == len({s._program for s in stages}) + static_compiles
    sizes = [[d for t in torch.utils._pytree.tree_leaves(i)
              for d in (t.shape if isinstance(t, torch.Tensor) else [t])] for i in compiles]
    symbolic = [s for s in sizes if any(isinstance(d, torch.SymInt) for d in s)]
    # a stage whose inputs hold no token-dim size (static buffers) is one static compilation
    fixed = {s.name for s in stages if ind._symbolic_dims(s.gm) is None}
    assert len(symbolic) == 1 + len({s._program for s in stages if s.name not in fixed})
    for tokens, b in runner.graphs.items():
        want = {name: "static" if tokens in static_buckets or name in fixed else "dynamic"
                for name in b.stage_kinds}
        assert len(b.stage_kinds) > len(fixed) and b.stage_kinds == want, tokens
        assert runner.stats["buckets"][tokens]["stage_kinds"] == dict(
            collections.Counter(want.values()))
    step = make_step(cfg, decode_context_lens=[5, 40, 17], prefills=[(16, 9)], block_size=16,
                     num_blocks=NUM_BLOCKS)
    ref, _ = eager_then_restore(model, step)
    with torch.no_grad():
        out = runner(step.input_ids, step.positions, step.attn_metadata,
                     step.num_scheduled_tokens)
    assert runner.last_choice == (16, "split")
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_static_buckets_must_be_buckets():
    _, model = _model(layers=1)
    with pytest.raises(GraphRunnerError, match="static_buckets"):
        CudaGraphRunner(model, BUCKETS, max_blocks_per_req=8, static_buckets=[32])


@pytest.mark.parametrize("options,timed", [
    ({}, "none"),  # bucket below the thresholds: the unsplit graph alone, nothing to choose
    ({"split": "never"}, "none"),
    ({"split": "always", "schedule_candidates": False}, "none"),  # one split graph
    ({"split": "always"}, "variants"),  # the unsplit time cannot change the choice
    ({"decode_token_threshold": 16}, "all"),
])
def test_only_graphs_whose_time_can_change_the_choice_are_timed(options, timed):
    cfg, model = _model(layers=1)
    runner = CudaGraphRunner(torch.compile(model, backend="dbo", options=options), [16],
                             max_blocks_per_req=8, timing_iters=1, keep_candidates=True)
    runner.capture()
    b = runner.graphs[16]
    variants = set(b.artifact.candidates) if b.split_args is not None else set()
    assert set(b.times_us) == {"none": set(), "variants": variants,
                               "all": variants | {"unsplit"}}[timed]
    assert set(b.graphs) == variants | {"unsplit"}
    if options.get("split") == "always":
        assert b.choice in variants
        assert b.choice == "list" or len(variants) > 1
    elif timed == "none":
        assert b.choice == "unsplit" and b.t_unsplit_us is None
    assert "16: unsplit" in runner.describe()


@pytest.mark.parametrize("dense", [False, True])
def test_wide_block_table_runs_eagerly_with_a_warning(dense, caplog):
    """``dense``: no MoE layer, a graph compiled unsplit without collectives, which runs no DP
    vote: the runner's ask for the eager path went unheard, it replayed the bucket's graph and
    the block table did not fit its buffer (UBatchExecutionError)."""
    cfg = get_config("tiny", num_layers=2, first_k_dense_replace=2 if dense else 0)
    model = DeepseekMoEModel(cfg, seed=0)
    model.allocate_kv_cache(NUM_BLOCKS, 16)
    compiled = torch.compile(model, backend="dbo")
    runner = CudaGraphRunner(compiled, [16], max_blocks_per_req=2, timing_iters=1)
    runner.capture()
    step = make_step(cfg, decode_context_lens=[60, 3], prefills=[], block_size=16,
                     num_blocks=NUM_BLOCKS)
    assert step.attn_metadata.block_table.shape[1] > 2
    with torch.no_grad(), caplog.at_level("WARNING", logger="dbo_compile.runtime.cudagraph_runner"):
        ref = model(step.input_ids, step.positions, step.attn_metadata)
        out = runner(step.input_ids, step.positions, step.attn_metadata, [1, 1])
    assert runner.eager_steps == 1 and "block table width" in caplog.text
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def _wide_on_one_rank_body(rank, world_size):
    import torch.distributed as dist

    from dbo_compile.backend import register

    register()
    cfg, model = _model(dist.group.WORLD)
    compiled = torch.compile(model, backend="dbo", options={"split": "always"})
    runner = CudaGraphRunner(compiled, [16], max_blocks_per_req=2, timing_iters=1)
    runner.capture()
    # rank 0's request reaches block 3 (wider than the graphs' 2); rank 1's fits
    ctx = [60, 3] if rank == 0 else [5, 3]
    step = make_step(cfg, decode_context_lens=ctx, prefills=[], block_size=16,
                     num_blocks=NUM_BLOCKS)
    with torch.no_grad():
        ref = model(step.input_ids, step.positions, step.attn_metadata)
        out = runner(step.input_ids, step.positions, step.attn_metadata, [1, 1])
    return {"eager_steps": runner.eager_steps, "err": float((out - ref).abs().max())}


def _many_reqs_on_one_rank_body(rank, world_size):
    import torch.distributed as dist

    from dbo_compile.backend import register

    register()
    cfg, model = _model(dist.group.WORLD)
    compiled = torch.compile(model, backend="dbo", options={"split": "always"})
    runner = CudaGraphRunner(compiled, [16], max_blocks_per_req=8, timing_iters=1,
                             max_num_reqs=6)
    runner.capture()
    # 7 tokens on each rank (the eager reference's all-to-all takes equal counts): rank 0 in
    # 7 requests (> max_num_reqs 6), rank 1 in 3, which fit
    dec, pre = ([5, 40, 17, 3, 60, 33, 9], []) if rank == 0 else ([5, 3], [(20, 5)])
    step = make_step(cfg, decode_context_lens=dec, prefills=pre, block_size=16,
                     num_blocks=NUM_BLOCKS)
    with torch.no_grad():
        ref = model(step.input_ids, step.positions, step.attn_metadata)
        out = runner(step.input_ids, step.positions, step.attn_metadata,
                     step.num_scheduled_tokens)
    return {"eager_steps": runner.eager_steps, "choice": runner.last_choice,
            "err": float((out - ref).abs().max())}


@pytest.mark.multirank
def test_a_step_that_fits_no_graph_on_one_rank_runs_eagerly_on_every_rank(request):
    """Only rank 0's block table is too wide: every rank must take the eager path (graph
    replay on one rank and eager collectives on the other would hang)."""
    results = RANKS.results(request, _wide_on_one_rank_body)
    assert [r["eager_steps"] for r in results] == [1, 1]
    assert all(r["err"] <= 1e-5 for r in results)


class _ReadsMaxQueryLen(DeepseekMoEModel):
    def forward(self, input_ids, positions, md):
        out = super().forward(input_ids, positions, md)
        return out * 2 if md.max_query_len == 1 else out  # a layout-dependent host branch


class _MixesTokens(DeepseekMoEModel):
    def forward(self, input_ids, positions, md):
        out = super().forward(input_ids, positions, md)
        return out - out.mean(0, keepdim=True)  # padding rows would enter the mean


@pytest.mark.parametrize("cls,buckets,match", [
    # the serving path bypasses Dynamo's guards: a graph specialised to the warm-up layout
    (_ReadsMaxQueryLen, [16], "prefill-shaped step ran another compiled graph"),
    # an unsplit graph that mixes tokens: padding to a bucket would change its results
    (_MixesTokens, [16], "not known to be row-local"),
])
def test_capture_refuses_what_it_cannot_serve(cls, buckets, match):
    model = cls(get_config("tiny", num_layers=1), seed=0)
    model.allocate_kv_cache(NUM_BLOCKS, 16)
    runner = CudaGraphRunner(torch.compile(model, backend="dbo"), buckets, max_blocks_per_req=4,
                             timing_iters=1)
    with pytest.raises(GraphRunnerError, match=match):
        runner.capture()


def test_bucket_1_and_odd_buckets_serve_unsplit_and_split_steps_find_an_even_bucket():
    """A single decode request (1 token) has its bucket, as in a serving engine's list (the
    graph of 2 rows, the smallest the compiled graph takes); a bucket that is not a multiple
    of num_ubatches (33) captures the unsplit graph only, and a split step runs in the
    smallest bucket that holds it and is such a multiple (refused before: ``buckets must be
    ints >= 2``, ``not a multiple of num_ubatches``)."""
    cfg, model = _model()
    compiled = torch.compile(model, backend="dbo", options={"split": "always"})
    runner = CudaGraphRunner(compiled, [1, 33, 40], max_blocks_per_req=8, timing_iters=1)
    assert runner.buckets == [2, 33, 40]
    runner.capture()
    assert sorted(runner.graphs[33].graphs) == ["unsplit"] and runner.graphs[40].use_split
    for ctx, bucket, graph in (([7], 2, "unsplit"),  # one decode request: below 2, unsplit
                               ([5, 40, 17], 40, "split"),  # 3 tokens split: padded to 4
                               ([3] * 33, 40, "split")):  # 33 split: 34, not bucket 33
        step = make_step(cfg, decode_context_lens=ctx, prefills=[], block_size=16,
                         num_blocks=NUM_BLOCKS)
        with torch.no_grad():
            ref = model(step.input_ids, step.positions, step.attn_metadata)
            out = runner(step.input_ids, step.positions, step.attn_metadata,
                         step.num_scheduled_tokens)
        assert runner.last_choice == (bucket, graph), (ctx, runner.last_choice)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("split", ["always", "never"])
def test_a_kv_cache_replaced_after_capture_is_never_served_from_a_stale_graph(split, caplog):
    """The captured graphs read the KV cache captured with them: a model that allocates its
    cache again after capture() (same shape, new tensors) got logits off by ~1.9 and an
    untouched new cache, nothing said. Such a step runs eagerly, with a warning, until
    capture() again."""
    cfg, model = _model(layers=1)
    compiled = torch.compile(model, backend="dbo", options={"split": split})
    runner = CudaGraphRunner(compiled, [8], max_blocks_per_req=4, block_size=16,
                             timing_iters=1)
    runner.capture()
    step = make_step(cfg, decode_context_lens=[20, 30, 40], prefills=[], block_size=16,
                     num_blocks=NUM_BLOCKS)
    model.allocate_kv_cache(NUM_BLOCKS, 16)  # new tensors, same shape
    fill_kv_cache(model, step, seed=5)
    eager, eager_kv = eager_then_restore(model, step)
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="dbo_compile"):
        out = runner(step.input_ids, step.positions, step.attn_metadata,
                     step.num_scheduled_tokens)
    torch.testing.assert_close(out, eager, atol=1e-5, rtol=1e-5)
    for got, want in zip(model.kv_caches(), eager_kv):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert runner.last_choice[0] == "eager" and "kv_cache" in runner.last_choice[1]
    assert "capture() again" in caplog.text


def test_serving_buckets_are_an_engines_list():
    from dbo_compile.runtime.buckets import serving_buckets

    assert serving_buckets() == [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512,
                                 1024, 2048, 4096, 8192]
    assert serving_buckets(64, prefill=(4096, 32, 1024)) == [1, 2, 4, 8, 16, 24, 32, 48, 64,
                                                             1024, 4096]
    assert serving_buckets(3, prefill=()) == [1, 2]
    for bad in (0, 2.0, True):
        with pytest.raises(GraphRunnerError, match="max_decode"):
            serving_buckets(bad)
    with pytest.raises(GraphRunnerError, match="prefill"):
        serving_buckets(64, prefill=(1024.0,))
    cfg, model = _model()
    runner = CudaGraphRunner(torch.compile(model, backend="dbo"), serving_buckets(8, ()),
                             max_blocks_per_req=4)
    assert runner.buckets == [2, 4, 8]  # bucket 1 is the graph of 2 rows


def test_wrong_num_scheduled_tokens_raise_before_the_vote():
    """Counts that disagree with the metadata must fail in the vote (DpVoteError on every rank),
    not after it on one rank, whatever block_size is."""
    from dbo_compile.errors import DpVoteError

    cfg, model = _model()
    runner = CudaGraphRunner(torch.compile(model, backend="dbo", options={"split": "always"}),
                             [16, 32], max_blocks_per_req=4, timing_iters=1)
    runner.capture()
    step = make_step(cfg, decode_context_lens=[5, 7], prefills=[(0, 10), (3, 4)], block_size=16,
                     num_blocks=NUM_BLOCKS)
    with torch.no_grad(), pytest.raises(DpVoteError, match="disagree with the metadata"):
        runner(step.input_ids, step.positions, step.attn_metadata, [4, 4, 4, 4])
    with torch.no_grad(), pytest.raises(DpVoteError, match=">= 1 per request"):
        runner(step.input_ids, step.positions, step.attn_metadata, [1, 0, 1, 14])


def test_runner_errors():
    cfg, model = _model()
    compiled = torch.compile(model, backend="dbo")
    with pytest.raises(GraphRunnerError, match="buckets"):
        CudaGraphRunner(compiled, [0, 8], max_blocks_per_req=4)
    with pytest.raises(GraphRunnerError, match="buckets"):
        CudaGraphRunner(compiled, [8.0], max_blocks_per_req=4)
    with pytest.raises(GraphRunnerError, match="max_blocks_per_req"):
        CudaGraphRunner(compiled, [8], max_blocks_per_req=0)
    with pytest.raises(GraphRunnerError, match="timing_iters"):
        CudaGraphRunner(compiled, [8], max_blocks_per_req=4, timing_iters=0)
    assert CudaGraphRunner(compiled, (b for b in [16, 8]), max_blocks_per_req=4).buckets == [8, 16]
    if not torch.cuda.is_available():
        with pytest.raises(GraphRunnerError, match="CUDA is not available"):
            CudaGraphRunner(compiled, [8], max_blocks_per_req=4, device="cuda")
    runner = CudaGraphRunner(compiled, [8], max_blocks_per_req=4)
    step = make_step(cfg, decode_context_lens=[3], prefills=[], block_size=16)
    with pytest.raises(GraphRunnerError, match="capture"):
        runner(step.input_ids, step.positions, step.attn_metadata, [1])


# --------------------------------------------------------------------------- host mirrors
class _PausedReplay:
    """A graph whose replay is not counted: on the GPU a replay reads nothing to the host (on
    CPU it re-runs the model, whose reference attention reads its static inputs)."""

    def __init__(self, graph, reads):
        self.graph, self.reads = graph, reads

    def replay(self):
        with self.reads.paused():
            self.graph.replay()


def _runner_call_reads(runner, step, md):
    """One runner call; the host reads of the step's own tensors it made (replays excluded)."""
    from dbo_compile.testing import count_host_reads

    saved = {t: dict(b.graphs) for t, b in runner.graphs.items()}
    with torch.no_grad(), count_host_reads(step.input_ids, step.positions,
                                           *md.tensors().values()) as reads:
        for b in runner.graphs.values():
            for name, g in b.graphs.items():
                b.graphs[name] = _PausedReplay(g, reads)
        try:
            out = runner(step.input_ids, step.positions, md, step.num_scheduled_tokens)
        finally:
            for t, graphs in saved.items():
                runner.graphs[t].graphs = graphs
    return reads, out.clone()


@pytest.mark.parametrize("split,graph,reads_without", [
    # the prefix-read veto (block_size given) reads slot_mapping and block_table in one copy
    ("always", "split", 2),
    ("never", "unsplit", 1),  # split="never" checks no veto: the counts only
])
def test_a_step_with_host_mirrors_reads_no_device_tensor(split, graph, reads_without):
    """Every host read of a device tensor is a sync on CUDA. With the host mirrors of its
    metadata, a runner step reads none of the step's tensors (vote, veto, split, copies);
    without, it reads the three counts in one copy (plus the veto's one). The answer is the
    same bit for bit, and the eager model's."""
    cfg, model = _model()
    runner = CudaGraphRunner(torch.compile(model, backend="dbo", options={"split": split}),
                             [16, 48], max_blocks_per_req=8, block_size=16, timing_iters=1)
    runner.capture()
    step = make_step(cfg, decode_context_lens=[5, 40, 17, 33], prefills=[(16, 9), (0, 20)],
                     block_size=16, num_blocks=NUM_BLOCKS, host_mirrors=True)
    md = step.attn_metadata
    assert md.query_start_loc_cpu is not None and md.block_table_cpu is not None
    device_only = dataclasses.replace(md, **{f"{k}_cpu": None for k in md.tensors()})
    with torch.no_grad():
        ref = model(step.input_ids, step.positions, md)
    mirrored, out = _runner_call_reads(runner, step, md)
    assert runner.last_choice == (48, graph)
    assert mirrored.calls == []
    without, out_without = _runner_call_reads(runner, step, device_only)
    assert without.count == reads_without, without.calls
    assert torch.equal(out, out_without)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_host_mirrors_that_disagree_with_the_device_fail_the_vote():
    """A mirror is trusted for its values, but checked on the host every step against what is
    known there without a device read (shapes, dtypes, the relations between the counts, the
    engine's num_scheduled_tokens); with check_host_mirrors=True also against the device.
    Whatever is wrong fails the vote (DpVoteError on every rank), never a wrong answer."""
    from dbo_compile.errors import DpVoteError

    cfg, model = _model()
    step = make_step(cfg, decode_context_lens=[5, 40, 17], prefills=[(16, 9)], block_size=16,
                     num_blocks=NUM_BLOCKS, host_mirrors=True)
    other = make_step(cfg, decode_context_lens=[5, 40], prefills=[(16, 9)], block_size=16,
                      num_blocks=NUM_BLOCKS, host_mirrors=True)
    md = step.attn_metadata
    seq, ctx = md.seq_lens_cpu.clone(), md.num_computed_tokens_cpu.clone()
    seq[1] += 16  # consistent on the host (ctx moves too), but not what the device holds
    ctx[1] += 16
    cases = [
        (dataclasses.replace(md, query_start_loc_cpu=other.attn_metadata.query_start_loc_cpu),
         "query_start_loc_cpu .*shape"),
        (dataclasses.replace(md, block_table_cpu=md.block_table_cpu.long()),
         "block_table_cpu .*int32"),
        (dataclasses.replace(md, seq_lens_cpu=md.seq_lens_cpu - 40),  # checked: compared first
         "shorter than the query lens|seq_lens_cpu disagrees with seq_lens at \\[0\\]"),
    ]
    for options in ({"split": "always"}, {"split": "always", "check_host_mirrors": True}):
        torch._dynamo.reset()
        runner = CudaGraphRunner(torch.compile(model, backend="dbo", options=options), [32],
                                 max_blocks_per_req=8, block_size=16, timing_iters=1)
        runner.capture()
        checked = options.get("check_host_mirrors", False)
        wrong = dataclasses.replace(md, seq_lens_cpu=seq, num_computed_tokens_cpu=ctx)
        for bad, match in cases + ([(wrong, "seq_lens_cpu .*disagrees with seq_lens")]
                                   if checked else []):
            with torch.no_grad(), pytest.raises(DpVoteError, match=match):
                runner(step.input_ids, step.positions, bad, step.num_scheduled_tokens)
        with torch.no_grad(), pytest.raises(DpVoteError, match="disagree with the metadata"):
            runner(step.input_ids, step.positions, md, [9, 1, 1, 1])
        with torch.no_grad():  # the runner still serves the next, correct step
            runner(step.input_ids, step.positions, md, step.num_scheduled_tokens)
        assert runner.last_choice == (32, "split")


def test_warmup_time_is_reported_per_bucket_and_part(caplog):
    from dbo_compile.runtime.cudagraph_runner import WARMUP_PARTS

    cfg, model = _model(layers=1)
    runner = CudaGraphRunner(torch.compile(model, backend="dbo", options={"split": "always"}),
                             [16, 48], max_blocks_per_req=8, timing_iters=1)
    with caplog.at_level("INFO", logger="dbo_compile.runtime.cudagraph_runner"):
        runner.capture()
    stats = runner.stats
    assert sorted(stats["buckets"]) == [16, 48]
    for tokens, b in runner.graphs.items():
        assert set(b.warmup_s) == set(WARMUP_PARTS)
        parts = sum(b.warmup_s[p] for p in WARMUP_PARTS if p != "total")
        assert 0 < parts <= b.warmup_s["total"] + 1e-6
        # every captured graph is accounted for, also those dropped after the choice
        n = len(b.artifact.candidates) + 1
        assert set(b.graph_s) >= set(b.graphs) and len(b.graph_s) == n
        assert stats["buckets"][tokens]["graphs_captured"] == n
        assert f"warm-up of bucket {tokens}: record" in caplog.text
    # the first bucket (the largest) pays Dynamo and the backend's compile
    assert runner.graphs[48].warmup_s["record"] > runner.graphs[16].warmup_s["record"]
    total = runner.warmup_s()
    assert total["total"] == pytest.approx(sum(b.warmup_s["total"] for b in runner.graphs.values()))


@pytest.mark.parametrize("split, dense", [
    ("always", False), ("auto", False), ("never", False), ("auto", True)])
def test_capture_leaves_the_models_state_as_it_was(split, dense):
    """Warm-up (the synthetic steps, the layout probe), the captures, every candidate's runs
    and the timing replays are no served step: they must leave every buffer the programs
    mutate as it was. ``capture()`` added 11,008 expert-load counts and 86 steps here
    (``"always"``; ``"never"``: 768 and 6), and after one served step the counters read that
    much more than eager's. ``dense``: no MoE layer, no comm op, an unsplit program (its step
    counter gained 6)."""
    cfg = get_config("tiny", num_layers=2, first_k_dense_replace=2 if dense else 0)
    model, ref = CountingModel(cfg, seed=0), CountingModel(cfg, seed=0)
    step = make_step(cfg, decode_context_lens=[30, 41, 7, 19, 60], prefills=[(16, 9)],
                     block_size=16, num_blocks=NUM_BLOCKS, seed=3)
    for m in (model, ref):
        m.allocate_kv_cache(NUM_BLOCKS, 16)
        fill_kv_cache(m, step, seed=1)
        m.expert_load.fill_(3.0)  # a state from earlier steps
        m.steps.fill_(5)
    before = model_state(model)
    compiled = torch.compile(model, backend="dbo", options={"split": split})
    runner = CudaGraphRunner(compiled, BUCKETS, max_blocks_per_req=8, block_size=16,
                             timing_iters=2)
    runner.capture()
    timed = {t: sorted(b.times_us) for t, b in runner.graphs.items()}
    after = model_state(model)
    changed = {k: (float(before[k].sum()), float(after[k].sum())) for k in before
               if not torch.equal(before[k], after[k])}
    assert not changed, (changed, timed)
    with torch.no_grad():
        out = runner(step.input_ids, step.positions, step.attn_metadata,
                     step.num_scheduled_tokens)
        eager = ref(step.input_ids, step.positions, step.attn_metadata)
    assert runner.last_choice[0] == 16, runner.last_choice
    served, want = model_state(model), model_state(ref)
    for k in ("expert_load", "steps"):
        assert torch.equal(served[k], want[k]), (k, served[k], want[k])
    torch.testing.assert_close(out, eager, rtol=0, atol=1e-5)


# -- numbers the graphs bake in (issue 29) ----------------------------------------------------


@pytest.mark.parametrize("dense", [False, True])
def test_a_number_changed_after_capture_is_never_served_from_a_stale_graph(dense, caplog):
    """Under ``torch.compile(dynamic=True)`` Dynamo passes float attributes (the norms' eps,
    the attention scale) as graph inputs, with no guard on their value; the captured graphs
    bake them in. After ``model.norm.eps`` changed, the runner did not see it: it replayed its
    split graph (the old eps folded in: logits off by 0.40), and a graph compiled unsplit
    (``dense``: no MoE layer) replayed the old value too. Such a step runs eagerly, with a
    WARNING naming the attribute; with the old value back the graphs serve again. A capture
    with the new value is refused where the backend folded the old one into its programs,
    and serves it where the graph reads it (Dynamo's graph, unsplit)."""
    cfg = get_config("tiny", num_layers=2, first_k_dense_replace=2 if dense else 0)
    model = DeepseekMoEModel(cfg, seed=0)
    model.allocate_kv_cache(NUM_BLOCKS, 16)
    step = make_step(cfg, decode_context_lens=[30, 41, 7, 19, 60], prefills=[(16, 9)],
                     block_size=16, num_blocks=NUM_BLOCKS, seed=3)
    fill_kv_cache(model, step, seed=1)
    saved = [c.clone() for c in model.kv_caches()]
    compiled = torch.compile(model, backend="dbo", dynamic=True,
                             options={"split": "always", "schedule_candidates": False})
    runner = CudaGraphRunner(compiled, [16], max_blocks_per_req=8, block_size=16,
                             timing_iters=1)
    runner.capture()
    assert runner.graphs[16].artifact.is_split != dense
    old = model.norm.eps

    def serve(eps):
        model.norm.eps = eps
        for c, s in zip(model.kv_caches(), saved):
            c.copy_(s)
        eager, _ = eager_then_restore(model, step)
        with torch.no_grad():
            out = runner(step.input_ids, step.positions, step.attn_metadata,
                         step.num_scheduled_tokens)
        torch.testing.assert_close(out, eager, rtol=0, atol=1e-5)
        return runner.last_choice

    with caplog.at_level(logging.WARNING, logger="dbo_compile"):
        assert serve(0.5)[0] == "eager"
    assert f"L['self']._modules['norm'].eps {old!r} -> 0.5" in caplog.text
    assert serve(old)[0] == 16
    model.norm.eps = 0.5
    if dense:
        runner.capture()
        assert serve(0.5)[0] == 16
    else:
        with pytest.raises(GraphRunnerError, match=r"fold floats the model no longer holds.*"
                           r"Compile the model again"):
            runner.capture()


def test_a_failed_load_replays_padding_and_keeps_the_models_state():
    """A rank whose step fails before its replay replays the graph on padding rows (its peers
    replay it too): that null replay added a step to the model's step counter, for a step that
    did not happen on this rank. It leaves every buffer the programs write as it was."""
    from dbo_compile.errors import UBatchExecutionError

    cfg = get_config("tiny", num_layers=2)
    model = CountingModel(cfg, seed=0)
    model.allocate_kv_cache(NUM_BLOCKS, 16)
    step = make_step(cfg, decode_context_lens=[30, 41, 7], prefills=[(0, 9)], block_size=16,
                     num_blocks=NUM_BLOCKS, seed=3)
    runner = CudaGraphRunner(torch.compile(model, backend="dbo", options={"split": "always"}),
                             [16], max_blocks_per_req=8, block_size=16, timing_iters=1)
    runner.capture()
    before = model_state(model)
    ids = step.input_ids.to(torch.int32).unsqueeze(1)  # the static buffers cannot take it
    with torch.no_grad(), pytest.raises(UBatchExecutionError, match="replayed with padding"):
        runner(ids, step.positions, step.attn_metadata, step.num_scheduled_tokens)
    after = model_state(model)
    assert runner.last_choice == (16, "split")
    changed = {k: (before[k].sum().item(), after[k].sum().item()) for k in before
               if not torch.equal(before[k], after[k])}
    assert not changed, changed


def _number_on_one_rank_body(rank, world_size):
    import torch.distributed as dist

    from dbo_compile.backend import register
    from dbo_compile.errors import DpVoteError

    register()
    cfg = get_config("tiny", num_layers=1)
    model = CountingModel(cfg, ep_group=dist.group.WORLD, seed=0)
    ref = CountingModel(cfg, seed=0)  # every expert local: the same function
    for m in (model, ref):
        m.allocate_kv_cache(NUM_BLOCKS, 16)
    compiled = torch.compile(model, backend="dbo", dynamic=True,
                             options={"split": "always", "schedule_candidates": False})
    runner = CudaGraphRunner(compiled, [16], max_blocks_per_req=8, block_size=16,
                             timing_iters=1)
    runner.capture()
    results = []
    # rank 0's eps changes for two steps: first of equal token counts, then rank 0's smaller
    for i, (eps, tokens) in enumerate([(0.5, [12, 12]), (0.5, [6, 12]), (None, [6, 12])]):
        for m in (model, ref):
            m.norm.eps = eps if eps is not None and rank == 0 else cfg.rms_eps
        step = make_step(cfg, decode_context_lens=[30] * (tokens[rank] - 4), prefills=[(0, 4)],
                         block_size=16, num_blocks=NUM_BLOCKS, seed=10 * i + rank)
        for m in (model, ref):
            fill_kv_cache(m, step, seed=i)
            m.expert_load.fill_(3.0)
        try:
            with torch.no_grad():
                out = runner(step.input_ids, step.positions, step.attn_metadata,
                             step.num_scheduled_tokens)
                eager = ref(step.input_ids, step.positions, step.attn_metadata)
        except DpVoteError as e:
            results.append(("DpVoteError", str(e), model.expert_load.sum().item()))
            continue
        same = all(torch.equal(getattr(model, k), getattr(ref, k)) for k in ("expert_load", "steps"))
        results.append(("ok", runner.last_choice[0], (out - eager).abs().max().item(), same))
    return results


@pytest.mark.multirank
def test_a_number_changed_on_one_rank_sends_every_rank_down_one_path(request):
    """Rank 0's model changes its final norm's eps after capture (a number folded into the
    programs and baked into the graphs), rank 1's does not. Every rank runs the step eagerly
    (rank 0 Dynamo's graph, rank 1 its unsplit program, the same collectives), each equal to
    its eager model; where rank 0's step is the smaller one, Dynamo's graph could not keep the
    group's padding rows out of its expert-load counter, and every rank raises DpVoteError
    before any collective of the step; with the value back the graphs serve again."""
    results = RANKS.results(request, _number_on_one_rank_body)
    print(results)
    for rank, (changed, padded, back) in enumerate(results):
        assert changed[0] == "ok" and changed[1] == "eager" and changed[2] <= 1e-5 and changed[3]
        assert padded[0] == "DpVoteError" and "ranks [0]" in padded[1], padded
        assert ("compile the model again" in padded[1]) == (rank == 0)
        assert padded[2] == 3.0 * get_config("tiny").num_experts  # nothing of the step ran
        assert back[0] == "ok" and back[1] == 16 and back[2] <= 1e-5 and back[3], back


# the two-rank tests' bodies run on one group of 2 ranks, launched once (tests/shared_ranks.py)
RANKS = SharedRanks(2, timeout_s=600, calls={
    "test_runner_matches_eager_and_never_recaptures": (_runner_body, ("always", 14)),
    "test_measured_table_is_identical_on_every_rank": (_runner_body, ("auto", 3)),
    "test_a_step_that_fits_no_graph_on_one_rank_runs_eagerly_on_every_rank":
        (_wide_on_one_rank_body, ()),
    "test_a_number_changed_on_one_rank_sends_every_rank_down_one_path":
        (_number_on_one_rank_body, ()),
    "test_more_than_max_num_reqs_on_one_rank_runs_eagerly_on_every_rank":
        (_many_reqs_on_one_rank_body, ()),
})


@pytest.mark.parametrize("kwargs,match", [
    (dict(buckets=None), "buckets must be"),
    (dict(vocab_size=-1), "vocab_size must be"),
    (dict(block_size=0), "block_size must be"),
    (dict(block_size=True), "block_size must be"),
])
def test_bad_runner_arguments_fail_at_construction(kwargs, match):
    _, model = _model(layers=1)
    args = dict(buckets=BUCKETS, max_blocks_per_req=8) | kwargs
    with pytest.raises(GraphRunnerError, match=match):
        CudaGraphRunner(model, args.pop("buckets"), **args)


# -- keyword arguments and the KV cache's block size, refused at construction ------------------


@pytest.mark.parametrize("kwargs,match", [
    # a typo of a runner argument went to the model (TypeError at capture(), deep in Dynamo)
    (dict(block_sise=16),
     r"block_sise=.*DeepseekMoEModel\.forward.*Did you mean block_size= for block_sise="),
    (dict(timing_iter=1), r"timing_iter=.*Did you mean timing_iters="),
    # the step's own arguments: run_step took them at warm-up (the model never saw them) and
    # an eager step raised TypeError (given twice)
    (dict(vetoes=()),
     r"vetoes=.*argument of each step.*pass it to each step: runner\(\.\.\., vetoes=\.\.\.\)"),
    (dict(allow_split=False), r"allow_split.*argument of each step"),
    (dict(token_kwargs=("x",)), r"token_kwargs.*the runner's own step"),
    # the inputs the runner passes itself, per step
    (dict(positions=None), r"positions.*the runner passes it.*every step"),
    (dict(inputs_embeds=None), r"inputs_embeds.*per-token input"),
])
def test_a_keyword_the_model_does_not_take_is_refused_at_construction(kwargs, match):
    """Keywords the runner does not know went to the model unchecked: a typo of a runner
    argument failed only at ``capture()``, with the model's TypeError, and the step's own
    arguments were taken by ``run_step`` at warm-up without reaching the model."""
    _, model = _model(layers=1)
    for m in (model, torch.compile(model, backend="dbo")):
        with pytest.raises(GraphRunnerError, match=match):
            CudaGraphRunner(m, BUCKETS, max_blocks_per_req=8, **kwargs)


class _ScaledModel(torch.nn.Module):
    """A model with an extra keyword of its forward (``scale``), which the runner passes on."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, positions, attn_metadata, scale: float = 1.0):
        return self.model(input_ids, positions, attn_metadata) * scale


def test_a_keyword_of_the_models_forward_reaches_the_model():
    cfg, model = _model(layers=1)
    wrapped = _ScaledModel(model)
    with pytest.raises(GraphRunnerError, match=r"scael=.*keywords are scale.*Did you mean scale="):
        CudaGraphRunner(torch.compile(wrapped, backend="dbo"), [16], max_blocks_per_req=8,
                        scael=2.0)
    # a function taking **kwargs takes any keyword
    CudaGraphRunner(lambda *a, **kw: None, [16], max_blocks_per_req=8, anything=1)
    runner = CudaGraphRunner(torch.compile(wrapped, backend="dbo"), [16], max_blocks_per_req=8,
                             block_size=16, timing_iters=1, scale=2.0)
    runner.capture()
    step = make_step(cfg, decode_context_lens=[5, 40], prefills=[(0, 9)], block_size=16,
                     num_blocks=NUM_BLOCKS)
    ref, _ = eager_then_restore(model, step)
    with torch.no_grad():
        out = runner(step.input_ids, step.positions, step.attn_metadata,
                     step.num_scheduled_tokens)
    torch.testing.assert_close(out, 2.0 * ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_size", [8, 32])
def test_a_block_size_other_than_the_kv_caches_is_refused_at_construction(block_size):
    """``block_size`` disagreeing with the model's KV cache was found only at ``capture()``,
    after Dynamo compiled the model, as a DP-vote error of the first synthetic step."""
    _, model = _model(layers=1)  # allocate_kv_cache(NUM_BLOCKS, 16)
    for m in (model, torch.compile(model, backend="dbo")):
        with pytest.raises(GraphRunnerError, match=(
                rf"block_size={block_size} .*KV cache has block size 16.*allocate_kv_cache"
                r".*pass block_size=16 or none")):
            CudaGraphRunner(m, BUCKETS, max_blocks_per_req=8, block_size=block_size)
    CudaGraphRunner(model, BUCKETS, max_blocks_per_req=8, block_size=16)
    # no cache yet (allocated after the runner is built): nothing to check here
    fresh = DeepseekMoEModel(get_config("tiny", num_layers=1), seed=0)
    CudaGraphRunner(fresh, BUCKETS, max_blocks_per_req=8, block_size=block_size)


def test_buckets_as_a_string_and_a_prune_margin_past_its_range_are_refused_clearly():
    """A newcomer's probe: ``buckets="64"`` was read as the buckets ['6', '4'], and
    ``prune_margin=20`` was refused as "a fraction >= 0"."""
    model = DeepseekMoEModel(get_config("tiny", num_layers=1), seed=0)
    model.allocate_kv_cache(NUM_BLOCKS, 16)
    compiled = torch.compile(model, backend="dbo")
    with pytest.raises(GraphRunnerError, match="not a str.*'64'"):
        CudaGraphRunner(compiled, "64", max_blocks_per_req=4)
    with pytest.raises(GraphRunnerError, match="static_buckets must be .* not a str.*'64'"):
        CudaGraphRunner(compiled, [64], max_blocks_per_req=4, static_buckets="64")
    with pytest.raises(GraphRunnerError, match=r"prune_margin must be None \(off\) or a fraction "
                                               r"in \[0, 10\), got 20"):
        CudaGraphRunner(compiled, [64], max_blocks_per_req=4, prune_margin=20)


def test_a_vocab_size_past_the_embedding_and_a_bool_block_table_width_are_refused():
    """A newcomer's probe: ``vocab_size=10**6`` on a model of a smaller vocabulary failed in
    ``capture()`` with an IndexError inside the split program; ``max_blocks_per_req=True``
    was taken as 1 while a numpy int was refused."""
    import numpy as np

    model = DeepseekMoEModel(get_config("tiny", num_layers=1), seed=0)
    model.allocate_kv_cache(NUM_BLOCKS, 16)
    compiled = torch.compile(model, backend="dbo")
    rows = model.embed_tokens.shape[0]
    with pytest.raises(GraphRunnerError, match=f"vocab_size={rows + 1}.*{rows} rows"):
        CudaGraphRunner(compiled, [8], max_blocks_per_req=4, vocab_size=rows + 1)
    CudaGraphRunner(compiled, [8], max_blocks_per_req=4, vocab_size=rows)
    with pytest.raises(GraphRunnerError, match="max_blocks_per_req must be an int"):
        CudaGraphRunner(compiled, [8], max_blocks_per_req=True)
    assert CudaGraphRunner(compiled, [8], max_blocks_per_req=np.int64(4)).max_blocks_per_req == 4


def _not_checked(caplog):
    return [r for r in caplog.records if "not checked against the model" in r.getMessage()]


def test_checks_the_runner_cannot_make_are_named_in_one_info_line(caplog):
    """A newcomer's finding: ``vocab_size`` / ``block_size`` given with a plain function as the
    compiled callable (no nn.Module behind it: no embedding, no KV cache to check them
    against) were skipped without a word. One INFO line at construction names each argument
    left unchecked and why; none where every given argument was checked, or none was given."""
    def fn(input_ids, positions, attn_metadata):
        return input_ids

    logger = "dbo_compile.runtime.cudagraph_runner"
    for compiled in (fn, torch.compile(fn, backend="dbo")):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger=logger):
            CudaGraphRunner(compiled, [16], max_blocks_per_req=8, block_size=16, vocab_size=100)
        lines = _not_checked(caplog)
        assert len(lines) == 1 and lines[0].levelno == logging.INFO, caplog.text
        msg = lines[0].getMessage()
        assert "block_size=16" in msg and "vocab_size=100" in msg, msg
        assert "no nn.Module behind the compiled callable" in msg, msg
    # a model whose KV cache is allocated later: block_size waits for capture(), said so
    caplog.clear()
    fresh = DeepseekMoEModel(get_config("tiny", num_layers=1), seed=0)
    with caplog.at_level(logging.INFO, logger=logger):
        CudaGraphRunner(fresh, [16], max_blocks_per_req=8, block_size=16)
    msg = " ".join(r.getMessage() for r in _not_checked(caplog))
    assert "block_size=16" in msg and "not allocated" in msg and "vocab_size" not in msg, msg
    # everything given was checked, or nothing given: no line
    caplog.clear()
    _, model = _model(layers=1)
    with caplog.at_level(logging.INFO, logger=logger):
        CudaGraphRunner(torch.compile(model, backend="dbo"), [16], max_blocks_per_req=8,
                        block_size=16, vocab_size=int(model.embed_tokens.shape[0]))
        CudaGraphRunner(fn, [16], max_blocks_per_req=8)
    assert not _not_checked(caplog), caplog.text


# -- max_num_reqs: the request capacity a serving engine promises ------------------------------


def _request_capacities(runner, tokens):
    """``(unsplit, [per ubatch])`` request capacity of bucket ``tokens``'s static buffers, per
    request-layout field (they must agree): ``query_start_loc`` rows - 1, the others' rows."""
    b = runner.graphs[tokens]
    art = b.artifact
    fields = ("query_start_loc", "seq_lens", "num_computed_tokens", "block_table")

    def cap(t, name):
        return int(t.shape[0]) - (1 if name == "query_start_loc" else 0)

    unsplit = {cap(b.args[b.input_pos[f]], f) for f in fields if f in b.input_pos}
    per_ub: dict[int, set[int]] = collections.defaultdict(set)
    for pos, (index, u) in enumerate(art.signature.inputs):
        f = art.specs[index].field
        if u is not None and f in fields:
            per_ub[u].add(cap(b.split_args[pos], f))
    assert len(unsplit) == 1 and all(len(v) == 1 for v in per_ub.values()), (unsplit, per_ub)
    return unsplit.pop(), [per_ub[u].pop() for u in sorted(per_ub)]


@pytest.mark.parametrize("max_num_reqs", [None, 5, 20, 1])
def test_max_num_reqs_bounds_the_captured_request_capacity(max_num_reqs):
    """Without it every bucket holds ``bucket`` requests (``bucket // 2`` per ubatch): the
    attention grid ``(T // BLOCK_M + R) x Hkv`` launches a program per padded request (475 us
    vs 207 us at V3 prefill 2048 on one H100). With it the unsplit graph holds
    ``min(bucket, M)`` and each ubatch ``min(bucket // 2, M)`` (a step's requests may all sit in
    one ubatch); at least 2 (the smallest request count the compiled graph is traced for)."""
    _, model = _model()
    compiled = torch.compile(model, backend="dbo", options={"split": "always"})
    runner = CudaGraphRunner(compiled, BUCKETS, max_blocks_per_req=8, timing_iters=1,
                             max_num_reqs=max_num_reqs)
    runner.capture()
    for t in BUCKETS:
        m = t if max_num_reqs is None else max(max_num_reqs, 2)
        assert runner.graphs[t].use_split
        assert _request_capacities(runner, t) == (min(t, m), [min(t // 2, m)] * 2), t
    if max_num_reqs is not None:
        assert _request_capacities(runner, 48)[0] < 48


@pytest.mark.parametrize("allow_split", [True, False])
def test_max_num_reqs_serves_m_requests_however_they_fall_into_ubatches(allow_split):
    """M requests in one ubatch: 5 decodes and the first 11 tokens of a 20-token prefill are
    ubatch 0's 6 requests (bucket 32, cut at 16), ubatch 1 holds the prefill's rest; a
    capacity of M / 2 per ubatch would not hold them. Also all-decode and all-prefill steps,
    split and unsplit; every output equals eager."""
    m = 6
    cfg, model = _model()
    compiled = torch.compile(model, backend="dbo", options={"split": "always"})
    runner = CudaGraphRunner(compiled, [32], max_blocks_per_req=8, block_size=16,
                             timing_iters=1, max_num_reqs=m)
    runner.capture()
    assert _request_capacities(runner, 32) == (6, [6, 6])
    graph = "split" if allow_split else "unsplit"
    for dec, pre in (([5, 40, 17, 3, 60], [(0, 20)]),  # ubatch 0: 6 requests
                     ([5, 40, 17, 3, 60, 33], []),  # M decodes
                     ([], [(16, 9), (0, 14), (3, 2)]),  # prefills
                     ([7], [(0, 3), (21, 1), (0, 2), (0, 1), (5, 12)])):
        step = make_step(cfg, decode_context_lens=dec, prefills=pre, block_size=16,
                         num_blocks=NUM_BLOCKS)
        assert len(step.num_scheduled_tokens) <= m
        with torch.no_grad():
            ref = model(step.input_ids, step.positions, step.attn_metadata)
            out = runner(step.input_ids, step.positions, step.attn_metadata,
                         step.num_scheduled_tokens, allow_split=allow_split)
        assert runner.last_choice == (32, graph), (dec, pre, runner.last_choice)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert runner.eager_steps == 0


@pytest.mark.parametrize("split", ["always", "never"])
def test_more_than_max_num_reqs_requests_run_eagerly_with_the_reason(split, caplog):
    """A step of M + 1 requests fits no captured request buffer: it runs eagerly (on every
    rank: the vote's ask for one token past the largest bucket), logged once, not a
    GraphRunnerError from copy_into (``query_start_loc: 7 requests > captured capacity 6``)."""
    m = 6
    cfg, model = _model()
    compiled = torch.compile(model, backend="dbo", options={"split": split})
    runner = CudaGraphRunner(compiled, [32], max_blocks_per_req=8, block_size=16,
                             timing_iters=1, max_num_reqs=m)
    runner.capture()
    step = make_step(cfg, decode_context_lens=[5, 40, 17, 3, 60, 33, 9], prefills=[],
                     block_size=16, num_blocks=NUM_BLOCKS)
    logger = "dbo_compile.runtime.cudagraph_runner"
    for i in range(2):
        with torch.no_grad(), caplog.at_level("WARNING", logger=logger):
            ref = model(step.input_ids, step.positions, step.attn_metadata)
            out = runner(step.input_ids, step.positions, step.attn_metadata,
                         step.num_scheduled_tokens)
        assert runner.last_choice == ("eager", "7 requests > max_num_reqs 6")
        assert runner.eager_steps == i + 1
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert caplog.text.count("7 requests > max_num_reqs 6") == 1


@pytest.mark.parametrize("bad", [0, -3, True, 2.5, "256"])
def test_a_bad_max_num_reqs_is_refused_at_construction(bad):
    _, model = _model(layers=1)
    with pytest.raises(GraphRunnerError, match=r"max_num_reqs must be None or an int >= 1"):
        CudaGraphRunner(model, BUCKETS, max_blocks_per_req=8, max_num_reqs=bad)


@pytest.mark.multirank
def test_more_than_max_num_reqs_on_one_rank_runs_eagerly_on_every_rank(request):
    """Only rank 0 has more than ``max_num_reqs`` requests: every rank takes the eager path
    (rank 0's copy into its request buffers would fail while rank 1 replays the graph)."""
    results = RANKS.results(request, _many_reqs_on_one_rank_body)
    assert [r["eager_steps"] for r in results] == [1, 1]
    assert results[0]["choice"] == ("eager", "7 requests > max_num_reqs 6")
    assert results[1]["choice"][0] == "eager" and "DP vote padded" in results[1]["choice"][1]
    assert all(r["err"] <= 1e-5 for r in results)
