"""Tests of the reference DeepSeek-style model and the step builders."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from dbo_compile.errors import MetadataError
from dbo_compile.models import (
    PRESETS,
    DeepseekMoEModel,
    ModelConfigError,
    context_slots,
    fill_kv_cache,
    get_config,
    make_step,
)
from dbo_compile.testing import run_multirank


def _tiny_model(seed=0, dtype=torch.float32, num_blocks=64, block_size=16, **kw):
    cfg = get_config("tiny", **kw)
    model = DeepseekMoEModel(cfg, dtype=dtype, seed=seed)
    model.allocate_kv_cache(num_blocks, block_size)
    return model


# ------------------------------------------------------------------------------------------
# configs and construction
# ------------------------------------------------------------------------------------------


def test_presets():
    lite, v3 = PRESETS["deepseek-v2-lite"], PRESETS["deepseek-v3"]
    assert (lite.hidden_size, lite.num_experts, lite.top_k, lite.num_shared_experts,
            lite.moe_intermediate_size, lite.num_heads, lite.num_layers, lite.vocab_size) == \
        (2048, 64, 6, 2, 1408, 16, 27, 102400)
    assert (v3.hidden_size, v3.num_experts, v3.top_k, v3.num_shared_experts,
            v3.moe_intermediate_size, v3.num_layers, v3.num_heads, v3.vocab_size) == \
        (7168, 256, 8, 1, 2048, 61, 128, 129280)
    assert get_config("tiny", top_k=3).top_k == 3
    with pytest.raises(ModelConfigError, match="unknown preset"):
        get_config("llama")
    with pytest.raises(ModelConfigError, match="unknown DeepseekConfig fields"):
        get_config("tiny", hiden_size=3)
    with pytest.raises(ModelConfigError, match="multiple of num_kv_heads"):
        get_config("tiny", num_kv_heads=3)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_build_on_meta(name):
    cfg = get_config(name)
    model = DeepseekMoEModel(cfg, device="meta", dtype=torch.bfloat16)
    assert all(p.device.type == "meta" for p in model.parameters())
    moe = [layer.mlp for layer in model.layers if hasattr(layer.mlp, "gate")]
    assert len(moe) == cfg.num_moe_layers
    i, h, e = cfg.moe_intermediate_size, cfg.hidden_size, cfg.num_experts
    assert moe[0].w13.shape == (e, 2 * i, h) and moe[0].w2.shape == (e, h, i)


@pytest.mark.parametrize("name,layers", [("deepseek-v2-lite", 2), ("deepseek-v3", 4)])
def test_forward_on_meta(name, layers):
    """Big presets run on meta (fake kernels of the dbo ops), a few layers to stay fast."""
    cfg = get_config(name, num_layers=layers)
    model = DeepseekMoEModel(cfg, device="meta", dtype=torch.bfloat16)
    model.allocate_kv_cache(num_blocks=8, block_size=16)
    step = make_step(cfg, decode_context_lens=[40, 3], prefills=[(0, 5)], pad_to=8).to("meta")
    with torch.no_grad():
        out = model(step.input_ids, step.positions, step.attn_metadata)
    assert out.shape == (8, cfg.vocab_size) and out.dtype == torch.float32


def test_init_deterministic():
    a, b, c = (DeepseekMoEModel(get_config("tiny"), seed=s) for s in (0, 0, 1))
    for (n, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), n
        if "layernorm" not in n and n != "norm.weight":
            assert not torch.equal(pa, pc), n


def test_kv_cache_required():
    cfg = get_config("tiny")
    model = DeepseekMoEModel(cfg)
    step = make_step(cfg, decode_context_lens=[3], prefills=[])
    with pytest.raises(ModelConfigError, match="allocate_kv_cache"):
        model(step.input_ids, step.positions, step.attn_metadata)
    model.allocate_kv_cache(4, 16)
    assert "layers.0.self_attn.kv_cache" not in model.state_dict()
    assert dict(model.named_buffers())["layers.0.self_attn.kv_cache"].shape == (2, 4, 16, 2, 16)


def _forward_flat(model, ids, pos, qsl, seq_lens, ctx, block_table, slot_mapping):
    from dbo_compile.metadata import AttentionMetadata

    # the int fields are deliberately bogus: forward must not read them
    md = AttentionMetadata(qsl, seq_lens, ctx, block_table, slot_mapping, -1, -1)
    return model(ids, pos, md)


def test_traces_with_symbolic_token_dim():
    """forward is traceable with a symbolic token dim: no .item(), no size baked in."""
    import contextlib
    import functools

    import torch.fx.experimental._config as fx_config
    from torch.fx.experimental.proxy_tensor import make_fx

    cfg = get_config("tiny")
    model = _tiny_model(num_blocks=40)
    step = make_step(cfg, decode_context_lens=[20, 300], prefills=[(0, 5)], pad_to=9,
                     num_blocks=40)
    md = step.attn_metadata
    args = (step.input_ids, step.positions, md.query_start_loc, md.seq_lens,
            md.num_computed_tokens, md.block_table, md.slot_mapping)
    # duck shaping off, as the backend traces (num_reqs == num_tokens must not merge symbols)
    no_duck = (fx_config.patch(use_duck_shape=False) if hasattr(fx_config, "use_duck_shape")
               else contextlib.nullcontext())
    with no_duck, torch.no_grad():
        gm = make_fx(functools.partial(_forward_flat, model), tracing_mode="symbolic",
                     _allow_non_fake_inputs=True)(*args)
    out_val = [n for n in gm.graph.nodes if n.op == "output"][0].args[0].meta["val"]
    tokens = out_val.shape[0]
    assert isinstance(tokens, torch.SymInt) and not tokens.node.is_constant()
    assert out_val.shape[1] == cfg.vocab_size
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.dbo.moe_dispatch.default) == cfg.num_moe_layers
    assert targets.count(torch.ops.dbo.moe_combine.default) == cfg.num_moe_layers
    assert targets.count(torch.ops.dbo.attention.default) == cfg.num_layers


# ------------------------------------------------------------------------------------------
# step builder
# ------------------------------------------------------------------------------------------


def test_make_step_layout():
    cfg = get_config("tiny")
    step = make_step(cfg, decode_context_lens=[35, 0], prefills=[(0, 4), (20, 3)], block_size=8,
                     pad_to=12, seed=3)
    md = step.attn_metadata
    assert step.num_scheduled_tokens == [1, 1, 4, 3] and step.context_lens == [35, 0, 0, 20]
    assert md.query_start_loc.tolist() == [0, 1, 2, 6, 9]
    assert md.seq_lens.tolist() == [36, 1, 4, 23]
    assert md.num_computed_tokens.tolist() == [35, 0, 0, 20]
    assert (md.max_query_len, md.max_seq_len) == (4, 36)
    assert step.positions.tolist() == [35, 0, 0, 1, 2, 3, 20, 21, 22, 0, 0, 0]
    assert md.slot_mapping[9:].tolist() == [-1, -1, -1]
    assert step.input_ids[9:].tolist() == [0, 0, 0] and bool((step.input_ids[:9] > 0).all())
    # disjoint blocks, and every slot is in the request's own blocks at its position
    nblocks = [5, 1, 1, 3]
    used = [b for i, n in enumerate(nblocks) for b in md.block_table[i, :n].tolist()]
    assert len(used) == len(set(used)) == sum(nblocks) == step.num_blocks
    for row, (pos, slot) in enumerate(zip(step.positions.tolist(), md.slot_mapping.tolist())):
        if row >= 9:
            break
        req = int(torch.searchsorted(md.query_start_loc[1:], torch.tensor(row), right=True))
        assert slot == int(md.block_table[req, pos // 8]) * 8 + pos % 8
    with pytest.raises(MetadataError, match="pad_to"):
        make_step(cfg, decode_context_lens=[1, 2], prefills=[], pad_to=1)
    with pytest.raises(MetadataError, match="num_blocks"):
        make_step(cfg, decode_context_lens=[100], prefills=[], num_blocks=2, block_size=16)


def test_fill_kv_cache_writes_only_contexts():
    cfg = get_config("tiny")
    step = make_step(cfg, decode_context_lens=[30, 5], prefills=[(0, 3)], block_size=8,
                     num_blocks=20)
    model = _tiny_model(num_blocks=20, block_size=8)
    fill_kv_cache(model, step, seed=4)
    slots = context_slots(step)
    assert slots.numel() == 35
    for cache in model.kv_caches():
        flat = cache.view(2, -1, 2, 16)
        written = flat.abs().sum(dim=(0, 2, 3)) != 0
        assert written.nonzero().flatten().tolist() == sorted(slots.tolist())


# ------------------------------------------------------------------------------------------
# model numerics (single process)
# ------------------------------------------------------------------------------------------


def _forward(model, step):
    with torch.no_grad():
        return model(step.input_ids, step.positions, step.attn_metadata)


def test_padding_rows_do_not_change_real_rows():
    cfg = get_config("tiny")
    kw = dict(decode_context_lens=[200, 7], prefills=[(0, 6), (33, 4)], num_blocks=40, seed=5)
    plain, padded = make_step(cfg, **kw), make_step(cfg, pad_to=16, **kw)
    outs = []
    for step in (plain, padded):
        model = _tiny_model(num_blocks=40)
        fill_kv_cache(model, step, seed=2)
        outs.append(_forward(model, step))
    n = plain.num_tokens
    assert outs[1].shape == (16, cfg.vocab_size)
    assert_close(outs[1][:n], outs[0])
    assert bool(torch.isfinite(outs[1]).all())


def test_chunked_prefill_and_decode_match_full_prefill():
    """Logits of a sequence do not depend on how its tokens are cut into steps (KV cache)."""
    cfg = get_config("tiny")
    common = dict(decode_context_lens=[], block_size=16, num_blocks=8, seed=9)
    full = make_step(cfg, prefills=[(0, 40)], **common)
    first = make_step(cfg, prefills=[(0, 30)], **common)
    chunk = make_step(cfg, prefills=[(30, 7)], **common)
    decode = make_step(cfg, prefills=[], **{**common, "decode_context_lens": [37]})
    # all steps share the block table prefix (same seed, same block count), same token ids
    ids = full.input_ids
    first.input_ids, chunk.input_ids, decode.input_ids = ids[:30], ids[30:37], ids[37:38]
    ref = _forward(_tiny_model(num_blocks=8), full)
    model = _tiny_model(num_blocks=8)
    got = torch.cat([_forward(model, s) for s in (first, chunk, decode)])
    assert_close(got, ref[:38], atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------
# expert parallelism over 2 Gloo ranks
# ------------------------------------------------------------------------------------------

# per rank: (decode context lens, prefills); padded to the same token count on both ranks
_EP_STEPS = {
    0: ([230, 17, 0, 480], [(0, 9), (40, 5)]),
    1: ([64, 300], [(12, 6)]),
}
_EP_EMPTY = ([], [])  # a rank with no work: all padding, still takes part in dispatch/combine


def _ep_worker(rank, world_size, dtype_name, pad_to, steps):
    import torch.distributed as dist

    dtype = getattr(torch, dtype_name)
    group = dist.new_group(list(range(world_size)))
    cfg = get_config("tiny")
    decodes, prefills = steps[rank]
    step = make_step(cfg, decode_context_lens=decodes, prefills=prefills, block_size=16,
                     num_blocks=80, seed=10 + rank, pad_to=pad_to)
    ep = DeepseekMoEModel(cfg, ep_group=group, dtype=dtype, seed=7)
    full = DeepseekMoEModel(cfg, ep_group=None, dtype=dtype, seed=7)
    assert ep.num_local_experts == cfg.num_experts // world_size
    start, stop = ep.local_expert_range
    assert torch.equal(ep.layers[0].mlp.w13, full.layers[0].mlp.w13[start:stop])
    logits = []
    for model in (ep, full):
        model.allocate_kv_cache(80, 16)
        fill_kv_cache(model, step, seed=3)
        with torch.no_grad():
            logits.append(model(step.input_ids, step.positions, step.attn_metadata))
    # a model built from the full one holds the same weights as the seeded EP model
    loaded = DeepseekMoEModel(cfg, ep_group=group, dtype=dtype, device="meta")
    loaded = loaded.to_empty(device="cpu")
    loaded.load_state_from_full(full)
    for (n, a), b in zip(ep.named_parameters(), loaded.parameters()):
        assert torch.equal(a, b), n
    return [t.float() for t in logits], step.num_actual_tokens


@pytest.mark.multirank
def test_ep2_matches_ep1():
    """EP=2 (experts split over two Gloo ranks) gives the EP=1 logits, fp32 and bf16, including
    a step where one rank has only padding rows."""
    pad_to = 24
    for dtype_name, tol in (("float32", dict(atol=1e-5, rtol=1e-5)),
                            ("bfloat16", dict(atol=6e-2, rtol=5e-2))):
        results = run_multirank(_ep_worker, 2, args=(dtype_name, pad_to, _EP_STEPS),
                                timeout_s=120)
        for rank, ((ep, full), n) in enumerate(results):
            assert ep.shape == (pad_to, get_config("tiny").vocab_size)
            assert n > 0
            assert_close(ep[:n], full[:n], **tol, msg=lambda m: f"{dtype_name} rank {rank}: {m}")
    results = run_multirank(_ep_worker, 2, args=("float32", 8, {0: _EP_STEPS[1], 1: _EP_EMPTY}),
                            timeout_s=120)
    (ep0, full0), n0 = results[0]
    assert results[1][1] == 0
    assert_close(ep0[:n0], full0[:n0], atol=1e-5, rtol=1e-5)
