"""DP vote: every DP rank agrees, once per step, on (split?, padded token count).

Rules from vLLM DBO (``--enable-dbo``, see ``docs/references.md`` §"vLLM DBO"):

- **One collective.** Each rank writes its column of a small int64 table
  ``[_NUM_ROWS, world_size]`` (other columns 0) and the table is all-reduced (sum) once over
  the DP group — a CPU (Gloo) group by default, or a device (NCCL) group. Every rank then
  holds the same table and evaluates the same pure function of it (:func:`decide_from_table`),
  so every rank takes the same decision without a second round.
- **Split only if every rank wants to.** A rank wants to split when ``allow_split`` (no veto:
  :mod:`dbo_compile.runtime.vetoes`) and ``config.split != "never"`` and, for
  ``split="auto"``, its cost model's ``prefer_split``.
- **Thresholds**, compared with ``>=`` on each rank's *real* tokens: the decode threshold only
  if every rank is uniform decode (one token per request), else the prefill threshold; every
  rank must pass. ``split="always"`` skips thresholds and the cost model but still needs
  ``>= num_ubatches`` real tokens on every rank (no vetoed rank either). Ranks with 0 tokens take
  part in the collective and therefore block the split (``0 < threshold``), as in vLLM, where an
  idle rank runs a 1-token dummy batch.
- **Padding.** Every rank pads to the group max of the per-rank padded counts;
  when splitting it is rounded up to a multiple of ``num_ubatches``. The padded count is voted
  even when not splitting (MoE collectives need equal token counts on all ranks). A rank whose
  program this step cannot be padded (padding rows would change its results or be counted in
  a buffer it updates: ``unpaddable``) reports its own rows; if the group pads past them,
  **every** rank raises :class:`DpVoteError` (no rank returns a wrong answer, none hangs).
- **Consistency.** The table also carries a hash of each rank's :class:`DboConfig`, a hash of
  the collectives its unsplit program issues (order, ops, dtypes, static sizes: what every
  rank runs when the step does not split) and an optional caller fingerprint (the split
  program's schedule and collectives, compared among the ranks that have one). Ranks that
  differ (models of another dtype or hidden size, whose collectives would not match: a process
  aborted or a hang), or a rank whose local inputs are invalid, make **every** rank raise
  :class:`DpVoteError` after the one collective — no rank raises before it, so none is left
  hanging in it, and none enters a collective of the step.

``group=None`` (or a group of one rank) runs no collective: the same rules on one column.
"""

from __future__ import annotations

import hashlib
import logging
import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from dbo_compile.config import DboConfig
from dbo_compile.errors import DpVoteError

log = logging.getLogger(__name__)

__all__ = ["VoteResult", "bucket_never_splits", "coordinate_across_dp", "decide_from_table",
           "fingerprint_to_int64", "min_split_tokens", "vote_device"]

# Rows of the vote table (one column per DP rank).
_REAL = 0  # real tokens of the rank
_PADDED = 1  # the rank's own padded count (its bucket), >= real
_ALLOW = 2  # 1 if no veto on this rank
_PREFER = 3  # 1 if the rank's cost model prefers to split
_UNIFORM = 4  # 1 if the rank's batch is uniform decode
_CONFIG = 5  # int64 hash of DboConfig.fingerprint()
_FINGERPRINT = 6  # int64 hash of the caller's fingerprint (0 if None)
_INVALID = 7  # 1 if the rank's local inputs are invalid (raises on every rank)
_FIXED = 8  # 1 if the rank's program runs only at its own token count (cannot pad)
_COLLECTIVES = 9  # int64 hash of the unsplit program's collectives (0 if None)
_UNPADDABLE = 10  # 1 if the rank's program this step must run at exactly its padded count
_NUM_ROWS = 11


@dataclass(frozen=True)
class VoteResult:
    """Outcome of the DP vote, identical on every rank of the group.

    Attributes:
        should_split: run the split (ubatched) program this step.
        num_tokens_padded: token rows every rank pads its step to (tokens); a multiple of
            ``num_ubatches`` when ``should_split``.
        num_tokens_across_dp: real tokens of each DP rank, in rank order (list of ints).
        uniform_decode: every rank's batch is uniform decode.
        reason: why the step does not split (``""`` when it splits), for logs.
    """

    should_split: bool
    num_tokens_padded: int
    num_tokens_across_dp: list[int]
    uniform_decode: bool = False
    reason: str = field(default="", compare=False)


