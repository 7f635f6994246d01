"""The ``deep_ep`` comm backend: DeepEP's low-latency and normal kernels behind
``dbo.moe_dispatch`` / ``dbo.moe_combine``.

``comm_backend="deep_ep"``, options (``comm_backend_options``):

- ``mode``: ``"low_latency"`` (LL), ``"normal"`` (high-throughput, HT) or ``"auto"`` (default:
  HT where DeepEP's intranode kernels run, an EP group of 2, 4 or 8 ranks, else LL). Chosen per
  compiled graph: the two modes have different receive layouts, fixed at trace time.
- ``max_tokens``: LL only, the tokens per rank one call may carry (DeepEP's
  ``num_max_dispatch_tokens_per_rank``; default 256): the static per-expert capacity of the LL
  receive buffer ``[E_local, W * max_tokens, H]``. Every call of a process uses one LL buffer of
  one layout (DeepEP: one NVSHMEM buffer per process, fixed ``(cap, hidden, experts)``): set it
  to the largest token count one call sees (the largest CUDA-graph bucket unsplit); a step
  with more tokens per call raises :class:`CommOpError` on every rank. Above 511 the NVSHMEM QP
  depth is raised (``NVSHMEM_QP_DEPTH >= 2 * (max_tokens + 1)``, DeepEP's assert) before the
  buffer is built.

Low-latency mode (decode, CUDA graphs), the expert-major layout of :mod:`dbo_compile.ops.comm`::

    issue   : low_latency_dispatch(x, ids, cap, E, use_fp8=False, return_recv_hook=True)
              the send, on the current stream (no SM held afterwards)
    receive : hook()  (comm_receive) - launches the receive kernel on the send's stream
    results : recv_x [E_local, W*cap, H], recv_count [E_local] int32 (the expert op's row
              counts), layout_range [E_local, W] int64, src_info [E_local, W*cap] int32 (handle)
    combine : low_latency_combine(y, ids, weights, (src_info, layout_range, cap, H, E),
              return_recv_hook=True) + hook(): out [T, H] = sum_k w[t, k] * y[e_k, row]

Its units run on the **compute stream**: DeepEP launches the send on the current stream and
the hook's receive on the send's stream; on the compute stream the schedule puts the other
ubatch's compute between the issue and the receive, so the receive kernel starts after that
compute (it holds no SM while the transfer is in flight) and no event is needed. The backend
declares ``ResultPool("low_latency", in_flight=1)``: the receive of LL op ``n`` (dispatch or
combine) is enqueued before op ``n + 1`` is issued, the rule DeepEP's kernels need on every
rank (an order ``D0, D1, hook(D0)`` hangs: seen on one H200), which the scheduler honours
(``passes/stream_assign.py``). The results themselves are fresh tensors in this DeepEP
(``torch::empty`` at each call; DeepEP's docstring limit of two live results is about its two
RDMA buffers, which the in-flight rule covers), so no ``live`` limit is declared. The unsplit
program calls the hook at once. A graph holds an even number of LL ops (a dispatch and a
combine per layer and ubatch), so a CUDA graph keeps DeepEP's buffer parity (DeepEP flips its
buffer index on the host at capture).

Normal mode (prefill), the rank-major layout (``[W*T, H]`` rows, local ids, weights)::

    get_dispatch_layout(ids, E) -> per-rank / per-expert counts, is_token_in_rank
    dispatch(x, ..., topk_idx=ids, topk_weights=w, num_worst_tokens=W*T)
    combine(y, handle) -> [T, H], the rows of each token summed (y weighted by the experts)

on **our comm stream**: ``previous_event=None`` (DeepEP's stream waits for the current stream,
ours), ``async_finish=False`` (ours waits for DeepEP's), ``allocate_on_comm_stream=False`` (the
results belong to our comm stream, so the generated code's ``record_stream`` keeps them alive
for the compute stream): the event edges of the schedule do the rest. ``num_worst_tokens=W*T``
removes DeepEP's host read of the receive counts (without it the host busy-waits on pinned
memory for them: a sync no CUDA graph can hold); the price is ``W*T`` receive rows, as the
torch backend's static capacity, while only routed tokens travel. The dispatch handle (its
``rank_prefix_matrix``, ``recv_channel_prefix_matrix``, ``recv_src_idx``, ``send_head``, all
int32) travels to the combine packed in the op's ``handle`` output. Normal mode needs 2, 4 or 8
ranks (DeepEP's intranode kernels): it cannot run on one GPU.

Not modelled: DeepEP's FP8 dispatch (``use_fp8``: halves the bytes; the scales would need a
slot in the op contract) and zero-copy combine buffers (they buy nothing intranode).

The package is ``deep_ep`` (``pip install 'dbo_compile[deepep]'``: tokenspeed-deepep
1.2.1.post20251110 for torch 2.11 + CUDA 13, sm90, NVSHMEM from torch's
``nvidia-nvshmem-cu13``); importing it needs CUDA libraries, so it is imported when the backend
is asked for, and an import failure is a :class:`CommBackendError` naming the fallback.
"""

