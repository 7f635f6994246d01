"""State threads: in-place updates of shared state under the split, replayed per ubatch.

A model may update a module buffer in every layer from the step's tokens, e.g. the expert load
an EPLB-style balancer records (``expert_load.index_add_(0, topk_ids.flatten(), ones)``). The
lowered graph is functional, so the updates are one chain from the buffer's old value to the
epilogue ``copy_`` that writes the new one back::

    a1 = index_add(load, 0, ids_l0, ones_l0)     # layer 0 (ids_l0: token-indexed)
    a2 = index_add(a1, 0, ids_l1, ones_l1)       # layer 1
    copy_(load, a2)

Each value of the chain depends on every token of the step but has no token dim (an
*aggregate*). Copied once per ubatch as any other per-ubatch node, every ubatch's chain would
start from the old value and the last ``copy_`` would win: ``1/num_ubatches`` of the counts.
This pass finds the chains (*threads*) so that the split replays them in eager order::

    a1_u0 = index_add(load,  0, ids_l0_u0, ...)  a1_u1 = index_add(a1_u0, 0, ids_l0_u1, ...)
    a2_u0 = index_add(a1_u1, 0, ids_l1_u0, ...)  a2_u1 = index_add(a2_u0, 0, ids_l1_u1, ...)
    copy_(load, a2_u1)                           # once, after every reader of the old value

The ubatches' rows are folded in in order (ubatch 0's, then ubatch 1's, site by site), which
is eager's order: on CPU, where ``index_add`` adds rows in order, the result is bitwise eager.

Algorithm:
  1. Aggregates: the scatter family writing token-indexed rows into a non-token destination,
     and every value without a token dim computed from one.
  2. Threads: for each ``copy_(P, v)`` of a shared placeholder ``P`` with ``v`` an aggregate,
     walk back from ``v`` along the destination: a *fold* (:data:`FOLDS`, its destination the
     previous value, index/source token-indexed), a *window* (``select``/``slice`` of the
     value, folds on it, the matching ``select_scatter``/``slice_scatter`` back: one row of an
     EPLB ``[layers, E]`` table), or a *free* op (token-free: ``mul(c, 0.9)``), until a
     shared value (``P``, or one computed from it). Each value of the chain has one user, the
     next node of the chain.
  3. Refusal: any aggregate no thread covers is read by something else (a token-indexed node:
     a step's histogram scaling its tokens; a second reader of an intermediate count), and
     the graph is unsplittable: a ubatch would see only its own tokens' share.
  4. Padding rows: each fold's index is redirected, for padding rows, to a scratch slot past
     the destination's end, so that padding never counts: the graph takes one more token
     input, ``dbo_row_valid`` (bool ``[T]``: ``True`` for real rows; the runtime appends it),
     and the fold runs on ``cat(dest, scratch)`` whose scratch is cut off again. This also
     holds for the unsplit program (the lowered graph) at a DP-padded count.

The split (:mod:`~dbo_compile.passes.split_ubatch`) emits the threads; the scheduler gives each
fold copy its own unit and orders every reader of ``P``'s old value before the write
(:mod:`~dbo_compile.passes.stream_assign`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import sympy
import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from dbo_compile.errors import UnsplittableGraphError
from dbo_compile.ops.registry import op_arg, op_info
from dbo_compile.passes.manager import CompileState, GraphPass
from dbo_compile.passes.meta import dbo_meta
from dbo_compile.passes.token_dim import is_token_indexed, per_ubatch_nodes
from dbo_compile.signature import ROW_VALID_INPUT, InputSpec

log = logging.getLogger(__name__)

__all__ = ["FOLDS", "PASS", "ROW_VALID", "Segment", "StateThread", "find_state_threads",
           "mask_padding_rows", "state_inputs"]

aten = torch.ops.aten

#: the name (and source) of the row-validity input the pass adds (bool ``[T]``)
ROW_VALID = ROW_VALID_INPUT

#: fold ops: ``op -> (position of the index argument, position of the dim argument or None:
#: dim 0, reduce modes that fold (``None``: any))``; the destination is argument 0
FOLDS: dict[Any, tuple[int, int | None, tuple[str, ...] | None]] = {
    aten.index_add.default: (2, 1, None),
    aten.index_copy.default: (2, 1, None),
    aten.index_fill.int_Scalar: (2, 1, None),
    aten.index_fill.int_Tensor: (2, 1, None),
    aten.index_reduce.default: (2, 1, ("prod", "amax", "amin")),
    aten.scatter.src: (2, 1, None),
    aten.scatter.value: (2, 1, None),
    aten.scatter_add.default: (2, 1, None),
    aten.scatter_reduce.two: (2, 1, ("sum", "prod", "amax", "amin")),
    aten.index_put.default: (1, None, None),
    aten._unsafe_index_put.default: (1, None, None),
}
_WINDOWS = {aten.select_scatter.default: aten.select.int,
            aten.slice_scatter.default: aten.slice.Tensor}


@dataclass
class Segment:
    """One step of a thread: ``kind`` ``"fold"`` (its nodes are replayed once per ubatch, in
    ubatch order) or ``"free"`` (token-free, run once); ``nodes`` in graph order, the last one
    the thread's value after it; ``prev`` the value before it."""

    kind: str
    nodes: list[fx.Node]
    prev: fx.Node


