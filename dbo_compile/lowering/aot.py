"""The AOTAutograd trace the lowering runs (of the whole graph or of one decoder layer), and
the lazily generated GraphModules it builds."""

from __future__ import annotations

import logging
from typing import Any, Sequence

import torch
import torch.fx as fx
from torch._functorch.aot_autograd import aot_module_simplified
from torch.fx._lazy_graph_module import _LazyGraphModule

log = logging.getLogger(__name__)


def graph_module(root: torch.nn.Module | fx.GraphModule, graph: fx.Graph,
                 class_name: str = "GraphModule") -> fx.GraphModule:
    """A GraphModule that generates its Python code only when it is first called or its
    ``code`` read (torch's ``_LazyGraphModule``, as Inductor uses it): the pipeline's big
    graphs (lowered, split, joined) are rewritten by several passes, and the split graphs are
    never called (their units are), but an eager ``recompile`` of a 61-layer graph costs half
    a second each time."""
    return _LazyGraphModule(root, graph, class_name=class_name)



def trace(gm: fx.GraphModule, fakes: Sequence[Any]) -> fx.GraphModule:
    """AOTAutograd's functional inference graph of ``gm`` on ``fakes`` (two traces: metadata
    collection, then the functionalised graph).

    Outside Dynamo's TracingContext: AOT would otherwise trace in Dynamo's fake mode and
    ShapeEnv (detect_fake_mode prefers the ambient context), re-fakeify our inputs there and
    silently drop the symbolic token dim of a static Dynamo graph instead of specialising it
    in our ``shape_env``, where :func:`~dbo_compile.lowering.aten.lower_to_aten`'s checks see it.
    """
    captured: dict[str, fx.GraphModule] = {}

    def fw_compiler(aten_gm: fx.GraphModule, _inputs: Any) -> Any:
        captured["gm"] = aten_gm
        return aten_gm.forward

    with torch.no_grad(), torch._guards.tracing(None):
        aot_module_simplified(gm, list(fakes), fw_compiler=fw_compiler,
                              keep_inference_input_mutations=True)
    return captured["gm"]