from __future__ import annotations

import atexit
import collections
import logging
import os
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from dbo_compile.errors import CommBackendError, CommOpError
from dbo_compile.ops.comm import (
    EXPERT_MAJOR,
    RANK_MAJOR,
    CommBackend,
    ResultPool,
    ep_world_size,
    register_comm_backend,
    result_key,
)
from dbo_compile.ops.backends import AutoPreference, backend_spec, import_optional
from dbo_compile.ops.registry import op_arg

log = logging.getLogger(__name__)

__all__ = ["LL_HIDDEN", "MODES", "deep_ep_backend", "release_buffers"]

MODES = ("auto", "low_latency", "normal")
#: hidden sizes DeepEP's low-latency kernels are compiled for (``SWITCH_HIDDEN``)
LL_HIDDEN = (2048, 2560, 3072, 4096, 5120, 6144, 7168, 8192)
_DEFAULT_MAX_TOKENS = 256
_HT_RANKS = (2, 4, 8)
_INSTALL = ("pip install 'dbo_compile[deepep]' (tokenspeed-deepep 1.2.1.post20251110: torch "
            "2.11, CUDA 13, sm90 GPUs)")


def _deep_ep() -> Any:
    """The ``deep_ep`` package (optional), or ``CommBackendError`` naming what to do."""
    return import_optional("deep_ep", CommBackendError, "comm backend 'deep_ep'", _INSTALL,
                           "comm_backend")


# --------------------------------------------------------------------------------------------
# Buffers (one per process and layout: NVSHMEM is a process singleton)
# --------------------------------------------------------------------------------------------

_BUFFERS: dict[tuple, Any] = {}
_GROUPS: dict[str, Any] = {}
#: the NVSHMEM_QP_DEPTH this module set (it may raise its own setting, not the user's)
_QP_DEPTH_SET: list[str | None] = [None]


def _group(group_name: str) -> Any:
    """The process group DeepEP builds its buffer over (``""``: a group of this rank alone,
    starting a one-rank Gloo world if torch.distributed is not initialised)."""
    if group_name in _GROUPS:
        return _GROUPS[group_name]
    if group_name:
        group = _resolve_process_group(group_name)
    else:
        if not dist.is_initialized():
            log.info("dbo: deep_ep: starting a one-rank Gloo process group for the EP group "
                     "of one rank (DeepEP's buffer exchanges its handles over a group)")
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        if dist.get_world_size() == 1:
            group = dist.group.WORLD
        else:  # each rank its own group (collective: every rank builds its buffer in step)
            group, _ = dist.new_subgroups(group_size=1)
    _GROUPS[group_name] = group
    return group


def release_buffers() -> None:
    """Destroy this process's DeepEP buffers (collective over each buffer's group: call on
    every rank), so that a buffer of another layout (``max_tokens``, hidden, experts) can be
    built; graphs captured with the old buffers must not be replayed again."""
    _destroy_buffers()


def _destroy_buffers() -> None:
    for key, buf in list(_BUFFERS.items()):
        try:
            buf.destroy()
        except Exception as e:  # noqa: BLE001 - exiting anyway
            log.warning("dbo: deep_ep: destroying the %s buffer failed: %s", key[0], e)
        _BUFFERS.pop(key, None)