@dataclass
class StateThread:
    """The chain of updates of one shared input (module docstring).

    Attributes:
        placeholder: the mutated shared input.
        start: the value the chain starts from (``placeholder``, or a shared value made from
            it, e.g. ``mul(placeholder, 0.9)``: computed once, in the prologue).
        segments: in graph order.
        write: the epilogue ``copy_(placeholder, value)``.
    """

    placeholder: fx.Node
    start: fx.Node
    segments: list[Segment] = field(default_factory=list)
    write: fx.Node | None = None

    def nodes(self) -> list[fx.Node]:
        return [n for s in self.segments for n in s.nodes]


#: ops that write rows of one tensor at positions another gives (the scatter family)
_SCATTERS = {*FOLDS, aten.scatter_reduce.two, aten.index_reduce.default}


def _is_scatter(node: fx.Node) -> bool:
    """A scatter-family node (its destination not token-indexed: the caller checks), the
    source of an aggregate; with a ``mean`` or ``include_self=False`` reduce too (a thread
    refuses those)."""
    return node.target in _SCATTERS


def _is_fold(node: fx.Node) -> bool:
    if node.op != "call_function" or node.target not in FOLDS:
        return False
    modes = FOLDS[node.target][2]
    if modes is None:
        return True
    reduce = node.args[4] if len(node.args) > 4 else node.kwargs.get("reduce")
    include_self = node.args[5] if len(node.args) > 5 else node.kwargs.get("include_self", True)
    return reduce in modes and include_self is True


def find_state_threads(graph: fx.Graph, specs: list[InputSpec]) -> list[StateThread]:
    """Steps 1-3 of the module docstring on the lowered graph (after the token-dim pass);
    annotates nothing.

    Returns:
        The threads, in graph order of their writes; also the token-free writes of shared
        inputs (a step counter), as threads without segments, so that the split orders them
        after every reader of the old value.

    Raises:
        UnsplittableGraphError: an aggregate that no thread covers (the message names it and
            what reads it), or a thread of an unsupported shape.
    """
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    shared = {placeholders[s.index] for s in specs if s.kind == "shared"}
    per_ubatch = per_ubatch_nodes(graph)
    aggregates: list[fx.Node] = []
    agg: set[fx.Node] = set()
    for n in graph.nodes:  # scatters of token rows into non-token tensors, and what they feed
        if (n.op != "call_function" or n not in per_ubatch or is_token_indexed(n)
                or not isinstance(n.meta.get("val"), torch.Tensor)):
            continue
        if _is_scatter(n) or any(a in agg for a in n.all_input_nodes):
            aggregates.append(n)
            agg.add(n)
    threads: list[StateThread] = []
    covered: set[fx.Node] = set()
    for n in graph.nodes:
        if not (n.op == "call_function" and n.target is aten.copy_.default
                and n.args[0] in shared):
            continue
        p, v = n.args[0], n.args[1]
        if v not in agg and v in per_ubatch:
            raise UnsplittableGraphError(
                f"buffer {p.name} is overwritten from the step's tokens ({v.name}, "
                f"{v.target}), not updated by folds of them: under the split the last ubatch's "
                "value would win; compute it outside the compiled region")
        if v not in agg:
            threads.append(StateThread(p, v, write=n))  # token-free: written once
            covered.add(n)
            continue
        thread = _walk(p, v, agg)
        thread.write = n
        threads.append(thread)
        covered |= set(thread.nodes()) | {n}
    for n in aggregates:
        if n not in covered:
            raise UnsplittableGraphError(_uncovered_reason(n, agg))
    return threads


