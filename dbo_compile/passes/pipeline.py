"""The pass pipeline: from Dynamo's graph to the programs of a compiled artifact.

The ordered pass lists (names as in ``artifact.compile_times`` and in the numbered dumps)::

    Dynamo graph    inline_regions (the backend, before anything reads the graph) the calls of
                                   nested compile regions inlined (lowering.inline_regions)
                    bind_backends  the config's comm / experts backends into the ops' ``backend``
                                   argument (before lowering: the fake shapes are the backend's)
    lowered graph   lower          lowering: classify the inputs, functional ATen graph with a
                                   symbolic token dim (AOTAutograd)
                    reinplace      KV-cache writes back in place (passes/reinplace.py)
                    dead_code      drop what nothing uses
                    token_dim      token dim of every node; reject token-mixing graphs
                    state_threads  in-place updates of shared inputs from the tokens, replayed
                                   per ubatch (passes/state_threads.py); padding rows masked
                    find_comm      the comm ops (none: unsplittable, nothing to overlap)
    split graph     split_ubatch   one copy of the body per ubatch (passes/split_ubatch.py)
                    insert_yields  comm ops -> issue + wait (passes/insert_yields.py)
    per candidate   join_experts   (+join candidates, once per split graph) routed experts of
                                   both ubatches in one call (passes/join_experts.py)
                    stream_assign  stages, list schedule on two streams, events
                    codegen        the generated wrapper (codegen/wrapper.py)
    unsplit         unsplit        the lowered graph as the unsplit program (Inductor or ATen)

:class:`PassRunner` runs a list: it times each pass (DEBUG log ``dbo pass NN name: s``, and
``times`` for the artifact), dumps the graph after each pass through ``trace_structured``
under a numbered name (``dbo_NN_<pass>``; tlparse shows them) and lints and recompiles the
graph once at the end of the list, where a pass changed it. Candidates come from one table
(:data:`dbo_compile.config.CANDIDATES`); the config is never rewritten: a fact found on the
way (no routed-expert call to join) is written into the schedule's ``meta``.
"""

from __future__ import annotations

import copy
import itertools
import logging
import os
import re
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.fx as fx
from torch._logging import trace_structured

import dbo_compile.ops  # noqa: F401  (registers torch.ops.dbo.* and their records)
from dbo_compile import lowering
from dbo_compile.codegen import cache, inductor
from dbo_compile.codegen.wrapper import SplitProgram
from dbo_compile.config import Candidate, DboConfig, candidates_of, program_variants
from dbo_compile.errors import CommBackendError, ScheduleError, UnsplittableGraphError
from dbo_compile.ops.comm import comm_backend_of
from dbo_compile.ops.registry import comm_fingerprint, comm_nodes, comm_plan, kv_block_sizes
from dbo_compile.passes import (
    bind,
    insert_yields,
    join_experts,
    reinplace,
    split_ubatch,
    state_threads,
    stream_assign,
)
from dbo_compile.passes import token_dim
from dbo_compile.passes.meta import dbo_meta
from dbo_compile.runtime.program import DboCompiledModule
from dbo_compile.schedule import Schedule
from dbo_compile.signature import InputSpec, OutputSpec, SplitSignature

log = logging.getLogger(__name__)


__all__ = ["CompileState", "GraphPass", "PassRunner", "bind_passes", "compile_split",
           "compile_unsplit", "drain_plan", "lowered_passes", "resolve_device_defaults",
           "split_passes", "stage_compiler"]


