"""The benchmarks' MoE model, steps and GPU stand-in kernels (``benchmarks/bench_moe.py``, the
emulated world's ``bench_emulated.py``, ``tests/test_gpu*.py``): what a benchmark and a test
build the same way live here, in the package, so that the tests import no benchmark script.

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

The emulated world's comm alone (``bench_emulated.py``'s ``comm`` and ``comm ops``):
:func:`comm_only_fn` (the link's round trips) and :func:`comm_ops_fn` (the backend's whole
dispatches and combines), two in flight as the split program has them.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
from typing import Any, Callable

import torch
import torch.distributed as dist

from dbo_compile.config import DboConfig
from dbo_compile.candidates import UNSPLIT_GRAPHS, UNSPLIT_OVERLAP
from dbo_compile.models import DeepseekMoEModel, get_config, make_step
from dbo_compile.ops import comm as _comm
from dbo_compile.ops import emulated as _emulated
from dbo_compile.ops.attention import (
    attention_cuda,
    check_attention_args,
    paged_attention,
    write_kv,
)
from dbo_compile.ops.comm import packing, payload_layout
from dbo_compile.ops.experts import check_experts_args, experts_loop
from dbo_compile.testing import measure
from dbo_compile.testing.measure import graph_us

_STATE: dict[str, Any] = {"attention": "ref"}


# ----------------------------------------------------------------------------- experts
def _experts_loop_kernel(x, ids, wts, w13, w2):
    check_experts_args(x, ids, wts, w13, w2)
    return experts_loop(x, ids, wts, w13, w2)


# ----------------------------------------------------------------------------- attention
def _attention_proj(q, k, v, kv_cache, slot_mapping, query_start_loc, seq_lens, block_table,
                    scale):
    write_kv(kv_cache, k, v, slot_mapping)
    return q.clone()


ATTENTION_KINDS = ("proj", "ref", "fused")


def install_kernels(device_type: str, experts: str = "grouped", attention: str = "proj") -> dict:
    """Switch this process's expert / attention implementations (see the module docstring).

    Raises:
        ValueError: ``attention`` is not one of :data:`ATTENTION_KINDS`.
    """
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
        with _emulated.without_link():
            yield
    finally:
        _comm.register_comm_backend(old)


def serial_and_nocomm(program, split_fn):
    """``(split serial, split without comm)``: ``split_fn`` (the split ``program`` over static
    inputs) with its comm on the compute stream (the emulated link's sends finished before
    they return: ``dbo_compile.ops.emulated.serial_link``), and the same without moving
    data."""
    def serial():
        with measure.serial_comm(program), _emulated.serial_link():
            return split_fn()

    def nocomm():
        with no_comm(), measure.serial_comm(program):
            return split_fn()

    return serial, nocomm


# ----------------------------------------------------------------------------- process group
def init_distributed() -> torch.device:
    """Join the ``torchrun`` job: NCCL on this rank's GPU (``LOCAL_RANK``) where CUDA is
    available, else Gloo on CPU. Returns the rank's device."""
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


def noise_floor(model: torch.nn.Module, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: Any, ref: torch.Tensor, *, fraction: float = 0.05,
                seed: int = 0) -> dict:
    """How far the unsplit model's own answer moves under a change of rounding alone:
    :func:`rel_err` against ``ref`` (``[T, vocab]`` fp32, the model's answer for this step) of
    the model run eagerly again with the hidden state entering its first layer moved by one
    ulp of its dtype on ``fraction`` of the elements (drawn with ``seed``), what a GEMM of
    another row count (a ubatch) or a fused kernel legitimately changes.

    Fine-grained top-k routing turns such a change into a different expert for the tokens
    whose K-th and (K+1)-th gate logits are within a few ulps of each other: in bf16 with
    DeepSeek-V3's routing (8 of 256 experts, renormalised, x2.5) about a tenth of the tokens,
    a max_rel of 0.1-0.3 on the logits (V2-Lite's 6 of 64: about 0.03); see docs/emulated.md,
    "Numerics at V3 routing". A split program's error at or under this floor is a different
    rounding, not a wrong answer. The model writes its KV cache again (the same slots);
    nothing else changes (the hook is removed on return)."""
    first = model.layers[0]
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def nudge(_module, args):
        x = args[0]
        moved = (torch.rand(x.shape, generator=gen) < fraction).to(x.device)
        up = x.to(torch.float32) * (1.0 + torch.finfo(x.dtype).eps)
        return (torch.where(moved, up.to(x.dtype), x), *args[1:])

    handle = first.register_forward_pre_hook(nudge)
    try:
        with torch.no_grad():
            out = model(input_ids, positions, attn_metadata)
    finally:
        handle.remove()
    return rel_err(out, ref)


