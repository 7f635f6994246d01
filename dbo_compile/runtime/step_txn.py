"""The step transaction: whatever one rank does inside a step, the group ends it together.

A step's collectives are matched across the ranks by order: a rank that leaves the step early
(an op raised in one of its ubatches) leaves its peers waiting in the next collective, and its
own next step's collectives are matched against theirs (a hang, or a Gloo "collective
mismatch" abort). So, from the DP vote to the end of the program, every rank runs::

    try:    outputs = program(...)              # the split or the unsplit program
    except: DRAIN: issue the program's remaining collectives (CommPlan) with null payloads
    AGREE:  one all-reduce of [posted + 1 if this rank failed else 0] per rank, on the vote's
            (CPU) group; if any rank failed, every rank raises the same UBatchExecutionError

The ledger of posted collectives is kept by the comm ops themselves
(:data:`dbo_compile.ops.comm.LEDGER`), so it also counts inside Inductor-compiled programs.
A null call routes no token anywhere (``dbo.dispatch``: ids ``-1``, weights 0) and adds
nothing (``dbo.combine``: zeros), so the peers' results are those of a step in which the
failed rank had no tokens; their outputs are discarded anyway, since every rank raises.

Under CUDA graphs nothing here runs inside a captured program: the ledger counts on the host
when the op runs (at capture, outside any transaction, it counts nothing), and the agreement
is a host collective after the eager program. The CUDA-graph runner's replays have their own
rule (:meth:`~dbo_compile.runtime.cudagraph_runner.CudaGraphRunner.__call__`).

What the transaction cannot do: complete a collective after the transport failed inside it
(``LEDGER.broken``), or drain a program issuing a collective without a null call (a
user-written ``all_to_all_single``, ``CommPlan`` ``None``). Then the failing rank raises at
once and its peers wait until the group's timeout.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Sequence, TypeVar

import torch
import torch.distributed as dist

from dbo_compile.errors import UBatchExecutionError
from dbo_compile.ops.comm import LEDGER, abort_pending_receives
from dbo_compile.runtime.vote import vote_device
from dbo_compile.schedule import CommPlan, NullArg

log = logging.getLogger(__name__)

__all__ = ["run_in_transaction", "ubatch_token_counts"]

T = TypeVar("T")


def ubatch_token_counts(num_tokens_padded: int, num_ubatches: int) -> list[int]:
    """Token rows of each ubatch of a split step padded to ``num_tokens_padded`` (the split
    points ``k * padded // num_ubatches`` of :func:`~dbo_compile.runtime.ubatch.make_ubatch_slices`)."""
    bounds = [k * num_tokens_padded // num_ubatches for k in range(num_ubatches + 1)]
    return [b - a for a, b in zip(bounds, bounds[1:])]


def run_in_transaction(fn: Callable[[], T], *, plan: CommPlan, token_counts: Sequence[int],
                       group: Any, what: str) -> T:
    """``fn()`` (one step's program) as a step transaction (module docstring).

    Args:
        fn: runs the program and returns its outputs.
        plan: the program's collectives in issue order (``None``: not drainable).
        token_counts: the token rows each :class:`~dbo_compile.schedule.CommCall` is sized
            by: per ubatch (split), or ``[padded]`` (unsplit).
        group: the DP vote's group (``None`` or one rank: no agreement, the failure is
            raised at once).
        what: ``"the split program"`` / ``"the unsplit program"`` (messages).

    Raises:
        UBatchExecutionError: on every rank, when ``fn`` raised on any rank: the same message
            on every rank, to which a failing rank adds ``"; this rank: <its error>"`` (its
            exception is also the ``__cause__``), as the DP vote's ``DpVoteError`` does.
    """
    saved = (LEDGER.active, LEDGER.posted, LEDGER.broken)
    LEDGER.active, LEDGER.posted, LEDGER.broken = True, 0, False
    failure: Exception | None = None
    out: Any = None
    try:
        out = fn()
    except Exception as e:  # noqa: BLE001 - re-raised on every rank after the agreement
        failure = e
    finally:
        posted, broken = LEDGER.posted, LEDGER.broken
        LEDGER.active, LEDGER.posted, LEDGER.broken = saved
    world = dist.get_world_size(group) if group is not None else 1
    if failure is not None:  # comm ops issued and not received (DeepEP LL hooks)
        abort_pending_receives()
    if failure is not None and world == 1:
        raise UBatchExecutionError(
            f"{what} failed ({type(failure).__name__}: {failure}); the step was aborted, the "
            "next step runs normally") from failure
    if failure is not None and not _drain(plan, posted, token_counts, broken):
        raise UBatchExecutionError(
            f"{what} failed ({type(failure).__name__}: {failure}) after {posted} collectives, "
            "and this rank cannot issue the rest ("
            + ("the transport failed inside one" if broken else
               "the program issues a collective without a null call") +
            "): its peers wait in them until the group's timeout") from failure
    if world > 1:
        _agree(group, failure, posted, plan, what)
    return out


def _drain(plan: CommPlan, posted: int, token_counts: Sequence[int], broken: bool) -> bool:
    """Issue ``plan[posted:]`` with null payloads; ``False`` when that cannot be done."""
    if plan is None or broken:
        return False
    try:
        for call in plan[posted:]:
            tokens = token_counts[0 if call.ubatch is None else call.ubatch]
            args = [torch.full(a.dims(tokens), a.fill, dtype=a.dtype, device=a.device)
                    if isinstance(a, NullArg) else a for a in call.args]
            call.op(*args, **dict(call.kwargs))
        abort_pending_receives()  # the null calls' own receives
    except Exception as e:  # noqa: BLE001 - reported as the reason the drain failed
        log.error("dbo: draining the step's remaining collectives failed (%s: %s)",
                  type(e).__name__, e)
        return False
    return True


def _agree(group: Any, failure: Exception | None, posted: int, plan: CommPlan,
           what: str) -> None:
    """The step-end agreement: one all-reduce over ``group``; raises on every rank if any
    failed, with a message every rank shares."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    flags = torch.zeros(world, dtype=torch.int64)
    if failure is not None:
        flags[rank] = posted + 1
    flags = flags.to(vote_device(group))
    dist.all_reduce(flags, op=dist.ReduceOp.SUM, group=group)
    failed = [(r, int(v) - 1) for r, v in enumerate(flags.cpu().tolist()) if v]
    if not failed:
        return
    total = "?" if plan is None else len(plan)
    where = ", ".join(f"rank {r} after {k} of {total} collectives" for r, k in failed)
    own = "" if failure is None else f"; this rank: {type(failure).__name__}: {failure}"
    raise UBatchExecutionError(
        f"the step failed on rank(s) {[r for r, _ in failed]} in {what} ({where}); every rank "
        "issued its remaining collectives with null payloads and aborted the step: its outputs "
        "are discarded and its KV-cache writes are undefined (treat the step's requests as "
        f"failed); the next step runs normally{own}") from failure