@dataclass
class CompileState:
    """What the passes of one graph hand on to each other.

    Attributes:
        config: the options (resolved device defaults; never changed by a pass).
        example_inputs: one value per Dynamo placeholder.
        input_kinds: explicit input kinds for graphs not from Dynamo (``None``: from sources).
        specs: the input classification (``lower``).
        token_symbols: the symbols of the token and request dims (``lower``).
        token_symbol: the symbol of the token dim (``lower``).
        request_symbols: the symbols of the request dims (``lower``).
        output_specs: what each graph output is (``token_dim``).
        threads: the state threads (in-place updates of shared inputs from the tokens) and
            token-free writes of shared inputs (``state_threads``).
        float_guards: ``(input index, value)`` of the floats folded into the graph
            (``lower``: :func:`~dbo_compile.lowering.fold_tensorified_floats`).
        comms: the issuing comm nodes of the lowered graph (``find_comm``).
        signature: how the split graph maps to the lowered one (``split_ubatch``).
        unit_graphs: per split graph (``id`` of its ``fx.Graph``), the units its schedule
            candidates share (``stream_assign``, found by the first candidate).
    """

    config: DboConfig
    example_inputs: Sequence[Any]
    input_kinds: Sequence[str] | None = None
    specs: list[InputSpec] = field(default_factory=list)
    token_symbols: frozenset = frozenset()
    token_symbol: Any = None
    request_symbols: frozenset = frozenset()
    output_specs: tuple[OutputSpec, ...] = ()
    threads: list = field(default_factory=list)
    float_guards: tuple[tuple[int, float], ...] = ()
    comms: list[fx.Node] = field(default_factory=list)
    signature: SplitSignature | None = None
    unit_graphs: dict[int, stream_assign.UnitGraph] = field(default_factory=dict)


@dataclass(frozen=True)
class GraphPass:
    """One pass: ``run(gm, state)`` changes ``gm`` in place and returns ``None``, or returns
    the new GraphModule that replaces it (``lower``, ``split_ubatch``).

    Attributes:
        name: as in ``compile_times`` and the dumps.
        run: the pass.
        changes_graph: the pass adds, removes or rewires nodes (the runner then lints and
            recompiles at the end of the list); ``False`` for passes that only annotate.
    """

    name: str
    run: Callable[[fx.GraphModule, CompileState], fx.GraphModule | None]
    changes_graph: bool = True


class PassRunner:
    """Runs pass lists (module docstring); ``times`` maps each pass (``name`` or
    ``name[candidate]``) to its seconds, in the order run."""

    def __init__(self):
        self.times: dict[str, float] = {}
        self._number = itertools.count()
        self._last = -1

    def run(self, gm: fx.GraphModule, passes: Sequence[GraphPass], state: CompileState,
            tag: str = "") -> fx.GraphModule:
        changed = False
        for p in passes:
            out = self.time(p.name, p.run, gm, state, tag=tag)
            if out is not None:
                gm, changed = out, False  # a new module, made consistent by its pass
            changed |= p.changes_graph
            _dump_graph(f"{self._last:02d}_{p.name}", gm)
        if changed:
            gm.graph.lint()
            gm.recompile()
        return gm

    def time(self, name: str, fn: Callable[..., Any], *args: Any, tag: str = "") -> Any:
        """``fn(*args)``, timed as pass ``name`` (``name[tag]``)."""
        key = f"{name}[{tag}]" if tag else name
        self._last = next(self._number)
        t0 = time.perf_counter()
        out = fn(*args)
        dt = time.perf_counter() - t0
        self.times[key] = self.times.get(key, 0.0) + dt
        log.debug("dbo pass %02d %s: %.3f s", self._last, key, dt)
        return out


# -- the passes -------------------------------------------------------------------------------


def bind_passes(config: DboConfig) -> list[GraphPass]:
    """The passes on Dynamo's graph itself (the unsplit fallback runs it too)."""
    return [GraphPass("bind_backends", lambda gm, st: bind.bind_backends(gm, st.config))]


