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
   embedding lookups, ops the registry declares row-local (:mod:`dbo_compile.ops.registry`:
   our comm, expert and attention ops, which keep each ubatch's tokens consistent, and user
   ops declared with :func:`~dbo_compile.ops.registry.register_row_local`), and ops batched over dim 0 (``scaled_dot_product_attention`` on ``[batch, heads, seq, d]``
   in the ``[batch, seq, hidden]`` layout: batch ``b`` of the output reads batch ``b`` of
   q/k/v/mask) when every tensor input's dim 0 is the output's or 1 (broadcast).
3. Reductions, scans, sorts, gathers, scatters, ``cat`` or slices *along* dim 0, and ops that
   create position-dependent rows (``arange``, random) mix tokens across the split.
4. One exception to 3, the *row iota*: ``arange(T)`` over the whole token dim (start 0, step 1)
   whose only uses are, through views keeping dim 0, the dim-0 index of an advanced ``index``
   of a ``[T, ...]`` token-indexed tensor (``x[arange(T)[:, None], j]``, how Hugging Face
   builds per-request attention masks). Each ubatch's ``arange(T_u)`` then picks exactly its
   own rows ``0..T_u-1`` of its slice, so ``out[t] = x[t, ...]`` is row-local. Any other use
   of the iota (arithmetic, comparison, indexing a non-token tensor) is rejected.
5. Python arithmetic on sizes (``operator.mul(T, S)`` from ``x.view(batch * seq, -1)`` in a
   dynamic Dynamo graph) is recomputed per ubatch, so it is allowed only where its result is
   used as a size (the shape of a view / expand / new tensor) or in more size arithmetic,
   never as a value.

:func:`annotate_token_dims` raises :class:`~dbo_compile.errors.UnsplittableGraphError` naming
the first offending node; the backend then compiles the graph unsplit.
"""

from __future__ import annotations

import logging
import operator
from typing import Any, Iterable

import sympy
import torch
import torch.fx as fx

from dbo_compile.errors import UnsplittableGraphError
from dbo_compile.ops.registry import comm_kind, is_wait, node_op_info
from dbo_compile.passes.manager import CompileState, GraphPass
from dbo_compile.passes.meta import dbo_meta
from dbo_compile.signature import OutputSpec

log = logging.getLogger(__name__)

aten = torch.ops.aten

_VIEW_OPS = {
    "view", "_unsafe_view", "reshape", "unsqueeze", "expand", "clone", "contiguous", "alias",
    "detach", "_to_copy", "to", "lift_fresh_copy", "view_as", "expand_as", "flatten",
    "unflatten", "type_as", "_reshape_alias", "as_strided_scatter", "squeeze",
}
_DIM_OPS = {  # op name -> positional index of its dim argument (default if absent)
    "softmax": 1, "_softmax": 1, "_safe_softmax": 1, "log_softmax": 1, "_log_softmax": 1, "cumsum": 1,
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
#: ops that compute each index of dim 0 from the same index of their inputs (batched over dim 0)
_BATCHED = {"scaled_dot_product_attention", "_scaled_dot_product_attention_math",
            "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
            "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention"}
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
    """Normalised dims, or ``None`` for "every dim" (also for anything we cannot read, which
    callers then treat as touching the token dim)."""
    if dims is None:
        return None
    if isinstance(dims, int):
        dims = [dims]
    if not isinstance(dims, (list, tuple)) or not all(isinstance(d, int) for d in dims):
        return None
    dims = list(dims)
    if not dims:
        return None
    return [d % max(ndim, 1) for d in dims]


def _ndim(node: Any) -> int:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return val.dim() if isinstance(val, torch.Tensor) else 0


def _is_full_range(node: fx.Node, pos: int) -> bool:
    """``args[pos:pos+3]`` (start, end, step) of a slice op cover the whole dim."""
    start, end, step = (_arg(node, pos, "start", None), _arg(node, pos + 1, "end", None),
                        _arg(node, pos + 2, "step", 1))
    return (start in (None, 0) and step == 1
            and (end is None or (isinstance(end, int) and end >= 2**62)))


def _expr(val: Any) -> Any:
    if isinstance(val, torch.SymInt):
        return val.node.expr
    return sympy.Integer(val) if isinstance(val, int) else None


def _arg_expr(arg: Any) -> Any:
    return _expr(arg.meta.get("val")) if isinstance(arg, fx.Node) else _expr(arg)


def _iota_size(node: fx.Node, syms: frozenset) -> Any:
    """The token symbol ``T`` if ``node`` is ``arange(T)`` (start 0, step 1), else ``None``."""
    if node.op != "call_function" or node.target not in (
            aten.arange.default, aten.arange.start, aten.arange.start_step):
        return None
    if node.target is aten.arange.default:
        start, end, step = 0, _arg(node, 0, "end", None), 1
    else:
        start, end = _arg(node, 0, "start", 0), _arg(node, 1, "end", None)
        step = _arg(node, 2, "step", 1) if node.target is aten.arange.start_step else 1
    end = _arg_expr(end)
    if start != 0 or step != 1 or end not in syms:
        return None
    return end


def _keeps_iota(node: fx.Node) -> bool:
    """``node`` maps a row iota ``[T, ...]`` (value ``t`` in row ``t``) to a row iota: a view
    or expand that keeps dim 0 (same size expression), or a full-range slice along dim 0."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return False
    name = node.target._opname
    src, out = node.args[0] if node.args else None, node.meta.get("val")
    if not (isinstance(src, fx.Node) and isinstance(out, torch.Tensor) and out.dim() >= 1):
        return False
    src_val = src.meta.get("val")
    if not isinstance(src_val, torch.Tensor) or _expr(out.shape[0]) != _expr(src_val.shape[0]):
        return False
    if name == "slice":
        dim = _arg(node, 1, "dim", 0)
        return dim % src_val.dim() != 0 or (
            _arg(node, 2, "start", None) in (None, 0) and _arg(node, 4, "step", 1) == 1)
    if name == "unsqueeze":
        return _arg(node, 1, "dim", 0) % (src_val.dim() + 1) != 0
    return name in ("view", "_unsafe_view", "reshape", "expand", "alias", "clone")


