"""Backend binding: the config's comm and experts backends bound into the graph's ops.

Runs on Dynamo's graph before lowering (the fake shapes are the bound backend's): every op whose
record names a backend registry (``dbo.moe_dispatch``, ``dbo.grouped_experts``, ...) gets its
``backend`` argument, a spec such as ``"deep_ep:mode=low_latency"``. ``"auto"`` chooses among
the backends that can serve the graph and logs why; an explicit choice that cannot serve it
raises. On every rank the choice is the same (the packages, shapes and options are).
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch
import torch.fx as fx

import dbo_compile.ops  # noqa: F401  (registers torch.ops.dbo.* and their records)
from dbo_compile.config import DboConfig
from dbo_compile.errors import CommBackendError, ExpertsOpError
from dbo_compile.ops import emulated
from dbo_compile.ops.comm import (
    EXPERT_MAJOR,
    RANK_MAJOR,
    backend_for_group,
    comm_options_for,
    ep_world_size,
    get_comm_backend,
)
from dbo_compile.ops.experts import experts_options_for, get_experts_backend
from dbo_compile.ops.registry import (
    backend_spec,
    bound_backend,
    comm_kind,
    op_arg,
    op_info,
    parse_backend_spec,
    set_op_arg,
)

log = logging.getLogger(__name__)

__all__ = ["bind_backends"]

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


#: the backends ``comm_backend="auto"`` chooses from: DeepEP, else each op's own
_AUTO_COMM = ("deep_ep", "torch", "local")
#: the backends ``experts_backend="auto"`` chooses from
_AUTO_EXPERTS = ("deep_gemm", "torch")


def _backend_options(kind: str, name: str, options: Any) -> dict[str, dict[str, Any]]:
    """``{kind}_backend_options`` (``kind``: ``"comm"`` / ``"experts"``) dealt to the backends
    they may configure: the named backend, or every backend ``"auto"`` may choose
    (:data:`_AUTO_COMM`, :data:`_AUTO_EXPERTS`), each value checked by the backend that takes
    it whatever is chosen, without importing its package.

    Raises:
        CommBackendError / ExpertsOpError: an unknown backend, an option none of them takes,
            or a bad value.
    """
    deal, auto = ((comm_options_for, _AUTO_COMM) if kind == "comm"
                  else (experts_options_for, _AUTO_EXPERTS))
    # the values a backend's configure gets: through its spec, as the ops carry it
    options = parse_backend_spec(backend_spec(kind, options))[1]
    if name != "auto":
        return deal((name,), options)
    try:
        return deal(auto, options)
    except (CommBackendError, ExpertsOpError) as e:
        raise type(e)(f"{kind}_backend='auto' checks {kind}_backend_options against every "
                      f"backend it may choose: {e}; name the backend they are for "
                      f"({kind}_backend=...), or drop them") from None


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


def _choose_comm(gm: fx.GraphModule, config: DboConfig, nodes: list[fx.Node]) -> str | None:
    """The comm backend spec to bind to every comm op (``None``: leave each op's own), and log
    the choice of ``comm_backend="auto"`` and why (a WARNING for ``comm_backend_options`` it
    leaves unused).

    Raises:
        CommBackendError: an explicit backend is unknown, cannot be loaded, or cannot serve one
            of the graph's comm ops (the reason and the fallback); a bad or unknown option
            (``"auto"``: of every backend it may choose, :func:`_backend_options`).
    """
    dealt = _backend_options("comm", config.comm_backend, config.comm_backend_options)
    dispatch_of = _dispatch_of(gm)
    facts = [_comm_facts(n, dispatch_of) for n in nodes]
    if config.comm_backend != "auto":
        spec = backend_spec(config.comm_backend, config.comm_backend_options)
        backend = get_comm_backend(spec)  # loads it, or says why not
        if backend.bind is not None:
            spec = backend.bind(facts)
            backend = get_comm_backend(spec)
        for f in facts:
            why = _comm_unsupported(backend, f)
            if why is not None:
                raise CommBackendError(
                    f"comm_backend={config.comm_backend!r} cannot serve {f['node']}: {why}; "
                    "comm_backend='auto' chooses one that serves it")
        return spec
    if not facts:
        return None
    if all(f["world_size"] == 1 for f in facts):
        log.info("dbo: comm_backend=auto -> local: one EP rank, no all-to-all")
        _unused_options("comm", "local", dealt)
        return None
    spec = backend_spec("deep_ep", dealt["deep_ep"])
    try:
        backend = get_comm_backend(spec)
        if backend.bind is not None:
            spec = backend.bind(facts)
            backend = get_comm_backend(spec)
    except CommBackendError as e:
        log.info("dbo: comm_backend=auto -> torch: %s", e)
        _unused_options("comm", "torch", dealt)
        return None
    for f in facts:
        why = _comm_unsupported(backend, f)
        if why is not None:
            log.info("dbo: comm_backend=auto -> torch: deep_ep cannot serve %s: %s",
                     f["node"], why)
            _unused_options("comm", "torch", dealt)
            return None
    log.info("dbo: comm_backend=auto -> %s (%s)", spec, backend.description)
    return spec


def _comm_unsupported(backend: Any, facts: dict[str, Any]) -> str | None:
    if backend.handle and facts["op"] != "moe":
        return (f"it has the {backend.layout} layout with a dispatch handle, which "
                "dbo.dispatch / dbo.combine cannot carry (write the layer with dbo.moe_dispatch "
                "/ dbo.grouped_experts / dbo.moe_combine)")
    return backend.supports(facts) if backend.supports is not None else None


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


def _choose_experts(node: fx.Node, config: DboConfig, comm_spec: str | None,
                    said: set[str]) -> str | None:
    """The experts backend spec for one ``dbo.grouped_experts`` call (``None``: the op's own),
    logging the choice of ``experts_backend="auto"`` once per reason (a WARNING for
    ``experts_backend_options`` it leaves unused).

    Raises:
        ExpertsOpError: an explicit backend is unknown, cannot be loaded or cannot serve it; a
            bad or unknown option (``"auto"``: of every backend it may choose).
    """
    dealt = _backend_options("experts", config.experts_backend, config.experts_backend_options)
    facts = _experts_facts(node, _experts_layout(node, comm_spec))
    if config.experts_backend != "auto":
        spec = backend_spec(config.experts_backend, config.experts_backend_options)
        backend = get_experts_backend(spec)
        why = backend.supports(facts) if backend.supports is not None else None
        if why is not None:
            raise ExpertsOpError(f"experts_backend={config.experts_backend!r} cannot serve "
                                 f"{node.name}: {why}; use experts_backend='auto' or 'torch'")
        return spec

    def say(msg: str, *args: Any, level: int = logging.INFO) -> None:
        text = msg % args if args else msg
        if text not in said:
            said.add(text)
            log.log(level, text)

    def torch_spec() -> str | None:  # the op's own, or torch with its options
        _unused_options("experts", "torch", dealt, lambda m: say(m, level=logging.WARNING))
        return backend_spec("torch", dealt["torch"]) if dealt["torch"] else None

    if facts["layout"] != EXPERT_MAJOR:
        say("dbo: experts_backend=auto -> torch for the rank-major rows (torch._grouped_mm; "
            "experts_backend='deep_gemm' runs its contiguous grouped GEMM there)")
        return torch_spec()
    spec = backend_spec("deep_gemm", dealt["deep_gemm"])
    try:
        backend = get_experts_backend(spec)
    except ExpertsOpError as e:
        say("dbo: experts_backend=auto -> torch: %s", e)
        return torch_spec()
    why = backend.supports(facts) if backend.supports is not None else None
    if why is not None:
        say("dbo: experts_backend=auto -> torch: deep_gemm cannot serve the experts: %s", why)
        return torch_spec()
    say("dbo: experts_backend=auto -> %s for the expert-major rows (masked grouped GEMM)", spec)
    _unused_options("experts", "deep_gemm", dealt, lambda m: say(m, level=logging.WARNING))
    return spec


def bind_backends(gm: fx.GraphModule, config: DboConfig) -> None:
    """Bind the config's comm and experts backends into the ``backend`` argument of every op
    whose record names a backend registry (a model that names a backend keeps it), before
    lowering, so that the fake shapes are the backend's. ``"auto"`` chooses and logs why
    (:func:`_choose_comm`, :func:`_choose_experts`); on every rank the same (the packages,
    shapes and options are).

    Every comm op is checked against the backend it will run with, the model's choice too
    (:func:`_check_model_comm`): its process group must be one of this process, of a size
    the backend serves (``torch`` needs a group, ``local`` one of one rank).

    Raises:
        CommBackendError / ExpertsOpError: an explicit backend is unknown, cannot be loaded or
            cannot serve an op of the graph; an option is bad or no backend it may configure
            takes it (checked whether the graph has ops of its kind or not); a comm op names
            a process group this process does not hold.
    """
    _backend_options("comm", config.comm_backend, config.comm_backend_options)
    _backend_options("experts", config.experts_backend, config.experts_backend_options)
    calls = [n for n in gm.graph.nodes if n.op == "call_function"
             and getattr(op_info(n.target), "backend", None) is not None]
    # comm_backend="emulated" binds the instance of the config's emulate_* options, also over
    # the one a model built for the emulated world names (:func:`emulated.bind_name`)
    emulate = emulated.is_emulated(config.comm_backend)
    comm = [n for n in calls if op_info(n.target).backend == "comm"
            and (not bound_backend(n) or (emulate and emulated.is_emulated(bound_backend(n))))]
    _check_model_comm(gm, [n for n in calls if op_info(n.target).backend == "comm"
                           and n not in comm], len(comm), config)
    if not comm:
        comm_spec = None
    elif emulate:
        comm_spec = emulated.bind_name(gm.graph, config)
    else:
        comm_spec = _choose_comm(gm, config, comm)
    for node in comm:
        if comm_spec is not None:
            set_op_arg(node, "backend", comm_spec)
    said: set[str] = set()
    for node in calls:
        if op_info(node.target).backend != "experts" or bound_backend(node):
            continue
        spec = _choose_experts(node, config, comm_spec, said)
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
        why = _comm_unsupported(get_comm_backend(spec), _comm_facts(node, dispatch_of))
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