atexit.register(_destroy_buffers)


def _ll_buffer(group_name: str, cap: int, hidden: int, num_experts: int) -> Any:
    key = ("low_latency", group_name, cap, hidden, num_experts)
    if key in _BUFFERS:
        return _BUFFERS[key]
    other = [k for k in _BUFFERS if k[0] == "low_latency"]
    if other:
        raise CommBackendError(
            f"deep_ep: this process already holds a low-latency buffer for (group, max_tokens, "
            f"hidden, experts) = {other[0][1:]}, and DeepEP keeps one NVSHMEM buffer per "
            f"process; {key[1:]} needs another: give every MoE layer of the process the same "
            "hidden size, expert count and comm_backend_options max_tokens")
    ep = _deep_ep()
    need = 2 * (cap + 1)
    depth = os.environ.get("NVSHMEM_QP_DEPTH")
    ours = depth is not None and depth == _QP_DEPTH_SET[0]
    if (depth is None and need > 1024) or (ours and int(depth) < need):
        os.environ["NVSHMEM_QP_DEPTH"] = _QP_DEPTH_SET[0] = str(1 << (need - 1).bit_length())
        log.info("dbo: deep_ep: NVSHMEM_QP_DEPTH=%s for max_tokens=%d (DeepEP needs >= %d)",
                 os.environ["NVSHMEM_QP_DEPTH"], cap, need)
    elif depth is not None and int(depth) < need:
        raise CommBackendError(
            f"deep_ep: NVSHMEM_QP_DEPTH={depth} is below 2 * (max_tokens + 1) = {need}; unset "
            "it (the backend raises it) or lower comm_backend_options max_tokens")
    group = _group(group_name)
    w = group.size()
    hint = ep.Buffer.get_low_latency_rdma_size_hint(cap, hidden, w, num_experts)
    log.info("dbo: deep_ep: low-latency buffer over %d rank(s), max_tokens=%d, hidden=%d, "
             "%d experts: %.1f MB RDMA", w, cap, hidden, num_experts, hint / 1e6)
    buf = ep.Buffer(group, 0, hint, low_latency_mode=True,
                    num_qps_per_rank=max(1, num_experts // w), explicitly_destroy=True)
    _BUFFERS[key] = buf
    return buf


def _ht_buffer(group_name: str, hidden: int) -> Any:
    key = ("normal", group_name, hidden)
    if key in _BUFFERS:
        return _BUFFERS[key]
    ep = _deep_ep()
    group = _group(group_name)
    w = group.size()
    nvl = max(cfg.get_nvl_buffer_size_hint(hidden * 2, w)
              for cfg in (ep.Buffer.get_dispatch_config(w), ep.Buffer.get_combine_config(w)))
    log.info("dbo: deep_ep: normal-mode buffer over %d ranks, hidden=%d: %.1f MB NVLink", w,
             hidden, nvl / 1e6)
    buf = ep.Buffer(group, nvl, 0, low_latency_mode=False, explicitly_destroy=True)
    _BUFFERS[key] = buf
    return buf


# --------------------------------------------------------------------------------------------
# The two modes
# --------------------------------------------------------------------------------------------


def _world(group_name: str) -> int:
    return ep_world_size(group_name)


def _common_unsupported(facts: dict) -> str | None:
    if facts.get("dtype", torch.bfloat16) != torch.bfloat16:
        return f"DeepEP moves bf16 rows, the dispatch's x is {facts['dtype']}"
    return None


def _ll_unsupported(facts: dict, cap: int) -> str | None:
    why = _common_unsupported(facts)
    w, e, k = facts.get("world_size", 1), facts.get("num_experts"), facts.get("top_k", 1)
    if why is None and facts.get("hidden") not in LL_HIDDEN:
        why = f"low-latency kernels need hidden in {LL_HIDDEN}, got {facts.get('hidden')}"
    if why is None and k > 11:
        why = f"low-latency kernels take top-k <= 11, got {k}"
    if why is None and (not isinstance(e, int) or e < 2 or e % w):
        why = f"{e} experts: need >= 2 and a multiple of the EP size {w}"
    if why is None and (w * cap) % 4:
        why = f"EP size {w} x max_tokens {cap} must be a multiple of 4 (TMA)"
    return why


def _ht_unsupported(facts: dict) -> str | None:
    why = _common_unsupported(facts)
    if why is None and facts.get("world_size") not in _HT_RANKS:
        why = (f"normal mode needs an EP group of {_HT_RANKS} ranks (DeepEP's intranode "
               f"kernels), this one has {facts.get('world_size')}")
    return why


class _LowLatency:
    """DeepEP low-latency mode (module docstring); ``pending`` holds the receive hooks of the
    calls issued with ``defer_receive`` and not yet received (at most one: the pool)."""

    def __init__(self, cap: int):
        self.cap = cap
        self.pending: collections.deque = collections.deque()

    def supports(self, facts: dict) -> str | None:
        return _ll_unsupported(facts, self.cap)

    def _check(self, x: torch.Tensor, topk_ids: torch.Tensor, num_experts: int, w: int) -> None:
        why = self.supports({"dtype": x.dtype, "hidden": x.shape[1], "top_k": topk_ids.shape[1],
                             "num_experts": num_experts, "world_size": w})
        if why is None and x.shape[0] > self.cap:
            why = (f"{x.shape[0]} tokens in one call exceed the low-latency capacity "
                   f"max_tokens={self.cap}; raise comm_backend_options max_tokens to the "
                   "largest call (the largest bucket, unsplit), or use mode='normal'")
        if why is not None:
            raise CommOpError(f"dbo.moe_dispatch (deep_ep low_latency): {why}")

    def _check_nothing_in_flight(self) -> None:
        """The pool's rule (``in_flight=1``), checked before DeepEP is called: an issue while
        an earlier call is not received would hang every rank on the GPU."""
        if self.pending:
            raise CommBackendError(
                "deep_ep: an LL op issued while the previous one was not received (the "
                "schedule broke the in-flight rule of the backend's pool); refusing to issue "
                "it (DeepEP's ranks would hang)")

    def abort(self) -> None:
        """Receive, in order, what a failed step issued and did not receive."""
        while self.pending:
            log.warning("dbo: deep_ep: receiving an LL op the aborted step left in flight")
            self.pending.popleft()[1]()

    def _finish(self, key: torch.Tensor, hook: Any, defer: bool) -> None:
        if defer:
            self.pending.append((key, hook))
        else:
            hook()

    def dispatch(self, x, topk_ids, topk_weights, num_experts, group_name, defer_receive):
        w = _world(group_name)
        self._check(x, topk_ids, num_experts, w)
        buf = _ll_buffer(group_name, self.cap, x.shape[1], num_experts)
        self._check_nothing_in_flight()
        recv_x, count, handle, _, hook = buf.low_latency_dispatch(
            x.contiguous(), topk_ids.to(_deep_ep().topk_idx_t).contiguous(), self.cap,
            num_experts, use_fp8=False, return_recv_hook=True)
        self._finish(recv_x, hook, defer_receive)
        src_info, layout_range = handle[0], handle[1]
        return recv_x, count, layout_range, src_info

    def combine(self, y, topk_ids, topk_weights, recv_ids, recv_weights, handle, group_name,
                defer_receive):
        num_experts = y.shape[0] * _world(group_name)
        if y.dtype != torch.bfloat16:
            raise CommOpError(f"dbo.moe_combine (deep_ep low_latency): the expert outputs must "
                              f"be bf16, got {y.dtype}")
        buf = _ll_buffer(group_name, self.cap, y.shape[2], num_experts)
        self._check_nothing_in_flight()
        out, _, hook = buf.low_latency_combine(
            y.contiguous(), topk_ids.to(_deep_ep().topk_idx_t).contiguous(),
            topk_weights.to(torch.float32).contiguous(),
            (handle, recv_weights, self.cap, y.shape[2], num_experts), return_recv_hook=True)
        self._finish(out, hook, defer_receive)
        return out

    def receive(self, value: Any) -> None:
        key = result_key(value)
        if not self.pending or self.pending[0][0] is not key:
            raise CommBackendError(
                "deep_ep: a receive that is not the oldest LL op in flight (the schedule broke "
                "the pool's in-flight rule); refusing to launch it (the ranks would hang)")
        self.pending.popleft()[1]()

    def dispatch_fake(self, x, topk_ids, topk_weights, num_experts, group_name, defer_receive):
        w = _world(group_name)
        el, rows = num_experts // w, w * self.cap
        h = x.shape[1]
        return (x.new_empty((el, rows, h)), torch.empty(el, dtype=torch.int32, device=x.device),
                torch.empty((el, w), dtype=torch.int64, device=x.device),
                torch.empty((el, rows), dtype=torch.int32, device=x.device))

    def combine_fake(self, y, topk_ids, topk_weights, recv_ids, recv_weights, handle,
                     group_name, defer_receive):
        return y.new_empty((topk_ids.shape[0], y.shape[2]))

    @staticmethod
    def moved_bytes(kind: str, node: Any, size: Any) -> int:
        """Each routed slot's row, bf16 (``T*K`` of them on average per rank), sent and
        received (args 0 and 1 of both ops: the rows and ``topk_ids``)."""
        t, k = (size(s) for s in node.args[1].meta["val"].shape)
        return 2 * t * k * size(node.args[0].meta["val"].shape[-1]) * 2


class _Normal:
    """DeepEP normal (high-throughput) mode (module docstring)."""

    def __init__(self):
        self.channels = _deep_ep().Buffer.num_sms // 2

    @staticmethod
    def supports(facts: dict) -> str | None:
        return _ht_unsupported(facts)

    def _handle_size(self, w: int, t: int) -> int:
        return w * w + w * self.channels + w * t + t * w

    def dispatch(self, x, topk_ids, topk_weights, num_experts, group_name, defer_receive):
        w = _world(group_name)
        why = self.supports({"dtype": x.dtype, "world_size": w})
        if why is not None:
            raise CommOpError(f"dbo.moe_dispatch (deep_ep normal): {why}")
        t = x.shape[0]
        buf = _ht_buffer(group_name, x.shape[1])
        ids = topk_ids.to(_deep_ep().topk_idx_t).contiguous()
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(ids, num_experts)
        worst = w * t  # every token to every rank: no host read of the counts
        recv_x, recv_ids, recv_w, _, handle, _ = buf.dispatch(
            x.contiguous(), num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert, topk_idx=ids,
            topk_weights=topk_weights.to(torch.float32).contiguous(),
            num_worst_tokens=max(worst, 1))
        rank_prefix, _, recv_channel, recv_src, _, send_head = handle
        packed = torch.cat([rank_prefix.reshape(-1), recv_channel.reshape(-1),
                            recv_src[:worst], send_head.reshape(-1)]).to(torch.int32)
        return (recv_x[:worst], recv_ids[:worst].to(torch.int64),
                recv_w[:worst].to(torch.float32), packed)

    def combine(self, y, topk_ids, topk_weights, recv_ids, recv_weights, handle, group_name,
                defer_receive):
        w, t, c = _world(group_name), topk_ids.shape[0], self.channels
        buf = _ht_buffer(group_name, y.shape[1])
        if handle.numel() != self._handle_size(w, t):
            raise CommOpError(f"dbo.moe_combine (deep_ep normal): the handle has "
                              f"{handle.numel()} ints, expected {self._handle_size(w, t)}")
        a, b, d = w * w, w * w + w * c, w * w + w * c + w * t
        unpacked = (handle[:a].view(w, w), None, handle[a:b].view(w, c), handle[b:d], None,
                    handle[d:].view(t, w))
        out, _, _ = buf.combine(y.to(torch.bfloat16).contiguous(), unpacked)
        return out.to(y.dtype)

    def dispatch_fake(self, x, topk_ids, topk_weights, num_experts, group_name, defer_receive):
        w = _world(group_name)
        t, h = x.shape
        k = topk_ids.shape[1]
        return (x.new_empty((w * t, h)), topk_ids.new_empty((w * t, k)),
                topk_weights.new_empty((w * t, k)),
                torch.empty(self._handle_size(w, t), dtype=torch.int32, device=x.device))

    def combine_fake(self, y, topk_ids, topk_weights, recv_ids, recv_weights, handle,
                     group_name, defer_receive):
        return y.new_empty((topk_ids.shape[0], y.shape[1]))

    @staticmethod
    def moved_bytes(kind: str, node: Any, size: Any) -> int:
        """Each token's row once per destination rank it has an expert on (at most K), sent
        and received."""
        t, k = (size(s) for s in node.args[1].meta["val"].shape)
        w = ep_world_size(op_arg(node, "group_name", ""))
        return 2 * t * min(k, w) * size(node.args[0].meta["val"].shape[-1]) * 2


# --------------------------------------------------------------------------------------------
# The backend
# --------------------------------------------------------------------------------------------


def _auto_bind(options: dict) -> Any:
    def bind(facts: list[dict]) -> str:
        w = facts[0].get("world_size", 1) if facts else 1
        mode = "normal" if w in _HT_RANKS else "low_latency"
        return backend_spec("deep_ep", {**options, "mode": mode})

    return bind


def _check_options(mode: str = "auto", max_tokens: int = _DEFAULT_MAX_TOKENS) -> None:
    """The options' values (module docstring), checked without importing ``deep_ep``."""
    if mode not in MODES:
        raise CommBackendError(f"comm backend 'deep_ep': mode={mode!r}; choose one of {MODES}")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise CommBackendError(f"comm backend 'deep_ep': max_tokens={max_tokens!r} must be an "
                               "int >= 1")


def _configure(mode: str = "auto", max_tokens: int = _DEFAULT_MAX_TOKENS, **unknown: Any
               ) -> CommBackend:
    if unknown:
        raise CommBackendError(f"comm backend 'deep_ep': unknown option(s) {sorted(unknown)}; "
                               "valid: mode, max_tokens")
    _check_options(mode, max_tokens)
    _deep_ep()  # the package must import, or the error says what to do
    if mode == "auto":
        # resolved per graph when the compiler binds it (the EP group's size decides)
        return CommBackend("deep_ep", _unbound, _unbound, "DeepEP (mode chosen per graph)",
                           bind=_auto_bind({"max_tokens": max_tokens} if max_tokens !=
                                           _DEFAULT_MAX_TOKENS else {}))
    if mode == "low_latency":
        ll = _LowLatency(max_tokens)
        return CommBackend(
            "deep_ep", ll.dispatch, ll.combine,
            f"DeepEP low-latency (max_tokens={max_tokens}, send at issue, receive hook)",
            dispatch_fake=ll.dispatch_fake, combine_fake=ll.combine_fake, layout=EXPERT_MAJOR,
            handle=True, pools=(ResultPool("low_latency", in_flight=1),), receive=ll.receive,
            stream="compute", supports=ll.supports, moved_bytes=ll.moved_bytes, abort=ll.abort)
    ht = _Normal()
    return CommBackend(
        "deep_ep", ht.dispatch, ht.combine,
        "DeepEP normal mode (intranode, num_worst_tokens: no host read)",
        dispatch_fake=ht.dispatch_fake, combine_fake=ht.combine_fake, layout=RANK_MAJOR,
        handle=True, supports=ht.supports, moved_bytes=ht.moved_bytes)


def _unbound(*args: Any, **kwargs: Any) -> Any:
    raise CommBackendError("deep_ep with mode='auto' is resolved when the compiler binds it; "
                           "call with mode='low_latency' or mode='normal'")


def deep_ep_backend() -> CommBackend:
    """The registry entry (options: :func:`_configure`)."""
    return CommBackend("deep_ep", _unbound, _unbound, "DeepEP low-latency / normal mode",
                       configure=_configure, check_options=_check_options,
                       auto=AutoPreference(0, only=_auto_where))


def _auto_where(facts: dict[str, Any]) -> str | None:
    """``comm_backend="auto"`` tries DeepEP for an op over an EP group of several ranks."""
    return None if facts.get("world_size", 1) > 1 else "for one EP rank (no all-to-all)"


register_comm_backend(deep_ep_backend())
