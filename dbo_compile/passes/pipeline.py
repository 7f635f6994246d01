"""The pass pipeline: from Dynamo's graph to the programs of a compiled artifact.

The ordered pass lists (names as in ``artifact.compile_times`` and in the numbered dumps;
each pass is its module's ``PASS``, run by :class:`~dbo_compile.passes.manager.PassManager`)::

    Dynamo graph    inline_regions (the backend, before anything reads the graph) the calls of
                                   nested compile regions inlined (lowering.inline_regions)
                    bind_backends  the config's comm / experts backends into the ops' ``backend``
                                   argument (before lowering: the fake shapes are the backend's)
    lowered graph   lower          lowering: classify the inputs, functional ATen graph with a
                                   symbolic token dim (AOTAutograd; passes/lower.py)
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
    unsplit         unsplit        the lowered graph as the unsplit program (codegen/stages.py)
                    unsplit_overlap (``unsplit_overlap`` on) the lowered graph as one ubatch
                                   on the two streams (passes/unsplit_overlap.py)

A new pass is one module exporting its ``PASS`` and one entry in a list below (or, from
outside the package, :func:`~dbo_compile.passes.manager.register_pass`). The candidates
(:mod:`dbo_compile.candidates`) are compiled by :mod:`~dbo_compile.passes.candidate_driver`;
the config is never rewritten: a fact found on the way (no routed-expert call to join) is
written into the schedule's ``meta``. With ``cache_dir`` the compile cache
(:mod:`dbo_compile.codegen.cache`) is read first (:mod:`~dbo_compile.passes.cache_lookup`)
and written after.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Sequence

import torch
import torch.fx as fx

import dbo_compile.ops  # noqa: F401  (registers torch.ops.dbo.* and their records)
from dbo_compile.codegen import cache
from dbo_compile.codegen.stages import StageCompiler, stage_compiler
from dbo_compile.codegen.wrapper import SplitProgram
from dbo_compile.config import DboConfig
from dbo_compile.errors import CommBackendError, PipelineError, UnsplittableGraphError
from dbo_compile.ops.registry import comm_fingerprint, kv_block_sizes
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
    unsplit_overlap,
)
from dbo_compile.passes.cache_lookup import cache_lookup
from dbo_compile.passes.candidate_driver import compile_candidates
from dbo_compile.passes.predict import predict_bucket
from dbo_compile.passes.manager import (
    CompileState,
    GraphPass,
    PassManager,
    check_disabled,
    dump_graph,
    registered_passes,
    with_user_passes,
)
from dbo_compile.runtime.drain import drain_plan
from dbo_compile.runtime.program import SplitArtifact, SplitRecord

log = logging.getLogger(__name__)

__all__ = ["BIND_PASSES", "CANDIDATE_PASSES", "JOIN_PASSES", "LOWERED_PASSES", "SPLIT_PASSES",
           "compile_split", "has_cuda_inputs", "pass_names", "pipeline_passes",
           "resolve_device_defaults"]


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
    ``inline_regions``, the passes of the lists (user passes included), ``codegen``,
    ``unsplit`` and (``unsplit_overlap`` on) ``unsplit_overlap``; with ``cache_dir`` also
    ``cache_key``, ``cache_load`` and ``cache_store``, which are not listed."""
    return ["inline_regions", *(p.name for p in pipeline_passes()), "codegen", "unsplit",
            "unsplit_overlap"]


def _check_passes(config: DboConfig) -> None:
    """The user passes run after a pass of the lists under a name of their own, and
    ``disable_passes`` names only optional passes.

    Raises:
        PipelineError: a user pass named after no pass, or with a pipeline pass's name.
        DboConfigError: ``disable_passes`` names a pass that cannot be disabled.
    """
    ours = {p.name for p in BIND_PASSES + LOWERED_PASSES + SPLIT_PASSES + JOIN_PASSES
            + CANDIDATE_PASSES}
    passes = pipeline_passes()
    for user, after in registered_passes():
        if user.name in ours:
            raise PipelineError(f"the user pass {user.name!r} has the name of a pipeline pass; "
                                "give it a name of its own")
        if after not in {p.name for p in passes}:
            raise PipelineError(f"the user pass {user.name!r} runs after {after!r}, which is "
                                f"no pass; the passes are {[p.name for p in passes]}")
    check_disabled(config, passes)


