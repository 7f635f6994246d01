"""In-place updates of shared state under the split (issue 16, finding 1): a buffer the
step's tokens update in every MoE layer (an EPLB-style expert-load counter) ends the step
with eager's value, bitwise on CPU, whatever the ubatch count, the padding (run_step's, the
DP vote's, a CUDA-graph bucket's) or the schedule; what cannot be replayed per ubatch (a
value of every token read back by the tokens) compiles unsplit and says why."""

from __future__ import annotations

import pytest
import torch

from conftest import last_artifact
from moe_cases import (
    CountingModel,
    MixingCountingModel,
    NoCommCountingModel,
    capture_then_serve,
    model_state,
)
from dbo_compile.backend import compiled_artifacts
from shared_ranks import SharedRanks
from dbo_compile.models.batch import fill_kv_cache, make_step
from dbo_compile.models.deepseek import DeepseekMoEModel, MoE, get_config
from dbo_compile.runtime.engine import run_step


def _routing(moe, x):
    """The model's softmax top-k routing (written out: the test runs on trees without
    ``MoE.route``)."""
    logits = torch.nn.functional.linear(x, moe.gate).to(torch.float32)
    topk_w, topk_ids = torch.topk(torch.softmax(logits, dim=-1), moe.top_k, dim=-1)
    return topk_w / topk_w.sum(dim=-1, keepdim=True), topk_ids


class _StateMoE(MoE):
    """Records expert load as ``kind`` says, then the usual dispatch / experts / combine."""

    kind = "counter"

    def forward(self, x):
        topk_w, topk_ids = _routing(self, x)
        flat = topk_ids.flatten()
        ones = torch.ones_like(flat, dtype=torch.float32)
        if self.kind == "counter":  # EPLB: one [E] buffer for every layer
            self.load.index_add_(0, flat, ones)
        elif self.kind == "table":  # one row of a [layers, E] table, and a step counter
            self.table[self.layer].index_add_(0, flat, ones)
            self.steps.add_(1)
        elif self.kind == "decayed":  # token-free ops between the folds
            self.load.mul_(0.5).index_add_(0, flat, ones)
        elif self.kind == "two":  # two folds of one buffer in one layer, and scatter_add
            self.load.index_add_(0, flat, ones)
            self.load.scatter_add_(0, topk_ids[:, 0], topk_w[:, 0])
        elif self.kind == "histogram":  # a per-step count read by the tokens
            counts = torch.zeros_like(self.load).index_add(0, flat, ones)
            topk_w = topk_w / (1.0 + counts[topk_ids])
        elif self.kind == "reads_back":  # reads the buffer after this step's updates
            self.load.index_add_(0, flat, ones)
            topk_w = topk_w * (1.0 + self.load[topk_ids] * 0)
        recv_x, recv_ids, recv_w = torch.ops.dbo.dispatch(
            x, topk_ids, topk_w, self.num_experts, self.group_name)
        if self.kind == "received":  # this rank's experts' load, from the received rows
            self.load.index_add_(0, recv_ids.clamp(min=0).flatten(),
                                 (recv_ids >= 0).flatten().to(torch.float32))
        out = torch.ops.dbo.combine(self.experts(recv_x, recv_ids, recv_w), self.group_name)
        return out + self.shared_experts(x)


def _build(kind, layers=2, group=None):
    cfg = get_config("tiny", num_layers=layers)
    model = DeepseekMoEModel(cfg, ep_group=group, seed=0)
    state = {"load": torch.zeros(cfg.num_experts), "table": torch.zeros(layers, cfg.num_experts),
             "steps": torch.zeros(())}
    for i, layer in enumerate(model.layers):
        layer.mlp.__class__ = _StateMoE
        layer.mlp.kind, layer.mlp.layer = kind, i
        for name, t in state.items():
            layer.mlp.register_buffer(name, t, persistent=False)
    return cfg, model, state


def _run(model, state, step, call):
    """Eager then compiled from the same state: (eager out, eager state, out, state)."""
    saved = [c.clone() for c in model.kv_caches()]
    before = {k: v.clone() for k, v in state.items()}
    with torch.no_grad():
        eager = model(step.input_ids, step.positions, step.attn_metadata)
        eager_state = {k: v.clone() for k, v in state.items()}
        for c, s in zip(model.kv_caches(), saved):
            c.copy_(s)
        for k, v in state.items():
            v.copy_(before[k])
        out = call()
    return eager, eager_state, out, state


