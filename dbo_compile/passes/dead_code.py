"""The ``dead_code`` pass: drop the nodes of the lowered graph whose values nothing uses
(``fx.Graph.eliminate_dead_code``: impure nodes, in-place writes included, stay). Optional:
the program is the same without it, with the dead nodes split and scheduled too."""

from __future__ import annotations

import torch.fx as fx

from dbo_compile.passes.manager import CompileState, GraphPass

__all__ = ["PASS"]


def _run(gm: fx.GraphModule, st: CompileState) -> None:
    gm.graph.eliminate_dead_code()


PASS = GraphPass("dead_code", _run, optional=True)
