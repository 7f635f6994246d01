"""Result pools: a comm backend declares how many of its results may be alive and how many of
its calls may be in flight (``ResultPool``); both schedulers honour it or the graph is compiled
unsplit with the reason (issue 16, finding 5; docs/design.md invariant 3).

The backend of issue 16's repro: results are zero-copy views of two receive workspaces used in
turn (call k writes workspace k % 2), so call k + 2 overwrites the result of call k. Without a
declaration the default list schedule issues layer 1's dispatch of ubatch 0 before layer 0's
experts of ubatch 1 read their receive: wrong answers. One process, EP = 1 (the rotating
backend wraps "local"), the tiny DeepSeek-style model.
"""

from __future__ import annotations

import pytest
import torch

import dbo_compile.ops  # noqa: F401
from conftest import last_artifact
from dbo_compile.errors import CommBackendError, ScheduleError, UBatchExecutionError
from dbo_compile.ops.comm import watch
from dbo_compile.models.batch import fill_kv_cache, make_step
from dbo_compile.models.deepseek import DeepseekMoEModel, get_config
from dbo_compile.ops.comm import (
    CommBackend,
    ResultPool,
    get_comm_backend,
    register_comm_backend,
    run_watched,
    watching_results,
)
from dbo_compile.passes import stream_assign
from dbo_compile.passes.pools import pool_plan_of
from dbo_compile.schedule import Schedule

CASES = [("list", 2), ("naive", 2), ("list", 3), ("naive", 3), ("list", 4), ("naive", 4),
         ("staged", 2), ("staged-d2", 3)]


class Rotating:
    """Results live in ``slots`` workspaces used round-robin (zero-copy views), shared by the
    dispatches and the combines (one counter), as in issue 16's repro."""

    def __init__(self, slots: int = 2, capacity: int = 1 << 16):
        self.base, self.calls = get_comm_backend("local"), 0
        self.slots = [{} for _ in range(slots)]
        self.capacity = capacity

    def _place(self, tensors):
        slot = self.slots[self.calls % len(self.slots)]
        self.calls += 1
        out = []
        for j, t in enumerate(tensors):
            key = (j, t.dtype)
            if key not in slot:
                slot[key] = torch.empty(self.capacity, dtype=t.dtype)
            v = slot[key][: t.numel()].view(t.shape)
            v.copy_(t)
            out.append(v)
        return out

    def dispatch(self, x, topk_ids, topk_weights, num_experts, group_name):
        return tuple(self._place(self.base.dispatch(x, topk_ids, topk_weights, num_experts,
                                                    group_name)))

    def combine(self, y, group_name):
        return self._place([self.base.combine(y, group_name)])[0]


def _register(live: int | None, slots: int = 2) -> None:
    rot = Rotating(slots)
    pools = () if live is None else (ResultPool("workspaces", live=live),)
    register_comm_backend(CommBackend("rotating", rot.dispatch, rot.combine,
                                      "test: rotating receive workspaces", pools=pools))


@pytest.fixture(scope="module")
def model_and_step():
    cfg = get_config("tiny", num_layers=2)
    model = DeepseekMoEModel(cfg, ep_group=None, seed=0)
    step = make_step(cfg, decode_context_lens=[], prefills=[(0, 64)], block_size=16, seed=0)
    model.allocate_kv_cache(step.num_blocks, step.block_size)
    fill_kv_cache(model, step, seed=0)
    caches = [c.clone() for c in model.kv_caches()]
    with torch.no_grad():
        eager = model(step.input_ids, step.positions, step.attn_metadata)
    return model, step, caches, eager


def _run(model_and_step, **options):
    model, step, caches, eager = model_and_step
    torch._dynamo.reset()
    for c, s in zip(model.kv_caches(), caches):
        c.copy_(s)
    compiled = torch.compile(model, backend="dbo", options={
        "split": "always", "schedule_candidates": False, "comm_backend": "rotating", **options})
    with torch.no_grad():
        out = compiled(step.input_ids, step.positions, step.attn_metadata)
    return last_artifact(), (out - eager).abs().max().item()


