"""FX graphs as plain, picklable data, node by node with their names (the compile cache's
graphs, :mod:`dbo_compile.codegen.cache`): a graph rebuilt by :func:`load_graph` is the same
program text as the one :func:`dump_graph` read, so Inductor's FX-graph cache, keyed by that
text, hits for it too. Targets are stored by qualified name (ops by namespace, name and
overload; functions by module and name); a local function cannot be stored.
"""

from __future__ import annotations

import builtins
import dataclasses
import importlib
import operator
from typing import Any

import torch
import torch.fx as fx

from dbo_compile.lowering import graph_module
from dbo_compile.schedule import CommPlan

__all__ = ["DeferredGraph", "dump_graph", "dump_plan", "dump_target", "load_graph", "load_plan"]


class _Ref:
    """A node argument in a dumped graph (the name of the node it is)."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def __reduce__(self) -> tuple:
        return (_Ref, (self.name,))


def dump_target(target: Any) -> tuple:
    """``target`` (an FX node's target) by name: what :func:`_load_target` resolves.

    Raises:
        ValueError: a target that cannot be named (a local function, a bound method).
    """
    if isinstance(target, str):
        return ("str", target)
    if isinstance(target, torch._ops.OpOverload):
        return ("op", target.namespace, target._opname, target._overloadname)
    if isinstance(target, torch._ops.HigherOrderOperator):
        return ("hop", target.name())
    module, qualname = getattr(target, "__module__", None), getattr(target, "__qualname__", "")
    if module in ("_operator", "operator"):
        return ("fn", "operator", qualname)
    if module and "<locals>" not in qualname and "." not in qualname:
        return ("fn", module, qualname)
    raise ValueError(f"cannot store the FX target {target!r}")


def _load_target(spec: tuple) -> Any:
    kind = spec[0]
    if kind == "str":
        return spec[1]
    if kind == "op":
        return getattr(getattr(getattr(torch.ops, spec[1]), spec[2]), spec[3])
    if kind == "hop":
        return getattr(torch.ops.higher_order, spec[1])
    module = importlib.import_module(spec[1]) if spec[1] != "builtins" else builtins
    return getattr(operator if spec[1] == "operator" else module, spec[2])


def dump_plan(plan: CommPlan) -> Any:
    """A program's :data:`~dbo_compile.schedule.CommPlan` as plain data (its ops by name)."""
    if plan is None:
        return None
    return [dataclasses.replace(call, op=dump_target(call.op)) for call in plan]


def load_plan(data: Any) -> CommPlan:
    """The :data:`~dbo_compile.schedule.CommPlan` :func:`dump_plan` stored."""
    if data is None:
        return None
    return tuple(dataclasses.replace(call, op=_load_target(call.op)) for call in data)


class _Target:
    """An op passed as an argument (``auto_functionalized(dbo.attention, ...)``), by name."""

    __slots__ = ("spec",)

    def __init__(self, spec: tuple):
        self.spec = spec

    def __reduce__(self) -> tuple:
        return (_Target, (self.spec,))


def _dump_arg(a: Any) -> Any:
    if isinstance(a, fx.Node):
        return _Ref(a.name)
    if isinstance(a, (torch._ops.OpOverload, torch._ops.HigherOrderOperator)):
        return _Target(dump_target(a))
    if isinstance(a, tuple):
        return tuple(_dump_arg(x) for x in a)
    if isinstance(a, list):  # fx's immutable_list too
        return [_dump_arg(x) for x in a]
    if isinstance(a, dict):
        return {k: _dump_arg(v) for k, v in a.items()}
    return a


def dump_graph(gm: fx.GraphModule) -> dict[str, Any]:
    """``gm`` as plain data (node names, ops, targets by name, arguments; the module's
    attributes that ``get_attr`` nodes read): what :func:`load_graph` rebuilds it from.

    Raises:
        ValueError: a target that cannot be named (a local function); the entry is not written.
    """
    nodes = []
    attrs = {}
    for n in gm.graph.nodes:
        nodes.append((n.op, n.name, dump_target(n.target), _dump_arg(n.args),
                      _dump_arg(n.kwargs)))
        if n.op == "get_attr":
            obj: Any = gm
            for part in n.target.split("."):
                obj = getattr(obj, part)
            attrs[n.target] = obj
    return {"nodes": nodes, "attrs": attrs, "class_name": type(gm).__name__}


def load_graph(data: dict[str, Any]) -> fx.GraphModule:
    """The GraphModule :func:`dump_graph` dumped (same node names, so the same code)."""
    graph = fx.Graph()
    env: dict[str, fx.Node] = {}

    def resolve(a: Any) -> Any:
        if isinstance(a, _Ref):
            return env[a.name]
        if isinstance(a, _Target):
            return _load_target(a.spec)
        if isinstance(a, (list, tuple)):
            return type(a)(resolve(x) for x in a)
        if isinstance(a, dict):
            return {k: resolve(v) for k, v in a.items()}
        return a

    for op, name, target, args, kwargs in data["nodes"]:
        node = graph.create_node(op, _load_target(target), resolve(args), resolve(kwargs), name)
        if node.name != name:
            raise ValueError(f"node {name} came back as {node.name}")
        env[name] = node
    root = torch.nn.Module()
    for target, value in data["attrs"].items():
        *path, last = target.split(".")
        owner = root
        for part in path:
            if not hasattr(owner, part):
                owner.add_module(part, torch.nn.Module())
            owner = getattr(owner, part)
        setattr(owner, last, value)
    return graph_module(root, graph, class_name=data.get("class_name", "GraphModule"))


class DeferredGraph:
    """A dumped graph rebuilt at its first use (call or attribute): the lowered graph of a
    warm start, the unsplit program, is big and often never run by an eager split step."""

    def __init__(self, data: dict[str, Any]):
        self._data = data
        self._gm: fx.GraphModule | None = None

    @property
    def module(self) -> fx.GraphModule:
        if self._gm is None:
            self._gm = load_graph(self._data)
            self._data = None
        return self._gm

    def __call__(self, *args: Any) -> Any:
        return self.module(*args)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.module, name)
