"""Every fact the compiler knows about an op, in one table: one :class:`OpInfo` per op.

The passes, the cost model and the runtime ask this table, never the op modules themselves:

- which nodes are **communication** (:func:`comm_kind`: our ``dbo.dispatch`` / ``dbo.combine``,
  and user-written ``_c10d_functional.all_to_all_single``), and which end one (:func:`is_wait`:
  the yield pass's :func:`comm_wait`, or ``_c10d_functional.wait_tensor``);
- which inputs of an op are **token-indexed** (dim 0 = the token dim), so that the token-dim
  pass can check they agree;
- which ops are **row-local** along the token dim (row ``i`` of each output depends only on
  row ``i`` of the token-indexed inputs), so that a graph using them can be split;
- which ops may be **joined** across the ubatches (:mod:`dbo_compile.passes.join_experts`);
- the **cost formula** (FLOPs) of an op the cost model cannot derive from ATen rules;
- for a comm op, which argument names its **process group** and the **null payload** a rank
  sends when it must issue the collective without data (a rank whose step failed drains its
  remaining collectives with it, :mod:`dbo_compile.runtime.step_txn`);
- for an op reading a **paged KV cache**, which argument is the cache and which of its dims
  the block size (the prefix-read veto takes the block size from there);
- for an op that reads or writes **step state outside the graph** keyed by an argument (vLLM's
  attention and KV-cache write read the step's metadata and the layer's KV cache from vLLM's
  forward context by layer name), which argument is the key: the split program runs such an
  op under its ubatch's step state (:func:`dbo_compile.runtime.context.ubatch_scope`) and
  orders the ubatches' calls with one key by ubatch, as for a KV cache the graph holds.

A call that AOTAutograd functionalised (``auto_functionalized(_v2)(op, ...)``: an op that
writes one of its arguments) has the record of ``op`` (:func:`node_op_info`).

Each ``dbo`` op module registers its record next to its ``torch.library.custom_op``
(:mod:`dbo_compile.ops` imports them all); users declare their own row-local custom ops with
:func:`register_row_local`. Comm and expert backends of the same op share its record.
"""

from __future__ import annotations

import dataclasses
import hashlib
import operator
from typing import Any, Callable

import sympy
import torch
import torch.fx as fx

from dbo_compile.ops.backends import (
    AutoPreference,
    BackendRecord,
    BackendRegistry,
    backend_spec,
    import_optional,
    parse_backend_spec,
)
from dbo_compile.schedule import COMM, CommCall, CommPlan, NullArg, Schedule

__all__ = ["AutoPreference", "BackendRecord", "BackendRegistry", "OpInfo", "backend_spec",
           "bound_backend", "collective_facts",
           "comm_call", "comm_fingerprint", "comm_group_name", "comm_kind", "comm_nodes",
           "comm_op_names",
           "comm_plan", "comm_wait", "expert_ops_on",
           "import_optional", "is_c10d_wait", "is_getitem", "is_receive", "is_wait",
           "joinable_ops", "kv_block_sizes", "node_op_info", "op_arg", "op_has_arg", "op_info",
           "parse_backend_spec", "register_op", "register_paged_kv_op", "register_row_local",
           "register_step_state_op", "registered_ops", "set_op_arg", "step_state_key"]

#: ``flops(node, size) -> float``: FLOPs of ``node`` with its symbolic sizes evaluated by
#: ``size(sym_or_int) -> int`` (the cost model's reference token counts)
FlopsFormula = Callable[[fx.Node, Callable[[Any], int]], float]


