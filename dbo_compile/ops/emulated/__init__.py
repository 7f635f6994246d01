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
NVLink: one flat link here), and SM-holding comm kernels unless asked for (copy engines
hold no SM; the option ``hold_sms=N`` makes each transfer hold ``N`` SMs for its emulated
duration with a kernel on the issuing stream, as DeepEP's normal-mode kernels hold 20–24,
:mod:`.hold`; the older ``comm_sms`` carves SMs out of the cuBLAS GEMMs of the split program
only).

The package: :mod:`.world` (the world's parameters), :mod:`.link` (the link), :mod:`.hold`
(the SM-holding kernel), :mod:`.routing` and :mod:`.kernels` (the two paths: torch ops,
Triton), :mod:`.backend` (the registered instances), :mod:`.binding` (the world a graph is
bound to, and the check of its model).

Usage (the bench and tests build the model with ``emulated_world_size=W``, see
:class:`~dbo_compile.models.DeepseekMoEModel`)::

    compiled = torch.compile(model, backend="dbo", options={
        "comm_backend": "emulated",
        "comm_backend_options": {"world_size": 8, "link_gbps": 50.0}})

(the options: :func:`~dbo_compile.ops.emulated.binding.check_options`; the ``DboConfig``
fields ``emulate_world_size``, ``emulate_link_gbps``, ... are their deprecated spelling.)
"""

from __future__ import annotations

from dbo_compile.ops.emulated import kernels, routing  # noqa: F401  (the two paths, for tests)
from dbo_compile.ops.emulated.backend import (
    EmulatedBackend,
    emulated_backend,
    is_emulated,
    register_emulated,
)
from dbo_compile.ops.emulated.binding import (
    OPTIONS,
    bind_name,
    check_built_for,
    check_options,
    world_of_options,
)
from dbo_compile.ops.emulated.link import (
    LINK,
    Transfer,
    link_figures,
    reset_stats,
    serial_link,
    stats,
    without_link,
)
from dbo_compile.ops.emulated.routing import slot_rows
from dbo_compile.ops.emulated.world import NAME, EmulatedWorld, payload_cols

__all__ = ["LINK", "NAME", "OPTIONS", "EmulatedBackend", "EmulatedWorld", "Transfer", "bind_name",
           "check_built_for", "check_options", "emulated_backend", "is_emulated", "link_figures",
           "payload_cols", "register_emulated", "reset_stats", "serial_link", "slot_rows",
           "stats", "without_link", "world_of_options"]