def time_graph(fn, iters: int, reps: int = 1) -> tuple[float, Any]:
    """Capture ``reps`` calls of ``fn`` as one CUDA graph (after warm-up calls); the median of
    ``iters`` CUDA-event-timed replays in µs per call, and the last call's output
    (:func:`dbo_compile.testing.measure.graph_us`)."""
    return graph_us(fn, iters, reps=reps)


# ----------------------------------------------------------------------------- emulated comm
def two_in_flight(starts: list[Callable[[], Any]], finish: Callable[[Any], Any]) -> None:
    """Call each of ``starts`` (each starts one transfer or comm op and returns it) and
    ``finish`` each one after the next has started: two in flight, as the split program has
    them (the emulated backend's pool)."""
    last = None
    for start in starts:
        now = start()
        if last is not None:
            finish(last)
        last = now
    if last is not None:
        finish(last)


def comm_only_fn(world: _emulated.EmulatedWorld, cfg: Any, dtype: torch.dtype,
                 tokens_per_ubatch: list[int], device: Any) -> Callable[[], None]:
    """The link round trips of the split program alone (per layer: the ubatches' dispatches,
    then their combines; each the static capacity), two in flight as the split program has
    them (each round trip is finished after the next one is sent)."""
    _, cols = payload_layout(cfg.hidden_size, dtype, cfg.top_k)
    bufs = []
    for _layer in range(cfg.num_moe_layers):
        for t in tokens_per_ubatch:
            bufs.append(torch.randn(max(1, world.capacity(t)), cols, device=device, dtype=dtype))
        for t in tokens_per_ubatch:
            bufs.append(torch.randn(max(1, world.capacity(t)), cfg.hidden_size, device=device,
                                    dtype=dtype))

    def run():
        two_in_flight([functools.partial(_emulated.LINK.send, b, world) for b in bufs],
                      lambda transfer: transfer.finish())
    return run


def comm_ops_fn(world: _emulated.EmulatedWorld, cfg: Any, dtype: torch.dtype,
                tokens_per_ubatch: list[int], device: Any) -> Callable[[], None]:
    """The split program's comm ops alone, whole: the emulated backend's dispatches and
    combines with their pack and unpack kernels around the round trips (per layer: the
    ubatches' dispatches, then their combines, as the DBO schedules order them; each op's
    receive after the next op is issued, two in flight as the split program has them), on
    uniform top-k routing of ``[T, hidden]`` rows of ``dtype`` per ubatch.
    :func:`comm_only_fn` times the round trips alone; this is what the comm stream carries."""
    backend = _comm.get_comm_backend(_emulated.register_emulated(world))
    e, k = world.num_experts, world.top_k
    gen = torch.Generator().manual_seed(0)
    layers = []
    for _layer in range(cfg.num_moe_layers):
        ops = []
        for t in tokens_per_ubatch:
            x = torch.randn(t, cfg.hidden_size, generator=gen).to(device, dtype)
            ids = torch.rand(t, e, generator=gen).topk(k, dim=1).indices.to(device)
            w = torch.rand(t, k, generator=gen).to(device)
            rx, rids, _ = backend.dispatch(x, ids, w, e, "")
            ops.append((x, ids, w, (rx * (rids >= 0).any(-1, keepdim=True)).contiguous()))
        layers.append(ops)

    calls = []
    for ops in layers:
        calls += [functools.partial(backend.dispatch, x, ids, w, e, "", defer_receive=True)
                  for x, ids, w, _ in ops]
        calls += [functools.partial(backend.combine, y, "", defer_receive=True)
                  for *_, y in ops]

    def run():
        two_in_flight(calls, backend.receive)
    return run


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

