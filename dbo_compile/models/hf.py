"""Expert parallelism for Hugging Face transformers MoE models, with our dispatch/combine ops.

:func:`make_expert_parallel` takes an already-built transformers MoE model (``from_pretrained``
or ``from_config``: weights load the normal way) and an EP process group, and replaces every
sparse-MoE block in place by an :class:`EPMoEBlock` that

1. routes with the block's own router module (the same object: its weights, its softmax /
   sigmoid / top-k / normalisation code, and the ``router_logits`` output recording keep
   working),
2. moves tokens with ``torch.ops.dbo.moe_dispatch`` / ``torch.ops.dbo.moe_combine`` (the
   MoE-layer contract of :mod:`dbo_compile.ops.comm`: any comm backend, DeepEP included),
3. computes this rank's share of the experts as one ``torch.ops.dbo.grouped_experts`` call on
   the received rows (torch's grouped GEMM or DeepGEMM, ``DboConfig.experts_backend``), on the
   family's own expert tensors (views, no copy): SwiGLU for Qwen3-MoE / Mixtral / DeepSeek-V3,
   GPT-OSS's clamped GLU with biases (``activation="gpt_oss"``); an activation the op does not
   know runs the dense masked loop over the local experts with the family's own code,
4. adds the shared experts (DeepSeek-V3) on the local tokens, and returns what the decoder
   layer expects (GPT-OSS: ``(hidden, router_scores)``).

Attention, norms, rotary embeddings, masks and caches stay the transformers code.

Supported families (transformers 5.x layout: routed experts stored as fused 3-D tensors in an
``*Experts`` module, routing in a ``*TopKRouter`` module):

=============  ==========================  ===============  ================================
model_type     sparse-MoE block            router           routing rule (the router's code)
=============  ==========================  ===============  ================================
qwen3_moe      Qwen3MoeSparseMoeBlock      ``gate``         softmax, top-k, opt. renormalise
mixtral        MixtralSparseMoeBlock       ``gate``         softmax, top-k, renormalise
deepseek_v3    DeepseekV3MoE (+ shared)    ``gate``         sigmoid + bias, group-limited
                                                            top-k, renormalise, scale
gpt_oss        GptOssMLP                   ``router``       top-k of logits, softmax
=============  ==========================  ===============  ================================

Expert sharding is contiguous, as the dispatch op expects: EP rank ``r`` of ``W`` keeps global
experts ``[r*E/W, (r+1)*E/W)``; ``E % W != 0`` is an error.

Layout: the decoder works on ``[batch, seq, hidden]``; the block flattens to
``[batch*seq, hidden]`` (batch-major, so the first ``b`` requests are the first ``b*seq`` rows)
before dispatch. Under ``torch.compile(backend="dbo")`` the split is along dim 0 of
``input_ids [batch, seq]``, i.e. by requests; mark that dim dynamic
(``torch._dynamo.mark_dynamic(input_ids, 0)`` or ``dynamic=True``) so that transformers'
``view(batch_size, ...)`` calls stay symbolic.

Example::

    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    model = Qwen3MoeForCausalLM.from_pretrained(...).eval()   # every rank loads the model
    model = make_expert_parallel(model, dist.group.WORLD)    # keeps this rank's experts
    compiled = torch.compile(model, backend="dbo", options={"split": "always"})
    torch._dynamo.mark_dynamic(input_ids, 0)                  # input_ids: [batch, seq] int64
    logits = compiled(input_ids=input_ids, use_cache=False).logits

transformers is imported lazily (optional extra ``dbo_compile[hf]``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import dbo_compile.ops  # noqa: F401  (registers torch.ops.dbo.*)
from dbo_compile.errors import UnsupportedModelError
from dbo_compile.ops.comm import ep_group_name

log = logging.getLogger(__name__)

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "EPMoEBlock",
    "UnsupportedModelError",
    "make_expert_parallel",
]


def _is_silu(act: Any) -> bool:
    return act is F.silu or type(act).__name__ in ("SiLU", "SiLUActivation")


def _swiglu_grouped(experts: nn.Module) -> dict[str, Any] | None:
    """``dbo.grouped_experts`` arguments of a SwiGLU family's experts (``gate_up_proj [E, 2I,
    H]``, ``down_proj [E, H, I]``: the op's layout), ``None`` for an activation it lacks."""
    if not _is_silu(experts.act_fn):
        return None
    return {"w13": experts.gate_up_proj, "w2": experts.down_proj}


def _gpt_oss_grouped(experts: nn.Module) -> dict[str, Any]:
    """GPT-OSS's experts as ``dbo.grouped_experts`` arguments: transposed views of its weights
    (``[E, H, 2I]`` -> ``[E, 2I, H]``), its biases, its clamped GLU over interleaved columns."""
    return {"w13": experts.gate_up_proj.transpose(1, 2), "w2": experts.down_proj.transpose(1, 2),
            "activation": "gpt_oss", "b13": experts.gate_up_proj_bias,
            "b2": experts.down_proj_bias, "alpha": float(experts.alpha),
            "limit": float(experts.limit)}


