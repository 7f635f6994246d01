"""vLLM's MoE layer with dispatch / experts / combine as our ops.

:class:`DboMoERunner` replaces vLLM's ``MoERunner`` (the module every ``FusedMoE(...)`` call
builds) through vLLM's out-of-tree layer registry (``PluggableLayer.register_oot``, done by
the plug-in :func:`dbo_compile.integrations.vllm.register`), so a model needs no edit. With
``backend="dbo"`` in vLLM's compilation config it computes, per MoE layer::

    router_logits            = gate(x)                       (the model's gate, if the runner holds it)
    topk_weights, topk_ids   = router.select_experts(x, router_logits)     (vLLM's router)
    recv_x, recv_ids, recv_w, handle = torch.ops.dbo.moe_dispatch(x, topk_ids, topk_weights, E, ep)
    y                        = torch.ops.dbo.grouped_experts(recv_x, recv_ids, recv_w, w13, w2)
    out                      = torch.ops.dbo.moe_combine(y, topk_ids, topk_weights, recv_ids, recv_w, handle, ep)
    shared                   = shared_experts(x)             (vLLM's shared experts, if any)

on vLLM's own weights (``routed_experts.w13_weight [E_local, 2I, H]`` gate then up,
``w2_weight [E_local, H, I]``: the layout of ``dbo.grouped_experts``; views, no copy), where
``ep`` is vLLM's EP group's device group (Gloo on CPU; ``""``, the local backend, without
EP). The dispatch and combine are then graph nodes the ``dbo`` backend schedules, where
vLLM hides them inside its modular kernel.

A layer the ops cannot serve runs vLLM's own path unchanged, the reason logged once at INFO:
another backend than ``dbo``, an activation other than SiLU-and-mul, quantised or biased
experts, tensor-parallel experts (TP > 1 without EP), an expert placement other than linear
(EP rank ``r`` owning experts ``[r*E/W, (r+1)*E/W)``), EPLB, or a routed input/output
transform.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

import dbo_compile.ops  # noqa: F401  (registers torch.ops.dbo.*)
from dbo_compile.ops.comm import ep_group_name

from vllm.config import get_current_vllm_config
from vllm.distributed import get_ep_group
from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

log = logging.getLogger(__name__)

__all__ = ["DboMoERunner", "dbo_enabled", "model_vllm_config"]

#: the vLLM config the last MoE layer was built under (vLLM compiles the model in its first
#: forward, where no current config is set)
_MODEL_CONFIG: list[Any] = [None]


def model_vllm_config() -> Any:
    """The vLLM config the model's MoE layers were built under (``None``: none built yet)."""
    return _MODEL_CONFIG[0]


def dbo_enabled(vllm_config: Any) -> bool:
    """vLLM compiles with our backend: ``compilation_config.backend`` is ``"dbo"`` or this
    package's backend entry."""
    backend = getattr(getattr(vllm_config, "compilation_config", None), "backend", "") or ""
    return backend == "dbo" or backend.startswith("dbo_compile.")


