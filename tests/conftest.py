"""Shared fixtures: the tiny MoE model, realistic steps, compile helpers."""

from __future__ import annotations

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
    yield
    torch._dynamo.reset()


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
