"""The parameters of one emulated EP world (:class:`EmulatedWorld`): its size, the link's
figures, and the static link capacity (:mod:`dbo_compile.ops.emulated`)."""

from __future__ import annotations

import dataclasses
import math

import torch

from dbo_compile.errors import CommBackendError
from dbo_compile.ops.backends import backend_spec
from dbo_compile.ops.comm import payload_layout

__all__ = ["DEFAULT_CAPACITY_FACTOR", "DEFAULT_LINK_GBPS", "EmulatedWorld", "FALLBACK_COPY_GBPS",
           "NAME", "payload_cols"]

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
        hold_sms: SMs each transfer holds for its emulated duration (0: none, the copy
            engines alone; :mod:`dbo_compile.ops.emulated.hold`).
    """

    world_size: int
    num_experts: int
    top_k: int
    link_gbps: float = DEFAULT_LINK_GBPS
    latency_us: float = 0.0
    copy_gbps: float | None = None
    capacity_factor: float = DEFAULT_CAPACITY_FACTOR
    hold_sms: int = 0

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
        if isinstance(self.hold_sms, bool) or not isinstance(self.hold_sms, int) \
                or self.hold_sms < 0:
            raise CommBackendError(f"emulated EP world: hold_sms={self.hold_sms!r} must be an "
                                   "int >= 0 (SMs)")

    @property
    def name(self) -> str:
        """The backend spec of this instance (:func:`~dbo_compile.ops.registry.backend_spec`:
        ``emulated:capacity_factor=1.1,copy_gbps=auto,...,world_size=8``), which the registry
        configures (:func:`~dbo_compile.ops.emulated.backend.configure`) and the compiler binds into the ops;
        ``hold_sms`` is in it where it is not 0."""
        held = {"hold_sms": self.hold_sms} if self.hold_sms else {}
        return backend_spec(NAME, {
            "world_size": self.world_size, "num_experts": self.num_experts, "top_k": self.top_k,
            "link_gbps": f"{self.link_gbps:g}", "latency_us": f"{self.latency_us:g}",
            "copy_gbps": "auto" if self.copy_gbps is None else f"{self.copy_gbps:g}",
            "capacity_factor": f"{self.capacity_factor:g}", **held})

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