def _lower(gm: fx.GraphModule, st: CompileState) -> fx.GraphModule:
    st.specs = lowering.classify_inputs(gm, st.example_inputs, st.input_kinds)
    mirror = next((s for s in st.specs if s.kind == "host_mirror"), None)
    if mirror is not None:
        raise UnsplittableGraphError(
            f"the model reads the host mirror {mirror.field}_cpu ({mirror.source}) of the "
            "attention metadata: mirrors serve the runtime's host decisions and are not cut "
            f"per ubatch; read the device field {mirror.field} instead")
    if not any(s.kind == "token" for s in st.specs):
        raise UnsplittableGraphError("the graph has no token-indexed tensor input")
    gm, st.float_guards = lowering.fold_tensorified_floats(gm, st.example_inputs)
    lowered = lowering.lower_to_aten(gm, st.example_inputs, st.specs)
    st.token_symbols = lowered.token_symbols
    st.token_symbol = lowered.token_symbol
    st.request_symbols = lowered.request_symbols
    placeholders = [n for n in lowered.gm.graph.nodes if n.op == "placeholder"]
    for spec, node in zip(st.specs, placeholders):
        if spec.field is not None:
            dbo_meta(node)["field"] = spec.field
    return lowered.gm


def _reinplace(gm: fx.GraphModule, st: CompileState) -> None:
    reinplace.reinplace_graph_input_mutations(gm.graph)


def _dead_code(gm: fx.GraphModule, st: CompileState) -> None:
    gm.graph.eliminate_dead_code()


def _token_dim(gm: fx.GraphModule, st: CompileState) -> None:
    token_dim.annotate_token_dims(gm.graph, st.token_symbols, st.request_symbols)
    st.output_specs = token_dim.check_outputs(gm.graph, st.token_symbol)


def _state_threads(gm: fx.GraphModule, st: CompileState) -> None:
    st.threads = state_threads.find_state_threads(gm.graph, st.specs)
    spec = state_threads.mask_padding_rows(gm.graph, st.threads, st.specs, st.token_symbol)
    if spec is not None:
        st.specs = [*st.specs, spec]


def _find_comm(gm: fx.GraphModule, st: CompileState) -> None:
    st.comms = comm_nodes(gm.graph)
    if not st.comms:
        e = UnsplittableGraphError(
            "the graph has no comm op (dbo.dispatch / dbo.combine / "
            "_c10d_functional.all_to_all_single): nothing to overlap"
        )
        e.row_local = True  # the token-dim pass passed: padding rows cannot change real rows
        e.state_inputs = state_threads.state_inputs(gm.graph, st.specs)
        raise e


def _split_ubatch(gm: fx.GraphModule, st: CompileState) -> fx.GraphModule:
    split_gm, st.signature = split_ubatch.split_ubatch(gm, st.specs, st.config.num_ubatches,
                                                       st.threads)
    return split_gm


def _insert_yields(gm: fx.GraphModule, st: CompileState) -> None:
    insert_yields.insert_yields(gm.graph)


def lowered_passes(config: DboConfig) -> list[GraphPass]:
    """The passes from Dynamo's graph to the lowered (unsplit) graph."""
    return [GraphPass("lower", _lower), GraphPass("reinplace", _reinplace),
            GraphPass("dead_code", _dead_code), GraphPass("token_dim", _token_dim, False),
            GraphPass("state_threads", _state_threads), GraphPass("find_comm", _find_comm, False)]


def split_passes(config: DboConfig) -> list[GraphPass]:
    """The passes from the lowered graph to the split graph."""
    return [GraphPass("split_ubatch", _split_ubatch), GraphPass("insert_yields", _insert_yields)]


def _join_pass(joined: list[int]) -> GraphPass:
    def run(gm: fx.GraphModule, st: CompileState) -> fx.GraphModule:
        copied = join_experts.copy_split_graph(gm)  # the unjoined graph is scheduled too
        joined.append(join_experts.join_experts(copied, st.config.num_ubatches))
        return copied

    return GraphPass("join_experts", run)


