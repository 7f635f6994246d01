"""Reference DeepSeek-style MoE decoder in the flattened-token layout ``[num_tokens, hidden]``.

Each layer: RMSNorm -> attention (q/k/v projections, RoPE, ``dbo.attention`` over a paged KV
cache, o_proj) -> residual -> RMSNorm -> MoE (softmax gate, top-k, ``dbo.moe_dispatch``, local
experts as ``dbo.grouped_experts`` on the dispatch's receive layout, ``dbo.moe_combine``, plus
shared experts on the same input) -> residual: the MoE-layer contract of
:mod:`dbo_compile.ops.comm`, so that any comm backend (torch, DeepEP) and experts backend
(torch, DeepGEMM) can run it. The first
``first_k_dense_replace`` layers use a dense SwiGLU MLP instead of MoE, as in DeepSeek-V2/V3.
(Attention is plain GQA, not MLA: what matters here is the MoE all-to-all.)

``forward`` is written for re-tracing with a symbolic token dim ``T``: every op is row-local
along dim 0 of token-indexed tensors, no size from ``.shape`` becomes a Python int in a view, no
``.item()`` / ``.tolist()``, no branch on tensor values, only the tensor fields of the metadata
are read, and the only in-place write is the KV-cache write inside ``dbo.attention``.

Expert parallelism: with an EP group of world size ``W`` rank ``r`` keeps global experts
``[r*E_local, (r+1)*E_local)``. Parameters are a deterministic function of ``seed`` and the
parameter name (never of the rank): expert weights are generated for all experts and sliced, so
an EP model and the ``ep_group=None`` model built with the same seed compute the same function.

Example::

    cfg = get_config("tiny")
    model = DeepseekMoEModel(cfg, ep_group=group, seed=0)
    model.allocate_kv_cache(num_blocks=64, block_size=16)
    step = make_step(cfg, decode_context_lens=[200, 37], prefills=[(0, 9)], pad_to=16)
    fill_kv_cache(model, step, seed=1)
    logits = model(step.input_ids, step.positions, step.attn_metadata)   # [T, vocab] fp32
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import zlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import dbo_compile.ops  # noqa: F401  (registers torch.ops.dbo.*)
from dbo_compile.errors import ModelConfigError
from dbo_compile.ops.attention import check_metadata_shapes
from dbo_compile.ops.comm import ep_group_name
from dbo_compile.ops.emulated import EmulatedWorld, register_emulated
from dbo_compile.metadata import AttentionMetadata

log = logging.getLogger(__name__)

__all__ = [
    "PRESETS",
    "DeepseekConfig",
    "DeepseekMoEModel",
    "ModelConfigError",
    "get_config",
]


@dataclass(frozen=True)
class DeepseekConfig:
    """Shape of a DeepSeek-style MoE decoder.

    Attributes:
        vocab_size: vocabulary size (rows of the embedding, columns of the logits).
        hidden_size: model width ``H``.
        num_layers: decoder layers.
        num_heads: query heads ``Hq``.
        num_kv_heads: key/value heads ``Hkv`` (``Hq % Hkv == 0``).
        head_dim: per-head width ``D`` (even, for RoPE).
        moe_intermediate_size: width ``I`` of each routed / shared expert.
        num_experts: routed experts ``E`` (global, over all EP ranks).
        top_k: experts per token ``K``.
        num_shared_experts: shared experts, fused as one SwiGLU of width ``I * num_shared``.
        rms_eps: RMSNorm epsilon.
        rope_theta: RoPE base.
        norm_topk_prob: renormalise the top-k weights to sum to 1.
        routed_scaling_factor: multiplies the routed experts' output.
        first_k_dense_replace: the first this many layers use a dense MLP instead of MoE.
        intermediate_size: width of the dense MLP of those layers.
    """

    vocab_size: int = 128
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    moe_intermediate_size: int = 32
    num_experts: int = 8
    top_k: int = 2
    num_shared_experts: int = 1
    rms_eps: float = 1e-6
    rope_theta: float = 10000.0
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    first_k_dense_replace: int = 0
    intermediate_size: int = 128

    def __post_init__(self) -> None:
        ints = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                "head_dim", "moe_intermediate_size", "num_experts", "top_k")
        for name in ints:
            if getattr(self, name) <= 0:
                raise ModelConfigError(f"DeepseekConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ModelConfigError(
                f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise ModelConfigError(f"head_dim={self.head_dim} must be even (RoPE)")
        if self.top_k > self.num_experts:
            raise ModelConfigError(f"top_k={self.top_k} > num_experts={self.num_experts}")
        if not 0 <= self.first_k_dense_replace <= self.num_layers:
            raise ModelConfigError(
                f"first_k_dense_replace={self.first_k_dense_replace} not in [0, {self.num_layers}]")

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.first_k_dense_replace


PRESETS: dict[str, DeepseekConfig] = {
    "tiny": DeepseekConfig(),
    # DeepSeek-V2-Lite (MLA replaced by GQA attention of the same width)
    "deepseek-v2-lite": DeepseekConfig(
        vocab_size=102400, hidden_size=2048, num_layers=27, num_heads=16, num_kv_heads=16,
        head_dim=128, moe_intermediate_size=1408, num_experts=64, top_k=6,
        num_shared_experts=2, norm_topk_prob=False, routed_scaling_factor=1.0,
        first_k_dense_replace=1, intermediate_size=10944,
    ),
    # DeepSeek-V3 (MLA -> GQA; softmax gate instead of sigmoid + bias routing)
    "deepseek-v3": DeepseekConfig(
        vocab_size=129280, hidden_size=7168, num_layers=61, num_heads=128, num_kv_heads=128,
        head_dim=128, moe_intermediate_size=2048, num_experts=256, top_k=8,
        num_shared_experts=1, norm_topk_prob=True, routed_scaling_factor=2.5,
        first_k_dense_replace=3, intermediate_size=18432,
    ),
}


def get_config(name: str, **overrides: Any) -> DeepseekConfig:
    """The preset ``name`` with fields replaced by ``overrides``.

    Raises:
        ModelConfigError: unknown preset or field name, or an invalid resulting config.
    """
    if name not in PRESETS:
        raise ModelConfigError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    fields = {f.name for f in dataclasses.fields(DeepseekConfig)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ModelConfigError(f"unknown DeepseekConfig fields {unknown}; valid: {sorted(fields)}")
    return dataclasses.replace(PRESETS[name], **overrides)


# --------------------------------------------------------------------------------------------
# Layers
# --------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """Row-wise RMSNorm over the last dim, computed in fp32, returned in the input dtype."""

    def __init__(self, hidden: int, eps: float, dtype: torch.dtype, device: Any) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.to(torch.float32)
        xf = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return (xf * self.weight.to(torch.float32)).to(x.dtype)


def _swiglu(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """``x [N, H]``, ``w13 [2I, H]``, ``w2 [H, I]`` -> ``[N, H]``."""
    gate, up = F.linear(x, w13).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w2)


class SwiGLUMLP(nn.Module):
    """Dense SwiGLU MLP (shared experts and dense layers): ``[T, H] -> [T, H]``."""

    def __init__(self, hidden: int, intermediate: int, dtype: torch.dtype, device: Any) -> None:
        super().__init__()
        self.w13 = nn.Parameter(torch.empty(2 * intermediate, hidden, dtype=dtype, device=device))
        self.w2 = nn.Parameter(torch.empty(hidden, intermediate, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _swiglu(x, self.w13, self.w2)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX-style rotary embedding. ``x [T, heads, D]``, ``cos/sin [T, 1, D/2]`` fp32."""
    xf = x.to(torch.float32)
    x1, x2 = xf.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class Attention(nn.Module):
    """GQA attention over a paged KV cache (``dbo.attention``). ``[T, H] -> [T, H]``.

    The KV cache is the non-persistent buffer ``kv_cache`` ``[2, num_blocks, block_size, Hkv,
    D]``, ``None`` until :meth:`DeepseekMoEModel.allocate_kv_cache`.
    """

    def __init__(self, cfg: DeepseekConfig, dtype: torch.dtype, device: Any) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.scale = cfg.head_dim ** -0.5
        h, d = cfg.hidden_size, cfg.head_dim
        mk = lambda o, i: nn.Parameter(torch.empty(o, i, dtype=dtype, device=device))  # noqa: E731
        self.q_proj = mk(cfg.num_heads * d, h)
        self.k_proj = mk(cfg.num_kv_heads * d, h)
        self.v_proj = mk(cfg.num_kv_heads * d, h)
        self.o_proj = mk(h, cfg.num_heads * d)
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)
        self.register_buffer("kv_cache", None, persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        if self.kv_cache is None:
            raise ModelConfigError("KV cache not allocated: call model.allocate_kv_cache() first")
        q = F.linear(x, self.q_proj).view(-1, self.num_heads, self.head_dim)
        k = F.linear(x, self.k_proj).view(-1, self.num_kv_heads, self.head_dim)
        v = F.linear(x, self.v_proj).view(-1, self.num_kv_heads, self.head_dim)
        freqs = positions.to(torch.float32).unsqueeze(-1) * self.inv_freq  # [T, D/2]
        cos, sin = freqs.cos().unsqueeze(1), freqs.sin().unsqueeze(1)
        q, k = _apply_rope(q, cos, sin), _apply_rope(k, cos, sin)
        o = torch.ops.dbo.attention(
            q, k, v, self.kv_cache, md.slot_mapping, md.query_start_loc, md.seq_lens,
            md.block_table, self.scale,
        )
        return F.linear(o.reshape(-1, self.num_heads * self.head_dim), self.o_proj)


class MoE(nn.Module):
    """Routed experts (EP-sharded) + shared experts. ``[T, H] -> [T, H]``.

    Local expert weights are stacked (``w13 [E_local, 2I, H]``, ``w2 [E_local, H, I]``) so a
    grouped GEMM can replace the per-expert loop.
    """

    def __init__(self, cfg: DeepseekConfig, ep_rank: int, ep_size: int, group_name: str,
                 dtype: torch.dtype, device: Any, comm_backend: str = "") -> None:
        super().__init__()
        self.num_experts, self.top_k = cfg.num_experts, cfg.top_k
        self.norm_topk_prob = cfg.norm_topk_prob
        self.routed_scaling_factor = cfg.routed_scaling_factor
        self.ep_rank, self.ep_size, self.group_name = ep_rank, ep_size, group_name
        self.comm_backend = comm_backend
        self.num_local_experts = cfg.num_experts // ep_size
        h, i, el = cfg.hidden_size, cfg.moe_intermediate_size, self.num_local_experts
        self.gate = nn.Parameter(torch.empty(cfg.num_experts, h, dtype=dtype, device=device))
        self.w13 = nn.Parameter(torch.empty(el, 2 * i, h, dtype=dtype, device=device))
        self.w2 = nn.Parameter(torch.empty(el, h, i, dtype=dtype, device=device))
        self.shared_experts = (
            SwiGLUMLP(h, i * cfg.num_shared_experts, dtype, device)
            if cfg.num_shared_experts > 0 else None
        )

    def experts(self, recv_x: torch.Tensor, recv_ids: torch.Tensor,
                recv_w: torch.Tensor) -> torch.Tensor:
        """Local experts on the dispatch's receive layout (``dbo.grouped_experts``: grouped
        GEMM on CUDA, the reference loop elsewhere): rank-major ``recv_x [N, H]``, ``recv_ids
        [N, K]`` int64 local ids (-1 = not here), ``recv_w [N, K]`` fp32 -> ``[N, H]``
        weighted; expert-major ``recv_x [E_local, M, H]``, ``recv_ids [E_local]`` int32 valid
        rows -> ``[E_local, M, H]`` unweighted (:mod:`dbo_compile.ops.comm`)."""
        return torch.ops.dbo.grouped_experts(recv_x, recv_ids, recv_w, self.w13, self.w2)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Softmax gate and top-k: ``x [T, H]`` -> ``(topk_w [T, K] fp32, topk_ids [T, K]
        int64)`` (global expert ids). Subclasses may observe the routing here (an EPLB-style
        load counter)."""
        logits = F.linear(x, self.gate).to(torch.float32)  # [T, E]
        probs = torch.softmax(logits, dim=-1)
        # unsorted: the slots' order is never read (every consumer sums over them), and on
        # CUDA the sort is a kernel of its own (bitonicSortKVInPlace, 4.4 µs per call at decode)
        topk_w, topk_ids = torch.topk(probs, self.top_k, dim=-1, sorted=False)
        if self.norm_topk_prob:
            topk_w = topk_w / topk_w.sum(dim=-1, keepdim=True)
        return topk_w, topk_ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        topk_w, topk_ids = self.route(x)
        # an emulated world names its backend instance (ops.emulated); else the op's own
        backend = {"backend": self.comm_backend} if self.comm_backend else {}
        recv_x, recv_ids, recv_w, handle = torch.ops.dbo.moe_dispatch(
            x, topk_ids, topk_w, self.num_experts, self.group_name, **backend)
        y = self.experts(recv_x, recv_ids, recv_w)
        out = torch.ops.dbo.moe_combine(y, topk_ids, topk_w, recv_ids, recv_w, handle,
                                        self.group_name, **backend)
        if self.routed_scaling_factor != 1.0:
            out = out * self.routed_scaling_factor
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


class _LayerMetadata:
    """The attention-metadata fields a decoder layer reads (the tensors a compile region takes:
    Dynamo reuses a region's trace only for inputs that are tensors, SymInts, constants or
    modules, and an :class:`AttentionMetadata` is none of them)."""

    def __init__(self, slot_mapping: torch.Tensor, query_start_loc: torch.Tensor,
                 seq_lens: torch.Tensor, block_table: torch.Tensor) -> None:
        self.slot_mapping, self.query_start_loc = slot_mapping, query_start_loc
        self.seq_lens, self.block_table = seq_lens, block_table


def _decoder_layer(layer: "DecoderLayer", x: torch.Tensor, positions: torch.Tensor,
                   slot_mapping: torch.Tensor, query_start_loc: torch.Tensor,
                   seq_lens: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    md = _LayerMetadata(slot_mapping, query_start_loc, seq_lens, block_table)
    x = x + layer.self_attn(layer.input_layernorm(x), positions, md)
    return x + layer.mlp(layer.post_attention_layernorm(x))


#: the decoder layer as a compile region where Dynamo reuses a region's trace (torch >= 2.13,
#: ``torch._dynamo.variables.invoke_subgraph``: traced once, the later calls stamped out);
#: ``None`` where it does not (an older Dynamo traces every call into a subgraph of its own,
#: slower than the flat trace)
_decoder_layer_region = (
    # a trace per distinct layer (constants it reads differ: a per-layer index, scale), past
    # Dynamo's default of 8 variants too, where a region would raise
    torch.compiler.nested_compile_region(_decoder_layer, max_reuse_entries=1 << 16)
    if importlib.util.find_spec("torch._dynamo.variables.invoke_subgraph") is not None else None)


def _use_region() -> bool:
    """Read while Dynamo traces (a constant of the trace): the region where it pays and is
    safe. Not under ``assume_static_by_default=False`` (``torch.compile(dynamic=True)``):
    Dynamo then passes float attributes (a norm's eps) as tensors, and its stamp-out of the
    reused region hands the later calls the float instead (torch 2.13)."""
    return (_decoder_layer_region is not None and torch.compiler.is_compiling()
            and torch._dynamo.config.assume_static_by_default)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DeepseekConfig, layer_idx: int, ep_rank: int, ep_size: int,
                 group_name: str, dtype: torch.dtype, device: Any, comm_backend: str = "") -> None:
        super().__init__()
        self.compile_region = True  # DeepseekMoEModel(compile_regions=...)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps, dtype, device)
        self.self_attn = Attention(cfg, dtype, device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps, dtype, device)
        if layer_idx < cfg.first_k_dense_replace:
            self.mlp: nn.Module = SwiGLUMLP(cfg.hidden_size, cfg.intermediate_size, dtype, device)
        else:
            self.mlp = MoE(cfg, ep_rank, ep_size, group_name, dtype, device, comm_backend)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        """``x [T, H]`` -> ``[T, H]``. Under Dynamo a compile region (:func:`_use_region`): one
        layer of each kind is traced and the trace reused for the others (61 layers: 3.4 s of
        Dynamo on our 2-core CPU instead of 9.6 s, ``benchmarks/compile_time.py``); the
        backend inlines the calls (:func:`dbo_compile.lowering.inline_regions`)."""
        layer = _decoder_layer
        if self.compile_region and _use_region():
            # outside the region: the metadata's sizes become expressions of the token and
            # request symbols before the region is traced (check_metadata_shapes says why)
            check_metadata_shapes(x.shape[0], md.slot_mapping, md.query_start_loc,
                                  md.seq_lens, md.block_table)
            layer = _decoder_layer_region
        return layer(self, x, positions, md.slot_mapping, md.query_start_loc, md.seq_lens,
                     md.block_table)


# --------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------


class DeepseekMoEModel(nn.Module):
    """DeepSeek-style MoE decoder: ``(input_ids [T], positions [T], metadata) -> logits [T, V]``.

    Args:
        config: the model shape.
        ep_group: EP process group; ``None`` (or world size 1) keeps all experts locally and the
            comm ops run locally (group name ``""``).
        dtype: parameter and activation dtype (logits are always fp32).
        device: where parameters live; ``"meta"`` builds without allocating or initialising.
        seed: parameters are a deterministic function of ``seed`` and their names, independent
            of the EP rank.
        emulated_world_size: this model is rank 0 of an emulated EP world of that many ranks
            on one device (:mod:`dbo_compile.ops.emulated`; no ``ep_group``): it holds the
            ``E / W`` experts of rank 0 and its comm ops name the emulated backend's instance
            for ``W`` (default link figures; ``comm_backend="emulated"`` re-binds the config's).
            The whole step equals :meth:`emulated_reference` run unsplit.
        compile_regions: under Dynamo each decoder layer is a compile region (one layer of
            each kind traced, the trace reused: :meth:`DecoderLayer.forward`). ``False`` traces
            every layer: for a layer that breaks the graph (a host read, a ``print`` in a
            subclass's ``route``), which a region refuses (``UncapturedHigherOrderOpError``).

    Raises:
        ModelConfigError: ``config.num_experts`` is not divisible by the EP world size, or
            both ``ep_group`` and ``emulated_world_size`` are given.
    """

    def __init__(self, config: DeepseekConfig, ep_group: dist.ProcessGroup | None = None,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 seed: int = 0, emulated_world_size: int | None = None,
                 compile_regions: bool = True) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.ep_group = ep_group
        self.group_name = ep_group_name(ep_group)
        self.ep_size = 1 if self.group_name == "" else ep_group.size()
        self.ep_rank = 0 if self.group_name == "" else ep_group.rank()
        self.emulated_world_size = emulated_world_size
        backend = ""
        if emulated_world_size is not None:
            if self.group_name != "":
                raise ModelConfigError("emulated_world_size emulates an EP world on one "
                                       "device: pass no ep_group with it")
            if (not isinstance(emulated_world_size, int) or emulated_world_size < 1
                    or config.num_experts % emulated_world_size):
                raise ModelConfigError(
                    f"emulated_world_size={emulated_world_size!r} must be an int >= 1 that "
                    f"divides num_experts={config.num_experts}")
            self.ep_size = emulated_world_size
            backend = register_emulated(EmulatedWorld(emulated_world_size, config.num_experts,
                                                      config.top_k))
        self.check_ep(config, self.ep_size)
        self.num_local_experts = config.num_experts // self.ep_size
        self.embed_tokens = nn.Parameter(
            torch.empty(config.vocab_size, config.hidden_size, dtype=dtype, device=device))
        self.layers = nn.ModuleList([
            DecoderLayer(config, i, self.ep_rank, self.ep_size, self.group_name, dtype, device,
                         backend)
            for i in range(config.num_layers)
        ])
        for layer in self.layers:
            layer.compile_region = compile_regions
        self.norm = RMSNorm(config.hidden_size, config.rms_eps, dtype, device)
        self.lm_head = nn.Parameter(
            torch.empty(config.vocab_size, config.hidden_size, dtype=dtype, device=device))
        self.seed = seed
        if torch.device(device).type != "meta":
            self.reset_parameters(seed)

    @staticmethod
    def check_ep(config: DeepseekConfig, ep_size: int) -> None:
        """Check that ``config``'s experts shard over ``ep_size`` EP ranks (before any process
        group exists: the example's argument parser calls it).

        Raises:
            ModelConfigError: ``ep_size < 1`` or ``num_experts % ep_size != 0``.
        """
        if ep_size < 1 or config.num_experts % ep_size:
            raise ModelConfigError(
                f"num_experts={config.num_experts} is not divisible by the EP world size "
                f"{ep_size}")

    @property
    def local_expert_range(self) -> tuple[int, int]:
        """Global ids ``[start, stop)`` of the experts this EP rank keeps."""
        return self.ep_rank * self.num_local_experts, (self.ep_rank + 1) * self.num_local_experts

    @torch.no_grad()
    def reset_parameters(self, seed: int = 0) -> None:
        """Deterministic init from ``seed`` and each parameter's name (rank-independent).

        Norm weights are 1; every other weight is ``N(0, 1) / sqrt(fan_in)`` (the embedding
        ``N(0, 1)``). Expert weights are drawn for all ``E`` experts (fp32, CPU) and sliced to
        this rank's range.
        """
        start, stop = self.local_expert_range
        routed = self.routed_expert_params()
        for name, p in self.named_parameters():
            if name.endswith("layernorm.weight") or name == "norm.weight":
                p.fill_(1.0)
                continue
            gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
            full_shape = list(p.shape)
            expert = name in routed
            if expert:
                full_shape[0] = self.config.num_experts
            w = torch.randn(full_shape, generator=gen, dtype=torch.float32)
            if name != "embed_tokens":
                w = w / (full_shape[-1] ** 0.5)
            if expert:
                w = w[start:stop]
            p.copy_(w.to(p.dtype))

    def routed_expert_params(self) -> set[str]:
        """Names of the routed experts' stacked weights (``layers.<i>.mlp.w13`` / ``.w2`` of
        the MoE layers; not a dense layer's MLP, whose weights are named alike)."""
        return {f"{name}.{w}" for name, m in self.named_modules() if isinstance(m, MoE)
                for w in ("w13", "w2")}

    @torch.no_grad()
    def load_state_from_full(self, full: DeepseekMoEModel) -> None:
        """Copy weights from a model holding all experts (``ep_group=None``), slicing experts.

        Raises:
            ModelConfigError: ``full`` does not hold all experts or its config differs.
        """
        if full.ep_size != 1 or full.config != self.config:
            raise ModelConfigError("load_state_from_full needs an EP=1 model of the same config")
        start, stop = self.local_expert_range
        src = dict(full.named_parameters())
        routed = self.routed_expert_params()
        for name, p in self.named_parameters():
            w = src[name]
            if name in routed:
                w = w[start:stop]
            p.copy_(w.to(device=p.device, dtype=p.dtype))

    @torch.no_grad()
    def emulated_reference(self) -> DeepseekMoEModel:
        """The one-device model an emulated-world model (``emulated_world_size=W``) equals: all
        ``E`` experts, expert ``e`` with the weights of this model's local expert
        ``e mod (E / W)``, every other weight the same, the ``local`` backend (its KV caches,
        if allocated, are copies).

        Raises:
            ModelConfigError: this model is not built for an emulated world.
        """
        if self.emulated_world_size is None:
            raise ModelConfigError("emulated_reference: the model was not built with "
                                   "emulated_world_size")
        ref = DeepseekMoEModel(self.config, None, dtype=self.dtype, device="meta", seed=self.seed)
        ref.to_empty(device=self.embed_tokens.device)
        ref.eval()
        src = dict(self.named_parameters())
        routed = self.routed_expert_params()
        for name, p in ref.named_parameters():
            w = src[name]
            if name in routed:
                w = w.repeat(self.emulated_world_size, 1, 1)
            p.copy_(w)
        for mine, theirs in zip(self.layers, ref.layers):
            mine_attn, ref_attn = mine.self_attn, theirs.self_attn
            ref_attn.inv_freq = mine_attn.inv_freq.clone()
            if mine_attn.kv_cache is not None:
                ref_attn.kv_cache = mine_attn.kv_cache.clone()
        return ref

    def allocate_kv_cache(self, num_blocks: int, block_size: int,
                          device: torch.device | str | None = None) -> None:
        """Give every layer a zeroed KV cache ``[2, num_blocks, block_size, Hkv, D]`` (model
        dtype), registered as the non-persistent buffer ``layers.<i>.self_attn.kv_cache``."""
        cfg = self.config
        if device is None:
            device = self.embed_tokens.device
        for layer in self.layers:
            layer.self_attn.kv_cache = torch.zeros(
                2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim,
                dtype=self.dtype, device=device)

    def kv_caches(self) -> list[torch.Tensor]:
        """The per-layer KV caches (raises if not allocated)."""
        caches = [layer.self_attn.kv_cache for layer in self.layers]
        if any(c is None for c in caches):
            raise ModelConfigError("KV cache not allocated: call model.allocate_kv_cache() first")
        return caches

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        """One step.

        Args:
            input_ids: ``[T]`` int64 token ids (``T`` = token dim, padding rows included).
            positions: ``[T]`` int64 absolute positions (RoPE).
            attn_metadata: tensor fields only are read; ``slot_mapping`` rows align with ``T``.

        Returns:
            ``[T, vocab_size]`` fp32 logits (padding rows are meaningless but finite).
        """
        x = F.embedding(input_ids, self.embed_tokens)
        for layer in self.layers:
            x = layer(x, positions, attn_metadata)
        x = self.norm(x)
        return F.linear(x, self.lm_head).to(torch.float32)