def state_inputs(graph: fx.Graph, specs: list[InputSpec]) -> tuple[int, ...]:
    """Graph-input indices (sorted) of the shared inputs ``graph`` (the lowered graph) writes
    in place: every write-back ``copy_`` of a shared input (a thread's fold of the tokens, a
    token-free write: a step counter) and every argument an op's schema declares written,
    except the cache of a paged-KV op (``kv_cache_arg``: it writes through ``slot_mapping``,
    so rows of slot -1 write nothing, and no copy of the largest tensors is needed).

    What a run that is no served step (the CUDA-graph runner's synthetic warm-up steps,
    captures and timing replays, whose rows are real rows to the folds) must put back as it
    was.
    """
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    shared = {placeholders[s.index]: s.index for s in specs if s.kind == "shared"}
    out: set[int] = set()
    for n in graph.nodes:
        schema = getattr(n.target, "_schema", None) if n.op == "call_function" else None
        if schema is None:
            continue
        info = op_info(n.target)
        kv = info.kv_cache_arg[1] if info is not None and info.kv_cache_arg else None
        for a in schema.arguments:
            if a.alias_info is None or not a.alias_info.is_write or a.name == kv:
                continue
            value = op_arg(n, a.name)
            for v in value if isinstance(value, (list, tuple)) else [value]:
                if isinstance(v, fx.Node) and v in shared:
                    out.add(shared[v])
    return tuple(sorted(out))


def _walk(p: fx.Node, v: fx.Node, agg: set[fx.Node]) -> StateThread:
    """Step 2: the segments from ``v`` back to a shared value; each value of the chain is
    read only by the chain's next nodes."""
    segments: list[Segment] = []
    cur = v
    while cur in agg:
        if _is_fold(cur) and not _reads_aggregate(cur, agg, but=cur.args[0]):
            seg = Segment("fold", [cur], cur.args[0])
        elif cur.target in _WINDOWS:
            seg = _window(cur, agg)
        elif not any(is_token_indexed(a) for a in cur.all_input_nodes) and sum(
                a in agg for a in cur.all_input_nodes) == 1 and cur.args and cur.args[0] in agg:
            seg = Segment("free", [cur], cur.args[0])
        else:
            raise UnsplittableGraphError(
                f"buffer {p.name} is updated in place by node {cur.name} ({cur.target}) from "
                "the step's tokens in a way that cannot be replayed per ubatch (supported: "
                "index_add / scatter_add / scatter_reduce / index_put / index_copy / "
                "index_fill folds, on the buffer or on one select/slice row of it, and "
                "token-free ops between them); compute it outside the compiled region")
        segments.append(seg)
        cur = seg.prev
    segments.reverse()
    for i, seg in enumerate(segments):
        members = set(seg.nodes)
        for node in seg.nodes[:-1]:
            _only_users(node, members, p)
        nxt = segments[i + 1].nodes if i + 1 < len(segments) else []
        if nxt:
            _only_users(seg.nodes[-1], {n for n in nxt if seg.nodes[-1] in n.all_input_nodes}, p)
    return StateThread(p, cur, segments)


def _window(scatter: fx.Node, agg: set[fx.Node]) -> Segment:
    """``select/slice(base) -> folds -> select_scatter/slice_scatter(base, .)``."""
    base, src = scatter.args[0], scatter.args[1]
    inner: list[fx.Node] = []
    s = src
    while isinstance(s, fx.Node) and _is_fold(s) and s in agg:
        if _reads_aggregate(s, agg, but=s.args[0]):
            break
        inner.append(s)
        s = s.args[0]
    view = _WINDOWS[scatter.target]
    same = (isinstance(s, fx.Node) and s.target is view and s.args[0] is base
            and tuple(s.args[1:]) == tuple(scatter.args[2:]) and not s.kwargs
            and not scatter.kwargs)
    if not inner or not same:
        raise UnsplittableGraphError(
            f"node {scatter.name} ({scatter.target}) writes a window of a buffer the step's "
            "tokens update, but not as select/slice -> folds -> the matching scatter back; "
            "compute it outside the compiled region")
    return Segment("fold", [s, *reversed(inner), scatter], base)


