"""Add a comm backend (``docs/architecture.md``, "Add a comm backend"): the whole backend is in
this file, plus one registration call; ``comm_backend=<its name>`` selects it, and the compiled,
split program equals the unsplit model. No other file of the package is touched to add it.

The backend here, ``loopback``, serves one EP rank (the model is built without an EP group): it
packs each token's payload row with the public packing helpers of
:mod:`dbo_compile.ops.comm.packing` (what a real transport would send), "receives" it at once
and unpacks it; its combine returns the expert outputs of its one source rank. It declares
what the compiler reads of a backend (:class:`~dbo_compile.ops.comm.RankMajorBackend`): the
rank-major layout (the default), no result pool, no receive phase, and which ops it serves
(``supports``: one EP rank).
"""

from __future__ import annotations

import torch

from conftest import last_artifact
from dbo_compile.ops.comm import CommBackend, register_comm_backend
from dbo_compile.ops.comm.packing import (
    check_combine_args,
    check_dispatch_args,
    send_buffers,
    split_payload,
)
from dbo_compile.ops.registry import bound_backend, comm_kind
from moe_cases import MIXED_CUT, build, eager_and_compiled

NAME = "loopback"
#: calls made, by kind (the test checks that the compiled program ran this backend)
CALLS = {"dispatch": 0, "combine": 0}


def loopback_dispatch(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                      num_experts: int, group_name: str
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x [T, H]``, ``topk_ids [T, K]`` int64, ``topk_weights [T, K]`` fp32 -> the rank-major
    receive rows of one rank: ``(recv_x [T, H], recv_ids [T, K] int64, recv_weights [T, K]
    fp32)``, each in storage of its own."""
    CALLS["dispatch"] += 1
    e_local = check_dispatch_args(x, topk_ids, topk_weights, num_experts, 1)
    send = send_buffers(x, topk_ids, topk_weights, e_local, 1)  # [1, T, P]: what would travel
    return split_payload(send.view(-1, send.shape[-1]), x.shape[1], topk_ids.shape[1])


def loopback_combine(y: torch.Tensor, group_name: str) -> torch.Tensor:
    """``y [T, H]`` (the weighted expert outputs of the receive rows) -> ``[T, H]``: one source
    rank, nothing to sum."""
    CALLS["combine"] += 1
    check_combine_args(y, 1)
    return y.clone()


def loopback_supports(facts: dict) -> str | None:
    """One EP rank: an op over a group of several ranks needs a real transport."""
    if facts.get("world_size", 1) != 1:
        return f"it serves one EP rank, and {facts['node']} runs over {facts['world_size']}"
    return None


# the one registration call
register_comm_backend(CommBackend(NAME, loopback_dispatch, loopback_combine,
                                  "one EP rank, payload rows packed and unpacked in place",
                                  supports=loopback_supports))


def test_a_backend_added_in_one_file_is_compiled_and_split():
    model, step = build(MIXED_CUT, layers=2)
    CALLS.update(dispatch=0, combine=0)
    eager, out, eager_caches, caches = eager_and_compiled(
        model, step, {"split": "always", "comm_backend": NAME, "schedule_candidates": False})
    art = last_artifact()
    assert art.is_split and art.stats.split_steps == 1
    comm = [n for n in art.split_gm.graph.nodes if comm_kind(n) in ("dispatch", "combine")]
    assert comm and {bound_backend(n) for n in comm} == {NAME}
    # two layers, two ubatches: a dispatch and a combine each, run by this backend
    assert CALLS["dispatch"] >= 4 and CALLS["combine"] >= 4, CALLS
    torch.testing.assert_close(out, eager)
    for got, want in zip(caches, eager_caches):
        torch.testing.assert_close(got, want)