@dataclasses.dataclass(frozen=True)
class OpInfo:
    """What the compiler knows about one op.

    Attributes:
        op: the ``OpOverload`` (or, for :func:`comm_wait`, the Python function) FX nodes call.
        comm: ``"dispatch"``, ``"combine"`` or ``"all_to_all"`` for an op that issues a
            collective; ``None`` otherwise.
        wait: the op ends a collective (its first argument is the issuing node).
        receive: a wait that does work of its own, the receive phase of a backend whose issue
            only sends (DeepEP low-latency's receive hook): it is a schedule unit of its own
            (:func:`dbo_compile.ops.comm.comm_receive`); a plain wait only passes the value on.
        token_args: ``(position, name)`` of the inputs whose dim 0 is the token dim.
        row_local: row ``i`` of each output depends only on row ``i`` of the token-indexed
            inputs (and on shared tensors the split orders explicitly, such as the KV cache
            ``dbo.attention`` writes), so the split pass may cut the op anywhere.
        joinable: the ubatch copies of one call may be joined into one call on the rows of
            all ubatches (row-local, and in decode bound by reading its weights).
        flops: the cost model's FLOP formula (:data:`FlopsFormula`), ``None``: ATen rules.
        backend: the registry the op's ``backend`` argument names (``"comm"``: comm backends,
            ``"experts"``: experts backends), which the compiler binds from the config
            (``DboConfig.comm_backend`` / ``experts_backend``); ``None``: no such argument.
        group_arg: ``(position, name)`` of a comm op's process-group-name argument.
        null_fill: for a comm op, the fill value of each tensor argument (in schema order) of
            a *null* call: the same collective with a payload that routes and adds nothing
            (``dbo.dispatch``: ``x = 0``, ``topk_ids = -1``, ``topk_weights = 0``). ``None``:
            the op has no null call (a failed rank cannot drain it).
        kv_cache_arg: ``(position, name, block_dim)`` of a paged KV cache argument: the
            block size (tokens per block) is dim ``block_dim`` of its static shape.
        step_state_arg: ``(position, name)`` of the argument keying state the op reads or
            writes outside the graph (vLLM's layer name): the op runs under its ubatch's step
            state, and the calls with one key are ordered by ubatch. ``None``: none.
    """

    op: Any
    comm: str | None = None
    wait: bool = False
    receive: bool = False
    token_args: tuple[tuple[int, str], ...] = ()
    row_local: bool = False
    joinable: bool = False
    flops: FlopsFormula | None = None
    backend: str | None = None
    group_arg: tuple[int, str] | None = None
    null_fill: tuple[float, ...] | None = None
    kv_cache_arg: tuple[int, str, int] | None = None
    step_state_arg: tuple[int, str] | None = None


_REGISTRY: dict[Any, OpInfo] = {}


def register_op(info: OpInfo) -> OpInfo:
    """Add (or replace) the record of ``info.op``."""
    _REGISTRY[info.op] = info
    return info


def register_row_local(op: Any) -> None:
    """Declare a custom op (an ``OpOverload``) row-local along dim 0: row ``i`` of each output
    depends only on row ``i`` of its token-indexed inputs. Graphs using it can then be split;
    a wrong declaration gives wrong answers, so declare only what is true."""
    if isinstance(op, torch._ops.OpOverloadPacket):
        op = op.default
    old = _REGISTRY.get(op)
    register_op(dataclasses.replace(old, row_local=True) if old else OpInfo(op, row_local=True))


def register_paged_kv_op(op: Any, cache_arg: tuple[int, str], block_dim: int) -> None:
    """Declare that ``op`` (an ``OpOverload``) reads a paged KV cache at argument
    ``cache_arg = (position, name)`` whose dim ``block_dim`` is the block size (tokens per
    block), so that the prefix-read veto (:mod:`dbo_compile.runtime.vetoes`) knows the block
    size of graphs using it (``dbo.attention`` is declared: ``kv_cache``, dim 2)."""
    if isinstance(op, torch._ops.OpOverloadPacket):
        op = op.default
    old = _REGISTRY.get(op) or OpInfo(op)
    register_op(dataclasses.replace(old, kv_cache_arg=(cache_arg[0], cache_arg[1], block_dim)))


def register_step_state_op(op: Any, key_arg: tuple[int, str], *, row_local: bool = True,
                           token_args: tuple[tuple[int, str], ...] = ()) -> None:
    """Declare that ``op`` (an ``OpOverload``) reads or writes per-step state outside the graph
    keyed by its argument ``key_arg = (position, name)`` (vLLM's attention reads the step's
    metadata and the layer's KV cache from the forward context by layer name): its ubatch
    copies run under their ubatch's step state and are ordered by ubatch per key. With
    ``row_local`` (the default) it is row-local along ``token_args`` given that state, as
    ``dbo.attention`` is given its metadata."""
    if isinstance(op, torch._ops.OpOverloadPacket):
        op = op.default
    old = _REGISTRY.get(op) or OpInfo(op)
    register_op(dataclasses.replace(old, step_state_arg=key_arg, row_local=row_local,
                                    token_args=token_args or old.token_args))


def registered_ops() -> list[OpInfo]:
    """Every record, in registration order."""
    return list(_REGISTRY.values())


