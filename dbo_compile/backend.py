"""The ``dbo`` torch.compile backend: ``torch.compile(model, backend="dbo", options={...})``.

Pipeline (../shared/DESIGN.md)::

    Dynamo FX graph
      -> lowering.lower_to_aten       functional ATen inference graph, symbolic token dim
      -> passes.reinplace             KV-cache writes back in place
      -> passes.token_dim             token dim of every node; reject token-mixing graphs
      -> passes.split_ubatch          one copy per ubatch over token-dim slices
      -> passes.insert_yields         comm ops -> issue + wait (the yield points)
      -> passes.stream_assign         stages, list schedule on comm/compute streams, events
      -> codegen.SplitProgram         one generated single-threaded function
      -> runtime.DboCompiledModule    guards + slicing per step; unsplit program as way out

A graph that cannot be split (no comm op, or an op mixing tokens) is compiled unsplit and the
reason is logged at WARNING, naming the node (``DboConfig.on_unsplittable="raise"`` raises).
"""

from __future__ import annotations

import copy
import itertools
import logging
import os
import re
import time
from typing import Any, Sequence

import torch
import torch.fx as fx

from dbo_compile.config import DboConfig
from dbo_compile.errors import ScheduleError, UnsplittableGraphError

log = logging.getLogger(__name__)

_ARTIFACTS: list[Any] = []


def compiled_artifacts() -> list[Any]:
    """What the backend returned, oldest first (``DboCompiledModule`` or ``UnsplitProgram``).

    Tests and tools read the schedule, the generated code and the step counters from here;
    :func:`reset_artifacts` empties the list (``torch._dynamo.reset()`` does not).
    """
    return list(_ARTIFACTS)


def reset_artifacts() -> None:
    _ARTIFACTS.clear()


def _ensure_ops_registered() -> None:
    import dbo_compile.ops  # noqa: F401 - registers torch.ops.dbo.*