def _refusal(info) -> CommBackendError:
    """The backend's own error inside the step's ``UBatchExecutionError``."""
    cause = info.value
    while cause is not None and not isinstance(cause, CommBackendError):
        cause = cause.__cause__
    assert isinstance(cause, CommBackendError), info.value
    return cause


@pytest.mark.parametrize("scheduler,n", CASES)
def test_undeclared_reuse_is_refused_at_the_first_call(model_and_step, scheduler, n):
    """Issue 29, finding 4: without the declaration the list schedule read a result after the
    call two later overwrote it (errors 2.4-3.3 with 2-4 ubatches, no error). The first call
    of the program now sees a result in the storage of an earlier call's live result and
    refuses, naming the declaration to add."""
    _register(live=None)
    with pytest.raises(UBatchExecutionError, match="ResultPool") as info:
        _run(model_and_step, scheduler=scheduler, num_ubatches=n)
    msg = str(_refusal(info))
    assert "'rotating'" in msg and "live=" in msg and "register_comm_backend" in msg, msg
    assert last_artifact().is_split
    # the program stays unchecked after a refusal: the next call refuses too
    with pytest.raises(UBatchExecutionError, match="ResultPool"):
        _run(model_and_step, scheduler=scheduler, num_ubatches=n)


def test_undeclared_reuse_is_refused_by_the_unsplit_program(model_and_step):
    """The unsplit program's first call checks too (its reuse is the same undeclared
    contract, whichever program runs first)."""
    _register(live=None)
    with pytest.raises(UBatchExecutionError, match="ResultPool") as info:
        _run(model_and_step, split="never")
    assert "dbo.moe_dispatch" in str(_refusal(info))
    assert last_artifact().stats.unsplit_steps == 1


def test_undeclared_reuse_is_refused_at_the_graph_runners_warm_up(model_and_step):
    """CudaGraphRunner's warm-up runs each program eagerly before capturing it: the refusal
    comes there, before any graph is captured or served."""
    from dbo_compile.runtime.cudagraph_runner import CudaGraphRunner

    _register(live=None)
    model = model_and_step[0]
    compiled = torch.compile(model, backend="dbo", options={
        "split": "always", "comm_backend": "rotating", "schedule_candidates": False})
    runner = CudaGraphRunner(compiled, [32], max_blocks_per_req=8, block_size=16,
                             timing_iters=1)
    with pytest.raises(Exception, match="ResultPool"):
        runner.capture()
    _register(live=2)
    runner = CudaGraphRunner(torch.compile(model, backend="dbo", options={
        "split": "always", "comm_backend": "rotating", "schedule_candidates": False}), [32],
        max_blocks_per_req=8, block_size=16, timing_iters=1)
    runner.capture()  # declared: warmed up and captured


def test_the_watch_checks_a_programs_first_call_only():
    """``run_watched`` checks the first call of a program that passes, and no call after it
    (a set lookup); a refused program stays unchecked."""
    _register(live=None)
    x, ids, w = torch.randn(4, 8), torch.zeros(4, 2, dtype=torch.int64), torch.rand(4, 2)

    def program(backend):  # call 3 writes the workspace of call 1, whose result is alive
        first = torch.ops.dbo.dispatch(x, ids, w, 2, "", backend)
        torch.ops.dbo.dispatch(x, ids, w, 2, "", backend)
        return first, torch.ops.dbo.dispatch(x, ids, w, 2, "", backend)

    with pytest.raises(CommBackendError, match="result 0 of dbo.dispatch call #3 of backend "
                       "'rotating' lies in the storage of result 0 of dbo.dispatch call #1"):
        run_watched(program, "rotating")
    assert program not in watch._WATCHED
    assert watch._WATCH.depth == 0 and not watch._WATCH.seen
    run_watched(program, "local")  # results of their own: checked, passes
    assert program in watch._WATCHED
    run_watched(program, "rotating")  # checked already: not watched again
    _register(live=2)
    with watching_results():  # declared: call 3 overwrites call 1, two calls of the pool before
        program("rotating")
    _register(live=3)  # two workspaces declared as three: under-declared is refused too
    with pytest.raises(CommBackendError, match=r"declares ResultPool\('workspaces', live=3\) "
                       r"for 'dispatch', but this call reuses the storage of the pool's call 2 "
                       "calls earlier"):
        with watching_results():
            program("rotating")


