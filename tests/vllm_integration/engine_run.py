"""Run tiny MoE models in vLLM with and without the dbo backend; print one JSON line.

Used by tests/vllm_integration/test_vllm_engine.py, in a process of its own (one vLLM engine at a time
per process, in-process engine core): ``python tests/vllm_integration/engine_run.py SPEC.json``, where
SPEC holds ``family``, ``workdir``, ``runs`` (a list of ``{"name", "backend", "options",
"speculative", "prefix_caching", "block_size"}``; backend ``null``: vLLM without
compilation), ``prompts`` (token-id lists), ``max_tokens`` (one, or one per prompt),
``then`` (``{"prompts", "max_tokens"}``: a second generate on the engines of the runs with
prefix caching), and for
data parallelism ``dp`` (2: one process per DP rank, started by the caller with
torch.distributed's ``RANK`` / ``WORLD_SIZE`` / ``MASTER_ADDR`` / ``MASTER_PORT``: vLLM's
``external_launcher`` executor, EP over the DP ranks) with ``rank_prompts`` (each rank's
prompt indices). Prints ``RESULT {json}`` with per run the generated token ids and the top
logprobs of each generated token by prompt index, the dbo artifacts' step counts and reasons,
and every step's DP vote.
"""

import gc
import json
import os
import sys

import torch
from safetensors.torch import save_file

os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

#: tiny configs of the two families (hidden 64, 2 layers, 4 experts top-2, 256-token vocab)
CONFIGS = {
    "qwen3_moe": {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
        "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
        "head_dim": 32, "num_experts": 4, "num_experts_per_tok": 2, "vocab_size": 256,
        "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "torch_dtype": "float32", "decoder_sparse_step": 1, "mlp_only_layers": [],
        "norm_topk_prob": True, "tie_word_embeddings": False, "bos_token_id": 1,
        "eos_token_id": 2},
    "deepseek_v2": {
        "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
        "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
        "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
        "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2,
        "first_k_dense_replace": 0, "moe_layer_freq": 1, "n_group": 1, "topk_group": 1,
        "topk_method": "greedy", "scoring_func": "softmax", "norm_topk_prob": False,
        "routed_scaling_factor": 1.0, "kv_lora_rank": 512, "q_lora_rank": None,
        "qk_nope_head_dim": 32, "qk_rope_head_dim": 64, "v_head_dim": 32,
        "vocab_size": 256, "max_position_embeddings": 512, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "torch_dtype": "float32", "tie_word_embeddings": False,
        "bos_token_id": 1, "eos_token_id": 2},
}


#: compilation options every engine of a family runs with: vLLM 0.32's CPU rotary kernel
#: (``_C.rotary_embedding``) mishandles a strided key, DeepSeek's ``k_pe`` (a column slice of
#: ``kv_a_proj_with_mqa``'s output), so the family's outputs would depend on the batch (the
#: rows beside a request's); vLLM's own native rotary (PyTorch ops) is used instead
FAMILY_COMPILATION = {"deepseek_v2": {"custom_ops": ["all", "-rotary_embedding"]}}
#: engine arguments per family: vLLM's CPU platform prefers its AMX MLA backend wherever the CPU
#: has AMX tiles, and that backend takes bf16/fp16/int8 weights only (this test's models are
#: float32): the reference CPU MLA backend on every machine, AMX or not
FAMILY_ENGINE_ARGS = {"deepseek_v2": {"attention_backend": "CPU_MLA"}}