def _reads_aggregate(node: fx.Node, agg: set[fx.Node], but: Any) -> bool:
    return any(a in agg for a in node.all_input_nodes if a is not but)


def _only_users(node: fx.Node, users: set[fx.Node], p: fx.Node) -> None:
    extra = [u for u in node.users if u not in users]
    if extra:
        raise _second_reader(node, extra[0], p)


def _second_reader(node: fx.Node, reader: fx.Node, p: fx.Node) -> UnsplittableGraphError:
    return UnsplittableGraphError(
        f"node {reader.name} ({reader.target}) reads {node.name}, buffer {p.name} after some "
        "of this step's updates from the tokens: under the split a ubatch would see only its "
        "own tokens' updates. Read the buffer before the step's updates, or outside the "
        "compiled region")


def _uncovered_reason(node: fx.Node, agg: set[fx.Node]) -> str:
    val = node.meta.get("val")
    shape = list(val.shape) if isinstance(val, torch.Tensor) else "?"
    readers = [u for u in node.users if u not in agg]
    read = f"; {readers[0].name} ({readers[0].target}) reads it" if readers else ""
    return (f"node {node.name} ({node.target}) scatters the step's token rows into a {shape} "
            f"tensor{read}: it depends on every token of the step, so a ubatch would see only "
            "its own. Compute it outside the compiled region, or make it a buffer the model "
            "only updates (a state the split replays per ubatch)")


def mask_padding_rows(graph: fx.Graph, threads: list[StateThread], specs: list[InputSpec],
                      token_symbol: Any) -> InputSpec | None:
    """Step 4: add the ``dbo_row_valid`` input and redirect each fold's padding rows to a
    scratch slot (``None``: no fold, nothing added).

    Raises:
        UnsplittableGraphError: a fold's index is not ``c * T`` rows (``c`` an int).
    """
    folds = [(seg, n) for t in threads for seg in t.segments if seg.kind == "fold"
             for n in seg.nodes if _is_fold(n)]
    if not folds:
        return None
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    token = next(placeholders[s.index] for s in specs if s.kind == "token")
    fake = token.meta["val"]
    with graph.inserting_after(placeholders[-1]):
        valid = graph.placeholder(ROW_VALID)
    with fake.fake_mode:
        valid.meta["val"] = fake.new_empty((fake.shape[0],), dtype=torch.bool)
    dbo_meta(valid)["token_dim"] = 0
    spec = InputSpec(len(specs), ROW_VALID, f"dbo:{ROW_VALID}", "token")
    cut_of: dict[fx.Node, fx.Node] = {}
    for seg, fold in folds:
        added = _redirect(graph, fold, valid, token_symbol)
        at = seg.nodes.index(fold)
        seg.nodes[at:at + 1] = added
        cut_of[fold] = added[-1]
    for t in threads:  # a segment after a fold continues from the fold's cut value
        for seg in t.segments:
            seg.prev = cut_of.get(seg.prev, seg.prev)
    return spec


