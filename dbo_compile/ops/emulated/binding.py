"""Binding the emulated backend to a graph: the world the config and the graph describe
(its expert count and top-k), and the check that the model was built as rank 0 of it
(:mod:`dbo_compile.ops.emulated`)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.fx as fx

from dbo_compile.errors import CommBackendError
from dbo_compile.ops.comm import CommBackend, register_comm_backend
from dbo_compile.ops.emulated.backend import emulated_backend, make_backend, register_emulated
from dbo_compile.ops.emulated.world import (
    DEFAULT_CAPACITY_FACTOR,
    DEFAULT_LINK_GBPS,
    NAME,
    EmulatedWorld,
)
from dbo_compile.ops.registry import (
    bound_backend,
    comm_group_name,
    comm_kind,
    expert_ops_on,
    op_arg,
)

__all__ = ["OPTIONS", "bind_name", "check_built_for", "check_options", "configure",
           "world_of_options"]

#: the options the emulated backend takes (``DboConfig.comm_backend_options``); the
#: deprecated ``DboConfig`` fields are ``emulate_<option>``
OPTIONS = ("world_size", "link_gbps", "latency_us", "copy_gbps", "capacity_factor", "comm_sms",
           "hold_sms")


def check_options(world_size: int | None = None, link_gbps: float | None = None,
                  latency_us: float | None = None, copy_gbps: float | None = None,
                  capacity_factor: float | None = None, comm_sms: int | None = None,
                  hold_sms: int | None = None) -> None:
    """Check the emulated backend's options (``comm_backend_options`` with
    ``comm_backend="emulated"``; ``None``: the default).

    Args:
        world_size: ``W``, the emulated EP ranks (this device is rank 0); required to compile.
        link_gbps: the link's bandwidth per direction, GB/s (default 50, one 400 Gb/s NIC).
        latency_us: added per dispatch / combine, µs (default 0).
        copy_gbps: the hardware's duplex copy bandwidth per direction, GB/s (default:
            measured at the first call).
        capacity_factor: static link capacity over the expected remote rows (default 1.1).
        comm_sms: SMs carved out of compute while the split program runs, the cost of comm
            kernels that hold SMs (``DboConfig.comm_sms`` wins where both are given); it
            limits cuBLAS GEMMs only.
        hold_sms: SMs each transfer holds for its emulated duration, as DeepEP's normal-mode
            kernels hold 20–24 (default 0: the copy engines alone hold none): a kernel of
            that many CTAs on the issuing stream, one per SM, that nothing needing shared
            memory can share an SM with (CUDA only; on CPU nothing is held:
            :mod:`dbo_compile.ops.emulated.hold`). Use it or ``comm_sms``, not both.

    Raises:
        CommBackendError: a value of the wrong type or out of range, naming it.
    """
    for name, v, low in (("world_size", world_size, 1), ("comm_sms", comm_sms, 0),
                         ("hold_sms", hold_sms, 0)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < low):
            raise CommBackendError(f"comm backend 'emulated': {name}={v!r} must be an int "
                                   f">= {low}")
    if comm_sms and hold_sms:
        raise CommBackendError(
            f"comm backend 'emulated': comm_sms={comm_sms} and hold_sms={hold_sms} emulate the "
            "same cost twice (a carve-out of the GEMMs and SMs held by the transfers); give "
            "one of them")
    for name, v, low, strict in (("link_gbps", link_gbps, 0.0, True),
                                 ("copy_gbps", copy_gbps, 0.0, True),
                                 ("latency_us", latency_us, 0.0, False),
                                 ("capacity_factor", capacity_factor, 1.0, False)):
        if v is None or (name == "copy_gbps" and v == "auto"):
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise CommBackendError(f"comm backend 'emulated': {name}={v!r} must be a finite "
                                   "number")
        if (v <= low) if strict else (v < low):
            raise CommBackendError(f"comm backend 'emulated': {name}={v!r} must be "
                                   f"{'>' if strict else '>='} {low:g}")


def world_of_options(options: dict[str, Any], num_experts: int, top_k: int) -> EmulatedWorld:
    """The world the emulated backend's options (:data:`OPTIONS`) describe, for a graph of
    ``num_experts`` experts and top-``top_k`` routing.

    Raises:
        CommBackendError: no ``world_size``, or a bad option (:class:`EmulatedWorld`).
    """
    if options.get("world_size") is None:
        raise CommBackendError(_NO_WORLD)
    copy_gbps = options.get("copy_gbps")
    return EmulatedWorld(
        world_size=options["world_size"], num_experts=num_experts, top_k=top_k,
        link_gbps=float(options.get("link_gbps") or DEFAULT_LINK_GBPS),
        latency_us=float(options.get("latency_us") or 0.0),
        copy_gbps=None if copy_gbps in (None, "auto") else float(copy_gbps),
        capacity_factor=float(options.get("capacity_factor") or DEFAULT_CAPACITY_FACTOR),
        hold_sms=int(options.get("hold_sms") or 0))


_NO_WORLD = ("the plain 'emulated' backend has no world: compile with comm_backend='emulated' "
             "and comm_backend_options={'world_size': W} (the deprecated emulate_world_size=W "
             "too; the compiler binds an instance), or build the model with "
             "emulated_world_size=W")


def configure(world_size: int | None = None, num_experts: int | None = None,
              top_k: int | None = None, link_gbps: Any = None, latency_us: Any = None,
              copy_gbps: Any = None, capacity_factor: Any = None,
              comm_sms: int | None = None, hold_sms: int | None = None) -> CommBackend:
    """The emulated backend of a spec: with ``num_experts`` and ``top_k`` (an instance's
    spec, :attr:`EmulatedWorld.name`), the instance of that world; with the config's options
    alone, the backend the compiler binds per graph (its ``bind`` sizes the world by the
    graph's expert count and top-k, :func:`bind_name`); with none, the backend that says how
    to get one.

    Raises:
        CommBackendError: a bad option (:func:`check_options`, :class:`EmulatedWorld`).
    """
    options = {k: v for k, v in dict(world_size=world_size, link_gbps=link_gbps,
                                     latency_us=latency_us, copy_gbps=copy_gbps,
                                     capacity_factor=capacity_factor,
                                     comm_sms=comm_sms, hold_sms=hold_sms).items()
               if v is not None}
    check_options(**options)
    if num_experts is not None or top_k is not None:
        return make_backend(world_of_options(options, num_experts, top_k))
    if world_size is None:
        return _PLAIN
    return dataclasses.replace(
        _PLAIN, description=f"emulated EP-{world_size} world on one device (sized per graph)",
        bind=lambda facts: bind_name(facts[0]["fx"].graph, options))


def _unconfigured(*args: Any, **kwargs: Any) -> Any:
    raise CommBackendError(_NO_WORLD)


_PLAIN = CommBackend(NAME, _unconfigured, _unconfigured,
                     "emulated EP-W world on one device (bound per config)", rebind=True)
register_comm_backend(dataclasses.replace(_PLAIN, configure=configure,
                                          check_options=check_options))


def _value(node: Any) -> Any:
    if not isinstance(node, fx.Node):
        return node
    return node.meta.get("val", node.meta.get("example_value"))


def _arg(node: fx.Node, pos: int, name: str) -> Any:
    return node.args[pos] if len(node.args) > pos else node.kwargs.get(name)


def bind_name(graph: fx.Graph, options: dict[str, Any]) -> str:
    """The registered instance the comm ops of ``graph`` (a Dynamo or lowered graph) run
    with under the emulated backend's ``options`` (:data:`OPTIONS`, the config's
    ``comm_backend_options``) and the graph's expert count and top-k, which every dispatch
    must share.

    The emulated backend answers right only for a model built as rank 0 of its world
    (:func:`check_built_for`), which is checked here, at compile time.

    Raises:
        CommBackendError: the dispatches disagree on the expert count or top-k, an expert
            count is not a multiple of the option ``world_size``, or the model was not built
            for an emulated world of that many ranks (:func:`check_built_for`).
    """
    facts = set()
    for node in graph.nodes:
        if comm_kind(node) == "dispatch":
            ids = _value(_arg(node, 1, "topk_ids"))
            e = _arg(node, 3, "num_experts")
            if not isinstance(e, int) or ids is None:
                raise CommBackendError(f"emulated backend: dispatch {node.name} has no static "
                                       "expert count or top-k to size the emulated world by")
            facts.add((e, int(ids.shape[1])))
    if len(facts) != 1:
        raise CommBackendError(f"emulated backend: the graph's dispatches must share one "
                               f"(num_experts, top_k), found {sorted(facts)}")
    (e, k), = facts
    world = world_of_options(options, e, k)
    check_built_for(graph, world)
    return register_emulated(world)


def check_built_for(graph: fx.Graph, world: EmulatedWorld) -> None:
    """Check that the model of ``graph`` was built as rank 0 of ``world``, for every comm op.

    The emulated dispatch delivers local ids ``id mod E_local`` (``E_local = E / W``) of rank
    0's ``E_local`` experts, whose weights the world repeats every ``E_local`` experts; a model
    holding all ``E`` experts (built for no EP world) would run its first ``E_local`` experts
    on every slot and return a wrong answer without an error. What proves the model right:

    - an expert op (``dbo.grouped_experts``) on a dispatch's rows holds ``E / W`` experts
      (``w13.shape[0]``), and
    - a comm op that names an emulated instance names one of ``W`` ranks, and runs over no
      process group (the world is one device; a model built for a real EP group holds that
      group's rank's experts, not rank 0's of the emulated world);
    - a dispatch whose rows reach no expert op (experts written with other ops) must name an
      emulated instance of ``W`` ranks: the model's declaration that its experts are rank
      0's (``DeepseekMoEModel(..., emulated_world_size=W)`` names it).

    Raises:
        CommBackendError: the first comm op that breaks a rule, and what to build instead.
    """
    w, e, el = world.world_size, world.num_experts, world.local_experts
    build = (f"build the model with DeepseekMoEModel(..., emulated_world_size={w}); another "
             f"model must hold rank 0's E/W = {e}/{w} = {el} experts (the world's experts "
             f"repeat every {el}) in its dbo.grouped_experts (w13 / w2 [{el}, ...]), or, with "
             "experts written in other ops, hold them there and declare it by naming the "
             "emulated instance in its dispatch and combine (backend=dbo_compile.ops.emulated."
             f"register_emulated(EmulatedWorld({w}, {e}, {world.top_k})))")
    for node in graph.nodes:
        kind = comm_kind(node)
        if kind not in ("dispatch", "combine"):
            continue
        own = emulated_backend(bound_backend(node) or "")
        if own is not None and own.world.world_size != w:
            raise CommBackendError(
                f"emulated backend: the model's {kind} {node.name} is built for an emulated "
                f"world of {own.world.world_size} ranks but the config asks for "
                f"world_size={w} (comm_backend_options); build the model with the same world "
                "size")
        group = comm_group_name(node)
        if group:
            raise CommBackendError(
                f"emulated backend: the model's {kind} {node.name} runs over the EP process "
                f"group {group!r}: the model was built for a real EP world, not as rank 0 of "
                f"an emulated one on this device; {build} (and no ep_group)")
        if kind != "dispatch":
            continue
        experts = expert_ops_on(node)
        for x in experts:
            w13 = _value(op_arg(x, "w13"))
            held = int(w13.shape[0]) if isinstance(w13, torch.Tensor) else None
            if held != el:
                raise CommBackendError(
                    f"emulated backend: the expert op {x.name} on the rows of {node.name} "
                    f"holds {held} experts, but rank 0 of the emulated EP-{w} world holds "
                    f"num_experts/W = {e}/{w} = {el}: the model was not built for this "
                    f"emulated world and its answer would be wrong; {build}")
        if not experts and own is None:
            raise CommBackendError(
                f"emulated backend: nothing shows that the model was built for an emulated "
                f"world of {w} ranks: the rows of {node.name} reach no dbo.grouped_experts "
                f"and it names no emulated instance; {build}")