def _schedule_pass(candidate: Candidate, out: dict[str, Schedule]) -> GraphPass:
    def run(gm: fx.GraphModule, st: CompileState) -> None:
        units_of = st.unit_graphs.get(id(gm.graph))
        if units_of is None:
            units_of = st.unit_graphs[id(gm.graph)] = stream_assign.unit_graph(gm.graph)
        out[candidate.name] = stream_assign.stream_assign(
            gm.graph, candidate.apply(st.config), st.token_symbols, st.config.num_ubatches,
            units_of)

    return GraphPass("stream_assign", run, changes_graph=False)


# -- the driver -------------------------------------------------------------------------------


def compile_split(gm: fx.GraphModule, example_inputs: Sequence[Any], config: DboConfig,
                  input_kinds: Sequence[str] | None = None,
                  runner: PassRunner | None = None) -> DboCompiledModule:
    """Run the whole pipeline; return the :class:`~dbo_compile.runtime.program.DboCompiledModule`.

    Args:
        gm: a Dynamo graph (or any FX graph with ``input_kinds``).
        example_inputs: one value per placeholder.
        config: options.
        input_kinds: explicit input classification for graphs not from Dynamo.
        runner: records the passes' times (default: a new one); the caller keeps it to know
            the times of a graph that turned out unsplittable.

    With ``config.cache_dir``, a graph compiled before (by this or another process) is read
    back from the compile cache instead (:mod:`dbo_compile.codegen.cache`; passes
    ``cache_key`` and ``cache_load`` in the times), and a graph compiled here is written to it.
    The key is taken after the bind pass: it sees the comm and experts backends each op is
    bound to (what ``"auto"`` chose from the packages present, the emulated world's
    instance), and the config fingerprint the calibration's content.

    Raises:
        UnsplittableGraphError: the graph has no comm op or mixes tokens across the split.
    """
    config = resolve_device_defaults(config, example_inputs)
    runner = runner or PassRunner()
    t0 = time.perf_counter()
    state = CompileState(config, example_inputs, input_kinds)
    _dump_graph("input", gm)
    gm = runner.run(gm, bind_passes(config), state)
    key = None
    if config.cache_dir:
        key = runner.time("cache_key", cache.cache_key, gm, example_inputs, config, input_kinds)
        found = runner.time("cache_load", _from_cache, key, gm, config, runner,
                            lowering.folded_floats(gm, example_inputs))
        if found is not None:
            found.compile_times = dict(runner.times)
            return found
    try:
        compiled, programs = _compile_split(gm, state, runner, t0)
    except UnsplittableGraphError as e:
        if key is not None:
            runner.time("cache_store", cache.write_entry, config.cache_dir, key,
                        {"kind": "unsplittable", "reason": str(e), "row_local": e.row_local,
                         "state_inputs": e.state_inputs})
        raise
    if key is not None:
        runner.time("cache_store", _to_cache, key, compiled, programs)
        compiled.compile_times = dict(runner.times)
    return compiled


