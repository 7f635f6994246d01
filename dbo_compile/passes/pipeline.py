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

:class:`PassManager` runs a list: it times each pass (DEBUG log ``dbo pass NN name: s``, and
``times`` for the artifact), dumps the graph after each pass through ``trace_structured``
under a numbered name (``dbo_NN_<pass>``; tlparse shows them) and lints and recompiles the
graph once at the end of the list, where a pass changed it. Candidates come from one table
(:data:`dbo_compile.config.CANDIDATES`); the config is never rewritten: a fact found on the
way (no routed-expert call to join) is written into the schedule's ``meta``.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

import dbo_compile.ops  # noqa: F401  (registers torch.ops.dbo.* and their records)
from dbo_compile import lowering
from dbo_compile.codegen import cache, inductor
from dbo_compile.codegen.wrapper import SplitProgram
from dbo_compile.candidates import candidate_programs, carveout_sms
from dbo_compile.config import DboConfig
from dbo_compile.errors import (
    CommBackendError,
    PipelineError,
    UnsplittableGraphError,
)
from dbo_compile.ops.comm import comm_backend_of
from dbo_compile.ops.registry import comm_fingerprint, comm_nodes, comm_plan, kv_block_sizes
from dbo_compile.passes import (
    bind,
    dead_code,
    find_comm,
    insert_yields,
    join_experts,
    lower,
    reinplace,
    split_ubatch,
    state_threads,
    stream_assign,
    token_dim,
)
from dbo_compile.passes.candidate_driver import compile_candidates, dump_programs
from dbo_compile.passes.manager import (
    CompileState,
    GraphPass,
    PassManager,
    check_disabled,
    dump_graph,
    registered_passes,
    with_user_passes,
)
from dbo_compile.runtime.program import DboCompiledModule
from dbo_compile.schedule import Schedule

log = logging.getLogger(__name__)


__all__ = ["BIND_PASSES", "CANDIDATE_PASSES", "JOIN_PASSES", "LOWERED_PASSES", "SPLIT_PASSES",
           "compile_split", "compile_unsplit", "drain_plan", "pass_names", "pipeline_passes",
           "resolve_device_defaults", "stage_compiler"]


# -- the passes -------------------------------------------------------------------------------

#: bind_backends: the config's comm / experts backends into the ops' ``backend`` argument
BIND_BACKENDS = GraphPass("bind_backends", lambda gm, st: bind.bind_backends(gm, st.config))
#: the passes on Dynamo's graph itself (the unsplit fallback runs it too)
BIND_PASSES: tuple[GraphPass, ...] = (BIND_BACKENDS,)
#: the passes from Dynamo's graph to the lowered (unsplit) graph
LOWERED_PASSES: tuple[GraphPass, ...] = (lower.PASS, reinplace.PASS, dead_code.PASS,
                                         token_dim.PASS, state_threads.PASS, find_comm.PASS)
#: the passes from the lowered graph to the split graph
SPLIT_PASSES: tuple[GraphPass, ...] = (split_ubatch.PASS, insert_yields.PASS)
#: once per split graph, for the joined candidates: a joined copy of it
JOIN_PASSES: tuple[GraphPass, ...] = (join_experts.PASS,)
#: per schedule candidate, on its split graph (``compile_times`` key ``name[candidate]``)
CANDIDATE_PASSES: tuple[GraphPass, ...] = (stream_assign.PASS,)


def pipeline_passes() -> list[GraphPass]:
    """Every pass of the lists, in pipeline order, the registered user passes included."""
    return with_user_passes(BIND_PASSES + LOWERED_PASSES + SPLIT_PASSES + JOIN_PASSES
                            + CANDIDATE_PASSES)


def pass_names() -> list[str]:
    """The name of every step the compile times, in pipeline order, as the keys of
    ``artifact.compile_times`` (a candidate's without its ``[candidate]`` tag): the backend's
    ``inline_regions``, the passes of the lists (user passes included), ``codegen`` and
    ``unsplit``; with ``cache_dir`` also ``cache_key``, ``cache_load`` and ``cache_store``,
    which are not listed."""
    return ["inline_regions", *(p.name for p in pipeline_passes()), "codegen", "unsplit"]


