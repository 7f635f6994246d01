"""Backend binding: the config's comm and experts backends bound into the graph's ops.

Runs on Dynamo's graph before lowering (the fake shapes are the bound backend's): every op whose
record names a backend registry (``dbo.moe_dispatch``, ``dbo.grouped_experts``, ...) gets its
``backend`` argument, a spec such as ``"deep_ep:mode=low_latency"``. ``"auto"`` chooses among
the backends that can serve the graph and logs why; an explicit choice that cannot serve it
raises. On every rank the choice is the same (the packages, shapes and options are).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable

import torch
import torch.fx as fx

import dbo_compile.ops  # noqa: F401  (registers torch.ops.dbo.* and their records)
from dbo_compile.config import DboConfig
from dbo_compile.errors import CommBackendError, ExpertsOpError
from dbo_compile.ops.backends import AutoPreference, backend_spec, parse_backend_spec
from dbo_compile.ops.comm import (
    RANK_MAJOR,
    auto_comm_choices,
    backend_for_group,
    comm_backend_name,
    comm_options_for,
    comm_record,
    ep_world_size,
    get_comm_backend,
)
from dbo_compile.ops.experts import (
    auto_experts_choices,
    experts_options_for,
    get_experts_backend,
)
from dbo_compile.ops.registry import bound_backend, comm_kind, op_arg, op_info, set_op_arg

log = logging.getLogger(__name__)

__all__ = ["BackendKind", "bind_backends", "choose"]

#: the MoE-layer comm ops (their backends may have a layout and a handle of their own)
_MOE_OPS = (torch.ops.dbo.moe_dispatch.default, torch.ops.dbo.moe_combine.default)


def _val(a: Any) -> Any:
    if isinstance(a, fx.Node):
        return a.meta.get("example_value", a.meta.get("val"))
    return a


def _comm_facts(node: fx.Node, dispatch_of: dict[fx.Node, fx.Node]) -> dict[str, Any]:
    """What a comm backend's ``supports`` is asked about a comm op of Dynamo's graph (a
    combine: its dispatch's facts)."""
    src = dispatch_of.get(node, node)
    x, ids = _val(op_arg(src, "x")), _val(op_arg(src, "topk_ids"))
    group = op_arg(src, "group_name", "")
    target = node.target.default if hasattr(node.target, "default") else node.target
    facts = {"op": "moe" if target in _MOE_OPS else "rank_major", "node": node.name,
             "fx": node, "kind": comm_kind(node), "model_backend": bound_backend(node),
             "num_experts": op_arg(src, "num_experts"), "world_size": ep_world_size(group),
             "group_name": group}
    if isinstance(x, torch.Tensor) and x.dim() == 2:
        facts.update(hidden=x.shape[1], dtype=x.dtype, device=x.device.type)
    if isinstance(ids, torch.Tensor) and ids.dim() == 2:
        facts["top_k"] = ids.shape[1]
    return facts


def _dispatch_of(gm: fx.GraphModule) -> dict[fx.Node, fx.Node]:
    """Each combine of Dynamo's graph -> the dispatch whose outputs it consumes (through
    ``getitem``s and the expert op), for the facts of the pair."""
    out: dict[fx.Node, fx.Node] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or comm_kind(node) != "combine":
            continue
        frontier, seen = list(node.all_input_nodes), set()
        while frontier:
            a = frontier.pop()
            if a in seen:
                continue
            seen.add(a)
            if comm_kind(a) == "dispatch":
                out[node] = a
                break
            if a.op == "call_function":
                frontier.extend(a.all_input_nodes)
    return out


@dataclasses.dataclass(frozen=True)
class BackendKind:
    """One kind of backend the compiler binds (comm, experts): its registry's functions and
    the config's fields.

    Attributes:
        kind: ``"comm"`` / ``"experts"`` (the config's ``{kind}_backend`` and
            ``{kind}_backend_options``).
        error: the registry's exception type.
        get: the backend of a spec, configured.
        deal: ``comm_options_for`` / ``experts_options_for``.
        auto: the ``(name, AutoPreference)`` ``"auto"`` tries, in order.
    """

    kind: str
    error: type[Exception]
    get: Callable[[str], Any]
    deal: Callable[[Any, Any], dict[str, dict[str, Any]]]
    auto: Callable[[], list[tuple[str, AutoPreference]]]


COMM = BackendKind("comm", CommBackendError, get_comm_backend, comm_options_for,
                   auto_comm_choices)
EXPERTS = BackendKind("experts", ExpertsOpError, get_experts_backend, experts_options_for,
                      auto_experts_choices)


def _backend_options(kind: BackendKind, name: str, options: Any) -> dict[str, dict[str, Any]]:
    """``{kind}_backend_options`` dealt to the backends they may configure: the named
    backend, or every backend ``"auto"`` may choose (those whose record declares an
    :class:`~dbo_compile.ops.backends.AutoPreference`), each value checked by the backend
    that takes it whatever is chosen, without importing its package.

    Raises:
        CommBackendError / ExpertsOpError: an unknown backend, an option none of them takes,
            or a bad value.
    """
    # the values a backend's configure gets: through its spec, as the ops carry it
    options = parse_backend_spec(backend_spec(kind.kind, options))[1]
    if name != "auto":
        return kind.deal((name,), options)
    try:
        return kind.deal([n for n, _ in kind.auto()], options)
    except kind.error as e:
        raise kind.error(f"{kind.kind}_backend='auto' checks {kind.kind}_backend_options "
                         f"against every backend it may choose: {e}; name the backend they "
                         f"are for ({kind.kind}_backend=...), or drop them") from None


def _unused_options(kind: str, chosen: str, dealt: dict[str, dict[str, Any]],
                    say: Callable[[str], None] = log.warning) -> None:
    """``say`` (a WARNING) which of ``dealt``'s options ``"auto"`` leaves unused by choosing
    ``chosen``, and for which backend they are."""
    unused = {k: v for opts in dealt.values() for k, v in opts.items()
              if k not in dealt.get(chosen, {})}
    if unused:
        owners = sorted(n for n, opts in dealt.items() if set(opts) & set(unused))
        say(f"dbo: {kind}_backend=auto chose {chosen}, which takes no option "
            f"{sorted(unused)}: {kind}_backend_options {unused} configure "
            f"{' / '.join(owners)} and are not used here (name {kind}_backend="
            f"{owners[0]!r} to require it, or drop them)")


def _unsupported(kind: BackendKind, backend: Any, facts: dict[str, Any]) -> str | None:
    if kind is COMM and backend.handle and facts["op"] != "moe":
        return (f"it has the {backend.layout} layout with a dispatch handle, which "
                "dbo.dispatch / dbo.combine cannot carry (write the layer with dbo.moe_dispatch "
                "/ dbo.grouped_experts / dbo.moe_combine)")
    return backend.supports(facts) if backend.supports is not None else None


def _bound(kind: BackendKind, spec: str, facts: list[dict[str, Any]]) -> tuple[str, Any]:
    """The spec to bind for ``spec`` (its backend's ``bind`` hook where it has one) and that
    backend. Raises ``kind.error`` where it cannot be loaded or configured."""
    backend = kind.get(spec)
    if getattr(backend, "bind", None) is not None:
        spec = backend.bind(facts)
        backend = kind.get(spec)
    return spec, backend


def choose(kind: BackendKind, name: str, options: Any, facts: list[dict[str, Any]],
           say: Callable[..., None] = log.log) -> str | None:
    """The spec of the ``kind`` backend to bind to the ops of ``facts`` (``None``: leave each
    op's own): the named backend with its options, or, for ``"auto"``, the first of the
    backends whose record declares an :class:`~dbo_compile.ops.backends.AutoPreference` (in
    its ``rank`` order) that is in place for the ops (its ``only``), loads (its package
    imports), binds and serves every op (its ``supports``); logged with why (``say(level,
    msg)``), with a WARNING for options left unused.

    Raises:
        CommBackendError / ExpertsOpError (``kind.error``): a named backend is unknown,
            cannot be loaded or cannot serve an op (the reason and the fallback); a bad or
            unknown option (``"auto"``: of every backend it may choose); no backend ``"auto"``
            tries serves the ops.
    """
    dealt = _backend_options(kind, name, options)
    if name != "auto":
        spec, backend = _bound(kind, backend_spec(name, options), facts)
        for f in facts:
            why = _unsupported(kind, backend, f)
            if why is not None:
                raise kind.error(f"{kind.kind}_backend={name!r} cannot serve {f['node']}: "
                                 f"{why}; {kind.kind}_backend='auto' chooses one that serves "
                                 "it")
        return spec
    first_why = None  # why the most preferred backend was passed over
    for cand, pref in kind.auto():
        if pref.only is not None:
            where = [pref.only(f) for f in facts]
            if all(w is not None for w in where):
                first_why = first_why or f" {where[0]}"
                continue
        try:
            spec, backend = _bound(kind, backend_spec(cand, dealt.get(cand, {})), facts)
        except kind.error as e:
            first_why = first_why or f": {e}"
            continue
        why = next(((f["node"], w) for f in facts
                    if (w := _unsupported(kind, backend, f)) is not None), None)
        if why is not None:
            first_why = first_why or f": {cand} cannot serve {why[0]}: {why[1]}"
            continue
        _unused_options(kind.kind, cand, dealt, lambda m: say(logging.WARNING, m))
        if pref.op_default and not dealt.get(cand):
            say(logging.INFO, f"dbo: {kind.kind}_backend=auto -> {cand}{first_why or ''}")
            return None
        say(logging.INFO, f"dbo: {kind.kind}_backend=auto -> {spec}{first_why or ''} "
            f"({backend.description})")
        return spec
    raise kind.error(f"{kind.kind}_backend='auto': no backend it tries serves the graph"
                     f"{first_why or ''}; name one ({kind.kind}_backend=...)")


def _experts_facts(node: fx.Node, layout: str) -> dict[str, Any]:
    x, w13, w2 = (_val(op_arg(node, n)) for n in ("x", "w13", "w2"))
    facts = {"node": node.name, "layout": layout,
             "activation": op_arg(node, "activation", "silu"),
             "bias": op_arg(node, "b13") is not None or op_arg(node, "b2") is not None}
    if isinstance(x, torch.Tensor):
        facts.update(dtype=x.dtype, device=x.device.type, hidden=x.shape[-1])
    if isinstance(w13, torch.Tensor) and isinstance(w2, torch.Tensor) and w2.dim() == 3:
        facts.update(num_experts=w13.shape[0], intermediate=w2.shape[2],
                     weight_dtype=w13.dtype)
    return facts


def _experts_layout(node: fx.Node, comm_spec: str | None) -> str:
    """The layout of an experts call's rows: that of the comm backend bound to the dispatch
    the rows come from (rank-major when they come from elsewhere)."""
    x = op_arg(node, "x")
    src = x.args[0] if isinstance(x, fx.Node) and x.op == "call_function" and x.args else None
    if isinstance(src, fx.Node) and comm_kind(src) == "dispatch" and comm_spec is not None:
        return get_comm_backend(comm_spec).layout
    return RANK_MAJOR


def _choose_comm(gm: fx.GraphModule, config: DboConfig, nodes: list[fx.Node]) -> str | None:
    """The comm backend spec to bind to the comm ops ``nodes`` of ``gm`` (:func:`choose`)."""
    dispatch_of = _dispatch_of(gm)
    return choose(COMM, config.comm_backend, config.comm_backend_options,
                  [_comm_facts(n, dispatch_of) for n in nodes])


def bind_backends(gm: fx.GraphModule, config: DboConfig) -> None:
    """Bind the config's comm and experts backends into the ``backend`` argument of every op
    whose record names a backend registry (a model that names a backend keeps it), before
    lowering, so that the fake shapes are the backend's. ``"auto"`` chooses and logs why
    (:func:`choose`: the comm backend once for the graph, the experts backend per call); on
    every rank the same (the packages, shapes and options are).

    Every comm op is checked against the backend it will run with, the model's choice too
    (:func:`_check_model_comm`): its process group must be one of this process, of a size
    the backend serves (``torch`` needs a group, ``local`` one of one rank).

    Raises:
        CommBackendError / ExpertsOpError: an explicit backend is unknown, cannot be loaded or
            cannot serve an op of the graph; an option is bad or no backend it may configure
            takes it (checked whether the graph has ops of its kind or not); a comm op names
            a process group this process does not hold.
    """
    _backend_options(COMM, config.comm_backend, config.comm_backend_options)
    _backend_options(EXPERTS, config.experts_backend, config.experts_backend_options)
    calls = [n for n in gm.graph.nodes if n.op == "call_function"
             and getattr(op_info(n.target), "backend", None) is not None]
    # a backend whose record says ``rebind`` (the emulated world) is bound also over the ops
    # whose model named an instance of it
    rebind = config.comm_backend != "auto" and comm_record(config.comm_backend).rebind
    comm = [n for n in calls if op_info(n.target).backend == "comm"
            and (not bound_backend(n) or (
                rebind and comm_backend_name(bound_backend(n)) == config.comm_backend))]
    _check_model_comm(gm, [n for n in calls if op_info(n.target).backend == "comm"
                           and n not in comm], len(comm), config)
    comm_spec = _choose_comm(gm, config, comm) if comm else None
    for node in comm:
        if comm_spec is not None:
            set_op_arg(node, "backend", comm_spec)
    said: set[str] = set()

    def say_once(level: int, msg: str) -> None:  # one line per reason, not per layer
        if msg not in said:
            said.add(msg)
            log.log(level, msg)

    for node in calls:
        if op_info(node.target).backend != "experts" or bound_backend(node):
            continue
        spec = choose(EXPERTS, config.experts_backend, config.experts_backend_options,
                      [_experts_facts(node, _experts_layout(node, comm_spec))], say_once)
        if spec is not None:
            set_op_arg(node, "backend", spec)


def _check_model_comm(gm: fx.GraphModule, nodes: list[fx.Node], bound: int,
                      config: DboConfig) -> None:
    """The comm ops whose backend the model named (``nodes``; the config's is not bound to
    them): each backend must serve its op (its group, shapes), as a backend the config names
    must; a WARNING where ``comm_backend`` or its options are given and the config binds
    none of the graph's comm ops (``bound``: how many it binds).

    Raises:
        CommBackendError: a backend cannot serve its op, or an op's process group is not
            one of this process.
    """
    dispatch_of = _dispatch_of(gm)
    for node in nodes:
        spec = backend_for_group(op_arg(node, "group_name", ""), bound_backend(node))
        why = _unsupported(COMM, get_comm_backend(spec), _comm_facts(node, dispatch_of))
        if why is not None:
            raise CommBackendError(f"the model's comm op {node.name} names the comm backend "
                                   f"{spec!r} (its backend argument), which cannot serve it: "
                                   f"{why}; build the model without naming one (comm_backend "
                                   "then chooses) or name one that serves it")
    given = config.comm_backend != "auto" or config.comm_backend_options
    if nodes and not bound and given:
        log.warning("dbo: comm_backend=%r, comm_backend_options %s are not used: the model "
                    "names the backend of every comm op (%s); build it without one to let "
                    "the config choose", config.comm_backend, dict(config.comm_backend_options),
                    sorted({bound_backend(n) for n in nodes}))
