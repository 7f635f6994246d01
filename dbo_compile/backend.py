"""The ``dbo`` torch.compile backend: ``torch.compile(model, backend="dbo", options={...})``.

The entry only: options -> :class:`~dbo_compile.config.DboConfig`, the pass pipeline
(:mod:`dbo_compile.passes.pipeline`), the way out for a graph it cannot split, the list of
compiled artifacts, and the registration of ``backend="dbo"``.

A graph that cannot be split (no comm op, or an op mixing tokens) is compiled unsplit and the
reason is logged at WARNING, naming the node (``DboConfig.on_unsplittable="raise"`` raises).
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import torch
import torch.fx as fx

from dbo_compile import lowering, register  # register: re-exported (backend.register())
from dbo_compile.codegen.cache_dirs import use_cache_dir
from dbo_compile.codegen.stages import stage_compiler
from dbo_compile.config import DboConfig
from dbo_compile.errors import UnsplittableGraphError
from dbo_compile.ops.registry import comm_fingerprint, comm_group_name, comm_kind
from dbo_compile.passes import pipeline, token_dim
from dbo_compile.passes.manager import PassManager
from dbo_compile.runtime.artifact import CompiledArtifact, check_groups
from dbo_compile.runtime.drain import drain_plan
from dbo_compile.runtime.program import UnsplitArtifact

log = logging.getLogger(__name__)

__all__ = ["compiled_artifacts", "dbo_backend", "register", "reset_artifacts"]

_ARTIFACTS: list[CompiledArtifact] = []


def compiled_artifacts() -> list[CompiledArtifact]:
    """What the backend returned, oldest first (``SplitArtifact`` or ``UnsplitArtifact``).

    Tests and tools read the schedule, the generated code, the pass times and the step
    counters from here; :func:`reset_artifacts` empties the list (``torch._dynamo.reset()``
    does not).
    """
    return list(_ARTIFACTS)


def reset_artifacts() -> None:
    _ARTIFACTS.clear()


def dbo_backend(gm: fx.GraphModule, example_inputs: Sequence[Any], *,
                options: dict[str, Any] | DboConfig | None = None,
                mode: str | None = None) -> CompiledArtifact:
    """The ``dbo`` Dynamo backend (registered through the ``torch_dynamo_backends`` entry point).

    Args:
        gm: the graph Dynamo captured.
        example_inputs: its example inputs.
        options: ``torch.compile(..., options=...)``, mapped onto :class:`DboConfig`.
        mode: ignored (accepted for compatibility with ``torch.compile(mode=...)``).

    Raises:
        DboConfigError: an unknown or invalid option; ``dp_group_name`` naming no process
            group; an EP group of the graph outside the DP vote's group.
        UnsplittableGraphError: only with ``on_unsplittable="raise"``.
    """
    config = pipeline.resolve_device_defaults(DboConfig.from_options(options), example_inputs)
    if config.comm_sms is not None and not pipeline.has_cuda_inputs(example_inputs):
        log.warning("dbo: comm_sms=%d has no effect on this graph: its inputs are not on CUDA "
                    "(an SM carve-out is a CUDA feature)", config.comm_sms)
    if config.cache_dir:  # Inductor's and Triton's caches under it too, before any stage compiles
        use_cache_dir(config.cache_dir)
    manager = PassManager()
    # one flat graph for every pass: nested compile regions (a decoder layer Dynamo traced
    # once and called per layer) are inlined first
    if manager.time("inline_regions", lowering.inline_regions, gm):
        gm.recompile()
    check_groups(config, [g for n in gm.graph.nodes if (g := comm_group_name(n)) is not None])
    try:
        compiled: CompiledArtifact = pipeline.compile_split(gm, example_inputs, config,
                                                            manager=manager)
    except UnsplittableGraphError as e:
        if config.on_unsplittable == "raise":
            raise
        log.warning("dbo: compiling this graph unsplit: %s", e)
        compiled = _unsplit_program(gm, example_inputs, config, e, manager.times)
    _ARTIFACTS.append(compiled)
    return compiled


def _unsplit_program(gm: fx.GraphModule, example_inputs: Sequence[Any], config: DboConfig,
                     why: UnsplittableGraphError, times: dict[str, float]) -> UnsplitArtifact:
    """The way out for a graph we do not split; it still votes if it issues collectives.
    ``why``: the reason, and what the passes found before it (``row_local``: padding rows
    cannot change real rows; ``state_inputs``: the inputs the graph writes in place;
    ``folds_token_rows``: padding rows would be counted in one of them)."""
    try:
        specs = lowering.classify_inputs(gm, example_inputs)
    except UnsplittableGraphError:
        specs = None
    has_comm = any(comm_kind(n) is not None for n in gm.graph.nodes)
    # a graph Dynamo traced with symbolic sizes runs at any token count; a static one cannot
    dynamic = any(isinstance(x, torch.SymInt) for x in example_inputs)
    token = _token_symbol(specs, gm)
    return UnsplitArtifact(stage_compiler(config).unsplit(gm), str(why), config, specs,
                          has_comm, fixed_num_tokens=not dynamic, row_local=why.row_local,
                          state_inputs=why.state_inputs, folds_token_rows=why.folds_token_rows,
                          unsplit_collectives=comm_fingerprint(gm.graph) if has_comm else None,
                          compile_times=times,
                          output_specs=token_dim.output_specs(gm.graph, token),
                          unsplit_plan=drain_plan(gm.graph, token))


def _token_symbol(specs: list | None, gm: fx.GraphModule) -> Any:
    """The symbol of Dynamo's token dim (dim 0 of the first token input's example value, in
    the ShapeEnv of the graph's other values), ``None`` for a static graph or no token
    input."""
    spec = next((s for s in specs or [] if s.kind == "token"), None)
    if spec is None:
        return None
    node = [n for n in gm.graph.nodes if n.op == "placeholder"][spec.index]
    value = node.meta.get("example_value")
    d0 = value.shape[0] if isinstance(value, torch.Tensor) and value.dim() else None
    return d0.node.expr if isinstance(d0, torch.SymInt) else None
