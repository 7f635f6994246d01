"""Hugging Face transformers MoE models under EP with backend="dbo" (issue 6).

Tiny random-weight models from the families' config classes (no download), EP = 2 Gloo ranks on
CPU: the compiled, expert-parallel, split model gives the unmodified model's logits, and the
split really happened (read from the compiled artifact).
"""

from __future__ import annotations

import copy
import inspect

import pytest
import torch

pytest.importorskip("transformers")

from conftest import last_artifact  # noqa: E402
from dbo_compile.models.hf import (  # noqa: E402
    SUPPORTED_MODEL_TYPES,
    EPMoEBlock,
    UnsupportedModelError,
    make_expert_parallel,
)
from dbo_compile.testing.hf import TINY_MODEL_TYPES, tiny_hf_model  # noqa: E402
from shared_ranks import SharedRanks  # noqa: E402

FP32 = dict(rtol=1e-5, atol=1e-5)
BATCH, SEQ, MAX_CACHE = 5, 6, 16  # batch 5: ubatches of 2 and 3 requests; batch != seq


def _comm_ops(gm: torch.fx.GraphModule) -> int:
    targets = (torch.ops.dbo.dispatch.default, torch.ops.dbo.combine.default,
               torch.ops.dbo.moe_dispatch.default, torch.ops.dbo.moe_combine.default)
    return sum(1 for n in gm.graph.nodes if n.target in targets)


def _num_moe_layers(model) -> int:
    return sum(1 for m in model.modules() if isinstance(m, EPMoEBlock))


def _cache_kwarg(model) -> str:
    """transformers 5.24 renamed ``past_key_values`` to ``cache`` (old name deprecated)."""
    return "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"


def _artifact_facts(art) -> dict:
    return {"kind": type(art).__name__, "reason": getattr(art, "reason", None),
            "split": art.stats.split_steps, "unsplit": art.stats.unsplit_steps,
            "comm_lowered": _comm_ops(art.lowered_gm) if hasattr(art, "lowered_gm") else 0,
            "comm_split": _comm_ops(art.split_gm) if hasattr(art, "split_gm") else 0,
            "comm_per_ubatch": art.schedule.meta["comm_ops_per_ubatch"]
            if hasattr(art, "split_gm") else 0,
            "code": getattr(art, "code", "")}


# --------------------------------------------------------------------------------------------
# Prefill (use_cache=False)
# --------------------------------------------------------------------------------------------


def _prefill_body(rank, world_size, model_type):
    import torch.distributed as dist

    from dbo_compile.backend import compiled_artifacts, register

    register()
    model = tiny_hf_model(model_type, seed=0)
    reference = copy.deepcopy(model)  # the unmodified model, all experts, this process
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own requests
    input_ids = torch.randint(0, model.config.vocab_size, (BATCH, SEQ), generator=gen)
    with torch.no_grad():
        expected = reference(input_ids=input_ids, use_cache=False).logits
        make_expert_parallel(model, dist.group.WORLD)
        compiled = torch.compile(model, backend="dbo", options={"split": "always"})
        torch._dynamo.mark_dynamic(input_ids, 0)
        out = compiled(input_ids=input_ids, use_cache=False).logits
    err = None
    try:
        torch.testing.assert_close(out, expected, **FP32)
    except AssertionError as e:
        err = str(e)
    block = next(m for m in model.modules() if isinstance(m, EPMoEBlock))
    return {"err": err, "artifacts": len(compiled_artifacts()),
            "moe_layers": _num_moe_layers(model), "local": block.local_expert_range,
            "local_tensor": tuple(block.experts.down_proj.shape),
            **_artifact_facts(compiled_artifacts()[-1])}


