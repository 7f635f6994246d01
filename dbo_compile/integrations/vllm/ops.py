"""What the compiler knows about vLLM's ops (vLLM 0.32 on CPU), as op-registry records.

Registered by :func:`register_vllm_ops` (the plug-in and the backend entry call it), for the
ops that exist in the running vLLM build:

=================================  =================================================
op                                 record
=================================  =================================================
``vllm.unified_kv_cache_update``   step state keyed by ``layer_name`` (the layer's KV
                                   cache and slot mapping in the forward context);
                                   row-local along ``key`` / ``value``
``vllm.unified_attention_with_``   step state keyed by ``layer_name`` (the metadata
``output``                         and KV cache); row-local along ``query`` ...
                                   ``output`` given its ubatch's metadata, as
                                   ``dbo.attention``; called functionalised
                                   (``auto_functionalized_v2``: it writes ``output``)
``vllm.unified_mla_kv_cache_``      the same for multi-head latent attention (MLA:
``update``, ``..._mla_attention_`` DeepSeek-V2/V3), keyed by ``layer_name``
``with_output``
``_C.onednn_mm``                   row-local (``out[T, N] = x[T, K] @ W``)
``_C.rotary_embedding``            row-local (rotates ``query`` / ``key`` rows by
                                   ``positions``)
``_C.rms_norm``,                   row-local (per-row norms)
``_C.fused_add_rms_norm``
``_C.silu_and_mul``                row-local
``_C.cpu_fused_moe``               row-local (each token's experts; vLLM's own MoE
                                   kernel at one EP rank)
=================================  =================================================

Row-local means: row ``i`` of each output depends only on row ``i`` of the token-indexed
inputs (the attention ops: and on the KV cache, written by ubatch 0 before ubatch 1 reads
it, which the step-state key orders). These are facts of the ops' documented semantics in
vLLM's source (``vllm/_custom_ops.py``, ``vllm/model_executor/layers/attention/attention.py``).
"""

from __future__ import annotations

import logging

import torch

from dbo_compile.ops.registry import register_row_local, register_step_state_op

log = logging.getLogger(__name__)

__all__ = ["register_vllm_ops"]

#: ``(namespace, op)`` of vLLM's row-local ops
_ROW_LOCAL = (("_C", "onednn_mm"), ("_C", "rotary_embedding"), ("_C", "rms_norm"),
              ("_C", "fused_add_rms_norm"), ("_C", "silu_and_mul"), ("_C", "cpu_fused_moe"))
#: ``(op, key argument, token args)`` of vLLM's ops keyed to the forward context
_STEP_STATE = (
    ("unified_kv_cache_update", (2, "layer_name"), ((0, "key"), (1, "value"))),
    ("unified_attention_with_output", (4, "layer_name"),
     ((0, "query"), (1, "key"), (2, "value"))),
    ("unified_mla_kv_cache_update", (2, "layer_name"), ((0, "kv_c_normed"), (1, "k_pe"))),
    ("unified_mla_attention_with_output", (4, "layer_name"),
     ((0, "q"), (1, "kv_c_normed"), (2, "k_pe"))),
)


def _overload(namespace: str, name: str):
    """``torch.ops.<namespace>.<name>.default`` where the running vLLM registers it."""
    try:
        return getattr(getattr(torch.ops, namespace), name).default
    except (AttributeError, RuntimeError):
        return None


def register_vllm_ops() -> list[str]:
    """Record vLLM's ops (the table of the module docstring) that this vLLM build registers;
    returns their names. Idempotent."""
    done = []
    for namespace, name in _ROW_LOCAL:
        op = _overload(namespace, name)
        if op is not None:
            register_row_local(op)
            done.append(f"{namespace}.{name}")
    for name, key, token_args in _STEP_STATE:
        op = _overload("vllm", name)
        if op is not None:
            register_step_state_op(op, key, token_args=token_args)
            done.append(f"vllm.{name}")
    log.debug("dbo: vLLM op records: %s", done)
    return done
