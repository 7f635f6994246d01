"""The ``find_comm`` pass: the comm ops of the lowered graph, the yield points of the split.

A graph without one has nothing to overlap: it is unsplittable
(:class:`~dbo_compile.errors.UnsplittableGraphError`, with ``row_local`` set: the token-dim
pass ran, so padding rows cannot change real rows, and the inputs the graph writes in place;
``folds_token_rows``: a state thread folds token rows, which padding rows would be counted in).
"""

from __future__ import annotations

import torch.fx as fx

from dbo_compile.errors import UnsplittableGraphError
from dbo_compile.ops.registry import comm_nodes, comm_op_names
from dbo_compile.passes import state_threads
from dbo_compile.passes.manager import CompileState, GraphPass

__all__ = ["PASS"]


def _run(gm: fx.GraphModule, st: CompileState) -> None:
    st.comms = comm_nodes(gm.graph)
    if not st.comms:
        e = UnsplittableGraphError(
            f"the graph has no comm op (one of {', '.join(comm_op_names())}): nothing to "
            "overlap. Route the MoE all-to-all through torch.ops.dbo.moe_dispatch / "
            "moe_combine (or dispatch / combine) inside the compiled region; a dense model "
            "has nothing for DBO to hide"
        )
        e.row_local = True  # the token-dim pass passed: padding rows cannot change real rows
        e.state_inputs = state_threads.state_inputs(gm.graph, st.specs)
        # ... but they would be counted in a fold of token rows (Dynamo's graph has no mask)
        e.folds_token_rows = any(seg.kind == "fold" for t in st.threads for seg in t.segments)
        raise e


PASS = GraphPass("find_comm", _run, reads=("specs", "threads"), writes=("comms",),
                 changes_graph=False)
