"""The ``emulated`` comm backend: this device as rank 0 of an EP world of ``W`` ranks.

One GPU measures what one rank of an EP-``W`` deployment sees: the kernels have the shapes of
one rank (``E / W`` local experts over the rows the dispatch delivers), the remote share of
every dispatch and combine really crosses a link (pinned host memory and back, on the copy
engines, both directions at once), and the step is CUDA-graph capturable. The numerics stay
checkable, because the emulated world is built so that rank 0 alone computes the whole answer.

**The world.** ``W`` ranks run identical batches; the expert weights repeat every
``E_local = E / W`` experts (expert ``e`` has the weights of expert ``e mod E_local``), and rank
``r``'s routing is rank 0's moved by ``r`` ranks. The world is then symmetric: what rank 0 sends
to rank ``r`` is what it receives from rank ``r`` (with expert ids relabelled mod ``E_local``),
and what rank ``r`` sends back in the combine is the output for the rows rank 0 sent it. So
rank 0 can run its ``E_local`` experts over every received row and sum the returned rows: the
result equals the same model with ``E`` experts (weights repeating every ``E_local``) run
unsplit on one device with the ``local`` backend. :func:`dispatch` / :func:`combine` check it
in tests (``tests/test_emulated.py``).

**Layout** (``T`` = the token dim, ``K`` = top-k, ``F = min(K, W - 1)`` = the fan-out: a token
reaches at most ``F`` remote ranks through ``F`` of its slots; ``G = 1 + F`` rows per token)::

    dispatch recv rows [T * G, ...], token-major: row t*G + 0   = token t for rank 0 (local)
                                                  row t*G + 1+j = token t for its j-th remote
                                                                  rank (ascending rank order)
    combine  y         [T * G, H] in that layout -> out [T, H] = sum over the G rows of token t

Each slot of a token is in exactly one row, with its local id (``id mod E_local``) and weight;
a row with no slot has ids ``-1``, weights 0 and zeros. A token with more than ``F`` remote
ranks (``K > W - 1`` cannot, larger ``K`` in no model here) would not exist; the local row would
take such slots (exact, the weights repeat), so no slot is ever dropped.

**What crosses the link** (static shapes for CUDA-graph capture vs a data-dependent routed
volume): the *remote* rows of the dispatch (the payload rows of :func:`payload_layout`:
``x[t]`` and the slots' ids and weights, what DeepEP sends) and of the combine (``H`` columns)
are packed, in token-major order, into a link buffer of a static **capacity** of ``C(T)`` rows,
``C(T) = min(T * F, ceil(m * T * capacity_factor))``, ``m = (W - 1) * (1 - comb(E - E_local,
K) / comb(E, K))`` the expected number of remote ranks per token under uniform top-``K``
routing (the routed volume, not the ``torch`` backend's fixed ``W * T`` capacity). The buffer
goes to pinned host memory and back (both directions at once, in ``n`` chunks: the way back
trails the way out by one chunk, so a round trip of ``V`` bytes takes about ``V / bw * (1 +
1/n)`` plus a few µs per chunk, ``n ~ sqrt(V / bw / 3 µs)``, at most 16); the rows come back
to their places. A row past the capacity (**overflow**) takes the device-side copy instead:
exact, and counted (:meth:`EmulatedWorld.stats`); its bytes do not cross the link, so a run
with overflow under-counts the comm by the counted rows. The combine finds the rows that
matter by value (a row of ``y`` that is all zeros needs no transfer: its contribution is zero).
The local share (row ``t*G``) never leaves the device.

**Send and receive** (the receive phase, as DeepEP low-latency's hook): an op called with
``defer_receive`` (``dbo.moe_dispatch`` / ``dbo.moe_combine`` in a split program: the compiler
sets it, ``passes/insert_yields.py``) packs its rows and starts the copies, then returns; its
receive (:meth:`EmulatedBackend` ``receive``, a schedule unit of its own) makes the stream wait
for that op's copies (its own event) and unpacks them (dispatch) or sums them (combine) into
the result. Meanwhile the comm stream packs the next op, whose copies follow on the link. The
backend's pool allows two calls in flight (``ResultPool("link", in_flight=2)``): each holds one
of the link's two pinned host slots until it is received; a third is refused
(:class:`~dbo_compile.errors.CommBackendError`), never a race. :func:`serial_link` finishes
every send before it returns (the benchmark's "split serial").

**Throttling.** The copies run at the hardware's pace (measured on one H200: 51 GB/s per
direction alone, 84–91 GB/s both at once: ``docs/references.md``). Where the asked
``link_gbps`` is below the hardware's duplex figure (``copy_gbps``, measured at the first eager
call unless given) each chunk is copied ``copy_gbps / link_gbps`` times (the link is busy as a
slower one would be); above it the link runs at the hardware's pace (logged). ``latency_us``
adds a spin kernel of that length on the link's stream before the first copy.

**What the emulation does not capture**: switch congestion and incast (one host link, no
fabric), stragglers and rank-to-rank skew (every rank runs the same batch, so no rank waits for
a slower one), skewed routing *across* ranks (rank 0's load is every rank's), NVLink-forwarded
internode traffic (DeepEP's normal kernels send a token once per node over RDMA and fan out over
NVLink: one flat link here), and SM-holding comm kernels (copy engines hold no SM; emulate the
cost with ``DboConfig.emulate_comm_sms``, an SM carve-out of compute while the split program
runs, as DeepEP reserves 20–24 SMs).

Usage (the bench and tests build the model with ``emulated_world_size=W``, see
:class:`~dbo_compile.models.DeepseekMoEModel`)::

    compiled = torch.compile(model, backend="dbo", options={
        "comm_backend": "emulated", "emulate_world_size": 8, "emulate_link_gbps": 50.0})
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import math
import threading
from typing import Any, Callable

import torch
import torch.fx as fx

from dbo_compile.errors import CommBackendError, CommOpError
from dbo_compile.ops._triton import triton_kernels
from dbo_compile.ops.comm import (
    CommBackend,
    ResultPool,
    _check_dispatch_args,
    _meta_view,
    get_comm_backend,
    payload_layout,
    register_comm_backend,
    result_key,
)
from dbo_compile.ops.registry import (
    backend_spec,
    bound_backend,
    comm_group_name,
    comm_kind,
    op_arg,
    op_info,
)

log = logging.getLogger(__name__)

__all__ = ["EmulatedBackend", "EmulatedWorld", "NAME", "bind_name", "check_built_for",
           "emulated_backend", "is_emulated", "link_figures", "register_emulated", "reset_stats",
           "serial_link", "stats", "without_link"]

#: the name users give (``DboConfig.comm_backend``); registered instances are ``NAME:...``
NAME = "emulated"

#: defaults of the options the config leaves at ``None``
DEFAULT_LINK_GBPS = 50.0
DEFAULT_CAPACITY_FACTOR = 1.1
#: the hardware's duplex copy figure per direction when it cannot be measured (one H200:
#: 84–91 GB/s both directions together, docs/references.md)
FALLBACK_COPY_GBPS = 44.0


@dataclasses.dataclass(frozen=True)
class EmulatedWorld:
    """The parameters of one emulated EP world (what a registered instance runs with).

    Attributes:
        world_size: ``W``, the emulated EP ranks (this device is rank 0).
        num_experts: ``E``, global routed experts (a multiple of ``W``).
        top_k: ``K``, slots per token.
        link_gbps: asked link bandwidth per direction, GB/s.
        latency_us: added per dispatch / combine, µs.
        copy_gbps: the hardware's duplex copy bandwidth per direction, GB/s (``None``:
            measured at the first eager call on CUDA, else :data:`FALLBACK_COPY_GBPS`).
        capacity_factor: link capacity over the expected remote rows (>= 1).
    """

    world_size: int
    num_experts: int
    top_k: int
    link_gbps: float = DEFAULT_LINK_GBPS
    latency_us: float = 0.0
    copy_gbps: float | None = None
    capacity_factor: float = DEFAULT_CAPACITY_FACTOR

    def __post_init__(self) -> None:
        w, e, k = self.world_size, self.num_experts, self.top_k
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (w, e, k)):
            raise CommBackendError(f"emulated EP world: world_size, num_experts and top_k must "
                                   f"be ints, got {w!r}, {e!r}, {k!r}")
        if w < 1 or k < 1 or e < 1 or e % w:
            raise CommBackendError(
                f"emulated EP world: num_experts={e} must be a positive multiple of "
                f"world_size={w} (and top_k={k} >= 1); choose a world size that divides the "
                "expert count")
        if not (self.link_gbps > 0 and self.latency_us >= 0 and self.capacity_factor >= 1
                and (self.copy_gbps is None or self.copy_gbps > 0)):
            raise CommBackendError(f"emulated EP world: bad link figures {self}")

    @property
    def name(self) -> str:
        """The backend spec of this instance (:func:`~dbo_compile.ops.registry.backend_spec`:
        ``emulated:capacity_factor=1.1,copy_gbps=auto,...,world_size=8``), which the registry
        configures (:func:`_configure`) and the compiler binds into the ops."""
        return backend_spec(NAME, {
            "world_size": self.world_size, "num_experts": self.num_experts, "top_k": self.top_k,
            "link_gbps": f"{self.link_gbps:g}", "latency_us": f"{self.latency_us:g}",
            "copy_gbps": "auto" if self.copy_gbps is None else f"{self.copy_gbps:g}",
            "capacity_factor": f"{self.capacity_factor:g}"})

    @property
    def local_experts(self) -> int:
        return self.num_experts // self.world_size

    @property
    def fanout(self) -> int:
        """``F``: remote rows per token (``min(K, W - 1)``)."""
        return min(self.top_k, self.world_size - 1)

    @property
    def rows_per_token(self) -> int:
        """``G = 1 + F``: dispatch receive rows per token (local row + fan-out)."""
        return 1 + self.fanout

    def remote_ranks_per_token(self) -> float:
        """``m``: expected remote ranks a token reaches under uniform top-``K`` routing
        without replacement: ``(W - 1) * (1 - comb(E - E_local, K) / comb(E, K))``."""
        e, el, k = self.num_experts, self.local_experts, self.top_k
        miss = math.comb(e - el, k) / math.comb(e, k) if e - el >= k else 0.0
        return (self.world_size - 1) * (1.0 - miss)

    def capacity(self, tokens: int) -> int:
        """``C(T)``: link rows of one dispatch / combine of ``tokens`` tokens (module
        docstring)."""
        want = math.ceil(self.remote_ranks_per_token() * tokens * self.capacity_factor - 1e-9)
        return max(0, min(tokens * self.fanout, want))

    def link_bytes(self, kind: str, tokens: int, hidden: int, itemsize: int) -> int:
        """Bytes one dispatch (payload rows) or combine (``hidden`` columns) of ``tokens``
        tokens sends over the link, per direction (the static capacity)."""
        cols = hidden if kind == "combine" else payload_cols(hidden, itemsize, self.top_k)
        return self.capacity(tokens) * cols * itemsize


def payload_cols(hidden: int, itemsize: int, top_k: int) -> int:
    """Columns of a dispatch payload row (:func:`~dbo_compile.ops.comm.payload_layout`) for an
    element size in bytes."""
    dtype = {1: torch.uint8, 2: torch.bfloat16, 4: torch.float32, 8: torch.float64}[itemsize]
    return payload_layout(hidden, dtype, top_k)[1]


# --------------------------------------------------------------------------------------------
# The link: pinned host memory and back, two copy streams, chunked (full duplex)
# --------------------------------------------------------------------------------------------


class _Link:
    """Per-process link state: copy streams, events and pinned buffers per CUDA device, the
    measured hardware figures, and the overflow counters.

    Pinned buffers are never freed (a captured graph holds their address). Each device has
    :data:`_SLOTS` of them, so that two transfers can be in flight at once (an op whose
    receive is deferred, :meth:`send`): a transfer takes a free slot and frees it when it is
    finished. A slot is reused only after the stream that sends next has waited for the
    transfer that used it last (all comm ops of a program run on one stream, and an op that
    is not deferred finishes before it returns).
    """

    def __init__(self):
        self._lock = threading.Lock()
        self.enabled = True
        #: False within serial_link(): a send finishes before it returns
        self.overlap = True
        self.streams: dict[int, tuple[Any, Any]] = {}
        self.events: dict[int, list[Any]] = {}
        self.host: dict[Any, list[torch.Tensor | None]] = {}
        self.busy: dict[Any, list[bool]] = {}
        self.kept: list[torch.Tensor] = []
        self.copy_gbps: dict[int, float] = {}
        self.cycles_per_us: dict[int, float] = {}
        self.counters: dict[Any, torch.Tensor] = {}

    # -- buffers ----------------------------------------------------------------------------
    @staticmethod
    def _key(device: torch.device) -> Any:
        return device.index if device.type == "cuda" else "cpu"

    def host_buffer(self, device: torch.device, nbytes: int, slot: int = 0) -> torch.Tensor:
        """Slot ``slot``'s pinned (CUDA) or plain (CPU) byte buffer of at least ``nbytes``
        (every slot of the device grows with it: a capture may draw another slot than the
        eager run that sized them)."""
        key = self._key(device)
        bufs = self.host.setdefault(key, [None] * _SLOTS)
        have = min(0 if b is None else b.numel() for b in bufs)
        if have < nbytes:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise CommOpError(
                    f"emulated link: {nbytes} bytes of pinned host memory are needed during "
                    f"CUDA-graph capture (have {have}); run the step once eagerly before "
                    "capturing (CudaGraphRunner and dbo_compile.runtime.capture do)")
            size = max(nbytes, 2 * have, 1 << 20)
            for i, buf in enumerate(bufs):
                if buf is not None and buf.numel() >= nbytes:
                    continue
                if buf is not None:
                    self.kept.append(buf)  # a captured graph may still hold its address
                bufs[i] = torch.empty(size, dtype=torch.uint8, pin_memory=device.type == "cuda")
        return bufs[slot]

    def take_slot(self, device: torch.device) -> int:
        """A free host-buffer slot of ``device``, now busy.

        Raises:
            CommOpError: every slot holds a transfer in flight (more than :data:`_SLOTS`
                deferred ops at once: the backend's pool allows as many).
        """
        busy = self.busy.setdefault(self._key(device), [False] * _SLOTS)
        for i, b in enumerate(busy):
            if not b:
                busy[i] = True
                return i
        raise CommOpError(f"emulated link: {_SLOTS} transfers are in flight on {device}, none "
                          "finished; receive one before sending another (the backend's pool "
                          f"allows {_SLOTS} calls in flight)")

    def free_slot(self, device: torch.device, slot: int) -> None:
        self.busy[self._key(device)][slot] = False

    def cuda_streams(self, index: int) -> tuple[Any, Any]:
        if index not in self.streams:
            self.streams[index] = (torch.cuda.Stream(device=index), torch.cuda.Stream(device=index))
            self.cuda_events(index, _MAX_CHUNKS + _SLOTS)  # made here, not during a capture
        return self.streams[index]

    def cuda_events(self, index: int, n: int) -> list[Any]:
        evs = self.events.setdefault(index, [])
        while len(evs) < n:
            evs.append(torch.cuda.Event())
        return evs[:n]

    def counter(self, device: torch.device) -> torch.Tensor | None:
        """``[4]`` int64 on ``device``: dispatch rows that mattered, of them past the capacity,
        the same for the combine (``None`` while capturing before the first eager call)."""
        key = str(device)
        if key not in self.counters:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                return None
            self.counters[key] = torch.zeros(4, dtype=torch.int64, device=device)
        return self.counters[key]

    # -- measured figures -------------------------------------------------------------------
    def measure(self, index: int) -> None:
        """The duplex copy figure and the spin kernel's clock, once per device (eager only)."""
        if index in self.copy_gbps or torch.cuda.is_current_stream_capturing():
            return
        with self._lock:
            if index in self.copy_gbps:
                return
            dev = torch.device("cuda", index)
            s_out, s_in = self.cuda_streams(index)
            n = 64 << 20
            src = torch.empty(n, dtype=torch.uint8, device=dev)
            dst = torch.empty_like(src)
            h1 = torch.empty(n, dtype=torch.uint8, pin_memory=True)
            h2 = torch.empty(n, dtype=torch.uint8, pin_memory=True)
            torch.cuda.synchronize(dev)
            best = 0.0
            for _ in range(3):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                c = torch.cuda.Event(enable_timing=True)
                cur = torch.cuda.current_stream(dev)
                a.record(cur)
                s_out.wait_stream(cur)
                s_in.wait_stream(cur)
                with torch.cuda.stream(s_out):
                    h1.copy_(src, non_blocking=True)
                with torch.cuda.stream(s_in):
                    dst.copy_(h2, non_blocking=True)
                cur.wait_stream(s_out)
                b.record(cur)
                cur.wait_stream(s_in)
                c.record(cur)
                torch.cuda.synchronize(dev)
                ms = max(a.elapsed_time(b), a.elapsed_time(c))
                best = max(best, n / (ms * 1e6))
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            torch.cuda._sleep(1_000_000)
            b.record()
            torch.cuda.synchronize(dev)
            self.cycles_per_us[index] = 1_000_000 / max(a.elapsed_time(b) * 1e3, 1e-3)
            self.copy_gbps[index] = best
            log.info("emulated link on cuda:%d: duplex copies %.1f GB/s per direction, "
                     "spin clock %.0f cycles/us", index, best, self.cycles_per_us[index])

    # -- one round trip ---------------------------------------------------------------------
    def round_trip(self, src: torch.Tensor, world: EmulatedWorld) -> torch.Tensor:
        """``src [rows, cols]`` (contiguous) out to host memory and back; a new tensor, ready
        on the current stream."""
        return self.send(src, world).finish()

    def send(self, src: torch.Tensor, world: EmulatedWorld) -> "_Transfer":
        """Start the round trip of ``src [rows, cols]`` (contiguous) on the link's copy
        streams after the work queued on the current stream; :meth:`_Transfer.finish` makes
        the stream it is called on wait for the copies back and returns the new tensor.
        Until then the current stream is free for other work (the next op's packing)."""
        if not self.enabled:  # without_link(): the rows stay where they are
            return _Transfer(src)
        out = torch.empty_like(src)
        nbytes = src.numel() * src.element_size()
        if nbytes == 0:
            return _Transfer(out)
        slot = self.take_slot(src.device)
        try:
            return self._send(src, out, nbytes, slot, world)
        except BaseException:  # nothing holds the transfer: its slot is free again
            self.free_slot(src.device, slot)
            raise

    def _send(self, src: torch.Tensor, out: torch.Tensor, nbytes: int, slot: int,
              world: EmulatedWorld) -> "_Transfer":
        host = self.host_buffer(src.device, nbytes, slot)[:nbytes]
        host = host.view(src.dtype).view(src.shape)
        if not src.is_cuda:  # synchronous copies; the slot is held until finished all the same
            host.copy_(src)
            out.copy_(host)
            return _Transfer(out, slot=(self, src.device, slot))
        index = src.device.index if src.device.index is not None else torch.cuda.current_device()
        self.measure(index)
        hw = world.copy_gbps or self.copy_gbps.get(index, FALLBACK_COPY_GBPS)
        repeat = max(1.0, hw / world.link_gbps)
        rows = src.shape[0]
        # n chunks: the second direction trails the first by one chunk, each copy has a setup
        # cost (~3 µs): the round trip takes ~ V/bw (1 + 1/n) + 3n µs, least at sqrt(V/bw / 3)
        t_link = nbytes / (min(hw, world.link_gbps) * 1e3)
        chunks = max(1, min(_MAX_CHUNKS, rows, round(math.sqrt(t_link / 3.0))))
        bounds = [rows * i // chunks for i in range(chunks + 1)]
        cur = torch.cuda.current_stream(src.device)
        s_out, s_in = self.cuda_streams(index)
        evs = self.cuda_events(index, _MAX_CHUNKS + _SLOTS)
        s_out.wait_stream(cur)
        s_in.wait_stream(cur)
        with torch.cuda.stream(s_out):
            if world.latency_us > 0:
                cyc = self.cycles_per_us.get(index, 1980.0)
                torch.cuda._sleep(int(world.latency_us * cyc))
        for i in range(chunks):
            a, b = bounds[i], bounds[i + 1]
            if a == b:
                continue
            with torch.cuda.stream(s_out):
                _copies(host[a:b], src[a:b], repeat)
                evs[i].record(s_out)
            with torch.cuda.stream(s_in):
                s_in.wait_event(evs[i])
                _copies(out[a:b], host[a:b], repeat)
        # the way back waited for every chunk out: its end is the transfer's end
        done = evs[_MAX_CHUNKS + slot]
        done.record(s_in)
        if not self.overlap:  # serial_link(): nothing runs beside the transfer
            cur.wait_event(done)
        return _Transfer(out, done, (src,), (self, src.device, slot))


@dataclasses.dataclass
class _Transfer:
    """A round trip started by :meth:`_Link.send`: ``out`` (``[rows, cols]``, the rows back)
    is ready on a stream once :meth:`finish` was called on it.

    Attributes:
        out: the rows back (complete after :meth:`finish`).
        done: CUDA event recorded after the last copy back (``None``: already complete).
        keep: tensors the copies read, held until then.
        slot: ``(link, device, slot)``: the host-buffer slot to free, or ``None``.
    """

    out: torch.Tensor
    done: Any = None
    keep: tuple = ()
    slot: tuple | None = None

    def finish(self) -> torch.Tensor:
        """The current stream waits for the copies back; returns :attr:`out`."""
        if self.done is not None:
            torch.cuda.current_stream(self.out.device).wait_event(self.done)
            self.done = None
        if self.slot is not None:
            link, device, slot = self.slot
            link.free_slot(device, slot)
            self.slot = None
        self.keep = ()
        return self.out


def _copies(dst: torch.Tensor, src: torch.Tensor, repeat: float) -> None:
    """``dst.copy_(src)`` ``repeat`` times (the fraction as a partial copy): a link at
    ``1 / repeat`` of the copy engine's pace."""
    dst.copy_(src, non_blocking=True)
    extra = repeat - 1.0
    while extra > 1e-3:
        rows = dst.shape[0] if extra >= 1.0 else max(1, int(dst.shape[0] * extra))
        dst[:rows].copy_(src[:rows], non_blocking=True)
        extra -= 1.0


_MAX_CHUNKS = 16
#: host-buffer slots per device: transfers in flight at once (the backend's pool)
_SLOTS = 2
_LINK = _Link()


@contextlib.contextmanager
def without_link():
    """Within the block (and in CUDA graphs captured in it) the link copies nothing: the
    split program's compute and the backend's own packing alone ("split without comm")."""
    was, _LINK.enabled = _LINK.enabled, False
    try:
        yield
    finally:
        _LINK.enabled = was


@contextlib.contextmanager
def serial_link():
    """Within the block (and in CUDA graphs captured in it) every send finishes before it
    returns: the stream that sent waits for the copies back, so no transfer overlaps the work
    issued after it, as in a program whose comm runs in turn with its compute ("split
    serial"; an op with a deferred receive otherwise keeps the stream free while its copies
    fly)."""
    was, _LINK.overlap = _LINK.overlap, False
    try:
        yield
    finally:
        _LINK.overlap = was


def reset_stats() -> None:
    """Zero the overflow counters (every device)."""
    for c in _LINK.counters.values():
        c.zero_()


def stats() -> dict[str, dict[str, int]]:
    """Per device: ``dispatch_rows`` / ``combine_rows`` (remote rows that mattered) and
    ``dispatch_overflow`` / ``combine_overflow`` (of them, rows past the link capacity, which
    took the device-side copy), summed since the last :func:`reset_stats` (one device read)."""
    out = {}
    for dev, c in _LINK.counters.items():
        v = c.tolist()
        out[dev] = {"dispatch_rows": v[0], "dispatch_overflow": v[1], "combine_rows": v[2],
                    "combine_overflow": v[3]}
    return out


def link_figures() -> dict[str, dict[str, float]]:
    """Per CUDA device measured so far: ``copy_gbps`` (duplex, per direction) and the spin
    kernel's ``cycles_per_us``."""
    return {f"cuda:{i}": {"copy_gbps": g, "cycles_per_us": _LINK.cycles_per_us.get(i, 0.0)}
            for i, g in _LINK.copy_gbps.items()}


# --------------------------------------------------------------------------------------------
# Routing (torch ops; the Triton kernels below compute the same)
# --------------------------------------------------------------------------------------------


def slot_rows(ids: torch.Tensor, world: EmulatedWorld) -> torch.Tensor:
    """``[T, K]`` int64: the row of each slot within its token's ``G`` rows (0 = local, ``1+j``
    = the token's ``j``-th remote rank in ascending order, ``-1`` = no expert: a negative or
    ``>= E`` id). A slot whose remote rank is past the fan-out (none when ``K <= W - 1``) goes
    to the local row."""
    e, el = world.num_experts, world.local_experts
    ok = (ids >= 0) & (ids < e)
    dest = torch.where(ok, torch.div(ids, el, rounding_mode="floor"), -1)
    remote = dest >= 1
    k = ids.shape[1]
    same = dest.unsqueeze(2) == dest.unsqueeze(1)  # [T, K, K']
    earlier = torch.ones(k, k, dtype=torch.bool, device=ids.device).tril(-1)
    first = ~(same & earlier).any(-1)  # the slot is its rank's first
    distinct = remote & first
    less = dest.unsqueeze(1) < dest.unsqueeze(2)  # [T, K(k), K(k')]: dest[k'] < dest[k]
    j = (less & distinct.unsqueeze(1)).sum(-1)
    row = torch.where(remote & (j < world.fanout), 1 + j, 0)
    return torch.where(ok, row, -1)


def _positions(valid: torch.Tensor, cap: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-major link positions of the rows that matter: ``(pos, sent)`` (``sent``: the row
    is within the capacity)."""
    pos = torch.cumsum(valid.to(torch.int64), 0) - 1
    return pos, valid & (pos < cap)


def _count(device: torch.device, offset: int, valid: torch.Tensor, sent: torch.Tensor) -> None:
    c = _LINK.counter(device)
    if c is not None:
        c[offset:offset + 2] += torch.stack([valid.sum(), (valid & ~sent).sum()])


def _through_link(world: EmulatedWorld, fan: torch.Tensor, valid: torch.Tensor, cap: int,
                  counter: int) -> Callable[[], torch.Tensor]:
    """Send the fan-out rows ``fan [N, C]`` that matter (``valid``), packed into the link's
    ``cap`` rows; the returned ``finish()`` waits for them and gives ``fan`` with those rows
    put back in place from the link (rows past ``cap`` keep their device-side values).
    Counted at ``counter`` of the stats."""
    pos, sent = _positions(valid, cap)
    _count(fan.device, counter, valid, sent)
    if cap == 0 or fan.shape[0] == 0:
        return lambda: fan
    link = torch.zeros((cap + 1, fan.shape[1]), dtype=fan.dtype, device=fan.device)
    link.index_copy_(0, torch.where(sent, pos, cap), fan)  # row cap: the unsent rows
    transfer = _LINK.send(link[:cap], world)

    def finish() -> torch.Tensor:
        got = transfer.finish().index_select(0, torch.where(sent, pos, 0))
        return torch.where(sent.unsqueeze(-1), got, fan)

    return finish


#: an op's issue: ``(result, finish)``; ``finish()`` completes ``result`` in place on the
#: current stream (the op's receive phase, :meth:`EmulatedBackend` ``receive``)
Issued = tuple[Any, Callable[[], None]]


def _now(issued: Issued) -> Any:
    """An op issued and finished at once: its result."""
    result, finish = issued
    finish()
    return result


def _dispatch_torch_issue(world: EmulatedWorld, x, topk_ids, topk_weights) -> Issued:
    t, h = x.shape
    k = topk_ids.shape[1]
    g = world.rows_per_token
    el = world.local_experts
    meta_col, cols = payload_layout(h, x.dtype, k)
    row = slot_rows(topk_ids, world)  # [T, K]
    mine = row.unsqueeze(1) == torch.arange(g, device=x.device).view(1, g, 1)  # [T, G, K]
    valid = mine.any(-1)  # [T, G]
    lid = torch.remainder(topk_ids, el)
    payload = torch.zeros((t, g, cols), dtype=x.dtype, device=x.device)
    payload[..., :h] = torch.where(valid.unsqueeze(-1), x.unsqueeze(1),
                                   torch.zeros((), dtype=x.dtype, device=x.device))
    _meta_view(payload, meta_col).copy_(torch.cat([
        torch.where(mine, lid.unsqueeze(1), -1).to(torch.float32),
        torch.where(mine, topk_weights.unsqueeze(1), 0.0)], dim=-1))
    fan_back = _through_link(world, payload[:, 1:].reshape(t * world.fanout, cols),
                             valid[:, 1:].reshape(-1), world.capacity(t), 0)
    out = (x.new_empty((t * g, h)), topk_ids.new_empty((t * g, k), dtype=torch.int64),
           torch.empty((t * g, k), dtype=torch.float32, device=x.device))

    def finish() -> None:
        fan = fan_back()
        recv = torch.cat([payload[:, :1], fan.view(t, world.fanout, cols)], dim=1)
        recv = recv.view(t * g, cols)
        meta = _meta_view(recv, meta_col)
        out[0].copy_(recv[:, :h])
        out[1].copy_(meta[:, :k])
        out[2].copy_(meta[:, k:])

    return out, finish


def _combine_torch_issue(world: EmulatedWorld, y) -> Issued:
    g = world.rows_per_token
    t, h = y.shape[0] // g, y.shape[1]
    y = y.contiguous()
    grouped = y.view(t, g, h)
    fan = grouped[:, 1:].reshape(t * world.fanout, h)
    fan_back = _through_link(world, fan, (fan != 0).any(-1), world.capacity(t), 2)
    out = y.new_empty((t, h))

    def finish() -> None:
        acc = torch.float32 if y.dtype in (torch.float16, torch.bfloat16) else y.dtype
        total = grouped[:, 0].to(acc)
        back = fan_back().view(t, world.fanout, h)
        for j in range(world.fanout):  # in the Triton kernel's order: the same bits
            total = total + back[:, j].to(acc)
        out.copy_(total)

    return out, finish


def _dispatch_torch(world: EmulatedWorld, x, topk_ids, topk_weights):
    """The dispatch with torch ops, issued and finished: ``(recv_x [T*G, H], recv_ids [T*G,
    K] int64, recv_weights [T*G, K] fp32)`` (module docstring)."""
    return _now(_dispatch_torch_issue(world, x, topk_ids, topk_weights))


def _combine_torch(world: EmulatedWorld, y):
    """The combine with torch ops, issued and finished: ``[T, H]`` of ``y.dtype``."""
    return _now(_combine_torch_issue(world, y))


# --------------------------------------------------------------------------------------------
# Triton kernels (CUDA): route + pack in one kernel, unpack in one, the combine's sum in one
# --------------------------------------------------------------------------------------------


@triton_kernels
def _kernels(triton, tl):

    @triton.jit
    def emulated_dispatch_route(ids_ptr, row_ptr, valid_ptr, T, E, EL, K: tl.constexpr,
                                K_P2: tl.constexpr, G: tl.constexpr, G_P2: tl.constexpr):
        """Token ``t``: each slot's row (as :func:`slot_rows`) and which of its ``G`` rows
        hold a slot."""
        t = tl.program_id(0).to(tl.int64)
        ks = tl.arange(0, K_P2)
        km = ks < K
        ids = tl.load(ids_ptr + t * K + ks, mask=km, other=-1)
        ok = (ids >= 0) & (ids < E) & km
        dest = tl.where(ok, ids // EL, -1)
        d_row = dest[:, None]
        d_col = dest[None, :]
        earlier = ks[None, :] < ks[:, None]
        dup = tl.max(((d_row == d_col) & earlier).to(tl.int32), axis=1)
        distinct = (dest >= 1) & (dup == 0)
        j = tl.sum(((d_col < d_row) & distinct[None, :]).to(tl.int32), axis=1)
        row = tl.where((dest >= 1) & (j < G - 1), 1 + j, 0)
        row = tl.where(ok, row, -1)
        tl.store(row_ptr + t * K + ks, row.to(tl.int32), mask=km)
        gs = tl.arange(0, G_P2)
        has = tl.max((row[None, :] == gs[:, None]).to(tl.int32), axis=1)
        tl.store(valid_ptr + t * G + gs, has.to(tl.int8), mask=gs < G)

    @triton.jit
    def emulated_dispatch_pack(x_ptr, ids_ptr, w_ptr, row_ptr, valid_ptr, pos_ptr,
                               out_x_ptr, out_ids_ptr, out_w_ptr, link_ptr, link_meta_ptr,
                               inv_ptr, count_ptr, H, stride_x, EL, cap, link_cols,
                               link_meta_row, K: tl.constexpr, K_P2: tl.constexpr,
                               G: tl.constexpr, BLOCK_H: tl.constexpr, COUNT: tl.constexpr):
        """Row ``(t, g)``: the local row and the fan-out rows that do not cross the link are
        written to the outputs; those that do, to link row ``pos`` (with ``inv[pos]``).
        ``COUNT``: fan-out rows that matter and those past the capacity are added to
        ``count[0]`` / ``count[1]``."""
        r = tl.program_id(0).to(tl.int64)
        t = r // G
        gg = r % G
        ks = tl.arange(0, K_P2)
        km = ks < K
        rows = tl.load(row_ptr + t * K + ks, mask=km, other=-1)
        mine = rows == gg
        valid = tl.load(valid_ptr + r) != 0
        ids = tl.load(ids_ptr + t * K + ks, mask=km, other=0)
        lid = tl.where(mine, ids % EL, -1)
        w = tl.where(mine, tl.load(w_ptr + t * K + ks, mask=km, other=0.0), 0.0)
        fan = (t * (G - 1) + gg - 1)
        pos = tl.load(pos_ptr + fan, mask=gg > 0, other=0)
        linked = (gg > 0) & valid & (pos < cap)
        cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        cm = cols < H
        if valid:
            xv = tl.load(x_ptr + t * stride_x + cols, mask=cm)
        else:
            xv = tl.zeros([BLOCK_H], dtype=out_x_ptr.dtype.element_ty)
        if COUNT:
            if (tl.program_id(1) == 0) & (gg > 0) & valid:
                tl.atomic_add(count_ptr, 1)
                if pos >= cap:
                    tl.atomic_add(count_ptr + 1, 1)
        if linked:
            tl.store(link_ptr + pos * link_cols + cols, xv, mask=cm)
            if tl.program_id(1) == 0:
                tl.store(link_meta_ptr + pos * link_meta_row + ks, lid.to(tl.float32), mask=km)
                tl.store(link_meta_ptr + pos * link_meta_row + K + ks, w, mask=km)
                tl.store(inv_ptr + pos, r)
        else:
            tl.store(out_x_ptr + r * H + cols, xv, mask=cm)
            if tl.program_id(1) == 0:
                tl.store(out_ids_ptr + r * K + ks, lid, mask=km)
                tl.store(out_w_ptr + r * K + ks, w, mask=km)

    @triton.jit
    def emulated_dispatch_unpack(link_ptr, link_meta_ptr, inv_ptr, out_x_ptr, out_ids_ptr,
                                 out_w_ptr, H, link_cols, link_meta_row, K: tl.constexpr,
                                 K_P2: tl.constexpr, BLOCK_H: tl.constexpr):
        """Link row ``i`` back to its receive row ``inv[i]`` (``-1``: an unused link row)."""
        i = tl.program_id(0).to(tl.int64)
        r = tl.load(inv_ptr + i)
        if r >= 0:
            cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
            cm = cols < H
            tl.store(out_x_ptr + r * H + cols, tl.load(link_ptr + i * link_cols + cols, mask=cm),
                     mask=cm)
            if tl.program_id(1) == 0:
                ks = tl.arange(0, K_P2)
                km = ks < K
                lid = tl.load(link_meta_ptr + i * link_meta_row + ks, mask=km, other=-1.0)
                w = tl.load(link_meta_ptr + i * link_meta_row + K + ks, mask=km, other=0.0)
                tl.store(out_ids_ptr + r * K + ks, lid.to(tl.int64), mask=km)
                tl.store(out_w_ptr + r * K + ks, w, mask=km)

    @triton.jit
    def emulated_combine_flag(y_ptr, valid_ptr, H, G: tl.constexpr, BLOCK_H: tl.constexpr):
        """Fan-out row ``f`` (token ``f // (G-1)``, row ``1 + f % (G-1)``): non-zero?"""
        f = tl.program_id(0).to(tl.int64)
        r = (f // (G - 1)) * G + 1 + f % (G - 1)
        acc = tl.zeros([BLOCK_H], dtype=tl.int32)
        for c0 in range(0, H, BLOCK_H):
            cols = c0 + tl.arange(0, BLOCK_H)
            v = tl.load(y_ptr + r * H + cols, mask=cols < H, other=0.0)
            acc = tl.maximum(acc, (v != 0).to(tl.int32))
        tl.store(valid_ptr + f, tl.max(acc, axis=0).to(tl.int8))

    @triton.jit
    def emulated_combine_pack(y_ptr, valid_ptr, pos_ptr, link_ptr, cap, H, G: tl.constexpr,
                              BLOCK_H: tl.constexpr):
        f = tl.program_id(0).to(tl.int64)
        pos = tl.load(pos_ptr + f)
        if (tl.load(valid_ptr + f) != 0) & (pos < cap):
            r = (f // (G - 1)) * G + 1 + f % (G - 1)
            cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
            cm = cols < H
            tl.store(link_ptr + pos * H + cols, tl.load(y_ptr + r * H + cols, mask=cm), mask=cm)

    @triton.jit
    def emulated_combine_sum(y_ptr, back_ptr, valid_ptr, pos_ptr, out_ptr, count_ptr, cap, H,
                             G: tl.constexpr, BLOCK_H: tl.constexpr, COUNT: tl.constexpr):
        """``out[t] = y[t, 0] + sum_j (row j from the link, or y[t, 1+j])``, in fp32 (counts
        as the pack kernel's, at ``count[2:4]``)."""
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        cm = cols < H
        acc = tl.load(y_ptr + t * G * H + cols, mask=cm, other=0.0).to(tl.float32)
        for j in tl.static_range(G - 1):
            f = t * (G - 1) + j
            pos = tl.load(pos_ptr + f)
            ok = tl.load(valid_ptr + f) != 0
            if COUNT:
                if (tl.program_id(1) == 0) & ok:
                    tl.atomic_add(count_ptr + 2, 1)
                    if pos >= cap:
                        tl.atomic_add(count_ptr + 3, 1)
            if ok & (pos < cap):
                v = tl.load(back_ptr + pos * H + cols, mask=cm, other=0.0)
            else:
                v = tl.load(y_ptr + (t * G + 1 + j) * H + cols, mask=cm, other=0.0)
            acc += v.to(tl.float32)
        tl.store(out_ptr + t * H + cols, acc.to(out_ptr.dtype.element_ty), mask=cm)

    return triton, {"route": emulated_dispatch_route, "pack": emulated_dispatch_pack,
                    "unpack": emulated_dispatch_unpack, "flag": emulated_combine_flag,
                    "cpack": emulated_combine_pack, "sum": emulated_combine_sum}


def _dispatch_triton_issue(world: EmulatedWorld, x, topk_ids, topk_weights) -> Issued:
    """The dispatch with the Triton kernels (CUDA; on CPU tensors under the interpreter)."""
    triton, kern = _kernels()
    t, h = x.shape
    k = topk_ids.shape[1]
    g, f = world.rows_per_token, world.fanout
    dev = x.device
    meta_col, cols = payload_layout(h, x.dtype, k)
    if x.stride(1) != 1:
        x = x.contiguous()
    ids, wts = topk_ids.contiguous(), topk_weights.contiguous()
    n = t * g
    out_x = torch.empty((n, h), dtype=x.dtype, device=dev)
    out_ids = torch.empty((n, k), dtype=torch.int64, device=dev)
    out_w = torch.empty((n, k), dtype=torch.float32, device=dev)
    if n == 0:
        return (out_x, out_ids, out_w), _nothing
    row = torch.empty((t, k), dtype=torch.int32, device=dev)
    valid = torch.empty((t, g), dtype=torch.int8, device=dev)
    k_p2, g_p2 = triton.next_power_of_2(k), triton.next_power_of_2(g)
    kern["route"][(t,)](ids, row, valid, t, world.num_experts, world.local_experts, K=k,
                        K_P2=k_p2, G=g, G_P2=g_p2)
    cap = world.capacity(t)
    pos = torch.cumsum(valid[:, 1:].reshape(-1), 0, dtype=torch.int64) - 1
    counter = _LINK.counter(dev)
    link = torch.empty((max(cap, 1), cols), dtype=x.dtype, device=dev)
    link_meta = _meta_view(link, meta_col)
    if meta_col > h:
        link[:, h:meta_col].zero_()
    inv = torch.full((max(cap, 1),), -1, dtype=torch.int64, device=dev)
    block_h = min(1024, triton.next_power_of_2(h))
    grid = (n, triton.cdiv(h, block_h))
    kern["pack"][grid](x, ids, wts, row, valid, pos, out_x, out_ids, out_w, link, link_meta, inv,
                       counter if counter is not None else inv, h, x.stride(0),
                       world.local_experts, cap, cols, link_meta.stride(0), K=k, K_P2=k_p2, G=g,
                       BLOCK_H=block_h, COUNT=counter is not None)
    if cap == 0:
        return (out_x, out_ids, out_w), _nothing
    transfer = _LINK.send(link[:cap], world)

    def finish() -> None:
        back = transfer.finish()
        kern["unpack"][(cap, triton.cdiv(h, block_h))](
            back, _meta_view(back, meta_col), inv, out_x, out_ids, out_w, h, cols,
            link_meta.stride(0), K=k, K_P2=k_p2, BLOCK_H=block_h)

    return (out_x, out_ids, out_w), finish


def _nothing() -> None:
    pass


def _combine_triton_issue(world: EmulatedWorld, y) -> Issued:
    """The combine with the Triton kernels (CUDA; on CPU tensors under the interpreter)."""
    triton, kern = _kernels()
    g, f = world.rows_per_token, world.fanout
    t, h = y.shape[0] // g, y.shape[1]
    dev = y.device
    y = y.contiguous()
    out = torch.empty((t, h), dtype=y.dtype, device=dev)
    if t == 0:
        return out, _nothing
    block_h = min(1024, triton.next_power_of_2(h))
    nf = t * f
    valid = torch.empty(nf, dtype=torch.int8, device=dev)
    if nf:
        kern["flag"][(nf,)](y, valid, h, G=g, BLOCK_H=block_h)
    cap = world.capacity(t)
    pos = torch.cumsum(valid, 0, dtype=torch.int64) - 1
    counter = _LINK.counter(dev)
    transfer = _Transfer(y)  # never read when nothing crosses the link
    if cap > 0 and nf:
        link = torch.empty((cap, h), dtype=y.dtype, device=dev)
        kern["cpack"][(nf, triton.cdiv(h, block_h))](y, valid, pos, link, cap, h, G=g,
                                                     BLOCK_H=block_h)
        transfer = _LINK.send(link, world)

    def finish() -> None:
        back = transfer.finish()
        kern["sum"][(t, triton.cdiv(h, block_h))](
            y, back, valid, pos, out, counter if counter is not None else pos, cap, h, G=g,
            BLOCK_H=block_h, COUNT=counter is not None)

    return out, finish


def _dispatch_triton(world: EmulatedWorld, x, topk_ids, topk_weights):
    """:func:`_dispatch_torch` with the Triton kernels, issued and finished."""
    return _now(_dispatch_triton_issue(world, x, topk_ids, topk_weights))


def _combine_triton(world: EmulatedWorld, y):
    """:func:`_combine_torch` with the Triton kernels, issued and finished."""
    return _now(_combine_triton_issue(world, y))


# --------------------------------------------------------------------------------------------
# The backend
# --------------------------------------------------------------------------------------------


def _use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda and _kernels() is not None


@dataclasses.dataclass(frozen=True)
class EmulatedBackend(CommBackend):
    """A registered instance of the emulated backend (:class:`CommBackend` plus its world).

    Attributes:
        world: the :class:`EmulatedWorld` it emulates.
    """

    world: EmulatedWorld | None = None

    @property
    def recv_rows_per_token(self) -> int:
        """Dispatch receive rows per token (``G``): the expert op's FLOP formula divides its
        rows by it (:func:`dbo_compile.ops.comm.ep_size_of_rows`)."""
        return self.world.rows_per_token



def _check_world(world: EmulatedWorld, x, topk_ids, num_experts) -> None:
    if num_experts != world.num_experts or topk_ids.shape[1] != world.top_k:
        raise CommOpError(
            f"dbo.dispatch with the emulated backend {world.name!r}: called with "
            f"num_experts={num_experts}, top_k={topk_ids.shape[1]}, but the backend was bound "
            f"for num_experts={world.num_experts}, top_k={world.top_k}; every dispatch of a "
            "graph must share them")


def _moved_bytes(world: EmulatedWorld):
    def moved_bytes(kind: str, node: fx.Node, size) -> int:
        """Bytes the comm node sends per direction at the cost model's reference sizes
        (``size``: symbolic size -> int): the link's static capacity."""
        x = node.args[0].meta.get("val")
        rows = size(x.shape[0])
        tokens = rows if kind == "dispatch" else rows // world.rows_per_token
        return world.link_bytes(kind, tokens, size(x.shape[1]), x.element_size())

    return moved_bytes


def _make_backend(world: EmulatedWorld) -> EmulatedBackend:
    #: the calls issued with defer_receive and not yet received: (result key, finish)
    pending: collections.deque = collections.deque()

    def issue(issued: Issued, defer: bool) -> Any:
        result, finish = issued
        if defer:
            pending.append((result_key(result), finish))
        else:
            finish()
        return result

    def check_in_flight() -> None:
        if len(pending) >= _SLOTS:
            raise CommBackendError(
                f"emulated backend {world.name!r}: {len(pending)} calls are in flight (issued "
                "with defer_receive and not received) and another is issued; the link holds "
                f"{_SLOTS} (the backend's pool: in_flight={_SLOTS}); receive one first")

    def dispatch(x, topk_ids, topk_weights, num_experts, group_name, defer_receive=False):
        _check_dispatch_args(x, topk_ids, topk_weights, num_experts, world.world_size)
        _check_world(world, x, topk_ids, num_experts)
        if topk_ids.device.type == "cpu" and topk_ids.numel():
            top = int(topk_ids.max())  # one process: raising hangs no other rank
            if top >= num_experts:
                raise CommOpError(f"dbo.dispatch: topk_ids holds expert id {top} but "
                                  f"num_experts={num_experts}; ids must be < num_experts")
        check_in_flight()
        if _use_triton(x) and x.shape[0]:
            return issue(_dispatch_triton_issue(world, x, topk_ids, topk_weights), defer_receive)
        return issue(_dispatch_torch_issue(world, x, topk_ids, topk_weights), defer_receive)

    def combine(y, group_name, defer_receive=False):  # y is read until the receive
        _check_combine(world, y)
        check_in_flight()
        if _use_triton(y) and y.shape[0]:
            return issue(_combine_triton_issue(world, y), defer_receive)
        return issue(_combine_torch_issue(world, y), defer_receive)

    def receive(value: Any) -> None:
        """The receive phase of a call issued with ``defer_receive``: the current stream
        waits for its rows back and unpacks them (dispatch) or sums them (combine) into the
        result ``value`` (what the call returned). A combine's input ``y`` must stay as it
        was until then (its local rows are summed here; a compiled graph never writes it);
        a dispatch copied what it sends at its issue. Calls may be received in any order."""
        key = result_key(value)
        for i, (k, finish) in enumerate(pending):
            if k is key:
                del pending[i]
                finish()
                return
        raise CommBackendError(
            f"emulated backend {world.name!r}: a receive of a value no call in flight returned "
            f"({len(pending)} in flight); receive each call issued with defer_receive once")

    def abort() -> None:
        """Receive, in order, what a failed step issued and did not receive."""
        while pending:
            log.warning("dbo: emulated backend: receiving a call the aborted step left in flight")
            pending.popleft()[1]()

    def dispatch_fake(x, topk_ids, topk_weights, num_experts, group_name):
        _check_dispatch_args(x, topk_ids, topk_weights, num_experts, world.world_size)
        _check_world(world, x, topk_ids, num_experts)
        n = x.shape[0] * world.rows_per_token
        return (x.new_empty((n, x.shape[1])), topk_ids.new_empty((n, topk_ids.shape[1])),
                topk_weights.new_empty((n, topk_weights.shape[1])))

    def combine_fake(y, group_name):
        _check_combine(world, y)
        return y.new_empty((y.shape[0] // world.rows_per_token, y.shape[1]))

    return EmulatedBackend(
        world.name, dispatch, combine,
        f"emulated EP-{world.world_size} world on one device (rank 0; {world.link_gbps:g} GB/s "
        f"link through pinned host memory)", dispatch_fake, combine_fake,
        pools=(ResultPool("link", in_flight=_SLOTS),), receive=receive, abort=abort,
        moved_bytes=_moved_bytes(world), world=world)


def _configure(world_size: int | None = None, num_experts: int | None = None,
               top_k: int | None = None, link_gbps: float = DEFAULT_LINK_GBPS,
               latency_us: float = 0.0, copy_gbps: Any = "auto",
               capacity_factor: float = DEFAULT_CAPACITY_FACTOR) -> CommBackend:
    """The backend of one emulated world, from the options of its spec
    (:attr:`EmulatedWorld.name`); without a world (the plain name ``"emulated"``), the
    backend that says how to get one.

    Raises:
        CommBackendError: a bad option (see :class:`EmulatedWorld`).
    """
    if world_size is None and num_experts is None and top_k is None:
        return _PLAIN
    return _make_backend(EmulatedWorld(
        world_size=world_size, num_experts=num_experts, top_k=top_k,
        link_gbps=float(link_gbps), latency_us=float(latency_us),
        copy_gbps=None if copy_gbps == "auto" else float(copy_gbps),
        capacity_factor=float(capacity_factor)))


def _unconfigured(*args: Any, **kwargs: Any) -> Any:
    raise CommBackendError(
        "the plain 'emulated' backend has no world: compile with comm_backend='emulated' and "
        "emulate_world_size=W (the compiler binds an instance), or build the model with "
        "emulated_world_size=W")


_PLAIN = CommBackend(NAME, _unconfigured, _unconfigured,
                     "emulated EP-W world on one device (bound per config)")
register_comm_backend(dataclasses.replace(_PLAIN, configure=_configure))


def _check_combine(world: EmulatedWorld, y) -> None:
    g = world.rows_per_token
    if y.dim() != 2:
        raise CommOpError(f"dbo.combine: y must be [rows, hidden], got {tuple(y.shape)}")
    if not isinstance(y.shape[0], torch.SymInt) and y.shape[0] % g:
        raise CommOpError(
            f"dbo.combine with the emulated backend: y has {y.shape[0]} rows, not a multiple "
            f"of its {g} receive rows per token (combine the rows of a dispatch of the same "
            "backend)")


def register_emulated(world: EmulatedWorld) -> str:
    """The spec of the instance for ``world``, configured in the registry (idempotent)."""
    get_comm_backend(world.name)
    return world.name


def is_emulated(name: str) -> bool:
    """``name`` is the emulated backend (``"emulated"``) or one of its instances."""
    return name == NAME or name.startswith(NAME + ":")


def emulated_backend(name: str) -> EmulatedBackend | None:
    """The registered instance ``name``, or ``None`` for a name that is none."""
    if not is_emulated(name) or name == NAME:
        return None
    backend = get_comm_backend(name)
    return backend if isinstance(backend, EmulatedBackend) else None


def world_of_config(config: Any, num_experts: int, top_k: int) -> EmulatedWorld:
    """The world ``DboConfig``'s ``emulate_*`` options describe, for a graph of
    ``num_experts`` experts and top-``top_k`` routing."""
    return EmulatedWorld(
        world_size=config.emulate_world_size, num_experts=num_experts, top_k=top_k,
        link_gbps=(DEFAULT_LINK_GBPS if config.emulate_link_gbps is None
                   else float(config.emulate_link_gbps)),
        latency_us=float(config.emulate_latency_us or 0.0),
        copy_gbps=None if config.emulate_copy_gbps is None else float(config.emulate_copy_gbps),
        capacity_factor=(DEFAULT_CAPACITY_FACTOR if config.emulate_capacity_factor is None
                         else float(config.emulate_capacity_factor)))


def _value(node: Any) -> Any:
    if not isinstance(node, fx.Node):
        return node
    return node.meta.get("val", node.meta.get("example_value"))


def _arg(node: fx.Node, pos: int, name: str) -> Any:
    return node.args[pos] if len(node.args) > pos else node.kwargs.get(name)


def bind_name(graph: fx.Graph, config: Any) -> str:
    """The registered instance the comm ops of ``graph`` (a Dynamo or lowered graph) run
    with under ``config`` (``comm_backend="emulated"``): the config's ``emulate_*`` options and
    the graph's expert count and top-k, which every dispatch must share.

    The emulated backend answers right only for a model built as rank 0 of its world
    (:func:`check_built_for`), which is checked here, at compile time.

    Raises:
        CommBackendError: the dispatches disagree on the expert count or top-k, an expert
            count is not a multiple of ``emulate_world_size``, or the model was not built for
            an emulated world of ``emulate_world_size`` ranks (:func:`check_built_for`).
    """
    facts = set()
    for node in graph.nodes:
        if comm_kind(node) == "dispatch":
            ids = _value(_arg(node, 1, "topk_ids"))
            e = _arg(node, 3, "num_experts")
            if not isinstance(e, int) or ids is None:
                raise CommBackendError(f"emulated backend: dispatch {node.name} has no static "
                                       "expert count or top-k to size the emulated world by")
            facts.add((e, int(ids.shape[1])))
    if len(facts) != 1:
        raise CommBackendError(f"emulated backend: the graph's dispatches must share one "
                               f"(num_experts, top_k), found {sorted(facts)}")
    (e, k), = facts
    world = world_of_config(config, e, k)
    check_built_for(graph, world)
    return register_emulated(world)


def _experts_of(dispatch: fx.Node) -> list[fx.Node]:
    """The expert ops (``dbo.grouped_experts``: an op of the ``experts`` backend registry) that
    compute on the rows ``dispatch`` receives: reached from it through its users, up to the
    next comm op."""
    found, todo, seen = [], list(dispatch.users), set()
    while todo:
        n = todo.pop()
        if n in seen or comm_kind(n) is not None:
            continue
        seen.add(n)
        if getattr(op_info(n.target), "backend", None) == "experts":
            found.append(n)
        else:
            todo.extend(n.users)
    return sorted(found, key=lambda n: n.name)


def check_built_for(graph: fx.Graph, world: EmulatedWorld) -> None:
    """Check that the model of ``graph`` was built as rank 0 of ``world``, for every comm op.

    The emulated dispatch delivers local ids ``id mod E_local`` (``E_local = E / W``) of rank
    0's ``E_local`` experts, whose weights the world repeats every ``E_local`` experts; a model
    holding all ``E`` experts (built for no EP world) would run its first ``E_local`` experts
    on every slot and return a wrong answer without an error. What proves the model right:

    - an expert op (``dbo.grouped_experts``) on a dispatch's rows holds ``E / W`` experts
      (``w13.shape[0]``), and
    - a comm op that names an emulated instance names one of ``W`` ranks, and runs over no
      process group (the world is one device; a model built for a real EP group holds that
      group's rank's experts, not rank 0's of the emulated world);
    - a dispatch whose rows reach no expert op (experts written with other ops) must name an
      emulated instance of ``W`` ranks: the model's declaration that its experts are rank
      0's (``DeepseekMoEModel(..., emulated_world_size=W)`` names it).

    Raises:
        CommBackendError: the first comm op that breaks a rule, and what to build instead.
    """
    w, e, el = world.world_size, world.num_experts, world.local_experts
    build = (f"build the model with DeepseekMoEModel(..., emulated_world_size={w}); another "
             f"model must hold rank 0's E/W = {e}/{w} = {el} experts (the world's experts "
             f"repeat every {el}) in its dbo.grouped_experts (w13 / w2 [{el}, ...]), or, with "
             "experts written in other ops, hold them there and declare it by naming the "
             "emulated instance in its dispatch and combine (backend=dbo_compile.ops.emulated."
             f"register_emulated(EmulatedWorld({w}, {e}, {world.top_k})))")
    for node in graph.nodes:
        kind = comm_kind(node)
        if kind not in ("dispatch", "combine"):
            continue
        own = emulated_backend(bound_backend(node) or "")
        if own is not None and own.world.world_size != w:
            raise CommBackendError(
                f"emulated backend: the model's {kind} {node.name} is built for an emulated "
                f"world of {own.world.world_size} ranks but the config asks for "
                f"emulate_world_size={w}; build the model with the same world size")
        group = comm_group_name(node)
        if group:
            raise CommBackendError(
                f"emulated backend: the model's {kind} {node.name} runs over the EP process "
                f"group {group!r}: the model was built for a real EP world, not as rank 0 of "
                f"an emulated one on this device; {build} (and no ep_group)")
        if kind != "dispatch":
            continue
        experts = _experts_of(node)
        for x in experts:
            w13 = _value(op_arg(x, "w13"))
            held = int(w13.shape[0]) if isinstance(w13, torch.Tensor) else None
            if held != el:
                raise CommBackendError(
                    f"emulated backend: the expert op {x.name} on the rows of {node.name} "
                    f"holds {held} experts, but rank 0 of the emulated EP-{w} world holds "
                    f"num_experts/W = {e}/{w} = {el}: the model was not built for this "
                    f"emulated world and its answer would be wrong; {build}")
        if not experts and own is None:
            raise CommBackendError(
                f"emulated backend: nothing shows that the model was built for an emulated "
                f"world of {w} ranks: the rows of {node.name} reach no dbo.grouped_experts "
                f"and it names no emulated instance; {build}")