def op_info(target: Any) -> OpInfo | None:
    """The record of an FX node's target (an ``OpOverloadPacket`` means its default
    overload, as Dynamo graphs call it), or ``None``."""
    if isinstance(target, torch._ops.OpOverloadPacket):
        target = target.default
    try:
        return _REGISTRY.get(target)
    except TypeError:  # an unhashable target
        return None


def _functionalized_op(node: fx.Node) -> Any:
    """The op of an ``auto_functionalized(_v2)(op, **kwargs)`` call, else ``None``."""
    hop = torch.ops.higher_order
    if node.target in (getattr(hop, "auto_functionalized", None),
                       getattr(hop, "auto_functionalized_v2", None)) and node.args:
        return node.args[0]
    return None


def node_op_info(node: fx.Node) -> OpInfo | None:
    """The record of the op ``node`` calls; for a functionalised call
    (``auto_functionalized(_v2)(op, **kwargs)``, whose arguments are keywords by the op's
    schema names) the record of ``op``. ``None`` for a node that calls no recorded op."""
    if node.op != "call_function":
        return None
    inner = _functionalized_op(node)
    return op_info(inner if inner is not None else node.target)


def step_state_key(node: fx.Node) -> Any:
    """The key argument of a call of a step-state op (:func:`register_step_state_op`; through
    a functionalised call too): a graph node (vLLM's layer name is a graph input) or a
    constant; ``None`` when ``node`` calls no such op."""
    info = node_op_info(node)
    if info is None or info.step_state_arg is None:
        return None
    pos, name = info.step_state_arg
    if _functionalized_op(node) is not None:
        return node.kwargs.get(name)
    return op_arg(node, name) if op_has_arg(node, name) else (
        node.args[pos] if pos < len(node.args) else node.kwargs.get(name))


def joinable_ops() -> frozenset:
    """The ops whose ubatch copies :mod:`dbo_compile.passes.join_experts` joins."""
    return frozenset(i.op for i in _REGISTRY.values() if i.joinable)


def _schema_names(node: fx.Node) -> list[str]:
    target = node.target
    if isinstance(target, torch._ops.OpOverloadPacket):
        target = target.default
    schema = getattr(target, "_schema", None)
    return [a.name for a in schema.arguments] if schema is not None else []


def op_arg(node: fx.Node, name: str, default: Any = None) -> Any:
    """Argument ``name`` of a call of an ``OpOverload``, given by keyword (a Dynamo graph) or
    by position (a lowered graph); ``default`` when absent."""
    if name in node.kwargs:
        return node.kwargs[name]
    names = _schema_names(node)
    pos = names.index(name) if name in names else -1
    return node.args[pos] if 0 <= pos < len(node.args) else default


def op_has_arg(node: fx.Node, name: str) -> bool:
    """The schema of the ``OpOverload`` ``node`` calls has an argument ``name``."""
    return name in _schema_names(node)


def set_op_arg(node: fx.Node, name: str, value: Any) -> None:
    """Set argument ``name`` of a call of an ``OpOverload`` where it is given (by position or
    keyword), else as a keyword."""
    names = _schema_names(node)
    pos = names.index(name) if name in names else -1
    if 0 <= pos < len(node.args):
        args = list(node.args)
        args[pos] = value
        node.args = tuple(args)
    else:
        node.kwargs = {**node.kwargs, name: value}


def bound_backend(node: fx.Node) -> str:
    """The ``backend`` argument of a call of an op with a backend registry (``""``: the op's
    own choice), whether it is given by keyword (a Dynamo graph) or by position (lowered)."""
    return op_arg(node, "backend", "") or ""


def comm_kind(node: fx.Node) -> str | None:
    """``"dispatch"``, ``"combine"`` or ``"all_to_all"`` for an issuing comm node, else ``None``."""
    if node.op != "call_function":
        return None
    info = op_info(node.target)
    return info.comm if info is not None else None


def comm_op_names() -> list[str]:
    """The registered issuing comm ops, sorted (``dbo.moe_dispatch``, ...), for messages."""
    return sorted(str(op).removesuffix(".default") for op, info in _REGISTRY.items()
                  if info.comm)


def is_wait(node: fx.Node) -> bool:
    """``node`` ends a collective: :func:`comm_wait` or ``_c10d_functional.wait_tensor``."""
    if node.op != "call_function":
        return False
    info = op_info(node.target)
    return info is not None and info.wait


def is_receive(node: fx.Node) -> bool:
    """``node`` is the receive phase of a comm op (a wait that is a schedule unit of its own)."""
    if node.op != "call_function":
        return False
    info = op_info(node.target)
    return info is not None and info.receive