def test_the_checker_refuses_the_unconstrained_order(model_and_step):
    """The list schedule compiled without the declaration (refused at its first call, above)
    breaks the declared rule: the checker names the call and the reader it may overtake."""
    _register(live=None)
    with pytest.raises(UBatchExecutionError, match="ResultPool"):
        _run(model_and_step, scheduler="list", num_ubatches=2)
    art = last_artifact()
    _register(live=2)  # the same backend, declared: the plan the scheduler would honour
    plan = pool_plan_of(art.split_gm.graph, art.schedule)
    with pytest.raises(ScheduleError, match="may run before"):
        stream_assign.check_pools(art.schedule, plan)


@pytest.mark.parametrize("scheduler", ["list", "naive", "staged"])
def test_pool_edges_join_readers_to_the_reusing_call(model_and_step, scheduler):
    """With 3 ubatches the two workspaces bind: the scheduler adds reader -> call edges (a
    compute stage before a comm call: event edges), recorded in ``hidden_deps``; without them
    the checker refuses the order."""
    _register(live=2)
    art, err = _run(model_and_step, scheduler=scheduler, num_ubatches=3)
    assert err < 1e-5
    sched = art.schedule
    plan = pool_plan_of(art.split_gm.graph, sched)
    by_id = {u.id: u for u in sched.units}
    pool_edges = [(a, b) for a, b in sched.hidden_deps if b in plan.pool_of]
    assert pool_edges, sched.hidden_deps
    for a, b in pool_edges:  # a reader of the results call b overwrites
        assert by_id[b].kind == "comm" and any(a in r for r in plan.readers.values())
    events = set(sched.event_edges)
    assert any(e in events and by_id[e[0]].stream != by_id[e[1]].stream for e in pool_edges)
    broken = Schedule.from_dict(sched.to_dict())
    broken.deps = [e for e in broken.deps if e not in set(pool_edges)]
    with pytest.raises(ScheduleError, match="may run before"):
        stream_assign.check_pools(broken, plan)


def test_infeasible_pool_is_refused_with_the_reason(model_and_step):
    """Joined experts read both ubatches' dispatch results at once; a pool keeping one result
    cannot hold them: compiled unsplit, the reason names the pool, the answer is eager's."""
    _register(live=1, slots=1)
    art, err = _run(model_and_step, join_experts=True)
    assert not art.is_split
    assert "pool 'workspaces'" in art.reason and "live=1" in art.reason, art.reason
    assert err < 1e-5


def test_infeasible_candidate_is_dropped_primary_kept(model_and_step):
    """Schedule candidates that cannot honour the pool are dropped; the primary (unjoined)
    splits."""
    _register(live=1, slots=1)
    model, step, caches, eager = model_and_step
    for c, s in zip(model.kv_caches(), caches):
        c.copy_(s)
    compiled = torch.compile(model, backend="dbo", options={
        "split": "always", "comm_backend": "rotating",
        "schedule_candidates": ("list+join", "naive")})
    with torch.no_grad():
        out = compiled(step.input_ids, step.positions, step.attn_metadata)
    art = last_artifact()
    assert art.is_split and "list+join" not in art.candidates, list(art.candidates)
    torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-5)


def test_pool_declaration_enters_the_schedule_fingerprint(model_and_step):
    _register(live=2)
    a, _ = _run(model_and_step, scheduler="list", num_ubatches=2)
    _register(live=3, slots=3)
    b, _ = _run(model_and_step, scheduler="list", num_ubatches=2)
    assert a.schedule.fingerprint() != b.schedule.fingerprint()


def test_pool_limits_are_checked():
    with pytest.raises(Exception, match="live=0"):
        ResultPool("p", live=0)
