"""Model + step builders shared by tests (importable from spawned ranks)."""

from __future__ import annotations

import torch

from dbo_compile.models.batch import fill_kv_cache, make_step
from dbo_compile.models.deepseek import DeepseekMoEModel, get_config
from dbo_compile.runtime.cudagraph_runner import CudaGraphRunner
from dbo_compile.testing.faults import FaultyMoEModel, _FaultyMoE

DECODE_64 = dict(decode_context_lens=[100 + 7 * i for i in range(64)], prefills=[])
# 24 decodes then a 40-token prefill: 64 tokens, split point 32 cuts the prefill in two
MIXED_CUT = dict(decode_context_lens=[200 + 37 * i for i in range(24)], prefills=[(0, 40)])
MIXED_CHUNKED = dict(decode_context_lens=[64, 90, 300], prefills=[(48, 29), (0, 12)])


def build(case: dict, *, dtype=torch.float32, group=None, layers: int = 2, seed: int = 0):
    cfg = get_config("tiny", num_layers=layers)
    model = DeepseekMoEModel(cfg, ep_group=group, dtype=dtype, seed=0)
    step = make_step(cfg, block_size=16, seed=seed, **case)
    model.allocate_kv_cache(step.num_blocks, step.block_size)
    fill_kv_cache(model, step, seed=seed)
    return model, step


def eager_then_restore(model, step):
    """Eager logits of ``step`` and the KV caches it wrote; the caches are then put back as
    they were, so that the program under test starts from the same state."""
    saved = [c.clone() for c in model.kv_caches()]
    with torch.no_grad():
        eager = model(step.input_ids, step.positions, step.attn_metadata)
        eager_caches = [c.clone() for c in model.kv_caches()]
        for c, s in zip(model.kv_caches(), saved):
            c.copy_(s)
    return eager, eager_caches


def eager_and_compiled(model, step, options):
    """Eager logits and compiled logits from the same KV-cache state."""
    eager, eager_caches = eager_then_restore(model, step)
    with torch.no_grad():
        compiled = torch.compile(model, backend="dbo", options=options)
        out = compiled(step.input_ids, step.positions, step.attn_metadata)
    return eager, out, eager_caches, [c.clone() for c in model.kv_caches()]


def capture_then_serve(runner, model, step, saved, reset=None):
    """``runner.capture()``, then the KV caches back to ``saved`` (and ``reset()``: other
    state the warm-up steps changed), then one served step of ``step``."""
    runner.capture()
    for c, s in zip(model.kv_caches(), saved):
        c.copy_(s)
    if reset is not None:
        reset()
    return runner(step.input_ids, step.positions, step.attn_metadata, step.num_scheduled_tokens)


def faulty_emulated_runner(layers: int, **options):
    """A tiny :class:`FaultyMoEModel` (8 experts, top-3) as rank 0 of an emulated EP-4 world,
    its one-device reference, both with KV caches of 64 blocks of 16 tokens, and a CPU
    ``CudaGraphRunner`` of bucket 32 over the model compiled with ``split="always"`` and
    ``options``: ``(cfg, model, ref, runner)``, not captured yet (the tests that fail an op
    between an emulated dispatch and its combine: ``dbo_compile.testing.faults``)."""
    cfg = get_config("tiny", num_experts=8, top_k=3, num_layers=layers)
    model = FaultyMoEModel(cfg, emulated_world_size=4)
    ref = model.emulated_reference()
    for m in (model, ref):
        m.allocate_kv_cache(64, 16)
    cm = torch.compile(model, backend="dbo", options={
        "split": "always", "comm_backend": "emulated", "comm_backend_options": {"world_size": 4},
        **options})
    runner = CudaGraphRunner(cm, [32], max_blocks_per_req=8, block_size=16, timing_iters=1)
    return cfg, model, ref, runner


class CountingModel(FaultyMoEModel):
    """An EPLB-style expert-load counter (every MoE layer adds its routing in place,
    ``FaultyMoEModel(count_load=True)``) and a step counter (``steps.add_(1)`` per call): two
    buffers the forward mutates in place, one from the tokens, one token-free."""

    def __init__(self, cfg, **kwargs):
        super().__init__(cfg, count_load=True, **kwargs)
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64,
                                                  device=self.embed_tokens.device),
                             persistent=False)

    def forward(self, input_ids, positions, attn_metadata):
        self.steps.add_(1)
        return super().forward(input_ids, positions, attn_metadata)


def model_state(model: CountingModel) -> dict[str, torch.Tensor]:
    """Copies of the model's counters and KV caches."""
    return {"expert_load": model.expert_load.clone(), "steps": model.steps.clone(),
            **{f"kv{i}": c.clone() for i, c in enumerate(model.kv_caches())}}


class _NoCommMoE(_FaultyMoE):
    """The routed experts of every token computed here, without dispatch / combine."""

    def forward(self, x):
        topk_w, topk_ids = self.route(x)  # counts the routing
        return self.experts(x, topk_ids, topk_w) + self.shared_experts(x)


class NoCommCountingModel(CountingModel):
    """:class:`CountingModel` without a comm op (all experts local, no dispatch / combine):
    row-local, compiled unsplit ("nothing to overlap"), its expert-load counter a fold of
    token rows in Dynamo's graph."""

    def __init__(self, cfg, **kwargs):
        super().__init__(cfg, **kwargs)
        for layer in self.layers:
            if isinstance(layer.mlp, _FaultyMoE):
                layer.mlp.__class__ = _NoCommMoE


class MixingCountingModel(CountingModel):
    """:class:`CountingModel` whose logits are centred over the step's tokens: compiled
    unsplit (it mixes tokens), with collectives, counting expert load."""

    def forward(self, input_ids, positions, attn_metadata):
        out = super().forward(input_ids, positions, attn_metadata)
        return out - out.mean(0, keepdim=True)
