"""Infer each node's token dim from symbolic shapes and reject graphs that mix tokens.

A graph can be cut into ubatches along the token dim only if every op computes row ``i`` of its
output from row ``i`` of its token-indexed inputs (*row-local*), so that running the graph on a
slice of the tokens gives the same slice of the result. The lowered graph is traced with the
token count (and the request count of the attention metadata) as symbols, so a value is
token-indexed exactly when the symbol appears in its shape.

The rules, and the test of one op against them, are :mod:`~dbo_compile.passes.row_local`'s.

:func:`annotate_token_dims` raises :class:`~dbo_compile.errors.UnsplittableGraphError` naming
the first offending node; the backend then compiles the graph unsplit.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable

import sympy
import torch
import torch.fx as fx

from dbo_compile.errors import UnsplittableGraphError
from dbo_compile.passes.manager import CompileState, GraphPass
from dbo_compile.passes.meta import dbo_meta
from dbo_compile.passes.row_local import (
    has_symbols,
    is_token_indexed,
    token_dims_of,
    why_not_row_local,
)
from dbo_compile.signature import OutputSpec

log = logging.getLogger(__name__)


def annotate_token_dims(graph: fx.Graph, token_symbols: Iterable[sympy.Symbol],
                        request_symbols: Iterable[sympy.Symbol] = ()) -> None:
    """Set ``meta["dbo"]["token_dim"]`` on every node and check the graph is row-local.

    Args:
        graph: a lowered ATen graph whose ``node.meta["val"]`` carry symbolic shapes.
        token_symbols: the symbols of the token dim (and of the request dim of the metadata).
        request_symbols: those of ``token_symbols`` that are request dims (messages about a
            node that mixes requests name the request dim and its metadata field).

    Raises:
        UnsplittableGraphError: a node mixes tokens across the split; the message names it.
    """
    syms = frozenset(token_symbols)
    if not syms:
        raise UnsplittableGraphError("no token-indexed graph input (nothing to split along)")
    for node in graph.nodes:
        if node.op == "output":
            continue
        val = node.meta.get("val")
        try:
            dims = token_dims_of(val, syms)
        except UnsplittableGraphError as e:
            raise UnsplittableGraphError(
                f"node {node.name} ({node.target}): {e}; only dim 0 may be the token dim"
            ) from None
        is_tok = any(d == 0 for d in dims)
        if isinstance(val, torch.SymInt) and has_symbols(val.node.expr, syms):
            is_tok = True  # a per-ubatch size
        dbo_meta(node)["token_dim"] = 0 if is_tok else None
        if node.op != "call_function":
            continue
        reads_tokens = any(is_token_indexed(a) for a in node.all_input_nodes)
        if reads_tokens or is_tok:
            why = why_not_row_local(node, syms)
            if why is not None:
                raise UnsplittableGraphError(_mixing_reason(node, why, frozenset(request_symbols)))


def _mixing_reason(node: fx.Node, why: str, request_syms: frozenset) -> str:
    """The message for ``node``, which mixes the rows of a token dim (``why``): when every
    indexed value it reads is request-indexed (dim 0 a request count), it names the request
    dim and the metadata field it comes from."""
    indexed = [a for a in node.all_input_nodes if is_token_indexed(a)]
    dim0 = [_dim0_symbols(a) for a in indexed]
    if request_syms and indexed and all(d and d <= request_syms for d in dim0):
        fields = sorted({f for a in indexed for f in _metadata_fields(a)})
        where = f" {', '.join(fields)}" if fields else " request-indexed metadata"
        return (f"node {node.name} ({node.target}) reads{where} along the request dim "
                f"({why.replace('token dim', 'request dim')}): the runtime rebuilds "
                "request-indexed metadata per ubatch (each ubatch sees only its own requests, "
                "offsets re-based), so a model may read it only through dbo ops. Pass the "
                "indices of the tokens to gather as a token-indexed input, or gather outside "
                "the compiled region.")
    return (f"node {node.name} ({node.target}) mixes tokens across the split: {why}. "
            "Move it out of the compiled region or make it row-local.")


def _dim0_symbols(node: fx.Node) -> frozenset:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor) and val.dim() and isinstance(val.shape[0], torch.SymInt):
        return frozenset(val.shape[0].node.expr.free_symbols)
    return frozenset()


def _metadata_fields(node: fx.Node) -> set[str]:
    """The attention-metadata fields (``meta["dbo"]["field"]`` of the placeholders, set by
    the pipeline's lowering) ``node`` is computed from."""
    from_fields: set[str] = set()
    seen: set[fx.Node] = set()
    todo = [node]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "placeholder" and dbo_meta(n).get("field"):
            from_fields.add(dbo_meta(n)["field"])
        todo += n.all_input_nodes
    return from_fields


def check_outputs(graph: fx.Graph, token_symbol: sympy.Symbol | None = None
                  ) -> tuple[OutputSpec, ...]:
    """Every graph output must be token-indexed (concatenated per ubatch), a size of the token
    count (evaluated once, at the step's count) or token-free.

    Returns:
        The outputs' :class:`~dbo_compile.signature.OutputSpec` (:func:`output_specs`).

    Raises:
        UnsplittableGraphError: an output depends on tokens without a token dim, or its token
            dim is not a multiple of the token count (a request-indexed output: a request
            cut in two would appear in both ubatches).
    """
    out = next(n for n in graph.nodes if n.op == "output")
    per_ubatch = _per_ubatch_nodes(graph)
    specs = output_specs(graph, token_symbol)
    for i, (arg, spec) in enumerate(zip(out.args[0], specs)):
        if not (isinstance(arg, fx.Node) and arg in per_ubatch):
            continue
        if not is_token_indexed(arg):
            raise UnsplittableGraphError(
                f"output {i} ({arg.name}) depends on the tokens but has no token dim; its "
                "per-ubatch values cannot be concatenated"
            )
        if token_symbol is not None and spec.kind not in ("token", "size"):
            raise UnsplittableGraphError(
                f"output {i} ({arg.name}) has dim 0 {_dim0_text(arg)}, not a multiple of the "
                "token count: a request-indexed output cannot be joined from the ubatches (a "
                "request cut in two is in both); return token-indexed values, or compute it "
                "outside the compiled region")
    return specs


def _dim0_text(node: fx.Node) -> str:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor) and val.dim():
        return str(val.shape[0])
    return repr(val)


