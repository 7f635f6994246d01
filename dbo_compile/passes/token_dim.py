"""Infer each node's token dim from symbolic shapes and reject graphs that mix tokens.

A graph can be cut into ubatches along the token dim only if every op computes row ``i`` of its
output from row ``i`` of its token-indexed inputs (*row-local*), so that running the graph on a
slice of the tokens gives the same slice of the result. The lowered graph is traced with the
token count (and the request count of the attention metadata) as symbols, so a value is
token-indexed exactly when the symbol appears in its shape.

Rules (conservative: an op we cannot prove row-local makes the graph unsplittable):

1. The token symbol may appear only in dim 0 of a value (``[num_tokens, ...]``, or
   ``[c * num_tokens, ...]`` after dispatch).
2. An op reading a token-indexed value must be row-local: pointwise ops, views that keep dim 0,
   matmuls whose contracted dim is not the token dim, reductions/scans/sorts over other dims,
   embedding lookups, our comm and attention ops (which keep each ubatch's tokens consistent).
3. Reductions, scans, sorts, gathers, scatters, ``cat`` or slices *along* dim 0, and ops that
   create position-dependent rows (``arange``, random) mix tokens across the split.

``check_splittable`` raises :class:`~dbo_compile.errors.UnsplittableGraphError` naming the first
offending node; the backend then compiles the graph unsplit.
"""

from __future__ import annotations

import logging
import operator
from typing import Any, Iterable

import sympy
import torch
import torch.fx as fx

from dbo_compile.errors import UnsplittableGraphError
from dbo_compile.passes.comm_ops import comm_kind, is_c10d_wait
from dbo_compile.passes.meta import dbo_meta

log = logging.getLogger(__name__)

aten = torch.ops.aten

_VIEW_OPS = {
    "view", "_unsafe_view", "reshape", "unsqueeze", "expand", "clone", "contiguous", "alias",
    "detach", "_to_copy", "to", "lift_fresh_copy", "view_as", "expand_as", "flatten",
    "unflatten", "type_as", "_reshape_alias", "as_strided_scatter", "squeeze",
}
_DIM_OPS = {  # op name -> positional index of its dim argument (default if absent)
    "softmax": 1, "_softmax": 1, "log_softmax": 1, "_log_softmax": 1, "cumsum": 1,
    "cumprod": 1, "sort": 1, "argsort": 1, "topk": 2, "select": 1, "narrow": 1,
    "split": 2, "split_with_sizes": 2, "chunk": 2, "unbind": 1, "gather": 1,
    "scatter": 1, "scatter_add": 1, "scatter_reduce": 1, "index_select": 1, "index_add": 1,
    "index_copy": 1, "index_fill": 1, "cat": 1, "stack": 1, "transpose": 1, "slice": 1,
    "squeeze": 1, "diff": 2, "roll": 2, "flip": 1, "max": 1, "min": 1, "mode": 1, "median": 1,
    "kthvalue": 2, "cummax": 1, "cummin": 1, "logcumsumexp": 1,
}
_DEFAULT_DIM = {"topk": -1, "sort": -1, "argsort": -1, "cat": 0, "stack": 0, "split": 0,
                "split_with_sizes": 0, "chunk": 0, "unbind": 0, "slice": 0, "select": None,
                "diff": -1}
_REDUCTIONS = {"sum", "mean", "amax", "amin", "prod", "var", "std", "any", "all", "logsumexp",
               "norm", "linalg_vector_norm", "argmax", "argmin", "var_mean", "std_mean",
               "count_nonzero", "nansum"}
_MATMULS = {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "_weight_int8pack_mm",
            "_grouped_mm", "addmv", "mv"}
_CREATION_OK = {"empty", "zeros", "ones", "full", "new_empty", "new_zeros", "new_ones",
                "new_full", "empty_like", "zeros_like", "ones_like", "full_like",
                "scalar_tensor", "empty_strided", "empty_permuted", "fill"}
_NORMS = {"native_layer_norm", "layer_norm", "rms_norm", "_fused_rms_norm", "native_group_norm"}
_ROW_LOCAL_OTHER = {"embedding", "where", "masked_fill", "clamp", "sym_size", "sym_numel",
                    "sym_stride", "_assert_tensor_metadata", "copy", "lift_fresh"}