@pytest.mark.multirank
@pytest.mark.parametrize("model_type", TINY_MODEL_TYPES)
def test_two_rank_ep_prefill_split_equals_unmodified_model(request, model_type):
    results = RANKS.results(request, _prefill_body, model_type)
    for rank, r in enumerate(results):
        assert r["kind"] == "SplitArtifact", r["reason"]
        assert r["artifacts"] == 1  # one graph: no graph break
        assert r["err"] is None, r["err"]
        assert r["split"] == 1 and r["unsplit"] == 0
        # every MoE layer: one dispatch + one combine per ubatch, twice as many after the split
        assert r["comm_per_ubatch"] == r["comm_lowered"] == 2 * r["moe_layers"]
        assert r["comm_split"] == 2 * r["comm_lowered"]
        e_local = r["local"][1] - r["local"][0]
        assert r["local"][0] == rank * e_local and r["local_tensor"][0] == e_local
    assert results[0]["code"] == results[1]["code"]  # one collective order on both ranks


# --------------------------------------------------------------------------------------------
# Decode with a static KV cache
# --------------------------------------------------------------------------------------------


def _decode_body(rank, world_size, model_type, num_steps, batch):
    import torch.distributed as dist
    from transformers import StaticCache

    from dbo_compile.backend import compiled_artifacts, register

    register()
    model = tiny_hf_model(model_type, seed=0)
    reference = copy.deepcopy(model)
    make_expert_parallel(model, dist.group.WORLD)
    kw = _cache_kwarg(model)
    gen = torch.Generator().manual_seed(200 + rank)
    vocab = model.config.vocab_size
    prompt = torch.randint(0, vocab, (batch, SEQ), generator=gen)
    errors, kv_err = [], 0.0
    with torch.no_grad():
        ref_cache = StaticCache(config=reference.config, max_cache_len=MAX_CACHE)
        cache = StaticCache(config=model.config, max_cache_len=MAX_CACHE)
        reference(input_ids=prompt, use_cache=True, **{kw: ref_cache})
        model(input_ids=prompt, use_cache=True, **{kw: cache})  # eager EP prefill fills it
        for layer in cache.layers:  # the cache is indexed by request, like input_ids
            torch._dynamo.mark_dynamic(layer.keys, 0)
            torch._dynamo.mark_dynamic(layer.values, 0)
        compiled = torch.compile(model, backend="dbo", options={"split": "always"})
        for _ in range(num_steps):
            token = torch.randint(0, vocab, (batch, 1), generator=gen)
            expected = reference(input_ids=token, use_cache=True, **{kw: ref_cache}).logits
            torch._dynamo.mark_dynamic(token, 0)
            out = compiled(input_ids=token, use_cache=True, **{kw: cache}).logits
            errors.append((out - expected).abs().max().item())
        for a, b in zip(ref_cache.layers, cache.layers):
            kv_err = max(kv_err, (a.keys - b.keys).abs().max().item(),
                         (a.values - b.values).abs().max().item())
    arts = compiled_artifacts()
    return {"errors": errors, "kv_err": kv_err, "moe_layers": _num_moe_layers(model),
            "arts": [_artifact_facts(a) for a in arts]}


# the two-rank tests' bodies run on one group of 2 ranks, launched once (tests/shared_ranks.py)
RANKS = SharedRanks(2, timeout_s=300, calls={
    **{f"test_two_rank_ep_prefill_split_equals_unmodified_model[{t}]": (_prefill_body, (t,))
       for t in TINY_MODEL_TYPES},
    **{f"test_two_rank_ep_static_cache_decode_split_equals_unmodified_model[{t}-{n}]":
       (_decode_body, (t, n, 4)) for t, n in [("qwen3_moe", 3), ("gpt_oss", 4)]},
    "test_two_rank_ep_static_cache_decode_odd_batch": (_decode_body, ("qwen3_moe", 2, 5)),
})


@pytest.mark.multirank
@pytest.mark.parametrize("model_type,num_steps", [("qwen3_moe", 3), ("gpt_oss", 4)])
def test_two_rank_ep_static_cache_decode_split_equals_unmodified_model(request, model_type,
                                                                       num_steps):
    """Decode steps (one new token per request) on a transformers StaticCache: the cache's
    step counter (a 0-dim tensor; GPT-OSS's sliding layers also a Python int) advances once per
    step, not once per ubatch, and the per-request cache rows are written in place.
    GPT-OSS crosses its sliding window (8) at step 3: Dynamo compiles 3 graphs, all split.
    Batch 4: an even batch is not padded by the DP vote (see the odd-batch test)."""
    _check_decode(RANKS.results(request, _decode_body, model_type, num_steps, 4), num_steps)