def output_specs(graph: fx.Graph, token_symbol: sympy.Symbol | None) -> tuple[OutputSpec, ...]:
    """What each output of ``graph`` is (:class:`~dbo_compile.signature.OutputSpec`), from
    its value's symbolic shape (``meta["val"]``, or Dynamo's ``meta["example_value"]``):
    a tensor of dim 0 ``c * T`` (``T`` = ``token_symbol``, ``c`` a positive int) is a token
    output, one without ``T`` shared, an int ``c * T + b`` a size, a non-node a constant;
    anything else (no token symbol known, other symbols) ``"unknown"``."""
    out = next(n for n in graph.nodes if n.op == "output")
    args = out.args[0] if isinstance(out.args[0], (tuple, list)) else (out.args[0],)
    specs = []
    for arg in args:
        if not isinstance(arg, fx.Node):
            specs.append(OutputSpec("const"))
            continue
        val = arg.meta.get("val", arg.meta.get("example_value"))
        specs.append(_output_spec(val, token_symbol))
    return tuple(specs)


def _output_spec(val: Any, t: sympy.Symbol | None) -> OutputSpec:
    if isinstance(val, (int, float, bool)) or val is None:
        return OutputSpec("const")
    if isinstance(val, torch.SymInt):
        expr = val.node.expr
        if not expr.free_symbols:
            return OutputSpec("const")
        linear = _linear_in(expr, t)
        return OutputSpec("size", *linear) if linear is not None else OutputSpec("unknown")
    if not isinstance(val, torch.Tensor):
        return OutputSpec("unknown")
    if val.dim() == 0:
        return OutputSpec("shared")
    d0 = val.shape[0]
    expr = d0.node.expr if isinstance(d0, torch.SymInt) else sympy.Integer(d0)
    if not expr.free_symbols:
        return OutputSpec("shared")
    linear = _linear_in(expr, t)
    if linear is not None and linear[0] >= 1 and linear[1] == 0:
        return OutputSpec("token", linear[0])
    return OutputSpec("unknown")


def _linear_in(expr: Any, t: sympy.Symbol | None) -> tuple[int, int] | None:
    """``(a, b)`` with ``expr == a * t + b`` for ints ``a``, ``b``, else ``None``."""
    if t is None or expr.free_symbols != {t}:
        return None
    a, b = sympy.expand(expr).as_independent(t, as_Add=True)[::-1]
    coef = sympy.simplify(a / t)
    if coef.free_symbols or not coef.is_integer or not sympy.sympify(b).is_integer:
        return None
    return int(coef), int(b)



def per_ubatch_nodes(graph: fx.Graph) -> set[fx.Node]:
    """Nodes that depend on a token-indexed value (after :func:`annotate_token_dims`)."""
    return _per_ubatch_nodes(graph)


def _per_ubatch_nodes(graph: fx.Graph) -> set[fx.Node]:
    """Nodes that depend on a token-indexed value (their value differs per ubatch)."""
    dep: set[fx.Node] = set()
    for node in graph.nodes:
        if is_token_indexed(node) or any(a in dep for a in node.all_input_nodes):
            dep.add(node)
    return dep


def _run(gm: fx.GraphModule, st: CompileState) -> None:
    annotate_token_dims(gm.graph, st.token_symbols, st.request_symbols)
    st.output_specs = check_outputs(gm.graph, st.token_symbol)


PASS = GraphPass("token_dim", _run, reads=("token_symbols", "request_symbols", "token_symbol"),
                 writes=("output_specs",), changes_graph=False)