def _swiglu_rows(experts: nn.Module, x: torch.Tensor, e: int) -> torch.Tensor:
    """Qwen3-MoE / Mixtral / DeepSeek-V3 expert ``e``: ``gate_up_proj [E, 2I, H]``,
    ``down_proj [E, H, I]``, ``act_fn(gate) * up``. ``x [N, H] -> [N, H]`` (x.dtype)."""
    gate, up = F.linear(x, experts.gate_up_proj[e]).chunk(2, dim=-1)
    return F.linear(experts.act_fn(gate) * up, experts.down_proj[e])


def _gpt_oss_rows(experts: nn.Module, x: torch.Tensor, e: int) -> torch.Tensor:
    """GPT-OSS expert ``e``: transposed weights with biases (``gate_up_proj [E, H, 2I]``,
    ``down_proj [E, I, H]``), the family's clamped gate (``experts._apply_gate``)."""
    gate_up = x @ experts.gate_up_proj[e] + experts.gate_up_proj_bias[e]
    return experts._apply_gate(gate_up) @ experts.down_proj[e] + experts.down_proj_bias[e]


@dataclass(frozen=True)
class _Family:
    """What we need to know about one transformers MoE family.

    Attributes:
        model_type: ``config.model_type``.
        block_class: class name of the sparse-MoE block the decoder layer holds as ``mlp``.
        router_attr: attribute of the block holding the router module.
        router_class: class name of the router module (returns ``(logits, weights, ids)``).
        expert_params: names of the expert parameters (leading dim = expert), sliced per rank.
        expert_rows: ``(experts_module, x [N, H], local expert index) -> [N, H]`` (the dense
            masked loop, for an activation ``dbo.grouped_experts`` does not know).
        grouped: ``(experts_module) -> dbo.grouped_experts arguments`` (weights, activation,
            biases), or ``None`` when they do not fit the op.
        shared_attr: attribute of the shared experts (added on the local tokens), or ``None``.
        returns_router_scores: the block returns ``(hidden, router_scores)`` (GPT-OSS).
    """

    model_type: str
    block_class: str
    router_attr: str
    router_class: str
    expert_params: tuple[str, ...]
    expert_rows: Callable[[nn.Module, torch.Tensor, int], torch.Tensor]
    grouped: Callable[[nn.Module], dict[str, Any] | None]
    shared_attr: str | None = None
    returns_router_scores: bool = False


_SWIGLU_PARAMS = ("gate_up_proj", "down_proj")
_FAMILIES: dict[str, _Family] = {
    f.model_type: f
    for f in (
        _Family("qwen3_moe", "Qwen3MoeSparseMoeBlock", "gate", "Qwen3MoeTopKRouter",
                _SWIGLU_PARAMS, _swiglu_rows, _swiglu_grouped),
        _Family("mixtral", "MixtralSparseMoeBlock", "gate", "MixtralTopKRouter",
                _SWIGLU_PARAMS, _swiglu_rows, _swiglu_grouped),
        _Family("deepseek_v3", "DeepseekV3MoE", "gate", "DeepseekV3TopkRouter",
                _SWIGLU_PARAMS, _swiglu_rows, _swiglu_grouped, shared_attr="shared_experts"),
        _Family("gpt_oss", "GptOssMLP", "router", "GptOssTopKRouter",
                ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"),
                _gpt_oss_rows, _gpt_oss_grouped, returns_router_scores=True),
    )
}
#: ``config.model_type`` values :func:`make_expert_parallel` accepts.
SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(sorted(_FAMILIES))