def _compile_split(gm: fx.GraphModule, state: CompileState, runner: PassRunner, t0: float
                   ) -> tuple[DboCompiledModule, dict[str, SplitProgram]]:
    """:func:`compile_split` after the bind pass, without the cache; also the distinct
    candidate programs."""
    config = state.config
    lowered_gm = runner.run(gm, lowered_passes(config), state)
    why = stream_assign.unsplit_pool_violation(lowered_gm.graph)
    if why is not None:
        raise CommBackendError(f"the model breaks its comm backend's result pool: {why}; "
                               "copy the result (x.clone()) before the later call")
    split_gm = runner.run(lowered_gm, split_passes(config), state)

    graphs: dict[bool, fx.GraphModule | None] = {False: split_gm}
    joined: dict[bool, int] = {}

    def graph_for(join: bool) -> fx.GraphModule | None:
        """The split graph a candidate schedules (``None``: nothing to join)."""
        if join not in graphs:
            count: list[int] = []
            try:
                copied = runner.run(split_gm, [_join_pass(count)], state)
            except ScheduleError as e:
                log.warning("dbo: routed experts not joined: %s", e)
                count = [0]
            joined[join] = count[0]
            graphs[join] = copied if count[0] else None
        return graphs[join]

    candidates = candidates_of(config)
    primary = candidates[0]
    nothing_to_join = graph_for(primary.join_experts) is None
    if nothing_to_join:  # the primary is unjoined, and no candidate joins
        log.info("dbo: join_experts: no routed-expert call to join; schedules are unjoined")
        primary = Candidate(config.scheduler, config.scheduler)
        candidates = [primary] + [c for c in candidates[1:] if not c.join_experts]
    schedules: dict[str, Schedule] = {}
    # alternative schedules first: stream_assign annotates the graph's nodes, and the primary
    # schedule's annotations must be the ones left on its graph (codegen reads the schedule only)
    alternatives = [(c, graph_for(c.join_experts)) for c in candidates[1:]]
    alternatives = [(c, g) for c, g in alternatives if g is not None]
    feasible = []
    for c, g in alternatives:
        try:
            runner.run(g, [_schedule_pass(c, schedules)], state, tag=c.name)
            feasible.append((c, g))
        except UnsplittableGraphError as e:  # a result pool this schedule cannot honour
            log.info("dbo: schedule candidate %s dropped: %s", c.name, e)
    alternatives = feasible
    primary_gm = graphs[primary.join_experts]
    runner.run(primary_gm, [_schedule_pass(primary, schedules)], state, tag=primary.name)
    for c, _ in [(primary, None)] + alternatives:
        schedules[c.name].meta.update(candidate=c.name, joined_calls=joined.get(c.join_experts, 0))
    schedule = schedules[primary.name]
    schedule.meta.update(comm_ops_per_ubatch=len(state.comms), num_graph_inputs=len(state.specs))
    if nothing_to_join and config.join_experts:
        schedule.meta["join_experts"] = "no routed-expert call to join"

    compile_stage = stage_compiler(config)
    # shared by the candidates of one split graph: a unit of several candidates is built (and
    # compiled) once; the joined graph has units of the same nodes that read other inputs
    built: dict[int, dict] = {}
    modules: dict[tuple, fx.GraphModule] = {}  # units computing the same, one GraphModule

    def codegen(gm: fx.GraphModule, sched: Schedule) -> SplitProgram:
        return SplitProgram(gm, sched, compile_stage, carveout_sms=_carveout_sms(config),
                            built=built.setdefault(id(gm), {}), modules=modules)

    program = runner.time("codegen", codegen, primary_gm, schedule, tag=primary.name)
    programs: dict[str, SplitProgram] = {primary.name: program}
    # each candidate's program: the first candidate's of the same host order
    alias = {primary.name: primary.name}
    orders = {_unit_order(schedule): primary.name}
    for c, g in alternatives:  # one program per distinct host order
        order = _unit_order(schedules[c.name])
        if order not in orders:
            orders[order] = c.name
            programs[c.name] = runner.time("codegen", codegen, g, schedules[c.name], tag=c.name)
        alias[c.name] = orders[order]
    alias.setdefault(config.scheduler + ("+join" if config.join_experts else ""), primary.name)
    candidate_programs = _with_carveouts(programs, alias, config)
    _dump_schedules(programs, config)
    # the unsplit program is the lowered graph: symbolic in the token dim, so it also runs at
    # the padded token count the DP vote agrees on
    unsplit = runner.time("unsplit", compile_unsplit, lowered_gm, config)
    log.info("dbo: split into %d ubatches, %d comm ops per ubatch, %d units, %d event edges "
             "(%.2f s)", config.num_ubatches, len(state.comms), len(schedule.units),
             len(schedule.event_edges), time.perf_counter() - t0)
    compiled = DboCompiledModule(unsplit, program, state.specs, state.signature, config,
                                 candidates=candidate_programs, compile_times=runner.times,
                                 kv_block_sizes=kv_block_sizes(lowered_gm.graph),
                                 output_specs=state.output_specs,
                                 split_plan=drain_plan(primary_gm.graph, state.token_symbol,
                                                       schedule),
                                 unsplit_plan=drain_plan(lowered_gm.graph, state.token_symbol),
                                 float_guards=state.float_guards,
                                 guard_fallback=compile_unsplit(gm, config)
                                 if state.float_guards else None,
                                 state_inputs=state_threads.state_inputs(lowered_gm.graph,
                                                                         state.specs),
                                 split_collectives=comm_fingerprint(primary_gm.graph, schedule),
                                 unsplit_collectives=comm_fingerprint(lowered_gm.graph))
    compiled.split_gm = split_gm
    compiled.lowered_gm = lowered_gm
    compiled.program_alias = alias
    compiled.token_symbols = state.token_symbols  # the cost model's (and a calibration's)
    return compiled, programs


