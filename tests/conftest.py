"""Shared fixtures: the tiny MoE model, realistic steps, compile helpers."""

from __future__ import annotations

import pytest
import torch

from dbo_compile.backend import compiled_artifacts, register, reset_artifacts


def pytest_configure(config):
    register()


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