def _step(cfg, tokens, seed=0):
    step = make_step(cfg, decode_context_lens=[30] * (tokens // 2 if tokens > 1 else tokens),
                     prefills=[(0, tokens - tokens // 2)] if tokens > 1 else [],
                     block_size=16, seed=seed)
    return step


@pytest.mark.parametrize("kind, layers, ubatches", [
    ("counter", 2, 2), ("counter", 2, 4), ("counter", 3, 2), ("counter", 1, 2),
    ("table", 2, 2), ("decayed", 2, 2), ("two", 2, 3)])
def test_buffer_updates_equal_eager_under_the_split(kind, layers, ubatches):
    """Split, each ubatch's chain started from the old value and the last write won: 1/N of
    the counts (256 -> 128 with 2 ubatches, -> 64 with 4), logits right, nothing said."""
    cfg, model, state = _build(kind, layers)
    step = _step(cfg, 64)
    model.allocate_kv_cache(step.num_blocks, step.block_size)
    fill_kv_cache(model, step, seed=1)
    compiled = torch.compile(model, backend="dbo", options={
        "split": "always", "num_ubatches": ubatches, "schedule_candidates": False})
    eager, eager_state, out, got = _run(model, state, step, lambda: compiled(
        step.input_ids, step.positions, step.attn_metadata))
    art = last_artifact()
    print(kind, layers, ubatches, {k: float(v.sum()) for k, v in got.items()},
          {k: float(v.sum()) for k, v in eager_state.items()})
    assert art.is_split and art.stats.split_steps == 1, art.reason
    for k in state:
        assert torch.equal(got[k], eager_state[k]), (k, got[k], eager_state[k])
    torch.testing.assert_close(out, eager, rtol=0, atol=1e-5)
    assert any(dbo.get("thread") for dbo in (n.meta.get("dbo", {}) for n in art.split_gm.graph.nodes))


@pytest.mark.parametrize("rows", [0, 1])
def test_padding_rows_are_not_counted(rows):
    """run_step pads a 0- or 1-token step to 2 rows: the padding row was routed and counted
    (1 token, top-2: eager 4 over 2 layers, compiled 8)."""
    cfg, model, state = _build("counter")
    step = _step(cfg, rows)
    model.allocate_kv_cache(max(step.num_blocks, 4), step.block_size)
    compiled = torch.compile(model, backend="dbo", options={"schedule_candidates": False})
    eager, eager_state, out, got = _run(model, state, step, lambda: run_step(
        compiled, step.input_ids, step.positions, step.attn_metadata, step.num_scheduled_tokens))
    assert out.shape[0] == rows
    assert torch.equal(got["load"], eager_state["load"]), (got["load"], eager_state["load"])


def test_runner_bucket_padding_is_not_counted():
    from dbo_compile.runtime.cudagraph_runner import CudaGraphRunner

    cfg, model, state = _build("counter")
    step = _step(cfg, 12)
    model.allocate_kv_cache(step.num_blocks, step.block_size)
    fill_kv_cache(model, step, seed=1)
    compiled = torch.compile(model, backend="dbo", options={"split": "always",
                                                            "schedule_candidates": False})
    runner = CudaGraphRunner(compiled, buckets=[16], timing_iters=1, device="cpu",
                             max_blocks_per_req=step.attn_metadata.block_table.shape[1])

    saved = [c.clone() for c in model.kv_caches()]
    eager, eager_state, out, got = _run(model, state, step, lambda: capture_then_serve(
        runner, model, step, saved, reset=state["load"].zero_))
    assert runner.last_choice == (16, "split")
    assert torch.equal(got["load"], eager_state["load"]), (got["load"], eager_state["load"])
    torch.testing.assert_close(out, eager, rtol=0, atol=1e-5)


@pytest.mark.parametrize("kind, why", [
    ("histogram", "scatters the step's token rows into a [8] tensor"),
    ("reads_back", "after some of this step's updates")])
def test_values_of_every_token_read_by_the_tokens_compile_unsplit(kind, why):
    """A per-step histogram that scales the tokens' weights was split (max abs error 0.16):
    each ubatch counted only its own tokens."""
    cfg, model, state = _build(kind)
    step = _step(cfg, 32)
    model.allocate_kv_cache(step.num_blocks, step.block_size)
    compiled = torch.compile(model, backend="dbo", options={"split": "always"})
    eager, eager_state, out, got = _run(model, state, step, lambda: compiled(
        step.input_ids, step.positions, step.attn_metadata))
    art = last_artifact()
    print(art.reason)
    assert not art.is_split and why in art.reason
    torch.testing.assert_close(out, eager, rtol=0, atol=1e-5)
    assert torch.equal(got["load"], eager_state["load"])


def _dp_body(rank, world_size):
    import torch.distributed as dist

    from dbo_compile.backend import register
    from dbo_compile.runtime.program import last_called

    register()
    cfg, model, state = _build("counter", group=dist.group.WORLD)
    ref_cfg, ref, ref_state = _build("counter")  # all experts local: the same function
    step = _step(cfg, [20, 33][rank], seed=rank)
    for m in (model, ref):
        m.allocate_kv_cache(step.num_blocks, step.block_size)
        fill_kv_cache(m, step, seed=rank)
    compiled = torch.compile(model, backend="dbo", options={"split": "always",
                                                            "schedule_candidates": False})
    with torch.no_grad():
        eager = ref(step.input_ids, step.positions, step.attn_metadata)  # no padding rows
        out = run_step(compiled, step.input_ids, step.positions, step.attn_metadata,
                       step.num_scheduled_tokens)
    vote = last_called().last_vote
    # a fold over the rows received from both ranks: their padding rows cannot be told apart
    _, received, _ = _build("received", group=dist.group.WORLD)
    decode = make_step(cfg, decode_context_lens=[30] * 20, prefills=[], block_size=16)
    received.allocate_kv_cache(decode.num_blocks, decode.block_size)
    with torch.no_grad():
        run_step(torch.compile(received, backend="dbo", options={"split": "always"}),
                 decode.input_ids, decode.positions, decode.attn_metadata,
                 decode.num_scheduled_tokens)
    return (vote.should_split, vote.num_tokens_padded, torch.equal(state["load"], ref_state["load"]),
            (out - eager).abs().max().item(), last_called().reason)


@pytest.mark.multirank
def test_dp_padding_rows_are_not_counted_on_any_rank(request):
    """Two ranks of 20 and 33 tokens: both pad to 34 and split; each rank's counter equals its
    eager one. A fold over the rows a dispatch received (other ranks' padding among them) is
    refused: padding could not be kept out of it."""
    results = RANKS.results(request, _dp_body)
    print(results)
    for split, padded, same, err, reason in results:
        assert split and padded == 34 and same and err <= 1e-5
        assert "not this rank's tokens grouped in order" in reason


# -- the way out and the guard fallback run Dynamo's graph: no dbo_row_valid (issue 29) ---------


def _counting(cls, group=None, **overrides):
    cfg = get_config("tiny", num_layers=2, **overrides)
    model, ref = cls(cfg, ep_group=group, seed=0), cls(cfg, seed=0)
    return cfg, model, ref


def _served_and_eager(model, ref, step, call):
    """``call()``'s output and the model's state, and eager's on ``ref`` (the same weights,
    every expert local) for the step's real rows, from the same KV caches and counters."""
    for m in (model, ref):
        m.allocate_kv_cache(max(step.num_blocks, 4), step.block_size)
        fill_kv_cache(m, step, seed=1)
        m.expert_load.fill_(3.0)  # a state from earlier steps
    with torch.no_grad():
        out = call()  # first: where it raises, neither model ran the step
        eager = ref(step.input_ids, step.positions, step.attn_metadata)
    return out, model_state(model), eager, model_state(ref)


@pytest.mark.parametrize("cls", [NoCommCountingModel, MixingCountingModel])
@pytest.mark.parametrize("rows", [0, 1])
def test_an_unsplit_graph_never_runs_run_steps_padding_rows(cls, rows):
    """A graph compiled unsplit runs Dynamo's graph, which has no ``dbo_row_valid`` input.
    ``run_step`` pads a 0- or 1-token step to 2 rows: the padding row was counted in the
    expert-load counter (1 token, top-2, 2 layers: 8 against eager's 4), and a graph that
    mixes tokens returned logits off by 1.26. Such a graph runs at the step's own rows."""
    cfg, model, ref = _counting(cls)
    step = _step(cfg, rows)
    compiled = torch.compile(model, backend="dbo", options={"schedule_candidates": False})
    out, got, eager, want = _served_and_eager(model, ref, step, lambda: run_step(
        compiled, step.input_ids, step.positions, step.attn_metadata, step.num_scheduled_tokens))
    assert out.shape[0] == rows
    for k in ("expert_load", "steps"):
        assert torch.equal(got[k], want[k]), (k, got[k], want[k])
    torch.testing.assert_close(out, eager, rtol=0, atol=1e-5)
    art = last_artifact()
    assert not art.is_split and art.padding_hazard() is not None, art.reason


def test_runner_refuses_an_unsplit_graph_that_would_count_bucket_padding():
    """The CUDA-graph runner pads a step to its bucket. A graph compiled unsplit (no comm op)
    whose expert-load counter folds token rows counted the bucket's padding rows: after a
    12-token step in bucket 16 the counter read 64 against eager's 48, nothing said. Refused at
    capture, naming the buffer; capture leaves the model's state as it was."""
    from dbo_compile.runtime.cudagraph_runner import CudaGraphRunner, GraphRunnerError

    cfg, model, ref = _counting(NoCommCountingModel)
    step = _step(cfg, 12)
    model.allocate_kv_cache(step.num_blocks, step.block_size)
    before = model_state(model)
    runner = CudaGraphRunner(torch.compile(model, backend="dbo"), buckets=[16], timing_iters=1,
                             device="cpu", max_blocks_per_req=step.attn_metadata.block_table.shape[1])
    with pytest.raises(GraphRunnerError, match=r"folds token rows into buffers it updates "
                       r"\(graph inputs .*expert_load"):
        runner.capture()
    after = model_state(model)
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("rows", [0, 1])
def test_a_changed_float_runs_dynamos_graph_at_the_steps_own_rows(rows):
    """After a float folded into the programs changed (``torch.compile(dynamic=True)``, the
    final norm's eps), a step runs Dynamo's graph (the guard's fallback), which has no
    ``dbo_row_valid``: run_step's padding row of a 1-token step was counted (8 against 4).
    It runs at the step's own rows."""
    cfg, model, ref = _counting(CountingModel)
    compiled = torch.compile(model, backend="dbo", dynamic=True,
                             options={"schedule_candidates": False})
    # compiles, the old eps folded in (a step of the same layout: Dynamo's graph for it)
    first = _step(cfg, rows, seed=1)
    _served_and_eager(model, ref, first, lambda: run_step(
        compiled, first.input_ids, first.positions, first.attn_metadata,
        first.num_scheduled_tokens))
    assert last_artifact().is_split and last_artifact().float_guards
    for m in (model, ref):
        m.norm.eps = 0.5
    step = _step(cfg, rows)
    out, got, eager, want = _served_and_eager(model, ref, step, lambda: run_step(
        compiled, step.input_ids, step.positions, step.attn_metadata, step.num_scheduled_tokens))
    assert "float" in last_artifact().stats.last_decision and len(compiled_artifacts()) == 1
    for k in ("expert_load", "steps"):
        assert torch.equal(got[k], want[k]), (k, got[k], want[k])
    torch.testing.assert_close(out, eager, rtol=0, atol=1e-5)


def _unpaddable_dp_body(rank, world_size):
    import torch.distributed as dist

    from dbo_compile.backend import register
    from dbo_compile.errors import DpVoteError

    register()
    cfg, model, ref = _counting(MixingCountingModel, group=dist.group.WORLD)
    compiled = torch.compile(model, backend="dbo", options={"schedule_candidates": False})
    results = []
    for tokens in ([20, 33][rank], 20):  # unequal: rank 0 is padded; equal: nobody is
        step = _step(cfg, tokens, seed=rank)
        try:
            out, got, eager, want = _served_and_eager(model, ref, step, lambda: run_step(
                compiled, step.input_ids, step.positions, step.attn_metadata,
                step.num_scheduled_tokens))
        except DpVoteError as e:
            after = model_state(model)
            results.append(("DpVoteError", str(e), after["expert_load"].sum().item(),
                            after["steps"].item()))
            continue
        results.append(("ok", (out - eager).abs().max().item(),
                        all(torch.equal(got[k], want[k]) for k in ("expert_load", "steps")),
                        last_artifact().reason))
    return results


@pytest.mark.multirank
def test_dp_padding_of_an_unsplit_graph_that_cannot_be_padded_raises_on_every_rank(request):
    """Two DP ranks of 20 and 33 tokens running a graph compiled unsplit (it mixes tokens)
    with an expert-load counter: the vote padded rank 0 to 33 rows, whose logits came back off
    (the padding rows entered the mean) and whose counter counted the padding, nothing said.
    Every rank raises ``DpVoteError`` (rank 0's names why it cannot be padded), before any
    collective of the step; a step of equal counts is exact, counters bitwise."""
    results = RANKS.results(request, _unpaddable_dp_body)
    print(results)
    for rank, (unequal, equal) in enumerate(results):
        assert unequal[0] == "DpVoteError", unequal
        assert "ranks [0]" in unequal[1] and "pads their [20] token rows to 33" in unequal[1]
        assert ("this rank cannot be padded: the graph was compiled unsplit (node mean"
                in unequal[1]) == (rank == 0)
        assert unequal[2:] == (3.0 * 8, 0)  # the state as it was: nothing of the step ran
        assert equal[0] == "ok" and equal[1] <= 1e-5 and equal[2], equal


# the two-rank tests' bodies run on one group of 2 ranks, launched once (tests/shared_ranks.py)
RANKS = SharedRanks(2, timeout_s=400, calls={
    "test_dp_padding_rows_are_not_counted_on_any_rank": (_dp_body, ()),
    "test_dp_padding_of_an_unsplit_graph_that_cannot_be_padded_raises_on_every_rank":
        (_unpaddable_dp_body, ()),
})
