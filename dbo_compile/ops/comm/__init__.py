"""Dispatch / combine: the MoE expert-parallel (EP) all-to-all as traceable custom ops.

Both ops have **static shapes**: every rank sends a fixed capacity of ``T`` rows to every
destination rank (``T`` = the token dim of the ubatch, the worst case: all tokens routed to one
rank), so they never drop a token, need no ``.item()`` and are CUDA-graph capturable. The price is
bandwidth (``W * T`` rows per rank instead of ``~T * top_k``); another backend (DeepEP, the
emulated world, yours: :func:`register_comm_backend`, ``docs/architecture.md`` "Add a comm
backend") replaces it without changing the graph.

Layout (``W`` = EP world size, ``T`` = tokens per rank, ``H`` = hidden, ``K`` = top-k)::

    rank s, dispatch send buffer [W, T, P]   row (r, t) = payload of token t for rank r
    rank r, dispatch recv        [W*T, P]    row s*T + t = payload of token t of source rank s
    rank r, combine send         [W*T, H]    row s*T + t = expert output for token t of rank s
    rank s, combine recv         [W, T, H]   summed over the W expert ranks -> [T, H]

A **dispatch payload row** carries the token and its routing metadata in ``x``'s dtype, so that
one collective moves both (DeepEP sends them in one kernel too)::

    [ x[t] (H) | pad to a 4-byte boundary | K local expert ids, K weights (2K float32 bits) ]

``x[t]`` is zeros where token ``t`` has no expert on rank ``r``; an id is the local expert index
on rank ``r`` (exact in float32, ids < 2**24) or -1, its weight the routing weight or 0. The
collective copies bytes, so the float32 bits arrive unchanged (:func:`payload_layout`; the
packing helpers are public, :mod:`.packing`).

Experts are sharded contiguously: rank ``r`` owns global experts ``[r*E_local, (r+1)*E_local)``,
``E_local = num_experts // W``.

**All ranks of the group must call with the same ``T``** (the runtime pads every DP rank to the
DP group's max, see ``runtime``); a mismatch makes ``all_to_all_single`` fail or hang.

**Empty ubatch** (``T == 0``): the collectives are still issued (with zero-size buffers) so every
rank issues the same collectives in the same order. Gloo and NCCL both accept zero-size
``all_to_all_single`` (checked on Gloo, torch 2.13 CPU: fp32/bf16/fp16/int64), so no dummy row
is sent.

Each op issues exactly one ``all_to_all_single`` call, synchronously (``async_op=False``) on the
process group's stream.

**Two op pairs.** ``dbo.dispatch`` / ``dbo.combine`` are the rank-major contract above: a model
may compute anything on the received rows. ``dbo.moe_dispatch`` / ``dbo.moe_combine`` are the
MoE-layer contract every backend serves: the dispatch returns its backend's receive layout
(:class:`CommBackend` ``layout``) and a handle, ``dbo.grouped_experts`` consumes that layout as
it is (no re-pack), and the combine gets the routing, the dispatch's outputs and the handle
back (DeepEP needs them)::

    recv_x, recv_ids, recv_w, handle = torch.ops.dbo.moe_dispatch(x, ids, w, E, group)
    y = torch.ops.dbo.grouped_experts(recv_x, recv_ids, recv_w, w13, w2)
    out = torch.ops.dbo.moe_combine(y, ids, w, recv_ids, recv_w, handle, group)

=================  ==============================  =========================  ==================
layout             recv_x                          recv_ids / recv_w          handle
=================  ==============================  =========================  ==================
``rank_major``     ``[W*T, H]`` rows (above)       ``[W*T, K]`` local ids /   backend's (torch:
(torch, local,                                     weights                    ``[0]`` int32)
DeepEP normal)
``expert_major``   ``[E_local, W*cap, H]``: rows   ``[E_local]`` int32 valid  ``[E_local, W*cap]``
(DeepEP LL)        ``[0, count[e])`` of expert e   rows per expert /          int32 source token
                   valid, the rest undefined       ``[E_local, W]`` int64     of each row
                                                   ``(begin << 32) | count``
                                                   per source rank
=================  ==============================  =========================  ==================

With ``rank_major`` the experts weight their outputs and the combine sums over ranks; with
``expert_major`` the experts return unweighted rows in the same places and the combine weights
them by ``topk_weights`` (DeepEP low-latency semantics, ``docs/references.md``).

**What a backend declares for the scheduler** (``docs/design.md`` invariant 3): the
:class:`ResultPool` s its calls draw from (how many results may be alive, how many calls may be
between issue and receive), where its units run, and whether its wait phase does work (a
receive, :func:`comm_receive`). The scheduler honours the declaration or refuses to split.

**The package.** :mod:`.contract` (the backend protocols and the record :class:`CommBackend`),
:mod:`.groups` (EP process groups), :mod:`.packing` (payload rows), :mod:`.register` (the
registry), :mod:`.builtin` (``local``, ``torch``), :mod:`.watch` (the step's ledger, result
reuse) and :mod:`.ops` (the custom ops); everything public is re-exported here.
"""

from dbo_compile.errors import CommBackendError, CommOpError
from dbo_compile.ops.comm import builtin  # noqa: F401  (registers local, torch; deep_ep lazily)
from dbo_compile.ops.comm.contract import (
    EXPERT_MAJOR,
    RANK_MAJOR,
    CommBackend,
    CommBackendProtocol,
    HandleBackend,
    RankMajorBackend,
    ResultPool,
)
from dbo_compile.ops.comm.groups import (
    backend_for_group,
    ep_group_name,
    ep_world_size,
    process_group_names,
    resolve_group,
)
from dbo_compile.ops.comm.ops import (
    combine,
    comm_backend_of,
    comm_receive,
    comm_spec_of,
    dispatch,
    ep_size_of_rows,
    moe_combine,
    moe_dispatch,
    result_key,
)
from dbo_compile.ops.comm.packing import payload_layout
from dbo_compile.ops.comm.register import (
    abort_pending_receives,
    auto_comm_choices,
    available_comm_backends,
    clear_configured_comm_backends,
    comm_backend_name,
    comm_options_for,
    comm_record,
    get_comm_backend,
    register_comm_backend,
    register_lazy_comm_backend,
)
from dbo_compile.ops.comm.watch import LEDGER, CommLedger, run_watched, watching_results

__all__ = [
    "EXPERT_MAJOR",
    "LEDGER",
    "RANK_MAJOR",
    "CommBackend",
    "CommBackendError",
    "CommBackendProtocol",
    "CommLedger",
    "CommOpError",
    "HandleBackend",
    "RankMajorBackend",
    "ResultPool",
    "abort_pending_receives",
    "auto_comm_choices",
    "available_comm_backends",
    "backend_for_group",
    "clear_configured_comm_backends",
    "combine",
    "comm_backend_name",
    "comm_backend_of",
    "comm_options_for",
    "comm_receive",
    "comm_record",
    "comm_spec_of",
    "dispatch",
    "ep_group_name",
    "ep_size_of_rows",
    "ep_world_size",
    "get_comm_backend",
    "moe_combine",
    "moe_dispatch",
    "payload_layout",
    "process_group_names",
    "register_comm_backend",
    "register_lazy_comm_backend",
    "resolve_group",
    "result_key",
    "run_watched",
    "watching_results",
]