def _row_iota(node: Any, syms: frozenset) -> Any:
    """The token symbol ``T`` if ``node`` is a row iota derived from ``arange(T)``, else ``None``."""
    while isinstance(node, fx.Node):
        size = _iota_size(node, syms)
        if size is not None:
            return size
        if not _keeps_iota(node):
            return None
        node = node.args[0]
    return None


def _is_iota_index(node: fx.Node, index_arg: Any, syms: frozenset) -> bool:
    """``node = index(x, [index_arg, ...])`` picks row ``t`` of ``x`` for output row ``t``: the
    dim-0 index is a row iota over ``T``, ``x`` and the output have dim 0 of size ``T``."""
    if node.target not in (aten.index.Tensor, aten._unsafe_index.Tensor):
        return False
    size = _row_iota(index_arg, syms)
    x, out = node.args[0], node.meta.get("val")
    x_val = x.meta.get("val") if isinstance(x, fx.Node) else None
    if size is None or not isinstance(x_val, torch.Tensor) or not isinstance(out, torch.Tensor):
        return False
    idx_val = index_arg.meta.get("val")
    others = [i for i in _arg(node, 1, "indices", [])[1:] if isinstance(i, fx.Node)]
    # the iota leads the broadcast of the index tensors, so output dim 0 is its dim 0
    leads = all(i.meta["val"].dim() <= idx_val.dim() for i in others)
    return (leads and _expr(x_val.shape[0]) == size and out.dim() >= 1
            and _expr(out.shape[0]) == size)


def _iota_uses_ok(node: fx.Node, syms: frozenset) -> bool:
    """Every use of the row iota ``node`` is the dim-0 index of a row-picking ``index``."""
    for user in node.users:
        if _keeps_iota(user) and user.args[0] is node:
            if not _iota_uses_ok(user, syms):
                return False
            continue
        indices = _arg(user, 1, "indices", None) if user.op == "call_function" else None
        if not (isinstance(indices, (list, tuple)) and indices and indices[0] is node
                and node not in indices[1:] and user.args[0] is not node
                and _is_iota_index(user, node, syms)):
            return False
    return True


