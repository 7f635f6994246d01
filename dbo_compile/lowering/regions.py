"""Inline Dynamo's nested compile regions (``invoke_subgraph``) into one flat graph."""

from __future__ import annotations

import logging
import operator
from typing import Any

import torch
import torch.fx as fx

from dbo_compile.errors import UnsplittableGraphError

log = logging.getLogger(__name__)


def inline_regions(gm: fx.GraphModule) -> int:
    """Inline every ``invoke_subgraph`` call of Dynamo's graph in place; returns how many.

    A decoder layer marked with :func:`torch.compiler.nested_compile_region` is traced by
    Dynamo once and called as ``invoke_subgraph(subgraph, identifier, *operands)`` at every
    layer that reuses the trace (Dynamo's subgraph reuse: a 61-layer graph traces one layer,
    not 61). Every pass here works on one flat graph, so the calls are replaced by copies of
    their subgraph's nodes (the ``getitem`` users by the copied outputs), as Dynamo's own
    ``inline_invoke_subgraph`` option does, and each copy's ``nn_module_stack`` is rewritten
    from the call site that traced the subgraph to its own call site (``layers.0`` ->
    ``layers.7``), so that :func:`trace_by_layers` still sees one run per decoder layer and
    lowers the repeated ones once. Nested regions are inlined first.
    """
    hop = getattr(torch.ops.higher_order, "invoke_subgraph", None)
    if hop is None:
        return 0
    calls = list(gm.graph.find_nodes(op="call_function", target=hop))
    if not calls:
        return 0
    traced_at: dict[str, str | None] = {}  # subgraph -> the innermost module path of its trace
    count = 0
    for node in calls:
        target = str(node.args[0].target)
        sub = getattr(gm, target)
        if target not in traced_at:
            count += inline_regions(sub)
            traced_at[target] = _innermost_path(node)
        _inline_call(gm, node, sub, traced_at[target])
        count += 1
    for target in traced_at:
        gm.delete_submodule(target)
    return count


def _innermost_path(node: fx.Node) -> str | None:
    stack = node.meta.get("nn_module_stack") or {}
    return next(reversed(stack.values()))[0] if stack else None


def _moved_stack(inner: dict, outer: dict, traced_at: str | None, here: str | None) -> dict:
    """``inner`` (a subgraph node's module stack, traced at ``traced_at``) as seen from a call
    at ``here`` under ``outer``: paths under ``traced_at`` move under ``here``."""

    def move(s: Any) -> Any:
        if isinstance(s, str) and traced_at and here and s.startswith(traced_at):
            return here + s[len(traced_at):]
        return s

    stack = dict(outer)
    for key, (path, *rest) in inner.items():
        stack.setdefault(move(key), (move(path), *rest))
    return stack


def _inline_call(gm: fx.GraphModule, node: fx.Node, sub: fx.GraphModule,
                 traced_at: str | None) -> None:
    here, outer = _innermost_path(node), node.meta.get("nn_module_stack") or {}
    env: dict[fx.Node, Any] = dict(zip(sub.graph.find_nodes(op="placeholder"), node.args[2:]))
    with gm.graph.inserting_before(node):
        for n in sub.graph.nodes:
            if n.op in ("placeholder", "output"):
                continue
            if _float_for_tensor(n, env):  # Dynamo's stamp-out passed the float itself
                env[n] = env[n.args[0]]
                continue
            if n.op == "get_attr":  # a constant of the subgraph: hoisted onto gm
                name = f"_region_{str(node.args[0].target)}_{n.target.replace('.', '_')}"
                if not hasattr(gm, name):
                    setattr(gm, name, getattr(sub, n.target))
                env[n] = gm.graph.get_attr(name)
                env[n].meta = dict(n.meta)
                continue
            env[n] = gm.graph.node_copy(n, lambda a: env[a])
            if "nn_module_stack" in n.meta:
                env[n].meta["nn_module_stack"] = _moved_stack(
                    n.meta["nn_module_stack"], outer, traced_at, here)
    outputs = sub.graph.output_node().args[0]
    for user in list(node.users):
        if user.op == "call_function" and user.target is operator.getitem:
            user.replace_all_uses_with(env.get(outputs[user.args[1]], outputs[user.args[1]]))
            gm.graph.erase_node(user)
    if node.users:
        raise UnsplittableGraphError(
            f"a nested compile region's result is used other than by index at {node.name}; "
            "return a tuple of tensors from the region")
    get_attr = node.args[0]
    gm.graph.erase_node(node)
    if not get_attr.users:
        gm.graph.erase_node(get_attr)


def _float_for_tensor(n: fx.Node, env: dict[fx.Node, Any]) -> bool:
    """``n`` is ``ph.item()`` of a subgraph placeholder traced as a 0-dim tensor (a float
    attribute Dynamo passed as a tensor: ``dynamic=True``, or a float that changed between
    calls) whose operand at this call is the float itself: torch 2.13's stamp-out of a reused
    region resolves a captured float attribute to its value, not to the tensor. The value is
    what ``.item()`` would read."""
    if n.op != "call_method" or n.target != "item" or not n.args:
        return False
    ph = n.args[0]
    if not isinstance(ph, fx.Node) or ph.op != "placeholder":
        return False
    operand = env.get(ph)
    value = operand.meta.get("example_value") if isinstance(operand, fx.Node) else operand
    return isinstance(value, (float, torch.SymFloat))
