"""The Gloo launcher (dbo_compile/testing/multirank.py)."""

from __future__ import annotations

import pytest
import torch

from dbo_compile.testing import run_multirank


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
