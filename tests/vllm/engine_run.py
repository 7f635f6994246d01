"""Run tiny MoE models in vLLM with and without the dbo backend; print one JSON line.

Used by tests/vllm/test_vllm_engine.py, in a process of its own (one vLLM engine at a time
per process, in-process engine core): ``python tests/vllm/engine_run.py SPEC.json``, where
SPEC holds ``family``, ``workdir``, ``runs`` (a list of ``{"name", "backend", "options",
"speculative"}``; backend ``null``: vLLM without compilation), ``prompts`` (token-id lists),
``max_tokens``. Prints ``RESULT {json}`` with per run the generated token ids, the
top logprobs of each generated token and the dbo artifacts' step counts and reasons.
"""

import gc
import json
import os
import sys

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


def write_model(family: str, workdir: str) -> str:
    path = os.path.join(workdir, family)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(CONFIGS[family], f)
    return path


def run(spec: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from dbo_compile.backend import compiled_artifacts, reset_artifacts

    model = write_model(spec["family"], spec["workdir"])
    prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]
    params = SamplingParams(max_tokens=spec["max_tokens"], temperature=0.0, logprobs=3,
                            detokenize=False, ignore_eos=True)
    results = {}
    for r in spec["runs"]:
        reset_artifacts()
        backend = r.get("backend")
        cc = {"mode": 2, "backend": backend} if backend else {"mode": 0}
        extra = {"speculative_config": r["speculative"]} if r.get("speculative") else {}
        llm = LLM(model=model, load_format="dummy", skip_tokenizer_init=True, dtype="float32",
                  max_model_len=256, max_num_seqs=8, max_num_batched_tokens=256, seed=0,
                  gpu_memory_utilization=0.05, kv_cache_memory_bytes=32 << 20,
                  compilation_config=cc, additional_config={"dbo": r.get("options", {})},
                  enable_prefix_caching=r.get("prefix_caching", False), **extra)
        outs = llm.generate(prompts, params, use_tqdm=False)
        arts = [a.artifact if hasattr(a, "artifact") else a for a in compiled_artifacts()]
        results[r["name"]] = {
            "tokens": [list(o.outputs[0].token_ids) for o in outs],
            "logprobs": [[{str(k): v.logprob for k, v in lp.items()} for lp in o.outputs[0].logprobs]
                         for o in outs],
            "artifacts": [{"kind": type(a).__name__, "reason": a.reason,
                           "split_steps": a.stats.split_steps,
                           "unsplit_steps": a.stats.unsplit_steps,
                           "reasons": a.stats.reasons} for a in arts],
        }
        del llm
        gc.collect()
    return results


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    print("RESULT " + json.dumps(run(spec)), flush=True)