class EPMoEBlock(nn.Module):
    """An expert-parallel sparse-MoE block: ``[B, S, H] -> [B, S, H]`` (GPT-OSS: a tuple with
    the router scores ``[B*S, K]``, as the original block returns).

    The child modules keep the original names, so ``state_dict`` keys are unchanged; only the
    routed-expert tensors are cut to this rank's ``E_local = E / W`` experts.

    Attributes:
        <router_attr>: the original router module (all ``E`` experts).
        experts: the original experts module with its expert tensors sliced to
            ``[E_local, ...]`` (its ``forward`` is not used: it selects tokens with
            data-dependent ``nonzero``/``index_add_``).
        shared_experts: DeepSeek-V3 only, the original shared-expert MLP.
        num_experts: global routed experts ``E``.
        num_local_experts: ``E_local``.
        ep_rank, ep_size: this rank and ``W``.
        group_name: EP process group name for the comm ops (``""`` = one rank, local).
    """

    def __init__(self, block: nn.Module, family: _Family, ep_rank: int, ep_size: int,
                 group_name: str) -> None:
        super().__init__()
        router = getattr(block, family.router_attr)
        experts = block.experts
        num_experts = int(router.num_experts)
        self.family = family
        self.router_attr = family.router_attr
        self.num_experts = num_experts
        self.top_k = int(router.top_k)
        self.ep_rank, self.ep_size, self.group_name = ep_rank, ep_size, group_name
        self.num_local_experts = num_experts // ep_size
        self.training = block.training
        self.jitter_noise = float(getattr(block, "jitter_noise", 0.0) or 0.0)
        start, stop = self.local_expert_range
        with torch.no_grad():
            for name in family.expert_params:
                full = getattr(experts, name)
                setattr(experts, name, nn.Parameter(full.detach()[start:stop].clone(),
                                                    requires_grad=full.requires_grad))
        experts.num_experts = self.num_local_experts
        self.add_module(family.router_attr, router)
        self.experts = experts
        if family.shared_attr is not None:
            self.add_module(family.shared_attr, getattr(block, family.shared_attr))

    @property
    def local_expert_range(self) -> tuple[int, int]:
        """Global ids ``[start, stop)`` of the routed experts this EP rank keeps."""
        return self.ep_rank * self.num_local_experts, (self.ep_rank + 1) * self.num_local_experts

    def extra_repr(self) -> str:
        start, stop = self.local_expert_range
        return (f"family={self.family.model_type}, experts=[{start}, {stop}) of "
                f"{self.num_experts}, top_k={self.top_k}, ep_rank={self.ep_rank}/{self.ep_size}")

    def _local_experts(self, recv_x: torch.Tensor, recv_ids: torch.Tensor,
                       recv_w: torch.Tensor) -> torch.Tensor:
        """This rank's experts on the dispatch's receive layout: one ``dbo.grouped_experts``
        call (grouped GEMM) on the family's expert tensors; for an activation the op lacks,
        the dense masked loop (:meth:`_dense_experts`, rank-major rows only).

        Args:
            recv_x: ``[N, H]`` received activations (``N = W * T``; rank-major), or
                ``[E_local, M, H]`` (expert-major, DeepEP low-latency).
            recv_ids: ``[N, K]`` int64 local expert ids (``-1``: not on this rank), or
                ``[E_local]`` int32 valid rows per expert.
            recv_w: ``[N, K]`` float32 routing weights (0 where the id is ``-1``), or the
                dispatch's row ranges.

        Returns:
            rank-major ``[N, H]`` of ``recv_x.dtype``: ``sum_k w_k * expert_{id_k}(x)``,
            accumulated in float32; expert-major ``[E_local, M, H]`` unweighted.

        Raises:
            UnsupportedModelError: expert-major rows with an activation the op lacks.
        """
        grouped = self.family.grouped(self.experts)
        if grouped is not None:
            return torch.ops.dbo.grouped_experts(recv_x, recv_ids, recv_w, **grouped)
        if recv_x.dim() != 2:
            raise UnsupportedModelError(
                f"{self.family.block_class}: act_fn {type(self.experts.act_fn).__name__} is "
                "not one dbo.grouped_experts computes, and the dense loop needs rank-major rows "
                "(use comm_backend='torch')")
        return self._dense_experts(recv_x, recv_ids, recv_w)

    def _dense_experts(self, recv_x: torch.Tensor, recv_ids: torch.Tensor,
                       recv_w: torch.Tensor) -> torch.Tensor:
        """Every local expert on every received row, masked: ``[N, H]``, accumulated in
        float32 over the local experts in ascending order."""
        y = torch.zeros_like(recv_x, dtype=torch.float32)
        for e in range(self.num_local_experts):
            w_e = (recv_w * (recv_ids == e)).sum(dim=-1, keepdim=True)  # [N, 1] fp32
            out = self.family.expert_rows(self.experts, recv_x, e)
            y = y + w_e * out.to(torch.float32)
        return y.to(recv_x.dtype)

    def forward(self, hidden_states: torch.Tensor) -> Any:
        if self.training and self.jitter_noise > 0:
            raise UnsupportedModelError(
                f"{self.family.block_class}: router jitter noise in training mode is not "
                "supported by the expert-parallel block; call model.eval()")
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])  # [B*S, H]: batch-major rows
        _, topk_w, topk_ids = getattr(self, self.router_attr)(x)
        ids, weights = topk_ids.to(torch.int64), topk_w.to(torch.float32)
        recv_x, recv_ids, recv_w, handle = torch.ops.dbo.moe_dispatch(
            x, ids, weights, self.num_experts, self.group_name)
        y = self._local_experts(recv_x, recv_ids, recv_w)
        out = torch.ops.dbo.moe_combine(y, ids, weights, recv_ids, recv_w, handle,
                                        self.group_name).reshape(shape)
        if self.family.shared_attr is not None:
            out = out + getattr(self, self.family.shared_attr)(hidden_states)
        if self.family.returns_router_scores:
            return out, topk_w
        return out


