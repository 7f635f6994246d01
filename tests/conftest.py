"""Shared fixtures: the tiny MoE model, realistic steps, compile helpers."""

from __future__ import annotations

import os

import pytest
import torch

from cpu_durations import CpuDurations
from dbo_compile.backend import compiled_artifacts, register, reset_artifacts


def pytest_addoption(parser):
    parser.addoption("--cpu-durations", type=int, default=None, metavar="N",
                     help="show the N tests with the most CPU time, spawned ranks included "
                          "(0: all), the CPU time per file and the total")


def pytest_configure(config):
    register()
    top = config.getoption("--cpu-durations")
    if top is not None:
        config.pluginmanager.register(CpuDurations(top), "cpu-durations")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    reset_artifacts()
    # a compile with cache_dir points Inductor's and Triton's caches under it (process-wide)
    env = {k: os.environ.get(k) for k in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    yield
    torch._dynamo.reset()
    for k, v in env.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def pytest_collection_modifyitems(config, items):
    has_cuda = torch.cuda.is_available()
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip)


def last_artifact():
    arts = compiled_artifacts()
    assert arts, "the dbo backend compiled nothing"
    return arts[-1]