def _with_carveouts(programs: dict[str, SplitProgram], alias: dict[str, str],
                    config: DboConfig) -> dict[str, Any]:
    """The candidate programs (:func:`~dbo_compile.config.program_variants`, the primary
    first): ``programs[alias[candidate]]`` for a variant without a carve-out, a copy of it
    with the carve-out (same code and units) for one with. ``alias`` maps each compiled
    candidate to the program of its host order; a variant of a candidate not compiled (no
    routed-expert call to join) or of a program already listed is left out."""
    out: dict[str, Any] = {}
    seen: set[tuple[int, int | None]] = set()
    for name, base, sms in program_variants(config):
        if base not in alias or (id(programs[alias[base]]), sms) in seen:
            continue
        prog = programs[alias[base]]
        seen.add((id(prog), sms))
        if sms is None:
            out[alias[base]] = prog
        else:
            out[name] = copy.copy(prog)
            out[name].carveout_sms = sms
    return out


def _dump_schedules(programs: dict[str, SplitProgram], config: DboConfig) -> None:
    graph_no = next(_SPLIT_GRAPHS)
    for i, (name, prog) in enumerate(programs.items()):  # the primary first
        _dump_schedule(prog.schedule, prog.code, config, graph_no, None if i == 0 else name)


# -- the compile cache (codegen/cache.py) -------------------------------------------------------


def _to_cache(key: str, compiled: DboCompiledModule, programs: dict[str, SplitProgram]) -> None:
    """Write ``compiled``'s entry: the lowered graph, the classification, the signature, and
    per distinct candidate program its schedule, wrapper and units (unit graphs once each)."""
    callables: dict[int, int] = {}
    units: list[tuple[dict, bool, str | None]] = []
    entries = []
    try:
        for name, prog in programs.items():
            index = []
            for fn in prog.units:
                if id(fn) not in callables:  # (graph, an Inductor stage?, why it runs ATen)
                    callables[id(fn)] = len(units)
                    units.append((cache.dump_graph(getattr(fn, "gm", fn)),
                                  not isinstance(fn, fx.GraphModule),
                                  getattr(fn, "aten_reason", None)))
                index.append(callables[id(fn)])
            entries.append((name, prog.schedule.to_dict(), index, prog.unit_io, prog.code,
                            prog.num_events))
        lowered = cache.dump_graph(compiled.lowered_gm)
    except ValueError as e:
        log.warning("dbo: compile cache: not writing this graph: %s", e)
        return
    cache.write_entry(compiled.config.cache_dir, key, {
        "kind": "split", "specs": compiled.specs, "signature": compiled.signature,
        "lowered": lowered, "units": units, "programs": entries,
        "alias": compiled.program_alias, "kv_block_sizes": compiled.kv_block_sizes,
        "output_specs": compiled.output_specs,
        "split_plan": cache.dump_plan(compiled.split_plan),
        "unsplit_plan": cache.dump_plan(compiled.unsplit_plan),
        "float_guards": compiled.float_guards, "state_inputs": compiled.state_inputs,
        "collectives": (compiled.split_collectives, compiled.unsplit_collectives)})


