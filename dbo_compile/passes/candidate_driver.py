"""The candidate driver: the schedules of one split graph and their programs.

From the split graph (after ``insert_yields``) to the split programs of the artifact, for the
candidates of :func:`~dbo_compile.candidates.candidates_of` (the primary first):

1. Graphs. The unjoined split graph, and where a candidate joins, one joined copy of it
   (``JOIN_PASSES``, once). With no routed-expert call to join (or ``join_experts``
   disabled), the primary is the config's scheduler unjoined and the joined candidates are
   dropped; the schedule's ``meta["join_experts"]`` says why (the config is never rewritten).
2. Schedules. ``CANDIDATE_PASSES`` (``stream_assign``) per candidate on its graph, timed as
   ``stream_assign[candidate]``; an alternative whose result pools cannot be honoured is
   dropped (logged), the primary's failure makes the graph unsplittable.
3. Programs. Codegen once per distinct host order (``codegen[candidate]``): candidates with
   the same order of units share one program (``alias``); units with the same nodes, and
   units computing the same, are built once for all of them.
4. Variants. Each program with the SM carve-outs of
   :func:`~dbo_compile.candidates.program_variants`
   (:func:`~dbo_compile.candidates.candidate_programs`).

The schedules and wrappers go to TORCH_TRACE, and with ``dump_dir`` to files
(:func:`dump_programs`).
"""

from __future__ import annotations

import itertools
import logging
import os
import re
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch.distributed as dist
import torch.fx as fx
from torch._logging import trace_structured

from dbo_compile.candidates import (
    Candidate,
    candidate_programs,
    candidates_of,
    carveout_sms,
    primary_candidate,
)
from dbo_compile.codegen.wrapper import SplitProgram
from dbo_compile.config import DboConfig
from dbo_compile.errors import ScheduleError, UnsplittableGraphError
from dbo_compile.passes import stream_assign
from dbo_compile.passes.manager import CompileState, GraphPass, PassManager
from dbo_compile.schedule import Schedule

log = logging.getLogger(__name__)

__all__ = ["CandidateSet", "compile_candidates", "dump_programs"]


@dataclass
class CandidateSet:
    """The split programs of one split graph.

    Attributes:
        primary_gm: the split graph the primary schedule orders (the joined copy for a
            joined primary).
        schedule: the primary schedule.
        programs: one program per distinct host order by candidate name, the primary first.
        alias: each compiled candidate's name -> the name of its program in ``programs``.
        candidates: every program variant by name, the primary first
            (:func:`~dbo_compile.candidates.candidate_programs`): the artifact's candidates.
    """

    primary_gm: fx.GraphModule
    schedule: Schedule
    programs: dict[str, SplitProgram]
    alias: dict[str, str]
    candidates: dict[str, Any]