def _redirect(graph: fx.Graph, fold: fx.Node, valid: fx.Node, t: Any) -> list[fx.Node]:
    """``fold(dest, ..., idx, ...)`` -> ``fold(cat(dest, scratch), ..., where(valid, idx, E),
    ...)[:E]`` along the fold's dim (``E`` its size); returns the nodes that replace ``fold``
    in its segment (those reading the thread's value), in graph order."""
    index_pos, dim_pos, _ = FOLDS[fold.target]
    dest = fold.args[0]
    dim = 0 if dim_pos is None else fold.args[dim_pos]
    dest_val = dest.meta["val"]
    dim = dim % max(dest_val.dim(), 1)
    index = fold.args[index_pos]
    if dim_pos is None:  # index_put: the first index tensor indexes dim 0
        indices = list(index)
        index = indices[0]
    if not isinstance(index, fx.Node):
        raise UnsplittableGraphError(f"fold {fold.name} ({fold.target}) has no index tensor")
    rows = index.meta["val"].shape[0]
    coef = _rows_per_token(rows, t)
    if coef is None or not _grouped_by_token(index, t):
        raise UnsplittableGraphError(
            f"fold {fold.name} ({fold.target}) folds {rows} index rows that are not this "
            "rank's tokens grouped in order (e.g. rows received from other ranks by a "
            "dispatch): the padding rows of a padded step could not be kept out of it. Fold "
            "the tokens' own routing (topk_ids before the dispatch)")
    size = dest_val.shape[dim]
    scratch_shape = [1 if d == dim else s for d, s in enumerate(dest_val.shape)]

    def call(target: Any, *args: Any, token: bool = False) -> fx.Node:
        node = graph.call_function(target, args)
        node.meta["val"] = _fake_value(node)
        dbo_meta(node).update(dbo_meta(fold))
        dbo_meta(node)["token_dim"] = 0 if token else None
        return node

    with graph.inserting_before(fold):
        mask = valid if coef == 1 else call(aten.repeat_interleave.self_int, valid, coef,
                                            token=True)
        idx_dims = index.meta["val"].dim()
        if idx_dims > 1:
            mask = call(aten.view.default, mask, [-1] + [1] * (idx_dims - 1), token=True)
        redirected = call(aten.where.ScalarOther, mask, index, size, token=True)
        scratch = call(aten.new_zeros.default, dest, scratch_shape)
        widened = call(aten.cat.default, [dest, scratch], dim)
    args = list(fold.args)
    args[0] = widened
    args[index_pos] = [redirected, *indices[1:]] if dim_pos is None else redirected
    fold.args = tuple(args)
    with graph.inserting_after(fold):
        cut = graph.call_function(aten.slice.Tensor, (fold, dim, 0, size))
    fold.replace_all_uses_with(cut, delete_user_cb=lambda u: u is not cut)
    cut.meta["val"] = fold.meta["val"]
    dbo_meta(cut).update(dbo_meta(fold))
    fold.meta["val"] = _fake_value(fold)
    return [scratch, widened, fold, cut]


def _fake_value(node: fx.Node) -> Any:
    """``node``'s value run on its inputs' fake values (``meta["val"]``)."""
    def val(a: Any) -> Any:
        return a.meta["val"] if isinstance(a, fx.Node) else a

    args = [[val(x) for x in a] if isinstance(a, (list, tuple)) else val(a) for a in node.args]
    mode = next(v.fake_mode for v in pytree.tree_leaves(args) if isinstance(v, torch.Tensor))
    with mode:
        return node.target(*args, **node.kwargs)


#: ops that keep each token's rows together and in order (dim 0 stays outermost)
_GROUPING = {aten.view.default, aten._unsafe_view.default, aten.reshape.default,
             aten.clone.default, aten._to_copy.default, aten.alias.default,
             aten.unsqueeze.default, aten.flatten.using_ints, aten.contiguous.default}


def _grouped_by_token(node: fx.Node, t: Any) -> bool:
    """``node``'s rows come, through row-order-keeping views and copies, from a tensor whose
    dim 0 is the token dim ``t`` itself: row ``i`` belongs to token ``i // c``."""
    while isinstance(node, fx.Node):
        val = node.meta.get("val")
        d0 = val.shape[0] if isinstance(val, torch.Tensor) and val.dim() else None
        if isinstance(d0, torch.SymInt) and sympy.simplify(d0.node.expr - t) == 0:
            return True
        if node.op != "call_function" or node.target not in _GROUPING:
            return False
        node = node.args[0]
    return False


def _rows_per_token(rows: Any, t: Any) -> int | None:
    """``c`` with ``rows == c * t`` (a positive int), else ``None``."""
    if t is None or not isinstance(rows, torch.SymInt):
        return None
    ratio = sympy.simplify(rows.node.expr / t)
    return int(ratio) if ratio.is_integer and ratio.free_symbols == set() and int(ratio) > 0 else None


def _run(gm: fx.GraphModule, st: CompileState) -> None:
    st.threads = find_state_threads(gm.graph, st.specs)
    spec = mask_padding_rows(gm.graph, st.threads, st.specs, st.token_symbol)
    if spec is not None:
        st.specs = [*st.specs, spec]


PASS = GraphPass("state_threads", _run, reads=("specs", "token_symbol"),
                 writes=("threads", "specs"))
