"""Binding the emulated backend to a graph: the world the config and the graph describe
(its expert count and top-k), and the check that the model was built as rank 0 of it
(:mod:`dbo_compile.ops.emulated`)."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from dbo_compile.errors import CommBackendError
from dbo_compile.ops.emulated.backend import emulated_backend, register_emulated
from dbo_compile.ops.emulated.world import DEFAULT_CAPACITY_FACTOR, DEFAULT_LINK_GBPS, EmulatedWorld
from dbo_compile.ops.registry import (
    bound_backend,
    comm_group_name,
    comm_kind,
    expert_ops_on,
    op_arg,
)

__all__ = ["bind_name", "check_built_for", "world_of_config"]


def world_of_config(config: Any, num_experts: int, top_k: int) -> EmulatedWorld:
    """The world ``DboConfig``'s ``emulate_*`` options describe, for a graph of
    ``num_experts`` experts and top-``top_k`` routing."""
    return EmulatedWorld(
        world_size=config.emulate_world_size, num_experts=num_experts, top_k=top_k,
        link_gbps=(DEFAULT_LINK_GBPS if config.emulate_link_gbps is None
                   else float(config.emulate_link_gbps)),
        latency_us=float(config.emulate_latency_us or 0.0),
        copy_gbps=None if config.emulate_copy_gbps is None else float(config.emulate_copy_gbps),
        capacity_factor=(DEFAULT_CAPACITY_FACTOR if config.emulate_capacity_factor is None
                         else float(config.emulate_capacity_factor)))


def _value(node: Any) -> Any:
    if not isinstance(node, fx.Node):
        return node
    return node.meta.get("val", node.meta.get("example_value"))


def _arg(node: fx.Node, pos: int, name: str) -> Any:
    return node.args[pos] if len(node.args) > pos else node.kwargs.get(name)


def bind_name(graph: fx.Graph, config: Any) -> str:
    """The registered instance the comm ops of ``graph`` (a Dynamo or lowered graph) run
    with under ``config`` (``comm_backend="emulated"``): the config's ``emulate_*`` options and
    the graph's expert count and top-k, which every dispatch must share.

    The emulated backend answers right only for a model built as rank 0 of its world
    (:func:`check_built_for`), which is checked here, at compile time.

    Raises:
        CommBackendError: the dispatches disagree on the expert count or top-k, an expert
            count is not a multiple of ``emulate_world_size``, or the model was not built for
            an emulated world of ``emulate_world_size`` ranks (:func:`check_built_for`).
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
    world = world_of_config(config, e, k)
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
                f"emulate_world_size={w}; build the model with the same world size")
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

