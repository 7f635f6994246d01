"""The compile cache's read side of :func:`~dbo_compile.passes.pipeline.compile_split`.

With ``DboConfig.cache_dir``, the Dynamo graph (after the bind pass) is looked up in the
compile cache (:mod:`dbo_compile.codegen.cache`) before any other pass runs: its key taken
(``cache_key`` in the compile times), its entry loaded (``cache_load``) and the hit or miss
counted in ``torch._dynamo.utils.counters["dbo_compile"]`` (``cache_hit`` / ``cache_miss``),
where Inductor counts its own. The pipeline writes the entry after a compile.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import torch.fx as fx
from torch._dynamo.utils import counters

from dbo_compile import lowering
from dbo_compile.codegen import cache
from dbo_compile.codegen.stages import StageCompiler
from dbo_compile.config import DboConfig
from dbo_compile.passes.candidate_driver import dump_programs
from dbo_compile.passes.manager import PassManager, user_pass_keys
from dbo_compile.runtime.program import SplitRecord

log = logging.getLogger(__name__)

__all__ = ["cache_lookup"]


def cache_lookup(gm: fx.GraphModule, example_inputs: Sequence[Any], config: DboConfig,
                 input_kinds: Sequence[str] | None, manager: PassManager,
                 stages: StageCompiler) -> tuple[str | None, SplitRecord | None]:
    """``(key, record)`` of the bound Dynamo graph ``gm`` in the compile cache.

    ``key`` is ``None`` when the cache is not used (no ``config.cache_dir``, or
    ``unsplit_overlap`` on: an entry stores no overlapped program); ``record`` is the entry's
    record on a hit (its schedules dumped as a compile's are), else ``None``. The key sees the
    comm and experts backends each op is bound to and the registered user passes
    (:func:`~dbo_compile.codegen.cache.cache_key`); times go to ``manager``.
    """
    if not config.cache_dir:
        return None, None
    if config.unsplit_overlap:
        log.info("dbo: compile cache not used: unsplit_overlap's program is not stored in it")
        return None, None
    key = manager.time("cache_key", cache.cache_key, gm, example_inputs, config, input_kinds,
                       user_pass_keys())
    found = manager.time("cache_load", _from_cache, key, gm, config, stages,
                         lowering.folded_floats(gm, example_inputs))
    # counted where Inductor counts its own (torch._dynamo.utils.counters)
    counters["dbo_compile"]["cache_hit" if found is not None else "cache_miss"] += 1
    return key, found


def _from_cache(key: str, gm: fx.GraphModule, config: DboConfig, stages: StageCompiler,
                folds: tuple[tuple[int, float], ...]) -> SplitRecord | None:
    """The record of ``key``'s entry (:func:`~dbo_compile.codegen.cache.load`), its
    schedules dumped as a compile's are."""
    loaded = cache.load(config.cache_dir, key, gm, config, stages, folds)
    if loaded is None:
        return None
    record, programs = loaded
    dump_programs(programs, config)
    return record
