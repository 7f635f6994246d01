"""Reference models (flattened-token layout) and step builders for tests and benchmarks."""

from dbo_compile.models.batch import Step, context_slots, fill_kv_cache, make_step
from dbo_compile.models.deepseek import (
    PRESETS,
    DeepseekConfig,
    DeepseekMoEModel,
    ModelConfigError,
    get_config,
)

__all__ = [
    "PRESETS",
    "DeepseekConfig",
    "DeepseekMoEModel",
    "ModelConfigError",
    "Step",
    "context_slots",
    "fill_kv_cache",
    "get_config",
    "make_step",
]
