"""Compile the example DeepSeek-style MoE model on CPU (one process) and return its schedule."""

from __future__ import annotations

import torch

from dbo_compile.backend import compiled_artifacts, register
from dbo_compile.models.batch import fill_kv_cache, make_step
from dbo_compile.models.deepseek import DeepseekMoEModel, get_config
from dbo_compile.schedule import Schedule


def example_schedule(num_layers: int = 2, preset: str = "tiny") -> Schedule:
    """The schedule of ``DeepseekMoEModel(get_config(preset, num_layers=...))`` for a mixed
    step (48 decodes of context 40 + one 40-token prefill), compiled with ``split="always"``.

    Takes a few seconds on CPU; needs no GPU and no process group.
    """
    register()
    cfg = get_config(preset, num_layers=num_layers)
    torch.manual_seed(0)
    m = DeepseekMoEModel(cfg)
    step = make_step(cfg, decode_context_lens=[40] * 48, prefills=[(0, 40)], block_size=16)
    m.allocate_kv_cache(step.num_blocks, step.block_size)
    fill_kv_cache(m, step)
    cm = torch.compile(m, backend="dbo", options={"split": "always"})
    cm(step.input_ids, step.positions, step.attn_metadata)
    art = compiled_artifacts()[-1]
    if not art.is_split:
        raise RuntimeError(f"the example compiled unsplit ({art.reason}); no schedule")
    return art.split_program.schedule