def fingerprint_to_int64(fingerprint: Any) -> int:
    """Stable (process-independent) int64 of ``fingerprint``: int, str or bytes; ``None`` -> 0.

    Ints in the int64 range are kept as they are; anything else is hashed with SHA-256 (never
    Python's ``hash()``, which is salted per process).
    """
    if fingerprint is None:
        return 0
    if isinstance(fingerprint, bool):
        fingerprint = int(fingerprint)
    if isinstance(fingerprint, int) and -(2**63) <= fingerprint < 2**63:
        return fingerprint
    if isinstance(fingerprint, str):
        data = fingerprint.encode()
    elif isinstance(fingerprint, (bytes, bytearray)):
        data = bytes(fingerprint)
    else:
        data = repr(fingerprint).encode()
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "little", signed=True)


def min_split_tokens(config: DboConfig, uniform_decode: bool | None = None) -> float:
    """The fewest real tokens every rank needs for a step to split (the vote's threshold
    rule, above): ``config.decode_token_threshold`` for a uniform-decode step, the prefill
    threshold for any other, ``num_ubatches`` with ``split="always"``, infinity with
    ``"never"``. ``uniform_decode=None``: for either kind of step (the smaller threshold)."""
    if config.split == "never":
        return math.inf
    if config.split == "always":
        return config.num_ubatches
    if uniform_decode is None:
        return min(config.decode_token_threshold, config.prefill_token_threshold)
    return config.decode_token_threshold if uniform_decode else config.prefill_token_threshold


def bucket_never_splits(tokens: int, config: DboConfig) -> str | None:
    """Why no step runs split in a CUDA-graph bucket of ``tokens`` rows, or ``None`` where one
    can: below :func:`min_split_tokens` (the vote's thresholds), or not a multiple of
    ``num_ubatches`` (a split step is padded to one, so it runs in another bucket)."""
    least = min_split_tokens(config)
    if tokens < least:
        return (f"{tokens} tokens per rank is below the split threshold (split="
                f"{config.split!r}: {least:g} tokens for any step to split)")
    if tokens % config.num_ubatches:
        return (f"{tokens} tokens is not a multiple of {config.num_ubatches} ubatches (a split "
                "step runs in the next bucket that is)")
    return None


def _ranks(mask: list[bool]) -> list[int]:
    return [r for r, m in enumerate(mask) if m]


