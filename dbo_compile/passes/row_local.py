"""Whether an op computes row ``i`` of its output from row ``i`` of its token-indexed inputs
(*row-local*), the rules :mod:`~dbo_compile.passes.token_dim` checks every node against.

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
"""

from __future__ import annotations

import logging
import operator
from typing import Any

import sympy
import torch
import torch.fx as fx

from dbo_compile.errors import UnsplittableGraphError
from dbo_compile.ops.registry import comm_kind, is_wait, node_op_info
from dbo_compile.passes.meta import dbo_meta

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


def has_symbols(expr: Any, syms: frozenset) -> bool:
    return isinstance(expr, sympy.Basic) and bool(expr.free_symbols & syms)


def token_dims_of(val: Any, syms: frozenset) -> list[int | None]:
    """Per tensor in ``val``: 0 if dim 0 carries a token symbol, ``None`` if none does.

    Raises:
        UnsplittableGraphError: the token symbol appears in a dim other than 0.
    """
    dims = []
    for shape in _exprs(val):
        bad = [d for d, e in enumerate(shape) if d > 0 and has_symbols(e, syms)]
        if bad:
            raise UnsplittableGraphError(f"token dim found at dim {bad[0]} of shape {shape}")
        dims.append(0 if shape and has_symbols(shape[0], syms) else None)
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


def why_not_row_local(node: fx.Node, syms: frozenset) -> str | None:
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
                and has_symbols(a.meta["val"].node.expr, syms)
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



def is_token_indexed(node: Any) -> bool:
    """``node``'s dim 0 is the token (or request) dim (after
    :func:`~dbo_compile.passes.token_dim.annotate_token_dims`)."""
    return _node_token(node)
