"""The stage compilers: how the programs' compute runs (``DboConfig.compute_backend``).

A :class:`StageCompiler` turns the traced ATen graphs of an artifact into the callables its
programs call:

- ``compile_stage(gm, unit)``: a stage of a split program (a compute unit's GraphModule) ->
  its callable, :class:`~dbo_compile.codegen.wrapper.SplitProgram`'s ``compile_stage``;
  ``None``: every stage runs as its GraphModule (and units computing the same share one);
- ``unsplit(gm)``: the unsplit program from the lowered graph (symbolic in the token dim), or
  from Dynamo's graph for a graph compiled unsplit;
- ``lowered_from_cache(data)``: the lowered graph of a compile-cache entry
  (:func:`~dbo_compile.codegen.graph_store.dump_graph`'s data), as ``unsplit`` takes it.

Two are registered in :data:`STAGE_COMPILERS`: ``"aten"`` (the traced ATen ops as they are)
and ``"inductor"`` (:mod:`~dbo_compile.codegen.inductor`: each stage and the unsplit program
compiled by Inductor, so that the split and the unsplit program compare like with like).
:func:`stage_compiler` makes one per compile.
"""

from __future__ import annotations

from typing import Any, Callable

import torch.fx as fx

from dbo_compile.codegen.graph_store import DeferredGraph, load_graph
from dbo_compile.codegen.inductor import InductorStage, inductor_stage_compiler
from dbo_compile.config import DboConfig
from dbo_compile.errors import DboConfigError

__all__ = ["STAGE_COMPILERS", "AtenStages", "InductorStages", "StageCompiler", "stage_compiler"]


class StageCompiler:
    """The callables of one artifact's programs (module docstring). One instance per compile:
    what it shares between the stages (Inductor's :class:`~.inductor.StageCache`) is shared
    by the programs of one artifact only.

    Attributes:
        name: the ``DboConfig.compute_backend`` value that selects it.
        compile_stage: a stage's GraphModule and its unit -> the callable the wrapper calls
            (``None``: the GraphModule itself).
    """

    name: str = ""
    compile_stage: Callable[[fx.GraphModule, Any], Callable] | None = None

    def unsplit(self, gm: fx.GraphModule) -> Callable[..., Any]:
        """The unsplit program: ``gm`` (a graph over the graph inputs at any token count) as
        this backend runs it."""
        raise NotImplementedError

    def lowered_from_cache(self, data: dict[str, Any]) -> Any:
        """The lowered graph a compile-cache entry stored, as :meth:`unsplit` takes it."""
        raise NotImplementedError


class AtenStages(StageCompiler):
    """``compute_backend="aten"``: every stage and the unsplit program run their traced ATen
    ops; a warm start's lowered graph is rebuilt at its first use
    (:class:`~dbo_compile.codegen.graph_store.DeferredGraph`: an eager split step never runs it)."""

    name = "aten"

    def unsplit(self, gm: fx.GraphModule) -> Callable[..., Any]:
        return gm

    def lowered_from_cache(self, data: dict[str, Any]) -> Any:
        return DeferredGraph(data)


class InductorStages(StageCompiler):
    """``compute_backend="inductor"``: each stage is an
    :class:`~dbo_compile.codegen.inductor.InductorStage`, all of one artifact sharing one
    stage cache (:func:`~dbo_compile.codegen.inductor.inductor_stage_compiler`), and so is
    the unsplit program (a cache of its own)."""

    name = "inductor"

    def __init__(self):
        self.compile_stage = inductor_stage_compiler()

    def unsplit(self, gm: fx.GraphModule) -> Callable[..., Any]:
        return InductorStage(gm, "the unsplit program")

    def lowered_from_cache(self, data: dict[str, Any]) -> Any:
        return load_graph(data)


#: the stage compilers by ``DboConfig.compute_backend`` (``"auto"`` is resolved before:
#: :func:`~dbo_compile.passes.pipeline.resolve_device_defaults`)
STAGE_COMPILERS: dict[str, type[StageCompiler]] = {"aten": AtenStages, "inductor": InductorStages}


def stage_compiler(config: DboConfig) -> StageCompiler:
    """A new stage compiler for ``config.compute_backend``.

    Raises:
        DboConfigError: the name has no stage compiler (``"auto"`` not resolved yet).
    """
    try:
        return STAGE_COMPILERS[config.compute_backend]()
    except KeyError:
        raise DboConfigError(
            f"DboConfig.compute_backend={config.compute_backend!r} has no stage compiler (known: "
            f"{sorted(STAGE_COMPILERS)}); resolve 'auto' first "
            "(dbo_compile.passes.pipeline.resolve_device_defaults)") from None
