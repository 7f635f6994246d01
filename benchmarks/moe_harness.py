"""Shared by benchmarks/bench_moe.py and tests/test_gpu.py: model, steps, GPU stand-in kernels.

GPU stand-ins (installed per process by :func:`install_kernels`; they change nothing in the
package, only what this process runs):

- ``experts="grouped"``: the package's ``dbo.grouped_experts`` CUDA kernel (grouped GEMM, see
  ``dbo_compile.ops.experts``); ``"loop"`` replaces it in this process by the reference
  per-expert dense loop (every expert on every received row).
- ``attention="proj"``: ``dbo.attention`` on the benchmark's device type writes the KV cache and
  returns ``q`` (projection-only attention, as in the hand-written schedule of
  docs/references.md); ``"ref"`` runs the reference implementation (a Python chunk loop:
  correct, capturable, but far slower than a fused kernel); ``"fused"`` runs the package's own
  implementation: on CUDA the fused Triton kernel (``dbo_compile.ops.attention``; the reference
  where it does not apply), elsewhere the reference.
- :func:`no_comm`: the ``torch`` comm backend replaced by a local stand-in of the same shapes
  (packs the send buffers, copies instead of all_to_all): "split program without comm".
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch

import dbo_compile.ops  # noqa: F401
from dbo_compile import DboConfig
from dbo_compile.candidates import UNSPLIT_GRAPHS, UNSPLIT_OVERLAP
from dbo_compile.models import DeepseekMoEModel, get_config, make_step
from dbo_compile.ops import comm as _comm
from dbo_compile.ops.comm import packing
from dbo_compile.testing import measure
from harness import graph_us

try:  # (the harness also measures trees before the emulated backend: the split price's "before")
    from dbo_compile.ops import emulated as _emulated
except ImportError:
    _emulated = None

_STATE: dict[str, Any] = {"attention": "ref"}


# ----------------------------------------------------------------------------- experts
def _experts_loop_kernel(x, ids, wts, w13, w2):
    from dbo_compile.ops.experts import check_experts_args, experts_loop

    check_experts_args(x, ids, wts, w13, w2)
    return experts_loop(x, ids, wts, w13, w2)


# ----------------------------------------------------------------------------- attention
def _attention_proj(q, k, v, kv_cache, slot_mapping, query_start_loc, seq_lens, block_table,
                    scale):
    from dbo_compile.ops.attention import write_kv

    write_kv(kv_cache, k, v, slot_mapping)
    return q.clone()


ATTENTION_KINDS = ("proj", "ref", "fused")


def install_kernels(device_type: str, experts: str = "grouped", attention: str = "proj") -> dict:
    """Switch this process's expert / attention implementations (see the module docstring).

    Raises:
        ValueError: ``attention`` is not one of :data:`ATTENTION_KINDS`.
    """
    from dbo_compile.ops.attention import (attention_cuda, check_attention_args, paged_attention,
                                           write_kv)

    if attention not in ATTENTION_KINDS:
        raise ValueError(f"attention={attention!r}: choose one of {ATTENTION_KINDS}")
    if experts == "loop":
        torch.library.register_kernel("dbo::grouped_experts", device_type, _experts_loop_kernel)
    _STATE["attention"] = attention

    def attn(q, k, v, kv_cache, slot_mapping, query_start_loc, seq_lens, block_table, scale):
        if _STATE["attention"] == "fused" and q.is_cuda:  # the package's CUDA kernel, unchanged
            return attention_cuda(q, k, v, kv_cache, slot_mapping, query_start_loc, seq_lens,
                                  block_table, scale)
        check_attention_args(q, k, v, kv_cache, slot_mapping, query_start_loc, seq_lens,
                             block_table)
        if _STATE["attention"] == "proj":
            return _attention_proj(q, k, v, kv_cache, slot_mapping, query_start_loc, seq_lens,
                                   block_table, scale)
        write_kv(kv_cache, k, v, slot_mapping)
        return paged_attention(q, kv_cache, query_start_loc, seq_lens, block_table, scale)

    torch.library.register_kernel("dbo::attention", device_type, attn)
    return {"experts": experts, "attention": attention}


# ----------------------------------------------------------------------------- no comm
def _nocomm_dispatch(x, topk_ids, topk_weights, num_experts, group_name):
    w = _comm.ep_world_size(group_name)
    e_local = packing.check_dispatch_args(x, topk_ids, topk_weights, num_experts, w)
    send = packing.send_buffers(x, topk_ids, topk_weights, e_local, w)
    recv = send.view(-1, send.shape[-1]).clone()
    return packing.split_payload(recv, x.shape[1], topk_ids.shape[1])


def _nocomm_combine(y, group_name):
    w = _comm.ep_world_size(group_name)
    return packing.sum_sources(y.contiguous().clone(), w)


@contextlib.contextmanager
def no_comm():
    """Within the block, ``dbo.dispatch``/``combine`` over a process group move no data, and
    the emulated world's link copies nothing (``dbo_compile.ops.emulated.without_link``)."""
    old = _comm.get_comm_backend("torch")
    _comm.register_comm_backend(_comm.CommBackend(
        "torch", _nocomm_dispatch, _nocomm_combine, "benchmark stand-in: no collective"))
    try:
        with _emulated.without_link() if _emulated else contextlib.nullcontext():
            yield
    finally:
        _comm.register_comm_backend(old)


