"""Lower a Dynamo FX graph to a functional ATen inference graph with a symbolic token dim.

Dynamo hands the backend a torch-level graph whose shapes may be static (the first compile
specialises every size). We re-trace it through AOTAutograd (functionalised, inference,
input mutations kept in the graph) on fake inputs whose token dim — and the request dim of the
attention metadata — are fresh symbols, so one graph serves every ubatch size and
``node.meta["val"]`` tells which values are token-indexed.

Graph inputs are classified from Dynamo's sources (``node.meta["grapharg"].source``):

- ``shared``: module parameters and buffers (weights, KV caches) and 0-dim tensors: one tensor
  for all ubatches;
- ``token``: any other tensor input; dim 0 is the token dim and is sliced per ubatch;
- ``request``: a field of :class:`~dbo_compile.metadata.AttentionMetadata` indexed by
  request (``query_start_loc``, ``seq_lens``, ...): rebuilt per ubatch by the runtime;
- ``size``: a SymInt input that is the size of another input's dim (dynamic Dynamo graphs);
- ``scalar``: any other non-tensor input (passed through unchanged); a SymInt that is not a
  size (a dynamic int argument) is traced as its own symbol, shared by the ubatches;
- ``host_mirror``: a host copy of a metadata field (``seq_lens_cpu``, ...): the runtime's
  host decisions read it; a graph reading one is compiled unsplit (it is not cut per ubatch).

Duck shaping is off (``ShapeEnv(duck_shape=False)``): in a pure-decode step the request count
equals the token count, and the two must stay distinct symbols (``docs/design.md``).

The package: the inputs' classification and the floats folded (:mod:`.inputs`), the lowering
itself (:mod:`.aten`), Dynamo's nested compile regions inlined first (:mod:`.regions`), the
AOT trace once per distinct decoder layer (:mod:`.layers`) and the AOTAutograd call they share
(:mod:`.aot`).
"""

from dbo_compile.lowering.aot import graph_module
from dbo_compile.lowering.aten import LoweredGraph, lower_to_aten
from dbo_compile.lowering.inputs import (
    baked_inputs,
    classify_inputs,
    fold_tensorified_floats,
    folded_floats,
    source_name,
)
from dbo_compile.lowering.layers import layer_of
from dbo_compile.lowering.regions import inline_regions

__all__ = ["LoweredGraph", "baked_inputs", "classify_inputs", "fold_tensorified_floats",
           "folded_floats", "graph_module", "inline_regions", "layer_of", "lower_to_aten",
           "source_name"]