def _exprs(val: Any) -> list[list[sympy.Expr | int]]:
    """Shapes of every tensor in ``val`` as lists of sympy expressions / ints."""
    out = []
    for t in _tensors(val):
        out.append([s.node.expr if isinstance(s, torch.SymInt) else int(s) for s in t.shape])
    return out


def _tensors(val: Any) -> list[torch.Tensor]:
    if isinstance(val, torch.Tensor):
        return [val]
    if isinstance(val, (list, tuple)):
        return [t for v in val for t in _tensors(v)]
    return []


def _has(expr: Any, syms: frozenset) -> bool:
    return isinstance(expr, sympy.Basic) and bool(expr.free_symbols & syms)


def token_dims_of(val: Any, syms: frozenset) -> list[int | None]:
    """Per tensor in ``val``: 0 if dim 0 carries a token symbol, ``None`` if none does.

    Raises:
        UnsplittableGraphError: the token symbol appears in a dim other than 0.
    """
    dims = []
    for shape in _exprs(val):
        bad = [d for d, e in enumerate(shape) if d > 0 and _has(e, syms)]
        if bad:
            raise UnsplittableGraphError(f"token dim found at dim {bad[0]} of shape {shape}")
        dims.append(0 if shape and _has(shape[0], syms) else None)
    return dims


def _node_token(node: Any) -> bool:
    return isinstance(node, fx.Node) and dbo_meta(node).get("token_dim") == 0


def _arg(node: fx.Node, pos: int, name: str, default: Any) -> Any:
    if len(node.args) > pos:
        return node.args[pos]
    return node.kwargs.get(name, default)


def _norm_dims(dims: Any, ndim: int) -> list[int] | None:
    if dims is None:
        return None
    if isinstance(dims, int):
        dims = [dims]
    dims = list(dims)
    if not dims:
        return None
    return [d % max(ndim, 1) for d in dims]


def _ndim(node: Any) -> int:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return val.dim() if isinstance(val, torch.Tensor) else 0


def _flat_inputs(node: fx.Node) -> Iterable[fx.Node]:
    return node.all_input_nodes


