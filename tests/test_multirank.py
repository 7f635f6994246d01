"""The Gloo launcher (dbo_compile/testing/multirank.py)."""

from __future__ import annotations

import os

import pytest
import torch

from dbo_compile.errors import MultirankError
from dbo_compile.testing import run_multirank, run_multirank_each
from dbo_compile.testing.multirank import START_METHODS


def _threads(rank, world_size):
    return torch.get_num_threads()


@pytest.mark.multirank
@pytest.mark.parametrize("env, want", [(None, 1), ({"OMP_NUM_THREADS": "3"}, 3)])
def test_each_rank_runs_the_threads_its_environment_asks_for(env, want):
    """A rank imports torch (unpickling its function) before the launcher sets its
    environment: ``OMP_NUM_THREADS`` (default 1) came too late, and every rank ran as many
    threads as the machine has cores, spinning against the other ranks' (the soak's steps
    took 10x the CPU time on 2 cores)."""
    assert run_multirank(_threads, 2, env=env) == [want, want]


def _env_var(rank, world_size, name):
    return os.environ.get(name)


@pytest.mark.multirank
@pytest.mark.parametrize("start_method", START_METHODS)
def test_each_rank_sees_the_callers_environment_now(start_method, monkeypatch):
    """A forked rank starts with the fork server's environment, from when it started (the
    first call): a variable the caller set or removed since must reach the rank as it is (one
    rank: a spawned one costs ~4 s of CPU)."""
    monkeypatch.delenv("DBO_TEST_LAUNCHER_MARK", raising=False)
    assert run_multirank(_env_var, 1, args=("DBO_TEST_LAUNCHER_MARK",),
                         start_method=start_method) == [None]
    monkeypatch.setenv("DBO_TEST_LAUNCHER_MARK", "set after the first call")
    assert run_multirank(_env_var, 1, args=("DBO_TEST_LAUNCHER_MARK",),
                         start_method=start_method) == ["set after the first call"]


def test_an_unknown_start_method_is_an_error():
    with pytest.raises(MultirankError, match="start_method='fork'.*forkserver"):
        run_multirank(_threads, 2, start_method="fork")


def _draw_and_compile(rank, world_size, x):
    """A body that leaves state behind: an artifact, a Dynamo cache entry, a drawn RNG."""
    import torch.distributed as dist

    from dbo_compile.backend import compiled_artifacts

    before = len(compiled_artifacts())
    torch.compile(torch.nn.Linear(4, 4), backend="dbo")(torch.randn(3, 4))
    t = torch.ones(1) * (rank + x)
    dist.all_reduce(t)
    return before, torch.rand(1).item(), t.item()


def _raise_on_rank_1(rank, world_size):
    if rank == 1:
        raise ValueError("rank 1 says no")
    return rank


@pytest.mark.multirank
def test_each_body_runs_on_one_group_as_if_alone():
    """run_multirank_each: every body gets its own per-rank results, and starts from a reset
    Dynamo, ``reset()`` (here: an empty artifact list) and the rank's starting RNG state (what a
    fresh launch gives it)."""
    from dbo_compile.backend import reset_artifacts

    out = run_multirank_each({"a": (_draw_and_compile, (1,)), "b": (_draw_and_compile, (10,))}, 2,
                             timeout_s=120, reset=reset_artifacts)
    assert list(out) == ["a", "b"]
    assert [r[2] for r in out["a"]] == [3.0, 3.0] and [r[2] for r in out["b"]] == [21.0, 21.0]
    assert [r[0] for r in out["a"] + out["b"]] == [0, 0, 0, 0]  # the artifacts were reset
    assert out["a"][0][1] == out["b"][0][1]  # the same RNG state at each body's start


@pytest.mark.multirank
def test_a_failing_body_fails_itself_and_the_bodies_after_it_only():
    out = run_multirank_each({"ok": (_env_var, ("HOME",)), "bad": (_raise_on_rank_1, ()),
                              "after": (_env_var, ("HOME",))}, 2, timeout_s=60)
    assert out["ok"] == [os.environ.get("HOME")] * 2
    assert isinstance(out["bad"], MultirankError) and "rank 1 says no" in str(out["bad"])
    assert isinstance(out["after"], MultirankError) and "did not run" in str(out["after"])
    with pytest.raises(MultirankError, match="start_method='fork'"):
        run_multirank_each({"ok": (_env_var, ("HOME",))}, 1, start_method="fork")