def _from_cache(key: str, gm: fx.GraphModule, config: DboConfig, runner: PassRunner,
                folds: tuple[tuple[int, float], ...]) -> DboCompiledModule | None:
    """The artifact of ``key``'s entry (``None``: no usable entry); ``gm``: the bound Dynamo
    graph (the float guards' fallback compiles it unsplit); ``folds``: the floats this graph's
    lowering would fold (:func:`~dbo_compile.lowering.folded_floats`), which must be the
    entry's (they are part of the key; an entry folding others is ignored).

    Raises:
        UnsplittableGraphError: the entry says the graph is unsplittable (why, as compiled).
    """
    payload = cache.read_entry(config.cache_dir, key)
    if payload is None:
        return None
    if payload.get("kind") == "unsplittable":
        e = UnsplittableGraphError(f"{payload['reason']} (compile cache)")
        e.row_local = bool(payload.get("row_local"))
        e.state_inputs = tuple(payload.get("state_inputs", ()))
        raise e
    try:
        if tuple(payload["float_guards"]) != tuple(folds):
            raise ValueError(f"its programs fold the floats (input, value) "
                             f"{list(payload['float_guards'])}, this graph's inputs hold "
                             f"{list(folds)}")
        compile_stage = stage_compiler(config)
        made = [cache.load_graph(data) for data, _, _ in payload["units"]]
        programs: dict[str, SplitProgram] = {}
        staged_fns: dict[int, Callable] = {}
        for name, sched, index, unit_io, code, num_events in payload["programs"]:
            schedule = Schedule.from_dict(sched)
            fns = []
            for unit, i in zip(schedule.units, index):
                fn = made[i]
                _, staged, aten_reason = payload["units"][i]
                if staged and compile_stage is not None:
                    if i not in staged_fns:  # one stage per unit graph, as compiled
                        staged_fns[i] = compile_stage(fn, unit)
                        # the rebuilt graph has no meta["val"] to find a value int in
                        staged_fns[i].aten_reason = aten_reason or staged_fns[i].aten_reason
                    fn = staged_fns[i]
                fns.append(fn)
            programs[name] = SplitProgram.from_parts(schedule, fns, unit_io, code, num_events,
                                                     carveout_sms=_carveout_sms(config))
        if config.compute_backend == "aten":
            lowered: Any = cache.DeferredGraph(payload["lowered"])
        else:
            lowered = cache.load_graph(payload["lowered"])
        primary = next(iter(programs.values()))
        compiled = DboCompiledModule(compile_unsplit(lowered, config), primary, payload["specs"],
                                     payload["signature"], config,
                                     candidates=_with_carveouts(programs, payload["alias"],
                                                                config),
                                     compile_times=runner.times,
                                     kv_block_sizes=payload["kv_block_sizes"],
                                     output_specs=payload["output_specs"],
                                     split_plan=cache.load_plan(payload["split_plan"]),
                                     unsplit_plan=cache.load_plan(payload["unsplit_plan"]),
                                     float_guards=payload["float_guards"],
                                     guard_fallback=compile_unsplit(gm, config)
                                     if payload["float_guards"] else None,
                                     state_inputs=payload["state_inputs"],
                                     split_collectives=payload["collectives"][0],
                                     unsplit_collectives=payload["collectives"][1])
        compiled.program_alias = payload["alias"]
    except Exception as e:  # noqa: BLE001 - an entry that does not rebuild is ignored
        cache.ignore(config.cache_dir, key, e)
        return None
    _dump_schedules(programs, config)
    compiled.split_gm = None  # not stored: nothing runs it
    compiled.lowered_gm = lowered
    compiled.token_symbols = None  # no traced graphs to read them in (calibrate.py refuses)
    log.info("dbo: compile cache: read %s's entry (%d candidate programs)", key[:16],
             len(programs))
    return compiled


