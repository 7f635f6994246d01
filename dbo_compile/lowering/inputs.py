"""Classify the inputs of a Dynamo graph; find the floats Dynamo passed as tensors.

Graph inputs are classified from Dynamo's sources (``node.meta["grapharg"].source``): see
:mod:`dbo_compile.lowering` for the kinds.
"""

from __future__ import annotations

import logging
import re
from typing import Any, Sequence

import torch
import torch.fx as fx

from dbo_compile.errors import UnsplittableGraphError
from dbo_compile.metadata import FIELD_LAYOUT
from dbo_compile.signature import InputSpec

log = logging.getLogger(__name__)

_SHARED_SOURCE = re.compile(r"(_parameters\[|_buffers\[|_modules\[|^G\[|^L\['self'\]|\['self'\]\.)")
_SIZE_SOURCE = re.compile(r"^(?P<base>.*)\.size\(\)\[(?P<dim>\d+)\]$")
_SHAPE_LIKE = re.compile(r"\.(size|stride|numel|storage_offset|dim)\(\)")


def source_name(node: fx.Node) -> str:
    """The Dynamo source of a placeholder (``L['input_ids']``), ``""`` without one."""
    ga = node.meta.get("grapharg")
    if ga is None or getattr(ga, "source", None) is None:
        return ""
    name = ga.source.name
    return name() if callable(name) else str(name)


def classify_inputs(gm: fx.GraphModule, example_inputs: Sequence[Any],
                    kinds: Sequence[str] | None = None) -> list[InputSpec]:
    """Classify the placeholders of ``gm`` (see the module docstring).

    Args:
        gm: the Dynamo graph (or any FX graph when ``kinds`` is given).
        example_inputs: one value per placeholder.
        kinds: explicit kinds per placeholder for graphs that did not come from Dynamo
            (``"shared"``, ``"token"``, ``"request"``, ``"scalar"``); metadata fields are
            recognised by placeholder name then.

    Raises:
        UnsplittableGraphError: a SymInt input whose source we cannot map.
    """
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(example_inputs):
        raise UnsplittableGraphError(
            f"graph has {len(placeholders)} inputs but {len(example_inputs)} example inputs"
        )
    sources = [source_name(n) for n in placeholders]
    by_source = {s: i for i, s in enumerate(sources) if s}
    specs = []
    for i, (node, value, source) in enumerate(zip(placeholders, example_inputs, sources)):
        field = None
        mirror = None
        for f in FIELD_LAYOUT:
            if source.endswith(f".{f}") or (not source and node.name.endswith(f)):
                field = f
            if source.endswith(f".{f}_cpu"):
                mirror = f
        if mirror is not None and kinds is None:
            # the runtime's host copy of a field: never cut per ubatch (_lower refuses it)
            specs.append(InputSpec(i, node.name, source, "host_mirror", mirror))
            continue
        if kinds is not None:
            kind = kinds[i]
            if kind == "token" and field is None:
                field = None
        elif isinstance(value, torch.Tensor):
            if _SHARED_SOURCE.search(source) or value.dim() == 0:
                kind = "shared"  # a 0-dim tensor has no token dim (e.g. a cache's step counter)
            elif field is not None:
                kind = FIELD_LAYOUT[field]
            else:
                kind = "token"
        elif isinstance(value, torch.SymInt):
            m = _SIZE_SOURCE.match(source)
            if m is None and source and not _SHAPE_LIKE.search(source):
                # a dynamic int argument (a cache's Python step counter, logits_to_keep):
                # the same for every ubatch, kept symbolic so the graph serves every value
                specs.append(InputSpec(i, node.name, source, "scalar"))
                continue
            if m is None and not node.users:
                # an unused layout symbol (input_ids.stride()[0] of a strided view, a
                # storage offset): Dynamo adds it, nothing reads it
                specs.append(InputSpec(i, node.name, source, "scalar"))
                continue
            if m is None or m.group("base") not in by_source:
                raise UnsplittableGraphError(
                    f"SymInt input {node.name} (source {source!r}) is not the size of a graph "
                    "input; cannot tell whether it is per-ubatch"
                )
            specs.append(InputSpec(i, node.name, source, "size", None,
                                   (by_source[m.group("base")], int(m.group("dim")))))
            continue
        else:
            kind = "scalar"
        if kind in ("token", "request") and not (isinstance(value, torch.Tensor) and value.dim() >= 1):
            raise UnsplittableGraphError(
                f"input {node.name} (source {source!r}) is classified {kind}-indexed but is not a "
                "tensor with a dim 0"
            )
        specs.append(InputSpec(i, node.name, source, kind, field if kind != "shared" else None))
    if kinds is None:
        _check_scalars_are_not_token_counts(specs, placeholders)
    return specs


