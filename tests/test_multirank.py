"""The Gloo launcher (dbo_compile/testing/multirank.py)."""

from __future__ import annotations

import os

import pytest
import torch

from dbo_compile.errors import MultirankError
from dbo_compile.testing import run_multirank
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