def decide_from_table(table: torch.Tensor, config: DboConfig) -> VoteResult:
    """Evaluate the vote rules (module docstring) on an all-reduced table.

    Args:
        table: int64 ``[_NUM_ROWS, world_size]``, on any device.
        config: the (identical on every rank) configuration.

    Raises:
        DpVoteError: a rank reported invalid inputs, or the ranks' config hashes,
            collectives or fingerprints differ (the message names the ranks).
    """
    rows = [[int(x) for x in row] for row in table.cpu().tolist()]
    world = len(rows[_REAL])
    invalid = _ranks([v != 0 for v in rows[_INVALID]])
    if invalid:
        raise DpVoteError(
            f"DP vote: ranks {invalid} passed invalid inputs (a metadata error found on that "
            f"rank, a negative token count or padded < real tokens: real="
            f"{[rows[_REAL][r] for r in invalid]}, padded={[rows[_PADDED][r] for r in invalid]}); "
            "every rank raises so that none hangs. Fix the caller on those ranks."
        )
    # a rank without a split program votes fingerprint 0: it cannot split, the others may differ
    no_program = _ranks([v == 0 for v in rows[_FINGERPRINT]])
    if len(no_program) == world:
        no_program = []
    same_model = ("load the same model (dtype, hidden size, layers, experts) and pass the same "
                  "options to torch.compile on every rank")
    for row, what, fix in (
        (_CONFIG, "DboConfig fingerprints", "pass the same options to torch.compile on every rank"),
        (_COLLECTIVES, "collectives (order, dtypes, static sizes) of the unsplit programs",
         same_model),
        (_FINGERPRINT, "fingerprints (schedule, and the dtypes and static sizes of its "
         "collectives) of the split programs", same_model),
    ):
        # 0: not reported (no unsplit collectives given); no split program (above)
        values_ranks = [r for r in range(world)
                        if not (row == _FINGERPRINT and r in no_program)
                        and not (row == _COLLECTIVES and rows[row][r] == 0)]
        values = [rows[row][r] for r in values_ranks]
        if len(set(values)) > 1:
            groups: dict[int, list[int]] = {}
            for r, v in zip(values_ranks, values):
                groups.setdefault(v, []).append(r)
            ordered = sorted(groups.items(), key=lambda kv: kv[1][0])
            desc = "; ".join(f"ranks {rs} have {v:#x}" for v, rs in ordered)
            raise DpVoteError(
                f"DP vote: the {what} of the {world} DP ranks differ ({desc}); the step's "
                f"collectives would not match (a deadlock, an aborted process or corrupt "
                f"data), so no rank enters them. {fix[0].upper()}{fix[1:]}."
            )
    real, padded = rows[_REAL], rows[_PADDED]
    allow = [v != 0 for v in rows[_ALLOW]]
    prefer = [v != 0 for v in rows[_PREFER]]
    uniform_all = all(v != 0 for v in rows[_UNIFORM])
    n = config.num_ubatches
    reason = ""
    if config.split == "never":
        reason = "split='never'"
    elif no_program:
        reason = f"ranks {no_program} run a graph compiled without a split program"
    elif not all(allow):
        reason = f"vetoed on ranks {_ranks([not a for a in allow])}"
    elif config.split == "always":
        low = _ranks([t < min_split_tokens(config) for t in real])
        if low:
            reason = (
                f"ranks {low} have fewer than num_ubatches={n} tokens ({[real[r] for r in low]})"
            )
    else:  # auto
        threshold = min_split_tokens(config, uniform_all)
        kind = "decode" if uniform_all else "prefill"
        low = _ranks([t < threshold for t in real])
        if low:
            reason = (
                f"ranks {low} below the {kind} token threshold {threshold} "
                f"({[real[r] for r in low]} tokens)"
            )
        elif not all(prefer):
            reason = f"cost model prefers unsplit on ranks {_ranks([not p for p in prefer])}"
    should_split = not reason
    num_tokens_padded = max(padded) if padded else 0
    if should_split:
        num_tokens_padded = -(-num_tokens_padded // n) * n
    unpaddable = _ranks([v != 0 and padded[r] != num_tokens_padded
                         for r, v in enumerate(rows[_UNPADDABLE])])
    if unpaddable:
        raise DpVoteError(
            f"DP vote: ranks {unpaddable} run a program this step whose padding rows would "
            f"change its results or be counted in a buffer it updates (a graph compiled unsplit "
            f"that mixes tokens or folds token rows into a buffer, or Dynamo's graph run after "
            f"a float folded into the programs changed; each such rank's error says which), "
            f"but the group pads their {[padded[r] for r in unpaddable]} token rows to "
            f"{num_tokens_padded}; every rank raises so that none returns a wrong answer or "
            "hangs. Give every DP rank the same token count this step, or remove the cause "
            "named on those ranks."
        )
    fixed = _ranks([v != 0 and padded[r] != num_tokens_padded for r, v in enumerate(rows[_FIXED])])
    if fixed:
        raise DpVoteError(
            f"DP vote: ranks {fixed} run a program compiled for exactly their own token count "
            f"({[padded[r] for r in fixed]}) but the group pads to {num_tokens_padded}; every "
            "rank raises so that none hangs. Call through dbo_compile.runtime.engine.run_step "
            "(one dynamic graph per model) or compile with dynamic=True."
        )
    return VoteResult(
        should_split=should_split,
        num_tokens_padded=num_tokens_padded,
        num_tokens_across_dp=list(real),
        uniform_decode=uniform_all,
        reason=reason,
    )


def vote_device(group: Any) -> torch.device:
    """Where a table all-reduced over ``group`` must live: the current CUDA device for an
    NCCL group, the CPU otherwise (Gloo)."""
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and "gloo" not in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def coordinate_across_dp(
    num_tokens: int,
    *,
    uniform_decode: bool,
    allow_split: bool,
    config: DboConfig,
    group: Any = None,
    fingerprint: int | str | bytes | None = None,
    prefer_split: bool = True,
    num_tokens_padded: int | None = None,
    local_error: str | None = None,
    fixed_num_tokens: bool = False,
    collectives: int | str | bytes | None = None,
    unpaddable: str | None = None,
) -> VoteResult:
    """Agree with the other DP ranks on whether this step splits and on its padded token count.

    Every rank of ``group`` must call this once per step, in the same order as its other
    collectives on that group, including ranks with no work (``num_tokens=0``).

    Args:
        num_tokens: real tokens of this rank's step (tokens, >= 0).
        uniform_decode: this rank's batch is uniform decode (one token per request).
        allow_split: no veto on this rank (:func:`dbo_compile.runtime.vetoes.check_vetoes`).
        config: the backend config; must be identical on every rank (checked).
        group: the DP process group (``torch.distributed`` ``ProcessGroup``), preferably a CPU
            (Gloo) group; ``None`` or a one-rank group runs no collective.
        fingerprint: anything that must be identical across ranks (schedule hash, bucket id);
            int, str or bytes, hashed with :func:`fingerprint_to_int64`. ``None`` counts as 0,
            so it must be ``None`` on every rank or on none.
        prefer_split: this rank's cost model expects the split program to be faster. With
            ``split="auto"`` every rank must prefer splitting; ignored by ``"always"``.
        num_tokens_padded: this rank's own padded count (e.g. its CUDA-graph bucket), >=
            ``num_tokens``; default ``num_tokens``.
        local_error: a problem this rank found in its own step (e.g. inconsistent metadata).
            It still takes part in the collective, then every rank raises ``DpVoteError``:
            raising before the vote would leave the other ranks hanging in it.
        fixed_num_tokens: this rank's program cannot run at another token count (a static
            graph): if the group pads beyond it, every rank raises ``DpVoteError``.
        collectives: the collectives this rank issues when the step does not split (their
            order, dtypes and static sizes: ``CompiledArtifact.unsplit_collectives``), hashed
            with :func:`fingerprint_to_int64`; compared among the ranks that give one (a rank
            that runs no collective gives ``None``).
        unpaddable: why this rank's program cannot be padded this step (``None``: it can):
            it runs at ``num_tokens_padded`` rows exactly; if the group pads further, every
            rank raises ``DpVoteError``, this rank's naming the reason.

    Returns:
        The :class:`VoteResult`, identical on every rank.

    Raises:
        DpVoteError: on every rank, when a rank's inputs are invalid, the ranks' config,
            collectives or fingerprints differ, or the group pads an ``unpaddable`` rank
            (message names the ranks).
    """
    padded = num_tokens if num_tokens_padded is None else int(num_tokens_padded)
    num_tokens = int(num_tokens)
    invalid = num_tokens < 0 or padded < num_tokens or local_error is not None
    if invalid:
        log.error(
            "DP vote: invalid local inputs num_tokens=%d num_tokens_padded=%d %s", num_tokens,
            padded, local_error or "",
        )
    world, rank, device = 1, 0, torch.device("cpu")
    if group is not None:
        world = dist.get_world_size(group)
        if world > 1:
            rank = dist.get_rank(group)
            device = vote_device(group)
    table = torch.zeros(_NUM_ROWS, world, dtype=torch.int64)
    table[:, rank] = torch.tensor(
        [
            num_tokens,
            padded,
            int(bool(allow_split)),
            int(bool(prefer_split)),
            int(bool(uniform_decode)),
            fingerprint_to_int64(config.fingerprint()),
            fingerprint_to_int64(fingerprint),
            int(invalid),
            int(bool(fixed_num_tokens)),
            fingerprint_to_int64(collectives),
            int(unpaddable is not None),
        ],
        dtype=torch.int64,
    )
    if world > 1:
        table = table.to(device)
        dist.all_reduce(table, op=dist.ReduceOp.SUM, group=group)
    try:
        result = decide_from_table(table, config)
    except DpVoteError as e:
        if local_error is not None:
            raise DpVoteError(f"{e}; this rank: {local_error}") from None
        # named only where the group pads this rank past its own rows (the ranks it lists)
        if unpaddable is not None and padded != int(table[_PADDED].max()):
            raise DpVoteError(f"{e}; this rank cannot be padded: {unpaddable}") from None
        raise
    log.debug(
        "DP vote (rank %d/%d): split=%s padded=%d tokens=%s uniform_decode=%s %s",
        rank, world, result.should_split, result.num_tokens_padded, result.num_tokens_across_dp,
        result.uniform_decode, result.reason,
    )
    return result