def _check_passes(config: DboConfig) -> None:
    """The user passes run after a pass of the lists under a name of their own, and
    ``disable_passes`` names only optional passes.

    Raises:
        PipelineError: a user pass named after no pass, or with a pipeline pass's name.
        DboConfigError: ``disable_passes`` names a pass that cannot be disabled.
    """
    ours = BIND_PASSES + LOWERED_PASSES + SPLIT_PASSES + JOIN_PASSES + CANDIDATE_PASSES
    passes = pipeline_passes()
    for user, after in registered_passes():
        if user.name in {p.name for p in ours}:
            raise PipelineError(f"the user pass {user.name!r} has the name of a pipeline pass; "
                                "give it a name of its own")
        if after not in {p.name for p in passes}:
            raise PipelineError(f"the user pass {user.name!r} runs after {after!r}, which is "
                                f"no pass; the passes are {[p.name for p in passes]}")
    check_disabled(config, passes)


# -- the driver -------------------------------------------------------------------------------


def compile_split(gm: fx.GraphModule, example_inputs: Sequence[Any], config: DboConfig,
                  input_kinds: Sequence[str] | None = None,
                  runner: PassManager | None = None) -> DboCompiledModule:
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
    _check_passes(config)
    runner = runner or PassManager()
    t0 = time.perf_counter()
    state = CompileState(config, example_inputs, input_kinds)
    dump_graph("input", gm)
    gm = runner.run(gm, BIND_PASSES, state)
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
                         "state_inputs": e.state_inputs,
                         "folds_token_rows": e.folds_token_rows})
        raise
    if key is not None:
        runner.time("cache_store", _to_cache, key, compiled, programs)
        compiled.compile_times = dict(runner.times)
    return compiled


def _compile_split(gm: fx.GraphModule, state: CompileState, runner: PassManager, t0: float
                   ) -> tuple[DboCompiledModule, dict[str, SplitProgram]]:
    """:func:`compile_split` after the bind pass, without the cache; also the distinct
    candidate programs."""
    config = state.config
    lowered_gm = runner.run(gm, LOWERED_PASSES, state)
    why = stream_assign.unsplit_pool_violation(lowered_gm.graph)
    if why is not None:
        raise CommBackendError(f"the model breaks its comm backend's result pool: {why}; "
                               "copy the result (x.clone()) before the later call")
    split_gm = runner.run(lowered_gm, SPLIT_PASSES, state)

    cands = compile_candidates(split_gm, state, runner, JOIN_PASSES, CANDIDATE_PASSES,
                               stage_compiler(config))
    schedule, primary_gm = cands.schedule, cands.primary_gm
    # the unsplit program is the lowered graph: symbolic in the token dim, so it also runs at
    # the padded token count the DP vote agrees on
    unsplit = runner.time("unsplit", compile_unsplit, lowered_gm, config)
    log.info("dbo: split into %d ubatches, %d comm ops per ubatch, %d units, %d event edges "
             "(%.2f s)", config.num_ubatches, len(state.comms), len(schedule.units),
             len(schedule.event_edges), time.perf_counter() - t0)
    compiled = DboCompiledModule(unsplit, cands.programs[next(iter(cands.programs))],
                                 state.specs, state.signature, config,
                                 candidates=cands.candidates, compile_times=runner.times,
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
    compiled.program_alias = cands.alias
    compiled.token_symbols = state.token_symbols  # the cost model's (and a calibration's)
    return compiled, cands.programs


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


def _from_cache(key: str, gm: fx.GraphModule, config: DboConfig, runner: PassManager,
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
        e.folds_token_rows = bool(payload.get("folds_token_rows"))
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
                                                     carveout_sms=carveout_sms(config))
        if config.compute_backend == "aten":
            lowered: Any = cache.DeferredGraph(payload["lowered"])
        else:
            lowered = cache.load_graph(payload["lowered"])
        primary = next(iter(programs.values()))
        compiled = DboCompiledModule(compile_unsplit(lowered, config), primary, payload["specs"],
                                     payload["signature"], config,
                                     candidates=candidate_programs(programs, payload["alias"], config),
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
    dump_programs(programs, config)
    compiled.split_gm = None  # not stored: nothing runs it
    compiled.lowered_gm = lowered
    compiled.token_symbols = None  # no traced graphs to read them in (calibrate.py refuses)
    log.info("dbo: compile cache: read %s's entry (%d candidate programs)", key[:16],
             len(programs))
    return compiled


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