@pytest.mark.multirank
def test_two_rank_ep_static_cache_decode_odd_batch(request):
    """5 requests per rank: the DP vote pads to 6 (a multiple of num_ubatches); the padded
    StaticCache is a copy whose written rows must reach the caller's cache."""
    _check_decode(RANKS.results(request, _decode_body, "qwen3_moe", 2, 5), 2)


def _check_decode(results, num_steps):
    for r in results:
        assert max(r["errors"]) < 1e-5 and r["kv_err"] < 1e-5, (r["errors"], r["kv_err"])
        assert all(a["kind"] == "SplitArtifact" for a in r["arts"]), r["arts"]
        assert sum(a["split"] for a in r["arts"]) == num_steps
        assert sum(a["unsplit"] for a in r["arts"]) == 0
        for a in r["arts"]:
            assert a["comm_lowered"] == 2 * r["moe_layers"]
            assert a["comm_split"] == 2 * a["comm_lowered"]
    assert [a["code"] for a in results[0]["arts"]] == [a["code"] for a in results[1]["arts"]]


# --------------------------------------------------------------------------------------------
# One process: layout, fallbacks, errors
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model_type", TINY_MODEL_TYPES)
def test_one_rank_replacement_is_exact_and_keeps_state_dict_keys(model_type):
    model = tiny_hf_model(model_type, seed=0)
    reference = copy.deepcopy(model)
    keys = {k: v.shape for k, v in model.state_dict().items()}
    ids = torch.randint(0, model.config.vocab_size, (3, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = reference(input_ids=ids, use_cache=False).logits
        make_expert_parallel(model, None)
        out = model(input_ids=ids, use_cache=False).logits
    torch.testing.assert_close(out, expected, **FP32)
    assert {k: v.shape for k, v in model.state_dict().items()} == keys  # loads like before
    assert _num_moe_layers(model) >= 1


def test_static_dynamo_graph_falls_back_unsplit_with_reason():
    """Without marking the request dim dynamic, Dynamo bakes the batch size into
    transformers' views; the backend must notice and run the model unsplit, not crash."""
    model = make_expert_parallel(tiny_hf_model("qwen3_moe"), None)
    ids = torch.randint(0, 128, (4, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(input_ids=ids, use_cache=False).logits
        out = torch.compile(model, backend="dbo", options={"split": "always"})(
            input_ids=ids, use_cache=False).logits
    art = last_artifact()
    assert art.stats.unsplit_steps == 1 and "specialised" in art.reason, art.reason
    torch.testing.assert_close(out, expected, **FP32)


def test_expert_count_not_divisible_by_ep_size_is_an_error():
    class _Group:  # only size()/rank()/group_name are read before the check
        group_name = "fake"

        def size(self):
            return 3

        def rank(self):
            return 0

    with pytest.raises(UnsupportedModelError, match="not divisible by the EP world size 3"):
        make_expert_parallel(tiny_hf_model("qwen3_moe"), _Group())


def test_unsupported_family_is_an_error_naming_the_supported_ones():
    from transformers import LlamaConfig, LlamaForCausalLM

    dense = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=1, num_attention_heads=2))
    with pytest.raises(UnsupportedModelError, match="model_type='llama'") as info:
        make_expert_parallel(dense, None)
    assert all(t in str(info.value) for t in SUPPORTED_MODEL_TYPES)


def test_unsupported_layout_and_double_application_are_errors():
    model = tiny_hf_model("mixtral")
    block = model.model.layers[0].mlp
    experts = block.experts
    block.experts = torch.nn.ModuleList([torch.nn.Linear(4, 4)])  # transformers < 5 layout
    with pytest.raises(UnsupportedModelError, match="nn.ModuleList|ModuleList"):
        make_expert_parallel(model, None)
    block.experts = experts
    make_expert_parallel(model, None)
    with pytest.raises(UnsupportedModelError, match="already expert-parallel"):
        make_expert_parallel(model, None)
