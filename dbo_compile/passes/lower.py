"""The ``lower`` pass: Dynamo's graph -> the functional ATen graph the split works on.

It classifies the graph inputs (:func:`~dbo_compile.lowering.classify_inputs`), refuses a
graph that reads a host mirror of the attention metadata or has no token input, folds the
floats Dynamo passed as tensors (:func:`~dbo_compile.lowering.fold_tensorified_floats`) and
lowers the graph with a symbolic token dim (:func:`~dbo_compile.lowering.lower_to_aten`);
each placeholder that is a metadata field gets ``meta["dbo"]["field"]``.
"""

from __future__ import annotations

import torch.fx as fx

from dbo_compile import lowering
from dbo_compile.errors import UnsplittableGraphError
from dbo_compile.passes.manager import CompileState, GraphPass
from dbo_compile.passes.meta import dbo_meta

__all__ = ["PASS"]


def _run(gm: fx.GraphModule, st: CompileState) -> fx.GraphModule:
    st.specs = lowering.classify_inputs(gm, st.example_inputs, st.input_kinds)
    mirror = next((s for s in st.specs if s.kind == "host_mirror"), None)
    if mirror is not None:
        raise UnsplittableGraphError(
            f"the model reads the host mirror {mirror.field}_cpu ({mirror.source}) of the "
            "attention metadata: mirrors serve the runtime's host decisions and are not cut "
            f"per ubatch; read the device field {mirror.field} instead")
    if not any(s.kind == "token" for s in st.specs):
        raise UnsplittableGraphError("the graph has no token-indexed tensor input")
    gm, st.float_guards = lowering.fold_tensorified_floats(gm, st.example_inputs)
    lowered = lowering.lower_to_aten(gm, st.example_inputs, st.specs)
    st.token_symbols = lowered.token_symbols
    st.token_symbol = lowered.token_symbol
    st.request_symbols = lowered.request_symbols
    placeholders = [n for n in lowered.gm.graph.nodes if n.op == "placeholder"]
    for spec, node in zip(st.specs, placeholders):
        if spec.field is not None:
            dbo_meta(node)["field"] = spec.field
    return lowered.gm


PASS = GraphPass("lower", _run, reads=("example_inputs", "input_kinds"),
                 writes=("specs", "float_guards", "token_symbols", "token_symbol",
                         "request_symbols"))