def compile_split(gm: fx.GraphModule, example_inputs: Sequence[Any], config: DboConfig,
                  input_kinds: Sequence[str] | None = None,
                  manager: PassManager | None = None) -> SplitArtifact:
    """Run the whole pipeline; return the :class:`~dbo_compile.runtime.program.SplitArtifact`.

    Args:
        gm: a Dynamo graph (or any FX graph with ``input_kinds``).
        example_inputs: one value per placeholder.
        config: options.
        input_kinds: explicit input classification for graphs not from Dynamo.
        manager: runs and times the passes (default: a new one); the caller keeps it to know
            the times of a graph that turned out unsplittable.

    With ``config.cache_dir``, a graph compiled before (by this or another process) is read
    back from the compile cache instead (:mod:`dbo_compile.codegen.cache`; passes
    ``cache_key`` and ``cache_load`` in the times; counted in
    ``torch._dynamo.utils.counters["dbo_compile"]``, ``cache_hit`` / ``cache_miss``), and a
    graph compiled here is written to it.
    The key is taken after the bind pass: it sees the comm and experts backends each op is
    bound to (what ``"auto"`` chose from the packages present, the emulated world's
    instance), and the config fingerprint the calibration's content.

    Raises:
        UnsplittableGraphError: the graph has no comm op or mixes tokens across the split.
        DboConfigError: ``disable_passes`` names a pass that cannot be disabled.
        PipelineError: a registered user pass cannot run (:func:`_check_passes`).
    """
    config = resolve_device_defaults(config, example_inputs)
    _check_passes(config)
    manager = manager or PassManager()
    t0 = time.perf_counter()
    state = CompileState(config, example_inputs, input_kinds)
    dump_graph("input", gm)
    gm = manager.run(gm, BIND_PASSES, state)
    stages = stage_compiler(config)
    key, found = cache_lookup(gm, example_inputs, config, input_kinds, manager, stages)
    if found is not None:
        found.compile_times = dict(manager.times)
        found.cache_key, found.predict = key, predict_bucket
        return SplitArtifact(found)
    try:
        record, programs = _compile_split(gm, state, manager, stages, t0)
    except UnsplittableGraphError as e:
        if key is not None:
            manager.time("cache_store", cache.store_unsplittable, config.cache_dir, key, e)
        raise
    if key is not None:
        manager.time("cache_store", cache.store, config.cache_dir, key, record, programs)
    record.compile_times = dict(manager.times)
    record.cache_key, record.predict = key, predict_bucket
    return SplitArtifact(record)


def _compile_split(gm: fx.GraphModule, state: CompileState, manager: PassManager,
                   stages: StageCompiler, t0: float
                   ) -> tuple[SplitRecord, dict[str, SplitProgram]]:
    """:func:`compile_split` after the bind pass, without the cache: the artifact's record
    and the distinct candidate programs."""
    config = state.config
    lowered_gm = manager.run(gm, LOWERED_PASSES, state)
    why = stream_assign.unsplit_pool_violation(lowered_gm.graph)
    if why is not None:
        raise CommBackendError(f"the model breaks its comm backend's result pool: {why}; "
                               "copy the result (x.clone()) before the later call")
    split_gm = manager.run(lowered_gm, SPLIT_PASSES, state)
    cands = compile_candidates(split_gm, state, manager, JOIN_PASSES, CANDIDATE_PASSES,
                               stages.compile_stage)
    schedule, primary_gm = cands.schedule, cands.primary_gm
    # the unsplit program is the lowered graph: symbolic in the token dim, so it also runs at
    # the padded token count the DP vote agrees on
    unsplit = manager.time("unsplit", stages.unsplit, lowered_gm)
    overlapped = unsplit_overlap.overlapped_unsplit(lowered_gm, state, manager,
                                                    stages.compile_stage)
    log.info("dbo: split into %d ubatches, %d comm ops per ubatch, %d units, %d event edges "
             "(%.2f s)", config.num_ubatches, len(state.comms), len(schedule.units),
             len(schedule.event_edges), time.perf_counter() - t0)
    record = SplitRecord(
        unsplit, cands.candidates, state.specs, state.signature, config,
        program_alias=cands.alias, kv_block_sizes=kv_block_sizes(lowered_gm.graph),
        output_specs=state.output_specs,
        split_plan=drain_plan(primary_gm.graph, state.token_symbol, schedule),
        unsplit_plan=drain_plan(lowered_gm.graph, state.token_symbol),
        float_guards=state.float_guards,
        guard_fallback=stages.unsplit(gm) if state.float_guards else None,
        state_inputs=state_threads.state_inputs(lowered_gm.graph, state.specs),
        split_collectives=comm_fingerprint(primary_gm.graph, schedule),
        unsplit_collectives=comm_fingerprint(lowered_gm.graph),
        unsplit_overlap=overlapped, lowered_gm=lowered_gm, split_gm=split_gm,
        token_symbols=state.token_symbols)  # the cost model's (and a calibration's)
    return record, cands.programs


def has_cuda_inputs(example_inputs: Sequence[Any]) -> bool:
    """Whether any of a graph's inputs is a CUDA tensor (its device defaults are CUDA's)."""
    return any(isinstance(x, torch.Tensor) and x.device.type == "cuda" for x in example_inputs)


def resolve_device_defaults(config: DboConfig, example_inputs: Sequence[Any]) -> DboConfig:
    """The defaults that depend on the device, for a graph with CUDA inputs / otherwise (every
    rank of a job sees the same device type, so every rank resolves the same way):
    ``compute_backend="auto"`` -> ``"inductor"`` / ``"aten"``; ``sm_carveout_candidates=None``
    -> ``(16,)`` where torch can carve SMs out / ``()``; ``device_sms=None``, where the comm
    backend's transfers hold SMs (``hold_sms``) -> the first CUDA input's device's
    ``multi_processor_count`` / left unset (the hold model's default, 132). Resolved once,
    before the passes; a resolved config resolves to itself."""
    cuda = has_cuda_inputs(example_inputs)
    if config.compute_backend == "auto":
        config = config.replace(compute_backend="inductor" if cuda else "aten")
    if config.sm_carveout_candidates is None:
        carve = cuda and hasattr(torch._C, "_set_sm_carveout_experimental")
        config = config.replace(sm_carveout_candidates=(16,) if carve else ())
    if cuda and config.device_sms is None and dict(config.comm_backend_options).get("hold_sms"):
        device = next(x.device for x in example_inputs
                      if isinstance(x, torch.Tensor) and x.device.type == "cuda")
        props = torch.cuda.get_device_properties(device.index or 0)
        config = config.replace(device_sms=int(props.multi_processor_count))
    return config