def _check_scalars_are_not_token_counts(specs: list[InputSpec], placeholders: list[fx.Node]) -> None:
    """An int argument equal to the token count at trace time gets the token dim's symbol
    (Dynamo's duck sizing, e.g. ``forward(x, n)`` with ``x.view(n, -1)``). As a scalar it would
    reach every ubatch unchanged, the full count where the ubatch has half the rows."""
    def example(node: fx.Node) -> Any:
        return node.meta.get("example_value", node.meta.get("val"))

    def symbols(v: Any) -> set:
        return set(v.node.expr.free_symbols) if isinstance(v, torch.SymInt) else set()

    token_symbols: set = set()
    for spec, node in zip(specs, placeholders):
        v = example(node)
        if spec.kind == "token" and isinstance(v, torch.Tensor) and v.dim():
            token_symbols |= symbols(v.shape[0])
    for spec, node in zip(specs, placeholders):
        if spec.kind == "scalar" and symbols(example(node)) & token_symbols:
            raise UnsplittableGraphError(
                f"int input {node.name} (source {spec.source!r}) equals the token count (Dynamo "
                "gave it the token dim's symbol), but as an argument it would reach every ubatch "
                "as the whole step's count. Derive it from the tokens (x.shape[0]) or use -1 in "
                "views")


def fold_tensorified_floats(gm: fx.GraphModule, example_inputs: Sequence[Any]
                            ) -> tuple[fx.GraphModule, tuple[tuple[int, float], ...]]:
    """``gm``, or a copy of it with each float Dynamo passed as a 0-dim float64 tensor and
    read only by ``.item()`` (``torch.compile(dynamic=True)`` does that to module attributes
    such as an attention scale or a norm's eps) replaced by its value, and the
    ``(input index, value)`` pairs folded.

    Re-traced, ``.item()`` would give a data-dependent ``SymFloat`` that ops taking a
    ``float`` (``dbo.attention``'s ``scale``) refuse. Dynamo did not guard on the value, so
    the artifact must check it every call (a host read of a CPU tensor) and run the original
    graph when it changed (``SplitArtifact.float_guards``).
    """
    folds = folded_floats(gm, example_inputs)
    if not folds:
        return gm, ()
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    copied = [n for n in graph.nodes if n.op == "placeholder"]
    for i, value in folds:
        for user in list(copied[i].users):
            user.replace_all_uses_with(value)
            graph.erase_node(user)
    folded = fx.GraphModule(gm, graph)
    return folded, tuple(folds)


def folded_floats(gm: fx.GraphModule, example_inputs: Sequence[Any]
                  ) -> tuple[tuple[int, float], ...]:
    """The ``(input index, value)`` pairs :func:`fold_tensorified_floats` folds into ``gm``
    (a Dynamo graph and its example inputs): the floats Dynamo passed as 0-dim float64 CPU
    tensors that only ``.item()`` reads."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    folds = []
    for i, (node, value) in enumerate(zip(placeholders, example_inputs)):
        grapharg = node.meta.get("grapharg")
        if (isinstance(value, torch.Tensor) and not isinstance(value, torch._subclasses.FakeTensor)
                and value.dim() == 0 and value.dtype == torch.float64 and value.device.type == "cpu"
                and getattr(grapharg, "pass_arg_as_tensor", False) and node.users
                and all(u.op == "call_method" and u.target == "item" for u in node.users)):
            folds.append((i, float(value)))
    return tuple(folds)


def baked_inputs(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> tuple[tuple[int, Any], ...]:
    """The inputs of ``gm`` whose *values*, not only their types and shapes, the lowered graph
    (and every program made from it) is a function of, as ``(input index, value)`` in input
    order: the floats :func:`fold_tensorified_floats` folds (:func:`folded_floats`) and the
    scalar inputs that are not symbolic (a Python int, float, bool, ... traced as a constant,
    :func:`~dbo_compile.lowering.aten.lower_to_aten`). A tensor input's values and a SymInt's
    are read at run time. Another value of one of these needs another lowered graph: the
    compile cache keys by them."""
    baked = dict(folded_floats(gm, example_inputs))
    for i, value in enumerate(example_inputs):
        if not isinstance(value, (torch.Tensor, torch.SymInt, torch.SymFloat, torch.SymBool)):
            baked[i] = value
    return tuple(sorted(baked.items()))
