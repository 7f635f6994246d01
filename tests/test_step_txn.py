"""The step transaction (issue 16, finding 3): whatever one rank does inside a step, every
rank ends it with the same project error, never a hang; the next step is exact.

One 2-rank job runs a sequence of steps; in some, one rank fails (an op raising inside a
ubatch of the split program or in the unsplit program, a comm op's argument check, a bad
input before the vote); each failed step is followed by a normal one, checked against eager.
Before the transaction, a failure on one rank left the other waiting in the next collective
(the jobs hit the limit)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from shared_ranks import SharedRanks

# (what, failing rank, how, argument, split) per failing step
CASES = [
    ("split: rank 0 before any collective (ubatch 0)", 0, "site", ("attention", 0), True),
    ("split: rank 1 in ubatch 1's routed experts", 1, "site", ("experts", 1), True),
    ("split: rank 0 in ubatch 0's tail", 0, "site", ("tail", 0), True),
    ("unsplit: rank 1 in the routed experts", 1, "site", ("experts", 0), False),
    ("split: rank 0's dispatch refuses its arguments (before posting)", 0, "dispatch", 2, True),
    ("before the vote: rank 1's num_scheduled_tokens", 1, "counts", None, True),
]


def _body(rank, world_size, cases):
    import torch.distributed as dist

    from dbo_compile.backend import register
    from dbo_compile.errors import CommOpError, DboError
    from dbo_compile.models.batch import fill_kv_cache, make_step
    from dbo_compile.models.deepseek import get_config
    from dbo_compile.ops import comm
    from dbo_compile.runtime.engine import run_step
    from dbo_compile.testing import faults

    register()
    cfg = get_config("tiny", num_layers=2)
    model = faults.FaultyMoEModel(cfg, ep_group=dist.group.WORLD, seed=0)
    step = make_step(cfg, decode_context_lens=[30] * 8, prefills=[(0, 24)], block_size=16,
                     seed=rank)
    model.allocate_kv_cache(step.num_blocks, step.block_size)
    fill_kv_cache(model, step, seed=rank)
    saved = [c.clone() for c in model.kv_caches()]
    torch_backend = comm.get_comm_backend("torch")
    calls = {"left": None}

    def refusing_dispatch(*args):
        if calls["left"] is not None:
            calls["left"] -= 1
            if calls["left"] < 0:
                calls["left"] = None
                raise CommOpError("dbo.dispatch: injected argument error")
        return torch_backend.dispatch(*args)

    comm.register_comm_backend(dataclasses.replace(torch_backend, dispatch=refusing_dispatch))
    comm.clear_configured_comm_backends()
    compiled = torch.compile(model, backend="dbo", options={"split": "always",
                                                            "schedule_candidates": False})

    def restore():
        for c, s in zip(model.kv_caches(), saved):
            c.copy_(s)

    def run(allow_split=True, counts=None):
        return run_step(compiled, step.input_ids, step.positions, step.attn_metadata,
                        counts or step.num_scheduled_tokens, allow_split=allow_split)

    out = []
    with torch.no_grad():
        eager = model(step.input_ids, step.positions, step.attn_metadata)
        for what, failing, how, arg, split in cases:
            restore()
            counts = None
            if rank == failing:
                if how == "site":
                    faults.arm(*arg)
                elif how == "dispatch":
                    calls["left"] = arg
                else:
                    counts = ["x"] * len(step.num_scheduled_tokens)
            try:
                run(allow_split=split, counts=counts)
                err = ("returned", "", None)
            except DboError as e:
                cause = e.__cause__
                err = (type(e).__name__, str(e), type(cause).__name__ if cause else None)
            except Exception as e:  # noqa: BLE001 - a foreign error is a failure of the test
                err = ("FOREIGN " + type(e).__name__, str(e), None)
            faults.disarm()
            calls["left"] = None
            restore()
            good = run(allow_split=split)
            out.append((err, (good - eager).abs().max().item()))
    return out


@pytest.mark.multirank
def test_one_rank_failing_ends_the_step_on_every_rank_with_the_same_error(request):
    results = RANKS.results(request, _body, CASES)
    for i, (what, failing, how, _arg, _split) in enumerate(CASES):
        errs = [r[i][0] for r in results]
        print(what, "->", errs[0][0], errs[0][1][:100])
        kinds = {e[0] for e in errs}
        assert len(kinds) == 1 and "returned" not in kinds and not any(
            k.startswith("FOREIGN") for k in kinds), (what, errs)
        # the same message on every rank; the failing rank adds its own error
        assert len({e[1].split("; this rank:")[0] for e in errs}) == 1, (what, errs)
        assert "; this rank:" in errs[failing][1] and "; this rank:" not in errs[1 - failing][1]
        if how == "counts":
            assert errs[0][0] == "DpVoteError" and f"ranks [{failing}]" in errs[0][1]
        else:
            assert errs[0][0] == "UBatchExecutionError" and f"rank(s) [{failing}]" in errs[0][1]
            assert errs[failing][2] in ("InjectedFault", "CommOpError"), errs[failing]
            assert errs[1 - failing][2] is None
        for r in results:  # the next step is exact on every rank
            assert r[i][1] <= 1e-5, (what, r[i][1])


def _runner_body(rank, world_size):
    import torch.distributed as dist

    from dbo_compile.backend import register
    from dbo_compile.errors import UBatchExecutionError
    from dbo_compile.models.batch import fill_kv_cache, make_step
    from dbo_compile.models.deepseek import DeepseekMoEModel, get_config
    from dbo_compile.runtime.cudagraph_runner import CudaGraphRunner

    register()
    cfg = get_config("tiny", num_layers=1)
    model = DeepseekMoEModel(cfg, ep_group=dist.group.WORLD, seed=0)
    step = make_step(cfg, decode_context_lens=[30] * 8, prefills=[(0, 8)], block_size=16,
                     seed=rank)
    model.allocate_kv_cache(step.num_blocks, step.block_size)
    fill_kv_cache(model, step, seed=rank)
    saved = [c.clone() for c in model.kv_caches()]
    compiled = torch.compile(model, backend="dbo", options={"split": "always",
                                                            "schedule_candidates": False})
    runner = CudaGraphRunner(compiled, buckets=[16], timing_iters=1, device="cpu",
                             max_blocks_per_req=step.attn_metadata.block_table.shape[1])
    with torch.no_grad():
        eager = model(step.input_ids, step.positions, step.attn_metadata)
        runner.capture()
        for c, s in zip(model.kv_caches(), saved):
            c.copy_(s)
        ids = step.input_ids
        if rank == 0:  # a step input the static buffers cannot take: _load fails on rank 0
            ids = step.input_ids.to(torch.int32).unsqueeze(1)
        try:
            out = runner(ids, step.positions, step.attn_metadata, step.num_scheduled_tokens)
            result = ("ok", (out - eager).abs().max().item(), runner.last_choice)
        except UBatchExecutionError as e:
            result = ("UBatchExecutionError", str(e), runner.last_choice)
    return result


@pytest.mark.multirank
def test_runner_load_failure_on_one_rank_replays_padding_and_the_peer_is_right(request):
    """A failure between the vote and the replay (copying the step into the static buffers)
    on one rank: it replays the graph with padding rows, so the peer's replay completes with
    the right output, and only the failing rank raises."""
    results = RANKS.results(request, _runner_body)
    print(results)
    assert results[0][0] == "UBatchExecutionError" and "replayed with padding" in results[0][1]
    assert results[1][0] == "ok" and results[1][1] <= 1e-5
    assert results[0][2] == results[1][2] == (16, "split")


def test_unsplit_graphs_know_the_collectives_to_drain():
    """A graph compiled unsplit (it mixes tokens) still issues collectives: its plan of null
    calls comes from Dynamo's graph, sized by Dynamo's token symbol (here a dynamic graph,
    through run_step), so that a failing rank can complete its peers' collectives."""
    from conftest import last_artifact
    from dbo_compile.models.batch import make_step
    from dbo_compile.models.deepseek import DeepseekMoEModel, get_config
    from dbo_compile.runtime.engine import run_step
    from dbo_compile.schedule import NullArg

    class MixesTokens(DeepseekMoEModel):
        def forward(self, input_ids, positions, attn_metadata):
            out = super().forward(input_ids, positions, attn_metadata)
            return out - out.amax(dim=0, keepdim=True)

    cfg = get_config("tiny", num_layers=2)
    model = MixesTokens(cfg, seed=0)
    step = make_step(cfg, decode_context_lens=[30] * 12, prefills=[], block_size=16)
    model.allocate_kv_cache(step.num_blocks, step.block_size)
    with torch.no_grad():
        run_step(torch.compile(model, backend="dbo"), step.input_ids, step.positions,
                 step.attn_metadata, step.num_scheduled_tokens)
    art = last_artifact()
    assert not art.is_split and art.unsplit_plan is not None
    assert [c.name for c in art.unsplit_plan][:1] and len(art.unsplit_plan) == 4
    x = art.unsplit_plan[0].args[0]
    assert isinstance(x, NullArg) and x.dims(10) == [10, cfg.hidden_size]


# the two-rank tests' bodies run on one group of 2 ranks, launched once (tests/shared_ranks.py)
RANKS = SharedRanks(2, timeout_s=400, calls={
    "test_one_rank_failing_ends_the_step_on_every_rank_with_the_same_error": (_body, (CASES,)),
    "test_runner_load_failure_on_one_rank_replays_padding_and_the_peer_is_right":
        (_runner_body, ()),
})
