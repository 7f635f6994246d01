"""The drain plan of a program: its collectives as null calls, for the step transaction.

A rank whose step failed issues the collectives its program had not issued yet with null
payloads, so that its peers' collectives complete (:mod:`~dbo_compile.runtime.step_txn`).
The plan is made once, when the program is compiled, from its graph (and for a split program
its schedule's host order); the artifacts keep it as ``split_plan`` / ``unsplit_plan``.
"""

from __future__ import annotations

from typing import Any

import torch.fx as fx

from dbo_compile.ops.comm import comm_backend_of
from dbo_compile.ops.registry import comm_nodes, comm_plan
from dbo_compile.schedule import CommPlan, Schedule

__all__ = ["drain_plan"]


def drain_plan(graph: fx.Graph, token_symbol: Any, schedule: Schedule | None = None) -> CommPlan:
    """The collectives a program issues, as null calls, for the step transaction
    (:func:`~dbo_compile.ops.registry.comm_plan`; ``schedule``: the split program's host
    order); ``None`` (not drainable: a failing rank raises at once) when a comm op's backend
    has a dispatch handle or a receive phase (DeepEP: a null combine needs the handle of a
    real dispatch), or an op has no null call."""
    for node in comm_nodes(graph):
        backend = comm_backend_of(node)
        if backend is not None and (backend.handle or backend.receive is not None):
            return None
    return comm_plan(graph, token_symbol, schedule)