def _group_rank_size(group: dist.ProcessGroup | None) -> tuple[int, int, str]:
    name = ep_group_name(group)
    if name == "":
        return 0, 1, ""
    return group.rank(), group.size(), name


def _check_block(block: nn.Module, family: _Family, path: str) -> None:
    router = getattr(block, family.router_attr, None)
    if router is None or type(router).__name__ != family.router_class:
        raise UnsupportedModelError(
            f"{path} ({type(block).__name__}) has no router module {family.router_attr!r} of "
            f"class {family.router_class} (found {type(router).__name__}); this transformers "
            "version's layout is not supported (needs transformers >= 5)")
    for attr in ("num_experts", "top_k"):
        if not isinstance(getattr(router, attr, None), int):
            raise UnsupportedModelError(f"{path}.{family.router_attr} has no int {attr!r}")
    experts = getattr(block, "experts", None)
    if experts is None or isinstance(experts, nn.ModuleList):
        raise UnsupportedModelError(
            f"{path}.experts is {type(experts).__name__}: routed experts stored as a list of "
            "per-expert modules (transformers < 5) are not supported; need fused 3-D expert "
            f"tensors {family.expert_params}")
    for name in family.expert_params:
        p = getattr(experts, name, None)
        if not isinstance(p, torch.Tensor) or p.dim() < 2 or p.shape[0] != router.num_experts:
            raise UnsupportedModelError(
                f"{path}.experts.{name} is missing or not [num_experts={router.num_experts}, ...] "
                f"(found {None if p is None else tuple(p.shape)})")
    if family.expert_rows is _swiglu_rows and not callable(getattr(experts, "act_fn", None)):
        raise UnsupportedModelError(f"{path}.experts has no act_fn")
    if family.expert_rows is _gpt_oss_rows and not callable(getattr(experts, "_apply_gate", None)):
        raise UnsupportedModelError(f"{path}.experts has no _apply_gate")
    if family.shared_attr is not None and getattr(block, family.shared_attr, None) is None:
        raise UnsupportedModelError(f"{path} has no {family.shared_attr!r} module")


def make_expert_parallel(model: nn.Module, group: dist.ProcessGroup | None) -> nn.Module:
    """Make a transformers MoE model expert-parallel over ``group``, in place.

    Every sparse-MoE block (see the module docstring for the families) is replaced by an
    :class:`EPMoEBlock` keeping this rank's contiguous share of the routed experts; everything
    else (attention, norms, dense layers, caches, weights of the router and shared experts)
    is left as it is.

    Args:
        model: a built transformers model (``*ForCausalLM`` or the base ``*Model``) whose
            ``config.model_type`` is one of :data:`SUPPORTED_MODEL_TYPES`, with all ``E``
            experts loaded on every rank (the other ranks' experts are freed).
        group: the EP process group; ``None`` or a group of size 1 keeps every expert and the
            comm ops run locally.

    Returns:
        ``model`` (modified in place; ``model.config`` unchanged).

    Raises:
        UnsupportedModelError: unknown family, a block/router/expert layout this module does not
            know (e.g. transformers < 5 per-expert ``nn.ModuleList``), no MoE block found, the
            model is already expert-parallel, or ``E`` is not divisible by the EP world size.
    """
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in _FAMILIES:
        raise UnsupportedModelError(
            f"{type(model).__name__} (config.model_type={model_type!r}) is not a supported MoE "
            f"family; supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}")
    family = _FAMILIES[model_type]
    if any(isinstance(m, EPMoEBlock) for m in model.modules()):
        raise UnsupportedModelError(f"{type(model).__name__} is already expert-parallel")
    rank, size, group_name = _group_rank_size(group)
    targets = [(name, m) for name, m in model.named_modules()
               if type(m).__name__ == family.block_class]
    if not targets:
        raise UnsupportedModelError(
            f"{type(model).__name__}: no {family.block_class} module found (model_type "
            f"{model_type!r}); this layout is not supported")
    for path, block in targets:
        _check_block(block, family, path)
        num_experts = getattr(block, family.router_attr).num_experts
        if num_experts % size:
            raise UnsupportedModelError(
                f"{path}: {num_experts} routed experts are not divisible by the EP world size "
                f"{size}; choose an EP size that divides the expert count")
    for path, block in targets:
        parent_path, _, attr = path.rpartition(".")
        parent = model.get_submodule(parent_path)
        setattr(parent, attr, EPMoEBlock(block, family, rank, size, group_name))
    log.info("dbo: %s: %d %s blocks made expert-parallel (EP rank %d of %d)",
             type(model).__name__, len(targets), family.block_class, rank, size)
    return model
