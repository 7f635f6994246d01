"""The emulated link: pinned host memory and back, two copy streams, chunked (full duplex);
its two slots (the backend's in-flight pool), throttling, latency, the SMs a transfer holds
(option ``hold_sms``, :mod:`.hold`) and overflow counters (:mod:`dbo_compile.ops.emulated`,
"What crosses the link" and "Throttling")."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import threading
from typing import Any

import torch

from dbo_compile.errors import CommOpError
from dbo_compile.ops.emulated.hold import hold_sms, hold_us
from dbo_compile.ops.emulated.world import FALLBACK_COPY_GBPS, EmulatedWorld

log = logging.getLogger(__name__)

__all__ = ["LINK", "MAX_CHUNKS", "SLOTS", "Transfer", "link_figures", "reset_stats",
           "serial_link", "stats", "without_link"]



class _Link:
    """Per-process link state: copy streams, events and pinned buffers per CUDA device, the
    measured hardware figures, and the overflow counters.

    Pinned buffers are never freed (a captured graph holds their address). Each device has
    :data:`SLOTS` of them, so that two transfers can be in flight at once (an op whose
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
        bufs = self.host.setdefault(key, [None] * SLOTS)
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
            CommOpError: every slot holds a transfer in flight (more than :data:`SLOTS`
                deferred ops at once: the backend's pool allows as many).
        """
        busy = self.busy.setdefault(self._key(device), [False] * SLOTS)
        for i, b in enumerate(busy):
            if not b:
                busy[i] = True
                return i
        raise CommOpError(f"emulated link: {SLOTS} transfers are in flight on {device}, none "
                          "finished; receive one before sending another (the backend's pool "
                          f"allows {SLOTS} calls in flight)")

    def free_slot(self, device: torch.device, slot: int) -> None:
        self.busy[self._key(device)][slot] = False

    def cuda_streams(self, index: int) -> tuple[Any, Any]:
        if index not in self.streams:
            self.streams[index] = (torch.cuda.Stream(device=index), torch.cuda.Stream(device=index))
            self.cuda_events(index, MAX_CHUNKS + SLOTS)  # made here, not during a capture
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

    def send(self, src: torch.Tensor, world: EmulatedWorld) -> "Transfer":
        """Start the round trip of ``src [rows, cols]`` (contiguous) on the link's copy
        streams after the work queued on the current stream; :meth:`Transfer.finish` makes
        the stream it is called on wait for the copies back and returns the new tensor.
        Until then the current stream is free for other work (the next op's packing)."""
        if not self.enabled:  # without_link(): the rows stay where they are
            return Transfer(src)
        out = torch.empty_like(src)
        nbytes = src.numel() * src.element_size()
        if nbytes == 0:
            return Transfer(out)
        slot = self.take_slot(src.device)
        try:
            return self._send(src, out, nbytes, slot, world)
        except BaseException:  # nothing holds the transfer: its slot is free again
            self.free_slot(src.device, slot)
            raise

    def _send(self, src: torch.Tensor, out: torch.Tensor, nbytes: int, slot: int,
              world: EmulatedWorld) -> "Transfer":
        host = self.host_buffer(src.device, nbytes, slot)[:nbytes]
        host = host.view(src.dtype).view(src.shape)
        if not src.is_cuda:  # synchronous copies; the slot is held until finished all the same
            host.copy_(src)
            out.copy_(host)
            return Transfer(out, slot=(self, src.device, slot))
        index = src.device.index if src.device.index is not None else torch.cuda.current_device()
        self.measure(index)
        hw = world.copy_gbps or self.copy_gbps.get(index, FALLBACK_COPY_GBPS)
        repeat = max(1.0, hw / world.link_gbps)
        rows = src.shape[0]
        # n chunks: the second direction trails the first by one chunk, each copy has a setup
        # cost (~3 µs): the round trip takes ~ V/bw (1 + 1/n) + 3n µs, least at sqrt(V/bw / 3)
        t_link = nbytes / (min(hw, world.link_gbps) * 1e3)
        chunks = max(1, min(MAX_CHUNKS, rows, round(math.sqrt(t_link / 3.0))))
        bounds = [rows * i // chunks for i in range(chunks + 1)]
        cur = torch.cuda.current_stream(src.device)
        s_out, s_in = self.cuda_streams(index)
        evs = self.cuda_events(index, MAX_CHUNKS + SLOTS)
        s_out.wait_stream(cur)
        s_in.wait_stream(cur)
        if world.hold_sms:  # SM-holding comm: the issuing stream's SMs for the transfer
            hold_sms(src.device, world.hold_sms,
                     hold_us(nbytes, min(hw, world.link_gbps), world.latency_us))
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
        done = evs[MAX_CHUNKS + slot]
        done.record(s_in)
        if not self.overlap:  # serial_link(): nothing runs beside the transfer
            cur.wait_event(done)
        return Transfer(out, done, (src,), (self, src.device, slot))


@dataclasses.dataclass
class Transfer:
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


MAX_CHUNKS = 16
#: host-buffer slots per device: transfers in flight at once (the backend's pool)
SLOTS = 2
LINK = _Link()


@contextlib.contextmanager
def without_link():
    """Within the block (and in CUDA graphs captured in it) the link copies nothing: the
    split program's compute and the backend's own packing alone ("split without comm")."""
    was, LINK.enabled = LINK.enabled, False
    try:
        yield
    finally:
        LINK.enabled = was


@contextlib.contextmanager
def serial_link():
    """Within the block (and in CUDA graphs captured in it) every send finishes before it
    returns: the stream that sent waits for the copies back, so no transfer overlaps the work
    issued after it, as in a program whose comm runs in turn with its compute ("split
    serial"; an op with a deferred receive otherwise keeps the stream free while its copies
    fly)."""
    was, LINK.overlap = LINK.overlap, False
    try:
        yield
    finally:
        LINK.overlap = was


def reset_stats() -> None:
    """Zero the overflow counters (every device)."""
    for c in LINK.counters.values():
        c.zero_()


def stats() -> dict[str, dict[str, int]]:
    """Per device: ``dispatch_rows`` / ``combine_rows`` (remote rows that mattered) and
    ``dispatch_overflow`` / ``combine_overflow`` (of them, rows past the link capacity, which
    took the device-side copy), summed since the last :func:`reset_stats` (one device read)."""
    out = {}
    for dev, c in LINK.counters.items():
        v = c.tolist()
        out[dev] = {"dispatch_rows": v[0], "dispatch_overflow": v[1], "combine_rows": v[2],
                    "combine_overflow": v[3]}
    return out


def link_figures() -> dict[str, dict[str, float]]:
    """Per CUDA device measured so far: ``copy_gbps`` (duplex, per direction) and the spin
    kernel's ``cycles_per_us``."""
    return {f"cuda:{i}": {"copy_gbps": g, "cycles_per_us": LINK.cycles_per_us.get(i, 0.0)}
            for i, g in LINK.copy_gbps.items()}


