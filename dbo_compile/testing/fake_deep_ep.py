"""A reference implementation of DeepEP's documented semantics in torch, for CPU tests.

Injected as the module ``deep_ep`` (``sys.modules["deep_ep"] = fake_deep_ep``) it lets the
adapter (:mod:`dbo_compile.ops.deep_ep`) run on CPU, on one process or over Gloo ranks. It
follows the API of tokenspeed-deepep 1.2.1.post20251110 (DeepEP V1, commit 92fe2de), the
semantics read from its sources and seen on one H200 (``docs/references.md``, DeepEP):

Low-latency mode (``low_latency_dispatch`` / ``low_latency_combine``):

- receive layout ``recv_x [E_local, W*cap, H]``: rows ``[0, recv_count[e])`` of expert ``e``
  valid, made of one block per source rank; **the order of the blocks and of the rows inside a
  block is not deterministic** (atomics on the GPU): here a random permutation per call.
  Rows past the count are NaN (uninitialised memory on the GPU); ``src_info`` holds each row's
  source token, ``layout_range[e, r] = (begin << 32) | count`` of source rank ``r``'s block;
- the combine weights: ``out[t] = bf16(sum_k w[t, k] * y[e_k, row(t, e_k)])`` in fp32, slots
  ``k`` ascending, ``-1`` slots skipped; rows past the counts are never read;
- ``return_recv_hook=True``: the results are garbage (NaN) until the hook runs; **the hook of
  op n must run before op n + 1 is issued** (the GPU kernels hang otherwise): here a
  :class:`WouldHang` error; ``use_fp8=False`` is not the default (DeepEP's default is FP8);
- the shapes of DeepEP's asserts: ``hidden`` in 2048..8192 (its list), ``T <= cap``, top-k
  ``<= 11``, ``W*cap % 4 == 0``, one layout (cap, hidden, experts) per buffer, the QP depth
  ``>= 2 * (cap + 1)``, one NVSHMEM buffer per process.

Normal (high-throughput) mode (``get_dispatch_layout`` / ``dispatch`` / ``combine``): 2, 4 or 8
ranks only ("Unsupported ranks" otherwise); one received row per (token, rank), rows ordered by
source rank then token; ids rewritten to local experts, ``-1`` elsewhere; with
``num_worst_tokens`` exactly that many rows (tail ids ``-1``, rows NaN) and no host read of the
counts, else the counts as a Python list (a host read, counted in :data:`HOST_READS`); the
combine sums the rows of each token without weights, found through the handle (``send_head``,
``rank_prefix_matrix``, ``recv_src_idx``).

Collectives go through ``torch.distributed`` on the group given to :class:`Buffer` (Gloo on
CPU); a group of one rank needs none.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

topk_idx_t = torch.int64

#: hidden sizes the low-latency kernels are compiled for (DeepEP ``SWITCH_HIDDEN``)
LL_HIDDEN = (2048, 2560, 3072, 4096, 5120, 6144, 7168, 8192)
#: host reads of receive counts the normal dispatch made (``num_worst_tokens == 0``)
HOST_READS = [0]


class WouldHang(RuntimeError):
    """An order the GPU kernels would hang on (an LL op issued before the previous op's
    receive hook ran)."""


class EventHandle:
    def current_stream_wait(self) -> None:
        pass


class EventOverlap:
    def __init__(self, event: EventHandle | None = None, extra_tensors: tuple | None = None):
        self.event, self.extra_tensors = event, extra_tensors

    def current_stream_wait(self) -> None:
        assert self.event is not None
        self.event.current_stream_wait()


class Config:
    def __init__(self, num_sms: int = 20, *args: Any):
        self.num_sms = num_sms

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        return 128 * (1 + (hidden_bytes * num_ranks * 64) // 128)

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        return 0


_ALIVE_LL: list[Buffer] = []


def _exchange(parts: list[torch.Tensor], group: Any) -> list[torch.Tensor]:
    """``parts[r]`` (``[n_r, ...]``) to rank ``r``; the parts every rank sent to this one."""
    if group is None or dist.get_world_size(group) == 1:
        return [parts[0].clone()]
    w = dist.get_world_size(group)
    tail = parts[0].shape[1:]
    sizes = torch.tensor([p.shape[0] for p in parts], dtype=torch.int64)
    got = torch.empty_like(sizes)
    dist.all_to_all_single(got, sizes, group=group)
    send = torch.cat([p.reshape(p.shape[0], -1) for p in parts])
    width = send.shape[1] if send.dim() == 2 else int(torch.tensor(tail).prod()) if tail else 1
    recv = torch.empty((int(got.sum()), width), dtype=send.dtype)
    dist.all_to_all_single(recv, send.reshape(-1, width) if send.numel() else
                           send.new_empty((0, width)), output_split_sizes=got.tolist(),
                           input_split_sizes=sizes.tolist(), group=group)
    out, start = [], 0
    for r in range(w):
        n = int(got[r])
        out.append(recv[start:start + n].reshape((n, *tail)))
        start += n
    return out


def _rank(group: Any) -> int:
    return 0 if group is None or not dist.is_initialized() else dist.get_rank(group)


def _size(group: Any) -> int:
    return 1 if group is None or not dist.is_initialized() else dist.get_world_size(group)


class Buffer:
    """The subset of ``deep_ep.Buffer`` the adapter uses (module docstring)."""

    num_sms = 20

    def __init__(self, group: Any, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                 low_latency_mode: bool = False, num_qps_per_rank: int = 24,
                 allow_nvlink_for_low_latency_mode: bool = True, allow_mnnvl: bool = False,
                 use_fabric: bool = False, explicitly_destroy: bool = False,
                 enable_shrink: bool = False, comm: Any = None):
        assert num_nvl_bytes % 128 == 0 and num_rdma_bytes % 128 == 0
        self.group, self.rank, self.group_size = group, _rank(group), _size(group)
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        self.low_latency_mode = low_latency_mode
        self.num_qps_per_rank = num_qps_per_rank
        self.explicitly_destroy = explicitly_destroy
        self.destroyed = False
        if low_latency_mode:
            if any(not b.destroyed for b in _ALIVE_LL):
                raise RuntimeError("fake deep_ep: a second NVSHMEM buffer in one process "
                                   "(DeepEP supports one)")
            os.environ.setdefault("NVSHMEM_QP_DEPTH", "1024")
            self.nvshmem_qp_depth = int(os.environ["NVSHMEM_QP_DEPTH"])
            _ALIVE_LL.append(self)
        self._ll_layout: tuple | None = None
        self._ll_pending = False
        self._ll_index = 0
        self.ll_ops = 0
        self._gen = torch.Generator().manual_seed(1234 + self.rank)

    # -- static helpers ---------------------------------------------------------------------
    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        assert new_num_sms % 2 == 0
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture() -> EventOverlap:
        return EventOverlap(EventHandle())

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int,
                                       num_ranks: int, num_experts: int) -> int:
        cap = num_max_dispatch_tokens_per_rank
        msg_d = 16 + max(2 * hidden, hidden + (hidden // 128) * 4)
        msg_c = (hidden // 128) * 4 + 2 * hidden
        send = max(cap * msg_d, num_experts * cap * msg_c)
        recv = max(num_experts * cap * msg_d, num_experts * cap * msg_c)
        signal = -(-num_experts * 4 // 128) * 128
        return (2 * (send + recv + signal) + 128) // 128 * 128

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        assert num_ranks in (2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 144, 160), \
            f"Unsupported number of EP ranks: {num_ranks}"
        return Config(Buffer.num_sms)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        return Buffer.get_dispatch_config(num_ranks)

    def destroy(self) -> None:
        if self.group_size not in (2, 4, 8) and self.num_nvl_bytes > 0:
            raise RuntimeError("Assertion error runtime.cu:29 'Unsupported ranks'")
        self.destroyed = True

    # -- low-latency mode -------------------------------------------------------------------
    def _ll_begin(self, layout: tuple) -> None:
        assert self.low_latency_mode, "not a low-latency buffer"
        if self._ll_layout is None:
            self._ll_layout = layout
        assert self._ll_layout == layout, (
            f"one layout (cap, hidden, experts) per buffer: {self._ll_layout} != {layout}")
        if self._ll_pending:
            raise WouldHang("an LL op was issued before the previous op's receive hook ran: "
                            "on the GPU the ranks hang (DeepEP: at most one op in flight)")
        self._ll_index ^= 1
        self.ll_ops += 1

    def _ll_finish(self, return_recv_hook: bool, results: list[torch.Tensor],
                   values: list[torch.Tensor]):
        """Without a hook, fill ``results`` now; with one, fill them when it is called."""
        def fill():
            for r, v in zip(results, values):
                r.copy_(v)
            self._ll_pending = False

        if not return_recv_hook:
            fill()
            return None
        self._ll_pending = True
        return fill

    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor,
                             num_max_dispatch_tokens_per_rank: int, num_experts: int,
                             cumulative_local_expert_recv_stats=None,
                             dispatch_wait_recv_cost_stats=None, use_fp8: bool = True,
                             round_scale: bool = False, use_ue8m0: bool = False,
                             async_finish: bool = False, return_recv_hook: bool = False):
        cap, w = num_max_dispatch_tokens_per_rank, self.group_size
        t, h = x.shape
        assert self.nvshmem_qp_depth >= (cap + 1) * 2
        assert x.dtype == torch.bfloat16 and x.is_contiguous() and h % 128 == 0
        assert h in LL_HIDDEN, f"Unsupported hidden {h}"
        assert t <= cap, f"{t} tokens > num_max_dispatch_tokens_per_rank {cap}"
        assert topk_idx.dtype == topk_idx_t and topk_idx.is_contiguous()
        assert topk_idx.dim() == 2 and topk_idx.shape[0] == t and topk_idx.shape[1] <= 11
        assert num_experts % w == 0 and num_experts >= 2 and (w * cap) % 4 == 0
        assert not (async_finish and return_recv_hook)
        self._ll_begin((cap, h, num_experts))
        el = num_experts // w
        # sender: one message per (token, slot) with an expert, to (its rank, local expert)
        parts_x, parts_meta = [], []
        for r in range(w):
            rows, meta = [], []
            for k in range(topk_idx.shape[1]):
                g = topk_idx[:, k]
                mine = (g >= 0) & (torch.div(g, el, rounding_mode="floor") == r)
                idx = mine.nonzero().flatten()
                rows.append(x[idx])
                meta.append(torch.stack([g[idx] % el, idx], dim=1))
            parts_x.append(torch.cat(rows).float())
            parts_meta.append(torch.cat(meta))
        got_x, got_meta = _exchange(parts_x, self.group), _exchange(parts_meta, self.group)
        # receiver: per local expert, one block per source rank in a random order, rows in a
        # random order inside each block
        recv_x = torch.full((el, w * cap, h), float("nan"), dtype=torch.bfloat16)
        src_info = torch.full((el, w * cap), -1, dtype=torch.int32)
        layout = torch.zeros((el, w), dtype=torch.int64)
        count = torch.zeros(el, dtype=torch.int32)
        for e in range(el):
            begin = 0
            for s in torch.randperm(w, generator=self._gen).tolist():
                sel = (got_meta[s][:, 0] == e).nonzero().flatten()
                sel = sel[torch.randperm(sel.numel(), generator=self._gen)]
                n = sel.numel()
                recv_x[e, begin:begin + n] = got_x[s][sel].to(torch.bfloat16)
                src_info[e, begin:begin + n] = got_meta[s][sel, 1].to(torch.int32)
                layout[e, s] = (begin << 32) | n
                begin += n
            count[e] = begin
        handle_src = torch.full_like(src_info, -1)
        handle_layout = torch.zeros_like(layout)
        out_x = torch.full_like(recv_x, float("nan"))
        out_count = torch.full_like(count, -1)
        hook = self._ll_finish(return_recv_hook, [out_x, out_count, handle_src, handle_layout],
                               [recv_x, count, src_info, layout])
        result: Any = out_x
        if use_fp8:
            assert h % 512 == 0
            scales = torch.empty((el, h // 128, w * cap), dtype=torch.float32).transpose(1, 2)
            blocks = out_x.float().view(el, w * cap, h // 128, 128)
            scales.copy_(blocks.abs().amax(-1).clamp(min=1e-4) / 448.0)
            q = (blocks / scales.unsqueeze(-1)).view(el, w * cap, h).to(torch.float8_e4m3fn)
            result = (q, scales)
        handle = (handle_src, handle_layout, cap, h, num_experts)
        return result, out_count, handle, EventOverlap(None), hook

    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor,
                            topk_weights: torch.Tensor, handle: tuple, use_logfmt: bool = False,
                            zero_copy: bool = False, async_finish: bool = False,
                            return_recv_hook: bool = False, out: torch.Tensor | None = None,
                            combine_wait_recv_cost_stats=None):
        src_info, layout, cap, h, num_experts = handle
        w = self.group_size
        el = num_experts // w
        assert x.dtype == torch.bfloat16 and x.is_contiguous()
        assert tuple(x.shape) == (el, w * cap, h), (tuple(x.shape), (el, w * cap, h))
        assert topk_weights.dtype == torch.float32 and topk_weights.is_contiguous()
        assert topk_idx.dtype == topk_idx_t and topk_idx.shape == topk_weights.shape
        assert topk_idx.shape[0] <= cap
        assert not (async_finish and return_recv_hook) and not zero_copy
        self._ll_begin((cap, h, num_experts))
        # each source rank's block of each local expert goes back with (global expert, token)
        parts_x, parts_meta = [], []
        for s in range(w):
            rows, meta = [], []
            for e in range(el):
                begin, n = int(layout[e, s]) >> 32, int(layout[e, s]) & 0xFFFFFFFF
                rows.append(x[e, begin:begin + n].float())
                tok = src_info[e, begin:begin + n].to(torch.int64)
                meta.append(torch.stack([torch.full_like(tok, self.rank * el + e), tok], 1))
            parts_x.append(torch.cat(rows))
            parts_meta.append(torch.cat(meta))
        got_x, got_meta = _exchange(parts_x, self.group), _exchange(parts_meta, self.group)
        t = topk_idx.shape[0]
        slot: dict[tuple[int, int], torch.Tensor] = {}
        for gx, gm in zip(got_x, got_meta):
            for row, (g, tok) in zip(gx, gm.tolist()):
                slot[(g, tok)] = row
        combined = torch.zeros((t, h), dtype=torch.float32)
        for tok in range(t):
            for k in range(topk_idx.shape[1]):
                g = int(topk_idx[tok, k])
                if g >= 0:
                    combined[tok] += topk_weights[tok, k] * slot[(g, tok)]
        result = out if out is not None else torch.empty((t, h), dtype=torch.bfloat16)
        result.fill_(float("nan"))
        hook = self._ll_finish(return_recv_hook, [result], [combined.to(torch.bfloat16)])
        return result, EventOverlap(None), hook

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int,
                                 num_experts: int) -> None:
        self._ll_pending = False

    def get_next_low_latency_combine_buffer(self, handle: Any) -> torch.Tensor:
        raise NotImplementedError("fake deep_ep: zero-copy combine buffers are not modelled")

    # -- normal (high-throughput) mode ------------------------------------------------------
    def _check_normal(self, previous_event, async_finish, allocate_on_comm_stream) -> None:
        if self.group_size not in (2, 4, 8):
            raise RuntimeError("Assertion error csrc/kernels/intranode.cu:157 'Unsupported ranks'")
        if allocate_on_comm_stream:
            assert previous_event is not None and async_finish

    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int,
                            previous_event=None, async_finish: bool = False,
                            allocate_on_comm_stream: bool = False):
        w = self.group_size
        el = num_experts // w
        valid = topk_idx >= 0
        ranks = torch.div(topk_idx, el, rounding_mode="floor")
        in_rank = torch.stack([((ranks == r) & valid).any(-1) for r in range(w)], dim=1)
        per_rank = in_rank.sum(0).to(torch.int32)
        per_expert = torch.stack([((topk_idx == g) & valid).any(-1).sum()
                                  for g in range(num_experts)]).to(torch.int32)
        event = EventOverlap(EventHandle() if async_finish else None)
        return per_rank, None, per_expert, in_rank, event

    def dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                 is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None,
                 topk_weights=None, expert_alignment: int = 1, num_worst_tokens: int = 0,
                 config=None, previous_event=None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False):
        self._check_normal(previous_event, async_finish, allocate_on_comm_stream)
        assert handle is None, "fake deep_ep: the cached-handle dispatch is not modelled"
        assert x.dtype == torch.bfloat16 and topk_idx is not None and topk_weights is not None
        w, t, h = self.group_size, x.shape[0], x.shape[1]
        el = num_tokens_per_expert.shape[0] // w
        parts_x, parts_meta = [], []
        for r in range(w):
            idx = is_token_in_rank[:, r].nonzero().flatten()
            local = topk_idx[idx] - r * el
            mine = (topk_idx[idx] >= 0) & (local >= 0) & (local < el)
            ids = torch.where(mine, local, -1)
            wts = torch.where(mine, topk_weights[idx], 0.0)
            parts_x.append(x[idx].float())
            parts_meta.append(torch.cat([idx.unsqueeze(1).double(), ids.double(),
                                         wts.double()], dim=1))
        got_x, got_meta = _exchange(parts_x, self.group), _exchange(parts_meta, self.group)
        counts = [g.shape[0] for g in got_x]
        n = sum(counts)
        rows = num_worst_tokens if num_worst_tokens > 0 else n
        assert rows >= n, f"num_worst_tokens {num_worst_tokens} < received {n}"
        k = topk_idx.shape[1]
        recv_x = torch.full((rows, h), float("nan"), dtype=torch.bfloat16)
        recv_ids = torch.full((rows, k), -1, dtype=topk_idx_t)
        recv_w = torch.full((rows, k), float("nan"), dtype=torch.float32)
        recv_src = torch.full((rows,), -1, dtype=torch.int32)
        if n:
            recv_x[:n] = torch.cat(got_x).to(torch.bfloat16)
            meta = torch.cat(got_meta)
            recv_src[:n] = meta[:, 0].to(torch.int32)
            recv_ids[:n] = meta[:, 1:1 + k].to(topk_idx_t)
            recv_w[:n] = meta[:, 1 + k:].to(torch.float32)
        # rank_prefix_matrix[i, j]: tokens rank j received from ranks <= i
        mine = torch.tensor(counts, dtype=torch.int32)
        table = [torch.empty_like(mine) for _ in range(w)]
        dist.all_gather(table, mine, group=self.group)
        rank_prefix = torch.stack(table, dim=1).cumsum(0).to(torch.int32)
        # send_head[t, r]: the row of rank r's receive buffer holding token t (-1: not sent)
        pos = torch.full((t, w), -1, dtype=torch.int32)
        for r in range(w):
            idx = is_token_in_rank[:, r].nonzero().flatten()
            pos[idx, r] = torch.arange(idx.numel(), dtype=torch.int32)
        # row of token t in rank r's buffer = (tokens r got from ranks < this one) + pos
        before = torch.stack(table, dim=1)  # [src, dst] counts
        start = torch.cat([torch.zeros((1, w), dtype=torch.int32),
                           before.cumsum(0)[:-1].to(torch.int32)])[self.rank]
        send_head = torch.where(pos >= 0, pos + start.unsqueeze(0), -1).to(torch.int32)
        c = (config or Config(Buffer.num_sms)).num_sms // 2
        channel = torch.zeros((w, c), dtype=torch.int32)
        recv_channel = torch.zeros((w, c), dtype=torch.int32)
        handle = (rank_prefix, channel, recv_channel, recv_src, is_token_in_rank, send_head)
        if num_worst_tokens > 0:
            per_expert: list[int] = []
        else:
            HOST_READS[0] += 1
            per_expert = [int(((recv_ids[:n] == e).any(-1)).sum()) for e in range(el)]
        event = EventOverlap(EventHandle() if async_finish else None)
        return recv_x, recv_ids, recv_w, per_expert, handle, event

    def combine(self, x, handle, topk_weights=None, bias=None, config=None, previous_event=None,
                async_finish: bool = False, allocate_on_comm_stream: bool = False):
        self._check_normal(previous_event, async_finish, allocate_on_comm_stream)
        rank_prefix, _, recv_channel, recv_src, _, send_head = handle
        assert x.dtype == torch.bfloat16 and x.shape[0] == recv_src.shape[0]
        w = self.group_size
        # rows of x by source rank: [rank_prefix[s-1, me], rank_prefix[s, me])
        me = self.rank
        bounds = [0] + rank_prefix[:, me].tolist()
        parts = [x[bounds[s]:bounds[s + 1]].float() for s in range(w)]
        got = _exchange(parts, self.group)  # got[r]: rows rank r sends back, in its row order
        t = send_head.shape[0]
        out = torch.zeros((t, x.shape[1]), dtype=torch.float32)
        for r in range(w):
            # the rows rank r holds for this rank start at this rank's offset in its buffer
            head = send_head[:, r]
            sent = head >= 0
            offset = int(head[sent].min()) if bool(sent.any()) else 0
            out[sent] += got[r][(head[sent] - offset).long()]
        event = EventOverlap(EventHandle() if async_finish else None)
        return out.to(torch.bfloat16), None, event