def compile_split(gm: fx.GraphModule, example_inputs: Sequence[Any], config: DboConfig,
                  input_kinds: Sequence[str] | None = None):
    """Run the whole pipeline; return a :class:`~dbo_compile.runtime.program.DboCompiledModule`.

    Args:
        gm: a Dynamo graph (or any FX graph with ``input_kinds``).
        example_inputs: one value per placeholder.
        config: options.
        input_kinds: explicit input classification for graphs not from Dynamo.

    Raises:
        UnsplittableGraphError: the graph has no comm op or mixes tokens across the split.
    """
    from dbo_compile.codegen import SplitProgram
    from dbo_compile.lowering import classify_inputs, lower_to_aten
    from dbo_compile.passes.comm_ops import comm_nodes
    from dbo_compile.passes.insert_yields import insert_yields
    from dbo_compile.passes.join_experts import copy_split_graph, join_experts
    from dbo_compile.passes.reinplace import reinplace_graph_input_mutations
    from dbo_compile.passes.split_ubatch import split_ubatch
    from dbo_compile.passes.stream_assign import stream_assign
    from dbo_compile.passes.token_dim import annotate_token_dims, check_outputs
    from dbo_compile.runtime.program import DboCompiledModule

    _ensure_ops_registered()
    config = _resolve_device_defaults(config, example_inputs)
    t0 = time.perf_counter()
    specs = classify_inputs(gm, example_inputs, input_kinds)
    if not any(s.kind == "token" for s in specs):
        raise UnsplittableGraphError("the graph has no token-indexed tensor input")
    lowered = lower_to_aten(gm, example_inputs, specs)
    graph = lowered.gm.graph
    reinplace_graph_input_mutations(graph)
    graph.eliminate_dead_code()
    annotate_token_dims(graph, lowered.token_symbols)
    check_outputs(graph)
    comms = comm_nodes(graph)
    if not comms:
        e = UnsplittableGraphError(
            "the graph has no comm op (dbo.dispatch / dbo.combine / "
            "_c10d_functional.all_to_all_single): nothing to overlap"
        )
        e.row_local = True  # padding rows cannot change the real rows' results
        raise e
    lowered.gm.recompile()
    _dump_graph("lowered", lowered.gm)
    split_gm, signature = split_ubatch(lowered.gm, specs, config.num_ubatches)
    insert_yields(split_gm.graph)
    split_gm.graph.lint()
    split_gm.recompile()
    graphs = {False: split_gm}  # join_experts -> the split graph it schedules (None: same)

    def graph_for(join: bool) -> fx.GraphModule | None:
        if join not in graphs:
            joined = copy_split_graph(split_gm)
            try:
                graphs[join] = joined if join_experts(joined, config.num_ubatches) else None
            except ScheduleError as e:
                log.warning("dbo: routed experts not joined: %s", e)
                graphs[join] = None
        return graphs[join]

    candidates = schedule_variants(config)
    primary_name, _ = candidates[0]
    if graph_for(config.join_experts) is None:  # nothing to join: the primary is unjoined
        log.info("dbo: join_experts: no routed-expert call to join; schedules are unjoined")
        primary_name = config.scheduler
        config = config.replace(join_experts=False)
        candidates = [(primary_name, config)] + [c for c in candidates[1:]
                                                 if not c[1].join_experts]
    # alternative schedules first: stream_assign annotates the graph's nodes, and the primary
    # schedule's annotations must be the ones left on its graph (codegen reads the schedule only)
    alternatives = [(name, cfg, graph_for(cfg.join_experts)) for name, cfg in candidates[1:]]
    alternatives = [(name, gm, stream_assign(gm.graph, cfg, lowered.token_symbols,
                                             config.num_ubatches))
                    for name, cfg, gm in alternatives if gm is not None]
    primary_gm = graphs[config.join_experts]
    schedule = stream_assign(primary_gm.graph, config, lowered.token_symbols, config.num_ubatches)
    schedule.meta.update(
        comm_ops_per_ubatch=len(comms),
        num_graph_inputs=len(specs),
    )
    _dump_graph("split", split_gm)
    compile_unit = _unit_compiler(config)
    # shared by the variants of one split graph: a unit of several variants is built (and
    # compiled) once; the joined graph has units of the same nodes that read other inputs
    built: dict[int, dict] = {}
    program = SplitProgram(primary_gm, schedule, compile_unit, carveout_sms=config.comm_sms,
                           built=built.setdefault(id(primary_gm), {}))
    variants: dict[str, Any] = {primary_name: program}
    orders = {_unit_order(schedule)}
    for name, gm, sched in alternatives:  # one program per distinct host order
        if _unit_order(sched) not in orders:
            orders.add(_unit_order(sched))
            variants[name] = SplitProgram(gm, sched, compile_unit, carveout_sms=config.comm_sms,
                                          built=built.setdefault(id(gm), {}))
    schedules = dict(variants)
    for sms in config.sm_carveout_candidates:  # same code and units, another carve-out
        for name, base in schedules.items():
            variants[f"{name}+sms{sms}"] = copy.copy(base)
            variants[f"{name}+sms{sms}"].carveout_sms = sms
    graph_no = next(_SPLIT_GRAPHS)
    for name, prog in schedules.items():  # the primary first
        _dump_schedule(prog.schedule, prog.code, config, graph_no,
                       None if prog is program else name)
    log.info("dbo: split into %d ubatches, %d comm ops per ubatch, %d units, %d event edges "
             "(%.2f s)", config.num_ubatches, len(comms), len(schedule.units),
             len(schedule.event_edges), time.perf_counter() - t0)
    # the unsplit program is the lowered graph: symbolic in the token dim, so it also runs at
    # the padded token count the DP vote agrees on
    compiled = DboCompiledModule(_unsplit_callable(lowered.gm, config), program, specs, signature,
                                 config, variants=variants)
    compiled.split_gm = split_gm
    compiled.lowered_gm = lowered.gm
    return compiled


def _unit_order(schedule: Any) -> tuple:
    return tuple(tuple(u.nodes) for u in schedule.units)