def _weight_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """The checkpoint tensors of a config of :data:`CONFIGS` (Hugging Face names), by name."""
    h, v, e, i = (cfg["hidden_size"], cfg["vocab_size"], cfg.get("num_experts", 0)
                  or cfg["n_routed_experts"], cfg["moe_intermediate_size"])
    nh = cfg["num_attention_heads"]
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h),
                                          "model.norm.weight": (h,), "lm_head.weight": (v, h)}
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        if cfg["model_type"] == "qwen3_moe":
            hd, nkv = cfg["head_dim"], cfg["num_key_value_heads"]
            shapes.update({p + "self_attn.q_proj.weight": (nh * hd, h),
                           p + "self_attn.k_proj.weight": (nkv * hd, h),
                           p + "self_attn.v_proj.weight": (nkv * hd, h),
                           p + "self_attn.o_proj.weight": (h, nh * hd),
                           p + "self_attn.q_norm.weight": (hd,),
                           p + "self_attn.k_norm.weight": (hd,)})
        else:  # deepseek_v2, multi-head latent attention without a q LoRA
            nope, rope, vd, kv = (cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"],
                                  cfg["v_head_dim"], cfg["kv_lora_rank"])
            shapes.update({p + "self_attn.q_proj.weight": (nh * (nope + rope), h),
                           p + "self_attn.kv_a_proj_with_mqa.weight": (kv + rope, h),
                           p + "self_attn.kv_a_layernorm.weight": (kv,),
                           p + "self_attn.kv_b_proj.weight": (nh * (nope + vd), kv),
                           p + "self_attn.o_proj.weight": (h, nh * vd)})
            shared = i * cfg["n_shared_experts"]
            shapes.update({p + "mlp.shared_experts.gate_proj.weight": (shared, h),
                           p + "mlp.shared_experts.up_proj.weight": (shared, h),
                           p + "mlp.shared_experts.down_proj.weight": (h, shared)})
        shapes[p + "mlp.gate.weight"] = (e, h)
        for x in range(e):
            shapes.update({p + f"mlp.experts.{x}.gate_proj.weight": (i, h),
                           p + f"mlp.experts.{x}.up_proj.weight": (i, h),
                           p + f"mlp.experts.{x}.down_proj.weight": (h, i)})
    return shapes