def _carveout_sms(config: DboConfig) -> int | None:
    """SMs the split programs carve out of compute: ``comm_sms``, else the comm backend's
    option ``comm_sms`` (the emulated world's: the SMs its comm kernels would hold), else
    none."""
    if config.comm_sms is not None:
        return config.comm_sms
    return dict(config.comm_backend_options).get("comm_sms") or None


def drain_plan(graph: fx.Graph, token_symbol: Any, schedule: Schedule | None = None):
    """The collectives a program issues, as null calls, for the step transaction
    (:func:`~dbo_compile.ops.registry.comm_plan`; ``schedule``: the split program's host
    order); ``None`` (not drainable: a failing rank raises at once) when a comm op's backend
    has a dispatch handle or a receive phase (DeepEP: a null combine needs the handle of a
    real dispatch), or an op has no null call."""
    for node in comm_nodes(graph):
        backend = comm_backend_of(node)
        if backend is not None and (backend.handle or backend.receive is not None):
            return None
    return comm_plan(graph, token_symbol, schedule)


def _unit_order(schedule: Schedule) -> tuple:
    return tuple(tuple(u.nodes) for u in schedule.units)


def resolve_device_defaults(config: DboConfig, example_inputs: Sequence[Any]) -> DboConfig:
    """The defaults that depend on the device, for a graph with CUDA inputs / otherwise (every
    rank of a job sees the same device type, so every rank resolves the same way):
    ``compute_backend="auto"`` -> ``"inductor"`` / ``"aten"``; ``sm_carveout_candidates=None``
    -> ``(16,)`` where torch can carve SMs out / ``()``. Resolved once, before the passes;
    a resolved config resolves to itself."""
    cuda = any(isinstance(x, torch.Tensor) and x.device.type == "cuda" for x in example_inputs)
    if config.compute_backend == "auto":
        config = config.replace(compute_backend="inductor" if cuda else "aten")
    if config.sm_carveout_candidates is None:
        carve = cuda and hasattr(torch._C, "_set_sm_carveout_experimental")
        config = config.replace(sm_carveout_candidates=(16,) if carve else ())
    return config


def stage_compiler(config: DboConfig) -> Callable[[fx.GraphModule, Any], Callable] | None:
    """``compile_stage`` of the split programs for ``config.compute_backend`` (``None``: each
    stage runs its traced ATen ops)."""
    if config.compute_backend == "aten":
        return None
    return inductor.inductor_stage_compiler()


def compile_unsplit(gm: fx.GraphModule, config: DboConfig) -> Callable[..., Any]:
    """The unsplit program: the graph as traced, or Inductor's (``compute_backend``), so that
    the runtime's split-or-not comparison is like for like."""
    if config.compute_backend == "aten":
        return gm
    return inductor.InductorStage(gm, "the unsplit program")


def _dump_graph(name: str, gm: fx.GraphModule) -> None:
    """The graph after a pass, as a ``trace_structured`` artifact ``dbo_<name>`` and at DEBUG
    (formatted only when someone listens)."""
    try:
        trace_structured("artifact", metadata_fn=lambda: {"name": f"dbo_{name}",
                                                          "encoding": "string"},
                         payload_fn=lambda: gm.print_readable(print_output=False))
    except Exception:  # noqa: BLE001 - logging must never break compilation
        pass
    if log.isEnabledFor(logging.DEBUG):
        log.debug("dbo graph after %s:\n%s", name, gm.graph.python_code("self").src)


#: dump dirs already warned about (one WARNING per unwritable directory and process)
_DUMP_WARNED: set[str] = set()
#: split graphs compiled in this process (numbers the dumps: a model with graph breaks has
#: several, compiled in the same order on every rank)
_SPLIT_GRAPHS = itertools.count()


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