def compile_candidates(split_gm: fx.GraphModule, state: CompileState, manager: PassManager,
                       join_passes: Sequence[GraphPass], candidate_passes: Sequence[GraphPass],
                       compile_stage: Callable[[fx.GraphModule, Any], Callable] | None
                       ) -> CandidateSet:
    """Steps 1-4 of the module docstring for ``split_gm``.

    Args:
        split_gm: the split graph (after ``insert_yields``).
        state: the compile state (``token_symbols``, ``comms``, ``specs`` written).
        manager: runs and times the passes.
        join_passes / candidate_passes: the pipeline's lists for step 1 / step 2.
        compile_stage: each stage's callable from its GraphModule (``None``: the GraphModule).

    Raises:
        UnsplittableGraphError: the primary schedule cannot honour a result pool.
    """
    config = state.config
    graphs: dict[bool, fx.GraphModule | None] = {False: split_gm}
    joined: dict[bool, int] = {}

    def graph_for(join: bool) -> fx.GraphModule | None:
        """The split graph a candidate schedules (``None``: nothing to join)."""
        if join not in graphs:
            state.write(joined_calls=0)  # stays 0 where join_experts is disabled
            try:
                copied = manager.run(split_gm, join_passes, state)
            except ScheduleError as e:
                log.warning("dbo: routed experts not joined: %s", e)
                state.joined_calls = 0
            joined[join] = state.joined_calls
            graphs[join] = copied if state.joined_calls else None
        return graphs[join]

    candidates = candidates_of(config)
    primary = candidates[0]
    nothing_to_join = graph_for(primary.join_experts) is None
    why_unjoined = ("disabled (DboConfig.disable_passes)"
                    if "join_experts" in config.disable_passes else "no routed-expert call to join")
    if nothing_to_join:  # the primary is unjoined, and no candidate joins
        log.info("dbo: join_experts: %s; schedules are unjoined", why_unjoined)
        primary = Candidate(config.scheduler, config.scheduler)
        candidates = [primary] + [c for c in candidates[1:] if not c.join_experts]
    schedules: dict[str, Schedule] = {}
    alternatives = [(c, graph_for(c.join_experts)) for c in candidates[1:]]
    alternatives = [(c, g) for c, g in alternatives if g is not None]
    feasible = []
    for c, g in alternatives:
        try:
            state.write(candidate=c)
            manager.run(g, candidate_passes, state, tag=c.name)
            schedules[c.name] = state.schedule
            feasible.append((c, g))
        except UnsplittableGraphError as e:  # a result pool this schedule cannot honour
            log.info("dbo: schedule candidate %s dropped: %s", c.name, e)
    alternatives = feasible
    primary_gm = graphs[primary.join_experts]
    state.write(candidate=primary)
    manager.run(primary_gm, candidate_passes, state, tag=primary.name)
    schedules[primary.name] = state.schedule
    for c, _ in [(primary, None)] + alternatives:
        schedules[c.name].meta.update(candidate=c.name, joined_calls=joined.get(c.join_experts, 0))
    schedule = schedules[primary.name]
    stream_assign.annotate_streams(primary_gm.graph, schedule)  # once, the schedule chosen
    schedule.meta.update(comm_ops_per_ubatch=len(state.comms), num_graph_inputs=len(state.specs))
    if nothing_to_join and config.join_experts:
        schedule.meta["join_experts"] = why_unjoined

    # shared by the candidates of one split graph: a unit of several candidates is built (and
    # compiled) once; the joined graph has units of the same nodes that read other inputs
    built: dict[int, dict] = {}
    modules: dict[tuple, fx.GraphModule] = {}  # units computing the same, one GraphModule

    def codegen(gm: fx.GraphModule, sched: Schedule) -> SplitProgram:
        return SplitProgram(gm, sched, compile_stage, carveout_sms=carveout_sms(config),
                            built=built.setdefault(id(gm), {}), modules=modules)

    program = manager.time("codegen", codegen, primary_gm, schedule, tag=primary.name)
    programs: dict[str, SplitProgram] = {primary.name: program}
    # each candidate's program: the first candidate's of the same host order
    alias = {primary.name: primary.name}
    orders = {_unit_order(schedule): primary.name}
    for c, g in alternatives:  # one program per distinct host order
        order = _unit_order(schedules[c.name])
        if order not in orders:
            orders[order] = c.name
            programs[c.name] = manager.time("codegen", codegen, g, schedules[c.name], tag=c.name)
        alias[c.name] = orders[order]
    alias.setdefault(primary_candidate(config).name, primary.name)
    dump_programs(programs, config)
    return CandidateSet(primary_gm, schedule, programs, alias,
                        candidate_programs(programs, alias, config))


def _unit_order(schedule: Schedule) -> tuple:
    return tuple(tuple(u.nodes) for u in schedule.units)


#: dump dirs already warned about (one WARNING per unwritable directory and process)
_DUMP_WARNED: set[str] = set()
#: split graphs compiled in this process (numbers the dumps: a model with graph breaks has
#: several, compiled in the same order on every rank)
_SPLIT_GRAPHS = itertools.count()


def dump_programs(programs: dict[str, SplitProgram], config: DboConfig) -> None:
    """Each program's schedule (JSON) to TORCH_TRACE, and with ``dump_dir`` its schedule and
    wrapper to files (:func:`_dump_schedule`); the primary first."""
    graph_no = next(_SPLIT_GRAPHS)
    for i, (name, prog) in enumerate(programs.items()):  # the primary first
        _dump_schedule(prog.schedule, prog.code, config, graph_no, None if i == 0 else name)


def _dump_schedule(schedule: Schedule, code: str, config: DboConfig, graph_no: int,
                   candidate: str | None) -> None:
    """The schedule (JSON) to TORCH_TRACE, and with ``dump_dir`` the schedule and its wrapper
    to ``schedule_rank{R}_g{graph_no}_{fingerprint}[_{candidate}].json/.py`` (``candidate``:
    None for the primary, else its name, ``@``, ``/`` and ``+`` written as ``-``)."""
    try:  # the JSON is made only where someone listens (it took 0.1 s a schedule at 61 layers)
        name = "dbo_schedule" if candidate is None else f"dbo_schedule_{candidate}"
        trace_structured("artifact", metadata_fn=lambda: {"name": name, "encoding": "json"},
                         payload_fn=schedule.to_json)
    except Exception:  # noqa: BLE001
        pass
    if config.dump_dir:
        payload = schedule.to_json()
        rank = dist.get_rank() if dist.is_initialized() else 0
        suffix = "" if candidate is None else "_" + re.sub(r"[^A-Za-z0-9_.]", "-", candidate)
        base = os.path.join(config.dump_dir,
                            f"schedule_rank{rank}_g{graph_no}_{config.fingerprint()}{suffix}")
        try:
            os.makedirs(config.dump_dir, exist_ok=True)
            with open(base + ".json", "w") as f:
                f.write(payload)
            with open(base + ".py", "w") as f:
                f.write(code)
        except OSError as e:  # a diagnostic never fails the compile
            if config.dump_dir not in _DUMP_WARNED:
                _DUMP_WARNED.add(config.dump_dir)
                log.warning("dbo: dump_dir=%r cannot be written (%s: %s); schedules are not "
                            "dumped", config.dump_dir, type(e).__name__, e)