def _why_not_row_local(node: fx.Node, syms: frozenset) -> str | None:
    """Why ``node`` (reading token-indexed values) mixes tokens; ``None`` if it is row-local."""
    target = node.target
    if target is operator.getitem or comm_kind(node) is not None or is_c10d_wait(node):
        return None
    if not isinstance(target, torch._ops.OpOverload):
        if callable(target) and getattr(target, "_dbo_row_local", False):
            return None
        return f"call of {getattr(target, '__name__', target)!r} is not known to be row-local"
    if target.namespace == "dbo":
        return None  # our attention / comm ops keep every ubatch's tokens consistent
    if target.namespace not in ("aten", "prims"):
        if getattr(target, "_dbo_row_local", False):
            return None
        return f"custom op {target} is not known to be row-local along the token dim"
    name = target._opname.rstrip("_")
    tok_inputs = [a for a in _flat_inputs(node) if _node_token(a)]
    first = node.args[0] if node.args else None
    if torch.Tag.pointwise in target.tags or name in _ROW_LOCAL_OTHER:
        return None
    if name in _CREATION_OK:
        return None
    if name in _VIEW_OPS:
        if name == "squeeze":
            dims = _norm_dims(_arg(node, 1, "dim", None), _ndim(first))
            if dims is None or 0 in dims:
                # squeeze() without dims could drop a 1-row token dim
                return "squeeze over the token dim"
        return None
    if name in ("permute",):
        perm = _norm_dims(_arg(node, 1, "dims", None), _ndim(first))
        return None if perm and perm[0] == 0 else "permute moves the token dim off dim 0"
    if name in ("t", "numpy_T", "mT"):
        return f"{name} moves the token dim off dim 0"
    if name in _MATMULS:
        # the token value must be a row operand: for mm(a, b) only a may carry tokens
        operands = {"mm": [1], "matmul": [1], "mv": [1], "addmm": [2], "addmv": [2],
                    "linear": [1], "bmm": [], "baddbmm": [], "_weight_int8pack_mm": [1],
                    "_grouped_mm": [1]}[name]
        for i in operands:
            if len(node.args) > i and _node_token(node.args[i]):
                return f"{name} contracts over the token dim (operand {i} is token-indexed)"
        return None
    if name in _NORMS:
        return None  # normalised dims are trailing; dim 0 is never normalised
    if name in _REDUCTIONS:
        if not (isinstance(first, fx.Node) and _node_token(first)):
            return None
        dims = _norm_dims(_arg(node, 1, "dim", None), _ndim(first))
        if dims is None:
            return f"{name} reduces over every dim, the token dim included"
        return f"{name} reduces over the token dim" if 0 in dims else None
    if name in _DIM_OPS:
        if name in ("cat", "stack"):
            tensors = node.args[0]
            if not any(_node_token(t) for t in tensors):
                return None
            ndim = _ndim(tensors[0])
        else:
            if not (isinstance(first, fx.Node) and _node_token(first)):
                return None
            ndim = _ndim(first)
        dim = _arg(node, _DIM_OPS[name], "dim", _DEFAULT_DIM.get(name, 0))
        if dim is None:
            return f"{name} without a dim"
        d = dim % max(ndim, 1) if name != "stack" else dim % (ndim + 1)
        if d != 0:
            return None
        if name == "slice":
            start = _arg(node, 2, "start", None)
            end = _arg(node, 3, "end", None)
            step = _arg(node, 4, "step", 1)
            if start in (None, 0) and step == 1 and (end is None or (isinstance(end, int) and end >= 2**62)):
                return None
        return f"{name} along the token dim"
    if name in ("index", "index_put", "_unsafe_index", "_unsafe_index_put"):
        indices = _arg(node, 1, "indices", [])
        if indices and indices[0] is not None and _node_token(first):
            return f"{name} with an index over the token dim"
        return None
    if name in ("arange", "randn", "rand", "randint", "randperm", "normal", "bernoulli",
                "rand_like", "randn_like", "native_dropout", "uniform"):
        return f"{name} gives rows that depend on their position or on RNG state"
    del tok_inputs
    return f"aten.{target._opname} is not known to be row-local along the token dim"


def annotate_token_dims(graph: fx.Graph, token_symbols: Iterable[sympy.Symbol]) -> None:
    """Set ``meta["dbo"]["token_dim"]`` on every node and check the graph is row-local.

    Args:
        graph: a lowered ATen graph whose ``node.meta["val"]`` carry symbolic shapes.
        token_symbols: the symbols of the token dim (and of the request dim of the metadata).

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
        if isinstance(val, torch.SymInt) and _has(val.node.expr, syms):
            is_tok = True  # a per-ubatch size
        dbo_meta(node)["token_dim"] = 0 if is_tok else None
        if node.op != "call_function":
            continue
        reads_tokens = any(_node_token(a) for a in node.all_input_nodes)
        if reads_tokens or is_tok:
            why = _why_not_row_local(node, syms)
            if why is not None:
                raise UnsplittableGraphError(
                    f"node {node.name} ({node.target}) mixes tokens across the split: {why}. "
                    "Move it out of the compiled region or make it row-local."
                )


def check_outputs(graph: fx.Graph) -> None:
    """Every graph output must be token-indexed (concatenated per ubatch) or token-free.

    Raises:
        UnsplittableGraphError: an output depends on tokens without a token dim.
    """
    out = next(n for n in graph.nodes if n.op == "output")
    per_ubatch = _per_ubatch_nodes(graph)
    for i, arg in enumerate(out.args[0]):
        if isinstance(arg, fx.Node) and arg in per_ubatch and not _node_token(arg):
            raise UnsplittableGraphError(
                f"output {i} ({arg.name}) depends on the tokens but has no token dim; its "
                "per-ubatch values cannot be concatenated"
            )


def _per_ubatch_nodes(graph: fx.Graph) -> set[fx.Node]:
    """Nodes that depend on a token-indexed value (their value differs per ubatch)."""
    dep: set[fx.Node] = set()
    for node in graph.nodes:
        if _node_token(node) or any(a in dep for a in node.all_input_nodes):
            dep.add(node)
    return dep