def schedule_variants(config: DboConfig) -> list[tuple[str, DboConfig]]:
    """``[(name, config)]`` of the schedules compiled for a graph, the primary first.

    The primary is ``config.scheduler`` at the config's cost figures (``"+join"`` appended with
    ``join_experts``). With ``schedule_candidates`` also: the list scheduler under a 4x and a
    16x slower link (``"list@link/4"``, ``"list@link/16"``: comm-heavy networks; measured here,
    NCCL through host memory moves ~6x less than the default figure), the other scheduler, and
    the list scheduler with the routed experts joined (``"list+join"``,
    ``"list@link/16+join"``; :mod:`dbo_compile.passes.join_experts`: in decode, where the
    expert GEMM is bound by its weight reads); with a tuple ``schedule_candidates`` only those
    (names in :data:`dbo_compile.config.SCHEDULE_CANDIDATES`). Deterministic in ``config``
    (every rank compiles the same candidates)."""
    def name(cfg: DboConfig, suffix: str = "") -> str:
        return cfg.scheduler + suffix + ("+join" if cfg.join_experts else "")

    out = [(name(config), config)]
    if config.schedule_candidates:
        plain = config.replace(join_experts=False)
        cands = [(name(plain.replace(scheduler="list")), plain.replace(scheduler="list"))]
        for f in (4, 16):
            cfg = plain.replace(scheduler="list", link_gbps=config.link_gbps / f)
            cands.append((name(cfg, f"@link/{f}"), cfg))
        cands.append(("naive", plain.replace(scheduler="naive")))
        for suffix, base in (("", cands[0][1]), ("@link/16", cands[2][1])):
            joined = base.replace(join_experts=True)
            cands.append((name(joined, suffix), joined))
        keep = config.schedule_candidates
        out += [c for c in cands if c[0] != out[0][0] and (keep is True or c[0] in keep)]
    return out


def _resolve_device_defaults(config: DboConfig, example_inputs: Sequence[Any]) -> DboConfig:
    """The defaults that depend on the device, for a graph with CUDA inputs / otherwise (every
    rank of a job sees the same device type, so every rank resolves the same way):
    ``compute_backend="auto"`` -> ``"inductor"`` / ``"aten"``; ``sm_carveout_candidates=None``
    -> ``(16,)`` where torch can carve SMs out / ``()``."""
    cuda = any(isinstance(x, torch.Tensor) and x.device.type == "cuda" for x in example_inputs)
    if config.compute_backend == "auto":
        config = config.replace(compute_backend="inductor" if cuda else "aten")
    if config.sm_carveout_candidates is None:
        carve = cuda and hasattr(torch._C, "_set_sm_carveout_experimental")
        config = config.replace(sm_carveout_candidates=(16,) if carve else ())
    return config


def _unit_compiler(config: DboConfig):
    """``compile_unit`` of the split programs for ``config.compute_backend``."""
    if config.compute_backend == "aten":
        return None
    from dbo_compile.codegen.inductor import inductor_unit_compiler

    return inductor_unit_compiler()


def _unsplit_callable(gm: fx.GraphModule, config: DboConfig):
    """The unsplit program: the lowered graph as traced, or Inductor's (``compute_backend``),
    so that the runtime's split-or-not comparison is like for like."""
    if config.compute_backend == "aten":
        return gm
    from dbo_compile.codegen.inductor import InductorStage

    return InductorStage(gm, "the unsplit program")


def _dump_graph(name: str, gm: fx.GraphModule) -> None:
    try:
        from torch._logging import trace_structured

        trace_structured("artifact", metadata_fn=lambda: {"name": f"dbo_{name}_graph",
                                                          "encoding": "string"},
                         payload_fn=lambda: gm.print_readable(print_output=False))
    except Exception:  # noqa: BLE001 - logging must never break compilation
        pass
    log.debug("dbo %s graph:\n%s", name, gm.code)


#: split graphs compiled in this process (numbers the dumps: a model with graph breaks has
#: several, compiled in the same order on every rank)
_SPLIT_GRAPHS = itertools.count()