def write_model(family: str, workdir: str, seed: int = 0) -> str:
    """``workdir/family``: config.json and model.safetensors with seeded random weights of
    unit scale (each linear layer ``N(0, 1/fan_in)``, so activations keep their size; norms
    ``1 + N(0, 0.01)``; the LM head ``N(0, 4/hidden)``, so the log-probabilities spread over
    several nats instead of vLLM's dummy weights' flat ``log(1/vocab)``). Every rank and
    engine loads the same numbers (vLLM's dummy loader would seed each rank's expert shard
    alike, i.e. a different model at EP 2)."""
    cfg = CONFIGS[family]
    path = os.path.join(workdir, family)
    os.makedirs(path, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in sorted(_weight_shapes(cfg).items()):
        t = torch.randn(shape, generator=gen)
        if len(shape) == 1:
            t = 1.0 + 0.1 * t
        elif name == "lm_head.weight":
            t = t * 2.0 / shape[1] ** 0.5
        elif name != "model.embed_tokens.weight":
            t = t / shape[1] ** 0.5
        tensors[name] = t.contiguous()
    save_file(tensors, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return path


#: every step's decision of the dbo artifacts, in call order (see _record_steps)
STEPS: list[dict] = []


def _record_steps() -> None:
    """Record each step's DP vote (tokens per DP rank, padded count, split?, reason)."""
    from dbo_compile.runtime.artifact import CompiledArtifact
    from dbo_compile.runtime.context import counting

    original = CompiledArtifact.decide_step

    def decide_step(self, args, **kwargs):
        decision = original(self, args, **kwargs)
        if counting():
            vote = decision.vote
            STEPS.append({"tokens": None if vote is None else vote.num_tokens_across_dp,
                          "padded": None if vote is None else vote.num_tokens_padded,
                          "split": decision.should_split, "reason": decision.reason})
        return decision

    CompiledArtifact.decide_step = decide_step


def _generate(llm, indices: list[int], prompts: list, params: list) -> dict:
    """``llm.generate``: tokens and logprobs by prompt index, and the steps it took."""
    outs = llm.generate(prompts, params, use_tqdm=False)
    return {"tokens": {i: list(o.outputs[0].token_ids) for i, o in zip(indices, outs)},
            "logprobs": {i: [{str(k): v.logprob for k, v in lp.items()}
                             for lp in o.outputs[0].logprobs] for i, o in zip(indices, outs)},
            "steps": list(STEPS)}


def run(spec: dict) -> dict:
    """Each run of ``spec["runs"]`` (one engine each, in turn) generates ``spec["prompts"]``
    (this DP rank's share, ``spec["rank_prompts"][rank]``, at ``dp`` > 1); returns per run the
    tokens and logprobs by prompt index, the artifacts' step counts and every step's vote."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from dbo_compile.backend import compiled_artifacts, reset_artifacts

    _record_steps()
    dp = spec.get("dp", 1)
    rank = int(os.environ.get("RANK", "0"))
    model = write_model(spec["family"], spec["workdir"])
    mine = spec["rank_prompts"][rank] if dp > 1 else list(range(len(spec["prompts"])))
    max_tokens = spec["max_tokens"]
    if isinstance(max_tokens, int):
        max_tokens = [max_tokens] * len(spec["prompts"])
    prompts = [TokensPrompt(prompt_token_ids=spec["prompts"][i]) for i in mine]
    params = [SamplingParams(max_tokens=max_tokens[i], temperature=0.0, logprobs=3,
                             detokenize=False, ignore_eos=True) for i in mine]
    parallel = {} if dp == 1 else {
        "data_parallel_size": dp, "enable_expert_parallel": True,
        "distributed_executor_backend": "external_launcher"}
    results = {}
    for r in spec["runs"]:
        reset_artifacts()
        STEPS.clear()
        backend = r.get("backend")
        cc = {"mode": 2, "backend": backend} if backend else {"mode": 0}
        cc.update(FAMILY_COMPILATION.get(spec["family"], {}))
        extra = {"speculative_config": r["speculative"]} if r.get("speculative") else {}
        if "block_size" in r:
            extra["block_size"] = r["block_size"]
        extra.update(FAMILY_ENGINE_ARGS.get(spec["family"], {}))
        llm = LLM(model=model, skip_tokenizer_init=True, dtype="float32",
                  max_model_len=256, max_num_seqs=8, max_num_batched_tokens=256, seed=0,
                  gpu_memory_utilization=0.05, kv_cache_memory_bytes=32 << 20,
                  compilation_config=cc, additional_config={"dbo": r.get("options", {})},
                  enable_prefix_caching=r.get("prefix_caching", False), **parallel, **extra)
        STEPS.clear()  # engine start-up's profile and warm-up runs
        results[r["name"]] = res = _generate(llm, mine, prompts, params)
        arts = [a.artifact if hasattr(a, "artifact") else a for a in compiled_artifacts()]
        res["artifacts"] = [{"kind": type(a).__name__, "reason": a.reason,
                             "split_steps": a.stats.split_steps,
                             "unsplit_steps": a.stats.unsplit_steps,
                             "reasons": a.stats.reasons} for a in arts]
        model_ = llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
        res["moe"] = [[m.dbo_reason, bool(m.ep_group)] for m in model_.modules()
                      if type(m).__name__ == "DboMoERunner"]
        then = spec.get("then")
        if then and r.get("prefix_caching"):  # a second generate on the same engine
            STEPS.clear()
            n = len(then["prompts"])
            res["then"] = _generate(
                llm, list(range(n)), [TokensPrompt(prompt_token_ids=p) for p in then["prompts"]],
                [SamplingParams(max_tokens=then["max_tokens"], temperature=0.0, logprobs=3,
                                detokenize=False, ignore_eos=True)] * n)
        del llm, model_
        gc.collect()
    return results


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    print("RESULT " + json.dumps(run(spec)), flush=True)
    if spec.get("dp", 1) > 1:  # every rank leaves the process group together
        import torch.distributed as dist

        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