_SYM_ARITH = {operator.add, operator.sub, operator.mul, operator.floordiv, operator.mod,
              operator.neg, torch.sym_max, torch.sym_min}
#: op name -> positions of its size-list arguments (a SymInt there is a shape, not a value)
_SIZE_ARGS = {"view": (1,), "_unsafe_view": (1,), "reshape": (1,), "expand": (1,),
              "empty": (0,), "zeros": (0,), "ones": (0,), "full": (0,), "new_empty": (1,),
              "new_zeros": (1,), "new_ones": (1,), "new_full": (1,), "empty_strided": (0, 1),
              "arange": (0, 1)}  # arange itself is checked as a token-shaped node


def _used_as_size_only(node: fx.Node) -> bool:
    """Every user of the SymInt ``node`` takes it as a size (or is more size arithmetic)."""
    for user in node.users:
        if user.op != "call_function":
            return False
        if user.target in _SYM_ARITH:
            continue  # checked on its own
        target = user.target
        if not isinstance(target, torch._ops.OpOverload) or target._opname not in _SIZE_ARGS:
            return False
        positions = _SIZE_ARGS[target._opname]
        for i, a in enumerate(user.args):
            inside = a is node or (isinstance(a, (list, tuple)) and node in a)
            if inside and i not in positions:
                return False
        if any(a is node or (isinstance(a, (list, tuple)) and node in a)
               for a in user.kwargs.values()):
            return False
    return True


def _misaligned(node: fx.Node, token_args: tuple[tuple[int, str], ...]) -> str | None:
    """A row-local op whose token inputs (``token_args`` of its registry record) disagree: one
    has the token dim, another a fixed first dim (built from a token count Dynamo specialised,
    e.g. ``torch.zeros(x.shape[0], k)`` in a static graph). Each ubatch would pair its rows with
    all of the other input's rows."""
    if node.target is not node_op_info(node).op:  # functionalised: arguments by name
        args = [node.kwargs.get(name) for _, name in token_args]
    else:
        args = [_arg(node, i, name, None) for i, name in token_args]
    tok = [a for a in args if _node_token(a)]
    fixed = [a for a in args if isinstance(a, fx.Node) and not _node_token(a)]
    if tok and fixed:
        return (f"its input {fixed[0].name} has a fixed first dim while {tok[0].name} is "
                "token-indexed (the graph was traced with a static token count; mark the "
                "token dim dynamic: torch._dynamo.mark_dynamic(x, 0), or call through "
                "dbo_compile.runtime.engine.run_step)")
    return None