def serial_and_nocomm(program, split_fn):
    """``(split serial, split without comm)``: ``split_fn`` (the split ``program`` over static
    inputs) with its comm on the compute stream (the emulated link's sends finished before
    they return: ``dbo_compile.ops.emulated.serial_link``), and the same without moving
    data."""
    def serial():
        with measure.serial_comm(program), (_emulated.serial_link() if _emulated
                                            else contextlib.nullcontext()):
            return split_fn()

    def nocomm():
        with no_comm(), measure.serial_comm(program):
            return split_fn()

    return serial, nocomm


# ----------------------------------------------------------------------------- process group
def init_distributed() -> torch.device:
    """Join the ``torchrun`` job: NCCL on this rank's GPU (``LOCAL_RANK``) where CUDA is
    available, else Gloo on CPU. Returns the rank's device."""
    import os

    import torch.distributed as dist

    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return device


# ----------------------------------------------------------------------------- options
def candidate_names(flag: str) -> Any:
    """The ``schedule_candidates`` option of the benchmarks' ``--candidates``: ``all``
    (every candidate), ``none``, ``default`` (the package default, the same for the torchrun
    and the emulated runs) or comma-separated names."""
    special = {"all": True, "none": False, "default": DboConfig().schedule_candidates}
    return special[flag] if flag in special else tuple(v for v in flag.split(",") if v)


# ----------------------------------------------------------------------------- model, steps
def build_model(preset: str, layers: int, group: Any, device: str, dtype=torch.bfloat16,
                seed: int = 0, emulated_world_size: int | None = None,
                **overrides: Any) -> DeepseekMoEModel:
    """The preset with ``layers`` layers, initialised on ``device`` (fast, no CPU randn).

    Non-expert weights are identical on every rank (same seed, same draw order); each rank's
    local experts are drawn from the same stream too (the benchmark does not need distinct ones).
    ``emulated_world_size``: rank 0 of an emulated EP world of that size on one device (no
    ``group``).
    """
    cfg = get_config(preset, num_layers=layers, **overrides)
    emulated = {} if emulated_world_size is None else {"emulated_world_size": emulated_world_size}
    model = DeepseekMoEModel(cfg, ep_group=group, dtype=dtype, device="meta", **emulated)
    model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight") or name == "norm.weight":
                p.fill_(1.0)
            else:
                std = 1.0 if name == "embed_tokens" else 1.0 / math.sqrt(p.shape[-1])
                p.normal_(0.0, std, generator=gen)
        for layer in model.layers:
            a = layer.self_attn
            d = a.head_dim
            a.inv_freq = 1.0 / (cfg.rope_theta ** (
                torch.arange(0, d, 2, dtype=torch.float32, device=device) / d))
    model.eval()
    return model


def make_bucket_step(cfg: Any, phase: str, tokens: int, device: str, seed: int = 0,
                     decode_ctx: int = 128, prompt: int = 512, block_size: int = 16,
                     host_mirrors: bool = False):
    """A decode step (``tokens`` requests of 1 token after ``decode_ctx`` cached tokens) or a
    prefill step (fresh prompts of ``prompt`` tokens, the last one shorter), ``tokens`` rows;
    ``host_mirrors``: its metadata carries the host copies it was built from (``*_cpu``), as a
    scheduler's does."""
    if phase == "decode":
        return make_step(cfg, decode_context_lens=[decode_ctx + (i % 7) for i in range(tokens)],
                         prefills=[], block_size=block_size, seed=seed, device=device,
                         host_mirrors=host_mirrors)
    prompts, left = [], tokens
    while left > 0:
        q = min(prompt, left)
        prompts.append((0, q))
        left -= q
    return make_step(cfg, decode_context_lens=[], prefills=prompts, block_size=block_size,
                     seed=seed, device=device, host_mirrors=host_mirrors)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> dict:
    """Error figures of ``a`` against reference ``b`` (fp32)."""
    a, b = a.float(), b.float()
    diff = (a - b).abs()
    scale = b.abs().max().clamp(min=1e-6)
    row_bad = (diff.amax(dim=-1) > 0.05 * b.abs().amax(dim=-1).clamp(min=1e-6))
    return {"max_abs": float(diff.max()), "max_rel": float(diff.max() / scale),
            "mean_abs": float(diff.mean()), "rows_off_5pct": float(row_bad.float().mean()),
            "finite": bool(torch.isfinite(a).all())}


def time_graph(fn, iters: int, reps: int = 1) -> tuple[float, Any]:
    """Capture ``reps`` calls of ``fn`` as one CUDA graph (after warm-up calls); the median of
    ``iters`` CUDA-event-timed replays in µs per call, and the last call's output
    (:func:`harness.graph_us`)."""
    return graph_us(fn, iters, reps=reps)


def baseline(t: dict) -> tuple[float, float, str]:
    """(serial unsplit graph's time, the baseline's time, the baseline's graph): the faster of
    the serial unsplit graph and ``unsplit-overlap`` (where captured) on the benchmark's step,
    so that DBO speedups are against the best unsplit program (issue 28 item 6)."""
    serial = t["graph:unsplit"]
    overlap = t.get(f"graph:{UNSPLIT_OVERLAP}")
    if overlap is not None and overlap < serial:
        return serial, overlap, UNSPLIT_OVERLAP
    return serial, serial, "unsplit"


def variants(t: dict) -> dict:
    """The split candidates' graph times (``graph:NAME`` keys, the unsplit graphs left out)."""
    return {k[6:]: v for k, v in t.items()
            if k.startswith("graph:") and k[6:] not in UNSPLIT_GRAPHS}