def _dump_schedule(schedule: Any, code: str, config: DboConfig, graph_no: int,
                   variant: str | None) -> None:
    """The schedule (JSON) to TORCH_TRACE, and with ``dump_dir`` the schedule and its wrapper
    to ``schedule_rank{R}_g{graph_no}_{fingerprint}[_{variant}].json/.py`` (``variant``: None
    for the primary, else the candidate's name, ``@``, ``/`` and ``+`` written as ``-``)."""
    payload = schedule.to_json()
    try:
        from torch._logging import trace_structured

        name = "dbo_schedule" if variant is None else f"dbo_schedule_{variant}"
        trace_structured("artifact", metadata_fn=lambda: {"name": name, "encoding": "json"},
                         payload_fn=lambda: payload)
    except Exception:  # noqa: BLE001
        pass
    if config.dump_dir:
        os.makedirs(config.dump_dir, exist_ok=True)
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        suffix = "" if variant is None else "_" + re.sub(r"[^A-Za-z0-9_.]", "-", variant)
        base = os.path.join(config.dump_dir,
                            f"schedule_rank{rank}_g{graph_no}_{config.fingerprint()}{suffix}")
        with open(base + ".json", "w") as f:
            f.write(payload)
        with open(base + ".py", "w") as f:
            f.write(code)


def dbo_backend(gm: fx.GraphModule, example_inputs: Sequence[Any], *,
                options: dict[str, Any] | DboConfig | None = None, mode: str | None = None):
    """The ``dbo`` Dynamo backend (registered through the ``torch_dynamo_backends`` entry point).

    Args:
        gm: the graph Dynamo captured.
        example_inputs: its example inputs.
        options: ``torch.compile(..., options=...)``, mapped onto :class:`DboConfig`.
        mode: ignored (accepted for compatibility with ``torch.compile(mode=...)``).

    Raises:
        DboConfigError: an unknown or invalid option.
        UnsplittableGraphError: only with ``on_unsplittable="raise"``.
    """
    from dbo_compile import _drop_duplicate_handlers

    # torch imports this package while parsing TORCH_LOGS and then adds its handler again
    _drop_duplicate_handlers(logging.getLogger("dbo_compile"))
    config = _resolve_device_defaults(DboConfig.from_options(options), example_inputs)
    try:
        compiled = compile_split(gm, example_inputs, config)
    except UnsplittableGraphError as e:
        if config.on_unsplittable == "raise":
            raise
        log.warning("dbo: compiling this graph unsplit: %s", e)
        compiled = _unsplit_program(gm, example_inputs, config, str(e),
                                    row_local=getattr(e, "row_local", False))
    _ARTIFACTS.append(compiled)
    return compiled


def _unsplit_program(gm: fx.GraphModule, example_inputs: Sequence[Any], config: DboConfig,
                     reason: str, row_local: bool = False):
    """The way out for a graph we do not split; it still votes if it issues collectives.
    ``row_local``: the token-dim analysis showed padding rows cannot change real rows."""
    from dbo_compile.lowering import classify_inputs
    from dbo_compile.passes.comm_ops import comm_kind
    from dbo_compile.runtime.program import UnsplitProgram

    try:
        specs = classify_inputs(gm, example_inputs)
    except UnsplittableGraphError:
        specs = None
    has_comm = any(comm_kind(n) is not None for n in gm.graph.nodes)
    # a graph Dynamo traced with symbolic sizes runs at any token count; a static one cannot
    dynamic = any(isinstance(x, torch.SymInt) for x in example_inputs)
    return UnsplitProgram(_unsplit_callable(gm, config), reason, config, specs, has_comm,
                          fixed_num_tokens=not dynamic, row_local=row_local)


def register() -> None:
    """Register ``backend="dbo"`` in this process (the entry point does it without imports)."""
    from torch._dynamo.backends.registry import _BACKENDS, register_backend

    if "dbo" not in _BACKENDS:
        register_backend(name="dbo")(dbo_backend)