def _why_not_row_local(node: fx.Node, syms: frozenset) -> str | None:
    """Why ``node`` (reading token-indexed values) mixes tokens; ``None`` if it is row-local."""
    target = node.target
    info = node_op_info(node)  # through auto_functionalized(_v2): the op's own record
    if info is not None and info.row_local:
        return _misaligned(node, info.token_args)  # keeps every ubatch's tokens consistent
    if target is operator.getitem or comm_kind(node) is not None or is_wait(node):
        return None
    if target in _SYM_ARITH:
        if _used_as_size_only(node):
            return None  # a per-ubatch size (rule 5)
        return f"{getattr(target, '__name__', target)} of the token count is used as a value"
    if not isinstance(target, torch._ops.OpOverload):
        return f"call of {getattr(target, '__name__', target)!r} is not known to be row-local"
    if target.namespace not in ("aten", "prims"):
        return (f"custom op {target} is not known to be row-local along the token dim "
                "(declare it with dbo_compile.ops.register_row_local if it is)")
    name = target._opname.rstrip("_")
    first = node.args[0] if node.args else None
    for i, a in enumerate(list(node.args) + list(node.kwargs.values())):
        if (isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.SymInt)
                and _has(a.meta["val"].node.expr, syms)
                and not (i < len(node.args) and i in _SIZE_ARGS.get(name, ()))):
            # the count differs per ubatch: x * num_tokens would change the answer
            return f"{name} uses the token count {a.name} as a value (rule 5)"
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
    if name in ("slice_scatter", "select_scatter"):
        # out = base with src written into a slice of dim ``dim`` (functionalised
        # ``x[..., a:b].copy_(y)``): row-local unless that dim is the token dim
        dim = _arg(node, 2, "dim", 0)
        if dim % max(_ndim(node), 1) != 0:
            return None
        if name == "slice_scatter" and _is_full_range(node, 3):
            return None  # src replaces every row: from x[:, ...] = y on a whole tensor
        return f"{name} along the token dim"
    if name in _BATCHED:
        outs = _tensors(node.meta.get("val"))
        batch = _expr(outs[0].shape[0]) if outs and outs[0].dim() else None
        args = [a for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]
        for a in args:
            val = a.meta["val"]
            d0 = _expr(val.shape[0]) if val.dim() else None
            if batch is None or d0 not in (batch, 1):
                return (f"{name} input {a.name} has dim 0 {d0}, neither the batch dim {batch} "
                        "nor 1")
        return None
    if name in _REDUCTIONS:
        if not (isinstance(first, fx.Node) and _node_token(first)):
            return None
        pos = 2 if name == "linalg_vector_norm" else 1  # (x, ord, dim) vs (x, dim)
        dims = _norm_dims(_arg(node, pos, "dim", None), _ndim(first))
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
        if isinstance(dim, (list, tuple)):  # roll / flip take a list of dims
            if dim and all(d % max(ndim, 1) != 0 for d in dim):
                return None
            return f"{name} along the token dim (dims {list(dim)})"
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
        if name in ("index", "_unsafe_index") and indices and _is_iota_index(node, indices[0], syms):
            return None  # x[arange(T)[:, None], j]: row t reads row t (rule 4)
        if indices and indices[0] is not None and _node_token(first):
            return f"{name} with an index over the token dim"
        return None
    if name == "arange" and _iota_size(node, syms) is not None and _iota_uses_ok(node, syms):
        return None  # a row iota used only to pick each row's own row (rule 4)
    if name in ("arange", "randn", "rand", "randint", "randperm", "normal", "bernoulli",
                "rand_like", "randn_like", "native_dropout", "uniform"):
        return f"{name} gives rows that depend on their position or on RNG state"
    return f"aten.{target._opname} is not known to be row-local along the token dim"


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
        if isinstance(val, torch.SymInt) and _has(val.node.expr, syms):
            is_tok = True  # a per-ubatch size
        dbo_meta(node)["token_dim"] = 0 if is_tok else None
        if node.op != "call_function":
            continue
        reads_tokens = any(_node_token(a) for a in node.all_input_nodes)
        if reads_tokens or is_tok:
            why = _why_not_row_local(node, syms)
            if why is not None:
                raise UnsplittableGraphError(_mixing_reason(node, why, frozenset(request_symbols)))


def _mixing_reason(node: fx.Node, why: str, request_syms: frozenset) -> str:
    """The message for ``node``, which mixes the rows of a token dim (``why``): when every
    indexed value it reads is request-indexed (dim 0 a request count), it names the request
    dim and the metadata field it comes from."""
    indexed = [a for a in node.all_input_nodes if _node_token(a)]
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
        if not _node_token(arg):
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


def is_token_indexed(node: Any) -> bool:
    """``node``'s dim 0 is the token (or request) dim (after :func:`annotate_token_dims`)."""
    return _node_token(node)


def per_ubatch_nodes(graph: fx.Graph) -> set[fx.Node]:
    """Nodes that depend on a token-indexed value (after :func:`annotate_token_dims`)."""
    return _per_ubatch_nodes(graph)


def _per_ubatch_nodes(graph: fx.Graph) -> set[fx.Node]:
    """Nodes that depend on a token-indexed value (their value differs per ubatch)."""
    dep: set[fx.Node] = set()
    for node in graph.nodes:
        if _node_token(node) or any(a in dep for a in node.all_input_nodes):
            dep.add(node)
    return dep


def _run(gm: fx.GraphModule, st: CompileState) -> None:
    annotate_token_dims(gm.graph, st.token_symbols, st.request_symbols)
    st.output_specs = check_outputs(gm.graph, st.token_symbol)


PASS = GraphPass("token_dim", _run, reads=("token_symbols", "request_symbols", "token_symbol"),
                 writes=("output_specs",), changes_graph=False)