class DboMoERunner(MoERunner):
    """vLLM's ``MoERunner`` whose routed experts run as ``dbo.moe_dispatch`` /
    ``dbo.grouped_experts`` / ``dbo.moe_combine`` (see the module docstring).

    ``hidden_states [T, H] -> [T, H]`` (vLLM's dtype); with shared experts
    ``(shared [T, H], routed [T, H])`` as vLLM's runner returns them.

    Attributes:
        dbo_reason: why the layer runs vLLM's own path (``None``: our ops).
        ep_group: the EP group name of the comm ops (``""``: one rank, local).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _MODEL_CONFIG[0] = get_current_vllm_config()
        self._dbo_shared = kwargs.get("shared_experts")
        self.dbo_reason = self._why_not_ours(kwargs)
        self.ep_group = ""
        if self.dbo_reason is None:
            pc = self.moe_config.moe_parallel_config
            if pc.use_ep and pc.ep_size > 1:
                self.ep_group = ep_group_name(get_ep_group().device_group)
            self._keep_checkpoint_layout()
        elif dbo_enabled(get_current_vllm_config()):
            log.info("dbo: MoE layer %s runs vLLM's own kernels: %s", self.layer_name,
                     self.dbo_reason)

    def _why_not_ours(self, kwargs: dict[str, Any]) -> str | None:
        cfg = self.moe_config
        pc = cfg.moe_parallel_config
        checks = [
            (not dbo_enabled(get_current_vllm_config()), "the compilation backend is not dbo"),
            (cfg.activation.name.lower() not in ("silu",),
             f"activation {cfg.activation.name} (dbo.grouped_experts serves SiLU-and-mul)"),
            (cfg.has_bias, "experts with biases"),
            (getattr(self.routed_experts, "quant_config", None) is not None, "quantised experts"),
            (pc.tp_size > 1 and not pc.use_ep, "tensor-parallel experts (TP > 1 without EP)"),
            (str(getattr(self.expert_placement_strategy, "value",
                         self.expert_placement_strategy)) != "linear",
             f"expert placement {self.expert_placement_strategy} (dbo.moe_dispatch assumes "
             "linear)"),
            (self.eplb_state is not None, "EPLB"),
            (kwargs.get("routed_input_transform") is not None
             or kwargs.get("routed_output_transform") is not None, "a routed transform"),
            (kwargs.get("shared_expert_gate") is not None, "a shared-expert gate"),
            (cfg.num_experts != cfg.num_local_experts * max(pc.ep_size, 1),
             f"{cfg.num_experts} experts over {pc.ep_size} EP ranks with "
             f"{cfg.num_local_experts} each"),
        ]
        return next((why for bad, why in checks if bad), None)

    def _keep_checkpoint_layout(self) -> None:
        """Our ops read the routed experts' weights in the checkpoint layout (``w13 [E_local,
        2I, H]`` gate then up, ``w2 [E_local, H, I]``); vLLM's post-load processing of them
        (``quant_method.process_weights_after_loading``) rewrites them for its own kernel: on
        CPU a grouped-GEMM prepack and an intermediate-dim padding, on GPU backend-dependent
        shuffles and reorders. The layer never runs that kernel, so the processing is skipped
        for it (no second copy of the weights is kept)."""
        experts = self.routed_experts
        method = experts.quant_method
        original = method.process_weights_after_loading

        def process_weights_after_loading(layer: torch.nn.Module) -> None:
            if layer is not experts:
                original(layer)
                return
            log.debug("dbo: MoE layer %s keeps its checkpoint weight layout (vLLM's %s "
                      "post-load processing skipped)", self.layer_name, type(method).__name__)

        method.process_weights_after_loading = process_weights_after_loading

    def _forward_impl(self, hidden_states: torch.Tensor, router_logits: torch.Tensor,
                      shared_experts_input: torch.Tensor | None,
                      input_ids: torch.Tensor | None = None) -> Any:
        if self.dbo_reason is not None:
            return super()._forward_impl(hidden_states, router_logits, shared_experts_input,
                                         input_ids)
        if self.gate is not None:
            router_logits, _ = self.gate(hidden_states)
        topk_weights, topk_ids = self.router.select_experts(
            hidden_states=hidden_states, router_logits=router_logits,
            topk_indices_dtype=None, input_ids=input_ids)
        experts = self.routed_experts
        recv_x, recv_ids, recv_w, handle = torch.ops.dbo.moe_dispatch(
            hidden_states, topk_ids.to(torch.int64), topk_weights.to(torch.float32),
            self.moe_config.num_experts, self.ep_group)
        y = torch.ops.dbo.grouped_experts(recv_x, recv_ids, recv_w, experts.w13_weight,
                                          experts.w2_weight)
        routed = torch.ops.dbo.moe_combine(y, topk_ids.to(torch.int64),
                                           topk_weights.to(torch.float32), recv_ids, recv_w,
                                           handle, self.ep_group)
        if self._dbo_shared is None:
            return routed
        shared_in = hidden_states if shared_experts_input is None else shared_experts_input
        return self._dbo_shared(shared_in), routed