def is_c10d_wait(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target == torch.ops._c10d_functional.wait_tensor.default


def is_getitem(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is operator.getitem


def comm_group_name(node: fx.Node) -> str | None:
    """The process-group name a comm node's op runs over (a constant of the graph), or
    ``None`` when the op declares no group argument or the argument is not a constant str."""
    info = op_info(node.target) if node.op == "call_function" else None
    if info is None or info.group_arg is None:
        return None
    name = op_arg(node, info.group_arg[1])
    return name if isinstance(name, str) else None


def kv_block_sizes(graph: fx.Graph) -> tuple[int, ...] | None:
    """The KV block sizes of every paged-KV op of ``graph`` (declared ``kv_cache_arg``), sorted,
    without duplicates; ``()`` when the graph has no such op; ``None`` when one's cache shape
    is not static (the block size cannot be told)."""
    sizes: set[int] = set()
    for n in graph.nodes:
        info = op_info(n.target) if n.op == "call_function" else None
        if info is None or info.kv_cache_arg is None:
            continue
        _, name, dim = info.kv_cache_arg
        cache = op_arg(n, name)
        val = cache.meta.get("val", cache.meta.get("example_value")) if isinstance(cache, fx.Node) else None
        size = val.shape[dim] if isinstance(val, torch.Tensor) and val.dim() > dim else None
        if not isinstance(size, int):
            return None
        sizes.add(int(size))
    return tuple(sorted(sizes))


def comm_call(node: fx.Node, token_symbol: Any, ubatch: int | None, name: str
              ) -> CommCall | None:
    """The null call of the comm node ``node`` (:class:`~dbo_compile.schedule.CommCall`):
    its tensor arguments as :class:`~dbo_compile.schedule.NullArg` (shapes linear in
    ``token_symbol``, from ``meta["val"]`` or Dynamo's ``meta["example_value"]``; fills from
    the op's ``null_fill``), the others as the constants they are. ``None`` when the op has
    no null call, or an argument is a graph value other than a tensor, or a shape is not
    linear in the token count."""
    info = op_info(node.target) if node.op == "call_function" else None
    if info is None or info.comm is None or info.null_fill is None:
        return None
    if any(isinstance(v, fx.Node) for v in node.kwargs.values()):
        return None  # keyword arguments must be constants (a bound backend's name)
    fills = iter(info.null_fill)
    args: list[Any] = []
    for a in node.args:
        if not isinstance(a, fx.Node):
            args.append(a)
            continue
        val = a.meta.get("val", a.meta.get("example_value"))
        fill = next(fills, None)
        shape = [_linear_dim(d, token_symbol) for d in getattr(val, "shape", ())]
        if not isinstance(val, torch.Tensor) or fill is None or None in shape:
            return None
        args.append(NullArg(tuple(shape), val.dtype, str(val.device), fill))
    return CommCall(node.target, tuple(args), ubatch, name, tuple(sorted(node.kwargs.items())))


def _issue_order(graph: fx.Graph, schedule: Schedule | None
                 ) -> list[tuple[fx.Node, int | None, str]]:
    """``(node, ubatch, name)`` of each collective a program issues, in issue order: the comm
    units of ``schedule`` in host order (a split program), else the comm nodes of ``graph`` in
    graph order (an unsplit program)."""
    if schedule is None:
        return [(n, None, n.name) for n in comm_nodes(graph)]
    by_name = {n.name: n for n in graph.nodes}
    # the units that issue a collective (not a receive phase)
    return [(by_name[u.nodes[0]], u.ubatch, u.name) for u in schedule.units
            if u.kind == COMM and comm_kind(by_name[u.nodes[0]]) is not None]


def comm_plan(graph: fx.Graph, token_symbol: Any, schedule: Schedule | None = None) -> CommPlan:
    """The collectives a program issues, in order, as null calls
    (:data:`~dbo_compile.schedule.CommPlan`): the comm units of ``schedule`` in host order
    (a split program), else the comm nodes of ``graph`` in graph order (an unsplit program).
    ``None`` when one has no null call (:func:`comm_call`)."""
    calls = [comm_call(node, token_symbol, ubatch, name)
             for node, ubatch, name in _issue_order(graph, schedule)]
    return None if any(c is None for c in calls) else tuple(calls)


def collective_facts(node: fx.Node) -> tuple:
    """What every rank's call of the comm node ``node`` must agree on, rank-independently:
    the op, and per schema argument its constant (expert count, group name, bound backend),
    or for a tensor its dtype, rank and static sizes. Dim 0 (the rows a collective moves:
    tokens, or the rows they route to; the traced count in a static graph) and symbolic sizes
    are left out, so a static and a dynamic graph of one model, or ranks with other token
    counts, agree; a list (split sizes) counts by its length. A Dynamo graph and its lowered
    graph give the same facts (arguments in schema order, defaults filled in)."""
    info = op_info(node.target)
    target = node.target.default if isinstance(node.target, torch._ops.OpOverloadPacket) \
        else node.target
    schema = getattr(target, "_schema", None)
    facts: list[Any] = [str(info.op if info is not None else target)]
    if schema is None:
        return (*facts, *(_arg_fact(a) for a in node.args))
    missing = object()
    for a in schema.arguments:
        value = op_arg(node, a.name, missing)
        if value is missing:
            value = a.default_value if a.has_default_value() else None
        facts.append((a.name, _arg_fact(value)))
    return tuple(facts)


def _arg_fact(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return ("list", len(value))
    if not isinstance(value, fx.Node):
        return value if isinstance(value, (str, int, float, bool, type(None))) else repr(value)
    val = value.meta.get("val", value.meta.get("example_value"))
    if not isinstance(val, torch.Tensor):
        return type(val).__name__
    sizes = tuple(d if isinstance(d, int) else "s" for d in val.shape[1:])
    return (str(val.dtype), val.dim(), sizes)


def comm_fingerprint(graph: fx.Graph, schedule: Schedule | None = None) -> str:
    """16 hex digits of SHA-256 over the collectives a program issues, in issue order
    (:func:`comm_plan`'s): per collective its ubatch and :func:`collective_facts` (op,
    dtypes, static sizes, constants). Ranks whose models differ in dtype or hidden size
    issue the same order of collectives over payloads that do not match, which the DP vote
    must refuse before the first of them (``runtime/vote.py``)."""
    what = [(ubatch, collective_facts(node)) for node, ubatch, _ in _issue_order(graph, schedule)]
    return hashlib.sha256(repr(what).encode()).hexdigest()[:16]


def _linear_dim(d: Any, t: Any) -> tuple[int, int] | None:
    """``(a, b)`` with ``d == a * t + b``, ``None`` if ``d`` is not linear in ``t`` alone."""
    if isinstance(d, int):
        return (0, d)
    expr = sympy.expand(d.node.expr)
    if t is None or expr.free_symbols - {t}:
        return None
    try:
        poly = sympy.Poly(expr, t)
    except sympy.PolynomialError:
        return None
    if poly.degree() > 1 or not all(c.is_integer for c in poly.all_coeffs()):
        return None
    a = int(poly.coeff_monomial(t))
    return a, int(poly.coeff_monomial(1))


def comm_nodes(graph: fx.Graph) -> list[fx.Node]:
    """Issuing comm nodes in graph order."""
    return [n for n in graph.nodes if comm_kind(n) is not None]


def comm_wait(value: Any) -> Any:
    """The wait phase of a comm op (inserted by :mod:`dbo_compile.passes.insert_yields`):
    returns ``value`` once the comm has completed.

    In generated code the synchronisation is an event wait on the consumer's stream; this
    function only passes the value through (eager execution of an FX graph is synchronous).
    """
    return value


register_op(OpInfo(comm_wait, wait=True, row_local=True))
register_op(OpInfo(torch.ops._c10d_functional.all_to_all_single.default, comm="all_to_all",
                   group_arg=(3, "group_name")))
register_op(OpInfo(torch.ops._c10d_functional.wait_tensor.default, wait=True))


def expert_ops_on(dispatch: fx.Node) -> list[fx.Node]:
    """The expert ops (ops whose record names the ``experts`` backend registry:
    ``dbo.grouped_experts``) that compute on the rows the comm node ``dispatch`` receives:
    reached from it through its users, up to the next comm op; sorted by name."""
    found, todo, seen = [], list(dispatch.users), set()
    while todo:
        n = todo.pop()
        if n in seen or comm_kind(n) is not None:
            continue
        seen.add(n)
        info = op_info(n.target) if n.op == "call_function" else None
        if info is not None and info.backend == "experts":
            found.append(n)
        else:
            todo.extend(n.users)
    return sorted(found, key=lambda n: n.name)
