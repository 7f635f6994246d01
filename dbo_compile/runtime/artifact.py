"""The base of what the backend returns to Dynamo: one step's guard, padding and run.

Both compiled artifacts, :class:`~dbo_compile.runtime.program.SplitArtifact` (split) and
:class:`~dbo_compile.runtime.program.UnsplitArtifact` (the way out), are a
:class:`CompiledArtifact`. Per step::

    decision = artifact.decide_step(args)     # the guard: DP vote (thresholds, vetoes, padding)
    outputs  = artifact.run_decided(args, decision)   # pad -> run -> write back -> unpad

``artifact(*args)`` (what Dynamo calls) does both; the CUDA-graph runner calls
:meth:`~CompiledArtifact.decide_step` and replays its captured graphs instead of running.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from dbo_compile.config import DboConfig
from dbo_compile.errors import DboConfigError
from dbo_compile.metadata import AttentionMetadata, HostCounts
from dbo_compile.ops.comm import process_group_names, run_watched
from dbo_compile.runtime.capture import state_kept
from dbo_compile.runtime.context import counting, current_step_context, note_call, note_outputs
from dbo_compile.runtime.padding import WriteBack, pad_args, restore_outputs
from dbo_compile.runtime.step_txn import run_in_transaction, ubatch_token_counts
from dbo_compile.runtime.vote import VoteResult
from dbo_compile.schedule import CommPlan
from dbo_compile.signature import ROW_VALID_INPUT, InputSpec, OutputSpec, SplitSignature

log = logging.getLogger(__name__)

__all__ = ["CompiledArtifact", "StepDecision", "StepStats", "check_groups", "dp_group",
           "own_rows"]


@dataclass
class StepStats:
    """Counters tests and benchmarks read (``compiled.stats``): the steps served, not the
    CUDA-graph runner's warm-up steps. ``split_steps`` / ``unsplit_steps`` count steps (a
    ``run_step`` call, or a direct call), ``calls`` every call."""

    split_steps: int = 0
    unsplit_steps: int = 0
    last_decision: str = ""
    reasons: dict[str, int] = field(default_factory=dict)
    calls: int = 0
    _last_step: int | None = field(default=None, repr=False)

    def count(self, split: bool, reason: str, step_id: int | None = None) -> None:
        """Count one step (``step_id``: the step context's; a graph run several times in one
        step, after a graph break, counts one step and several ``calls``)."""
        if not counting():  # the CUDA-graph runner's warm-up steps
            return
        self.calls += 1
        if step_id is not None:
            if step_id == self._last_step:
                return
            self._last_step = step_id
        if split:
            self.split_steps += 1
        else:
            self.unsplit_steps += 1
        self.last_decision = reason
        self.reasons[reason] = self.reasons.get(reason, 0) + 1


@dataclass
class StepDecision:
    """What the guard decided for one step (identical on every DP rank but ``qlens``/``host``).

    Attributes:
        vote: the DP vote's result; ``None`` when the artifact runs no vote (an unsplit graph
            without collectives, or without a group).
        reason: ``"split"``, or why the step does not split (for logs and ``stats``).
        qlens: tokens per request (host ints) of this rank's step.
        host: the metadata's host counts when the vote read them (the split reuses them).
        fallback: run the artifact's ``guard_fallback`` (Dynamo's graph, unsplit) instead of
            ``unsplit``: a value compiled into the programs changed.
        unpaddable: why the program this rank runs this step cannot be padded
            (:meth:`CompiledArtifact.padding_hazard`; ``None``: it can). It then runs at this
            rank's own rows (without ``run_step``'s padding rows); the vote raised if the DP
            group pads past them.
    """

    vote: VoteResult | None
    reason: str
    qlens: list[int]
    host: HostCounts | None = None
    fallback: bool = False
    unpaddable: str | None = None

    @property
    def should_split(self) -> bool:
        return self.vote is not None and self.vote.should_split


def dp_group(config: DboConfig) -> Any:
    """The group of the DP vote: ``config.dp_group_name``, else WORLD when distributed with
    more than one rank, else ``None`` (no vote)."""
    if not dist.is_available() or not dist.is_initialized():
        return None
    if config.dp_group_name:
        return _resolve_process_group(config.dp_group_name)
    return dist.group.WORLD if dist.get_world_size() > 1 else None


def check_groups(config: DboConfig, ep_group_names: Sequence[str]) -> None:
    """Check at compile time the groups a step will use (deterministic: every rank checks
    the same): ``dp_group_name`` names a registered group of an initialised
    ``torch.distributed``, and every EP group the graph's comm ops run over lies inside the
    DP vote's group (the step agreement on that group must reach every rank that can wait in
    one of the step's collectives).

    Raises:
        DboConfigError: what was found, and the registered group names.
    """
    name = config.dp_group_name
    if name is not None:
        if not dist.is_available() or not dist.is_initialized():
            raise DboConfigError(
                f"DboConfig.dp_group_name={name!r}: torch.distributed is not initialised; "
                "initialise it before the first call, or leave dp_group_name None")
        try:
            _resolve_process_group(name)
        except Exception as e:  # noqa: BLE001 - torch raises RuntimeError / KeyError / ValueError
            raise DboConfigError(
                f"DboConfig.dp_group_name={name!r} names no process group of this process "
                f"({type(e).__name__}); registered: {process_group_names()} (pass the "
                "group_name of the CPU (Gloo) group that carries the DP vote)") from None
    group = dp_group(config)
    if group is None:
        return
    vote_ranks = set(dist.get_process_group_ranks(group))
    for ep in sorted(set(ep_group_names)):
        if not ep:
            continue
        try:
            ranks = set(dist.get_process_group_ranks(_resolve_process_group(ep)))
        except Exception:  # noqa: BLE001 - an unknown EP group fails in its op, with its message
            continue
        if not ranks <= vote_ranks:
            raise DboConfigError(
                f"EP group {ep!r} spans ranks {sorted(ranks - vote_ranks)} outside the DP vote's "
                f"group (ranks {sorted(vote_ranks)}): a rank failing in a step could not tell "
                "them, and they would wait in its collectives. Pass dp_group_name of a group "
                "that contains every EP rank")


class CompiledArtifact:
    """What the ``dbo`` backend returns for one Dynamo graph (see the module docstring).

    Attributes:
        config: the options it was compiled with (never rewritten: the DP vote compares their
            fingerprint across ranks).
        specs: the classification of the graph inputs (``None``: could not be classified).
        unsplit: the unsplit program, a callable over the graph inputs at any token count
            (fixed to the traced count for a static graph: ``fixed_num_tokens``).
        split_program: the primary split program (``None``: not split).
        unsplit_overlap: the unsplit program on the comm and compute streams
            (:class:`~dbo_compile.passes.unsplit_overlap.OverlappedUnsplit`; called as
            ``unsplit``), which the CUDA-graph runner times beside it (``None``: not compiled,
            ``DboConfig.unsplit_overlap`` off or no comm op).
        candidates: every compiled split program by schedule-candidate name, the primary
            first (empty: not split).
        signature: how the split program's inputs and outputs map to the graph's (``None``:
            not split).
        reason: why the graph was not split (``None``: split).
        row_local: every output row depends only on the same input row, so padding rows
            cannot change the real rows' results (a split graph always is).
        compile_times: seconds per compile pass, in pipeline order (:mod:`dbo_compile.passes`).
        output_specs: what each graph output is (:class:`~dbo_compile.signature.OutputSpec`;
            ``None``: not classified), so that every entry returns outputs at the caller's
            token count.
        split_plan / unsplit_plan: the collectives the primary split program / the unsplit
            program issue, in order (:data:`~dbo_compile.schedule.CommPlan`), which a rank
            whose step failed issues with null payloads (:mod:`~.step_txn`).
        state_inputs: graph-input indices of the buffers the programs write in place (an
            expert-load counter, a step counter; not a paged KV cache, which rows of slot -1
            leave as it is: :func:`~dbo_compile.passes.state_threads.state_inputs`). A call
            that is no served step (:func:`~.context.uncounted`) puts them back as they were
            (:func:`~.capture.state_kept`), and so does the CUDA-graph runner around its
            captures and timing replays.
        unsplit_collectives: 16 hex digits over the collectives the unsplit program issues,
            in order: ops, dtypes, static sizes, constants
            (:func:`~dbo_compile.ops.registry.comm_fingerprint`); the DP vote compares it
            across ranks (``None``: it issues none, or not known).
        float_guards: ``(input index, value)`` of the floats folded into the programs
            (``torch.compile(dynamic=True)`` passes float attributes as 0-dim tensors, on
            whose value Dynamo does not guard; :func:`~dbo_compile.lowering.
            fold_tensorified_floats`): each step compares them (:meth:`guard_missed`); a step
            where one changed runs ``guard_fallback`` (Dynamo's graph, unsplit). Empty for
            an artifact that runs Dynamo's graph itself.
        guard_fallback: Dynamo's graph, unsplit, for such a step (``None``: no float folded).
        folds_token_rows: the graph folds token rows into a buffer it updates (an
            expert-load counter: :mod:`~dbo_compile.passes.state_threads`); the split
            program and ``unsplit`` keep padding rows out of it (``dbo_row_valid``), Dynamo's
            graph does not.
        stats / last_vote / last_slices: what the steps did (the last step's vote and ubatch
            slices).
    """

    def __init__(self, *, unsplit: Callable[..., Any], config: DboConfig,
                 specs: list[InputSpec] | None, reason: str | None, row_local: bool,
                 split_program: Any = None, candidates: dict[str, Any] | None = None,
                 signature: SplitSignature | None = None,
                 compile_times: dict[str, float] | None = None,
                 output_specs: Sequence[OutputSpec] | None = None,
                 split_plan: CommPlan = None, unsplit_plan: CommPlan = None,
                 state_inputs: Sequence[int] = (), unsplit_collectives: str | None = None,
                 float_guards: Sequence[tuple[int, float]] = (),
                 guard_fallback: Callable[..., Any] | None = None,
                 folds_token_rows: bool = False):
        self.unsplit = unsplit
        self.output_specs = None if output_specs is None else tuple(output_specs)
        self.split_plan = split_plan
        self.unsplit_plan = unsplit_plan
        self.float_guards = tuple(float_guards)
        self.guard_fallback = guard_fallback
        self._warned_guard = False
        self.folds_token_rows = folds_token_rows
        self.config = config
        self.specs = specs
        self.reason = reason
        self.row_local = row_local
        self.split_program = split_program
        self.unsplit_overlap: Callable[..., Any] | None = None
        self.candidates: dict[str, Any] = dict(candidates or {})
        self.signature = signature
        self.compile_times: dict[str, float] = dict(compile_times or {})
        self.state_inputs: tuple[int, ...] = tuple(state_inputs)
        self.unsplit_collectives = unsplit_collectives
        self.stats = StepStats()
        self.last_vote: VoteResult | None = None
        self.last_slices: list[Any] = []
        self.token_index = next((s.index for s in specs or [] if s.kind == "token"), None)
        #: graph-input index of each attention-metadata field the graph takes
        self.metadata_inputs: dict[str, int] = {s.field: s.index for s in specs or []
                                                if s.field is not None}
        #: graph-input index of the row-validity input the backend added (``None``: none)
        self.row_valid_index = next((s.index for s in specs or []
                                     if s.name == ROW_VALID_INPUT), None)
        if self.row_valid_index is not None:
            self.folds_token_rows = True

    @property
    def is_split(self) -> bool:
        return self.split_program is not None

    @property
    def takes_metadata(self) -> bool:
        """The graph takes the attention metadata (its ``query_start_loc`` at least)."""
        return "query_start_loc" in self.metadata_inputs

    def stale_floats(self, args: Sequence[Any]) -> list[tuple[int, float, float]]:
        """``(input index, folded value, value in args)`` of each float folded into the
        programs (``float_guards``) that ``args`` hold another value of (host reads of 0-dim
        CPU tensors)."""
        return [(i, v, float(args[i])) for i, v in self.float_guards if float(args[i]) != v]

    def guard_missed(self, args: Sequence[Any]) -> bool:
        """A float folded into the programs has another value in ``args`` (``float_guards``;
        WARNING the first time)."""
        missed = self.stale_floats(args)
        if missed and not self._warned_guard:
            self._warned_guard = True
            log.warning("dbo: float input(s) %s changed from the value(s) compiled into the "
                        "programs; such steps run Dynamo's graph unsplit (compile the model "
                        "again, torch._dynamo.reset() then torch.compile, to compile them in)",
                        [(self._input_name(i), old, new) for i, old, new in missed])
        return bool(missed)

    def padding_hazard(self, fallback: bool = False) -> str | None:
        """Why padding rows (the DP vote's, a CUDA-graph bucket's, ``run_step``'s) would change
        the results of the program a step runs, or be counted in a buffer it updates
        (``None``: they cannot). ``fallback``: the step runs ``guard_fallback``."""
        if not self.row_local:
            return (f"the graph was compiled unsplit ({self.reason}) and is not known to be "
                    "row-local: padding rows could change the real rows' results")
        if not self.folds_token_rows or (self.row_valid_index is not None and not fallback):
            return None
        buffers = ", ".join(self._input_name(i) for i in self.state_inputs) or "?"
        if fallback:
            return ("a float folded into the programs changed, and Dynamo's graph, which runs "
                    "such steps, would count padding rows in the buffers the model updates from "
                    f"the tokens (graph inputs {buffers}); compile the model again for the new "
                    "value (torch._dynamo.reset(), then torch.compile) to pad such steps")
        return (f"the graph was compiled unsplit ({self.reason}) and folds token rows into "
                f"buffers it updates (graph inputs {buffers}): padding rows would be counted "
                "in them")

    def _input_name(self, index: int) -> str:
        spec = self.specs[index] if self.specs is not None and index < len(self.specs) else None
        return (spec.source or spec.name) if spec is not None else f"#{index}"

    def token_outputs(self, num_outputs: int) -> list[bool | None]:
        """Per graph output: token-indexed (``True``), not (``False``), unknown (``None``:
        an unsplit graph, whose outputs the analysis did not classify)."""
        if self.signature is None:
            return [None] * num_outputs
        return self.signature.token_outputs()

    # -- one step ---------------------------------------------------------------------------
    def decide_step(self, args: Sequence[Any], *, min_padded: int = 0,
                    metadata: AttentionMetadata | None = None, host: HostCounts | None = None,
                    pads_itself: bool = False) -> StepDecision:
        """The per-step guard (every DP rank calls it once per step, ranks with zero tokens
        too): the DP vote and its decision; it also becomes
        :func:`~dbo_compile.runtime.context.last_called`, keeps the vote in ``last_vote`` and
        counts the step in ``stats``.

        Args:
            args: the step's graph inputs.
            min_padded: report at least this padded token count (the CUDA-graph runner sends
                one past its largest bucket when this rank's step fits no graph, so that every
                rank runs eagerly).
            metadata: the step's metadata when the caller holds it (the CUDA-graph runner):
                checked and vetoed as it is, host mirrors included, instead of being rebuilt
                from ``args`` (which carry no mirrors).
            host: the metadata's host counts when the caller has them.
            pads_itself: the caller pads to its own buckets (the CUDA-graph runner): a static
                graph's fixed token count does not apply.

        Raises:
            DpVoteError: on every rank, when one rank's metadata is inconsistent or the ranks
                run different compiled programs or configs.
        """
        note_call(self)
        decision = self._decide(args, min_padded, metadata, host, pads_itself)
        self.last_vote = decision.vote
        self.stats.count(decision.should_split, decision.reason,
                         current_step_context().step_id)
        return decision

    def run_decided(self, args: Sequence[Any], decision: StepDecision) -> Any:
        """Run the step as ``decision`` says: pad the token-indexed inputs to the agreed count,
        run the split or the unsplit program, copy in-place writes back, return the outputs
        at this call's token count (:func:`~dbo_compile.runtime.padding.restore_outputs`).

        With a vote over several ranks the run is a step transaction
        (:mod:`~dbo_compile.runtime.step_txn`): a failure on any rank raises the same
        ``UBatchExecutionError`` on every rank, never a hang. A call that is no served step
        (inside :func:`~dbo_compile.runtime.context.uncounted`: the CUDA-graph runner's
        synthetic warm-up steps) leaves the buffers of ``state_inputs`` as they were.
        """
        if self.state_inputs and not counting():
            with state_kept([args[i] for i in self.state_inputs]):
                return self._run(args, decision)
        return self._run(args, decision)

    def _run(self, args: Sequence[Any], decision: StepDecision) -> Any:
        vote = decision.vote
        num_tokens = token_count(args, self.token_index)
        # the first call of each program checks the comm backends' results (run_watched)
        unsplit = functools.partial(run_watched, self.unsplit)
        if decision.fallback:  # Dynamo's own graph: its inputs only
            unsplit = lambda *a: run_watched(  # noqa: E731
                self.guard_fallback, *a[:self.row_valid_index])
        if vote is None:  # no collective across ranks: nothing to pad or agree on
            rows = num_tokens
            if decision.unpaddable is not None and num_tokens is not None:
                rows = own_rows(num_tokens)  # without run_step's padding rows
            return self._finish(unsplit(*pad_args(self.specs or [], args, num_tokens, rows)),
                                num_tokens, rows)
        # a program that cannot be padded: the vote agreed on this rank's own rows, or raised
        padded = vote.num_tokens_padded
        split = decision.should_split

        def run() -> tuple[Any, ...]:
            if not split and padded == num_tokens:
                return unsplit(*args)  # at its own size: nothing to pad
            padded_args = pad_args(self.specs, args, num_tokens, padded)
            write_back = WriteBack(args, padded_args, num_tokens)
            outs = self._run_split(padded_args, decision) if split else unsplit(*padded_args)
            write_back()
            return outs

        # step_agreement=False: an engine with its own failure protocol (a failing rank
        # raises alone, as before; its peers wait in its collectives)
        group = dp_group(self.config) if self.config.step_agreement else None
        return self._finish(self._txn(run, split, padded, group), num_tokens, padded)

    def _txn(self, run: Callable[[], Any], split: bool, padded: int, group: Any) -> Any:
        plan = self.split_plan if split else self.unsplit_plan
        counts = (ubatch_token_counts(padded, self.config.num_ubatches) if split else [padded])
        what = "the split program" if split else "the unsplit program"
        return run_in_transaction(run, plan=plan, token_counts=counts, group=group, what=what)

    def _finish(self, outs: Any, num_tokens: int | None, padded: int | None) -> tuple[Any, ...]:
        """The outputs at ``num_tokens`` (from a run at ``padded``), recorded for
        :func:`~dbo_compile.runtime.engine.run_step` (:func:`~.context.note_outputs`)."""
        outs = tuple(outs) if isinstance(outs, (tuple, list)) else (outs,)
        if num_tokens is not None and padded is not None:
            outs = restore_outputs(outs, self.output_specs, num_tokens, padded)
        note_outputs(outs, self.output_specs)
        return outs

    def __call__(self, *args: Any) -> Any:
        args = self.graph_inputs(args)
        note_call(self, args)
        return self.run_decided(args, self.decide_step(args))

    def graph_inputs(self, args: Sequence[Any], real_rows: int | None = None) -> tuple[Any, ...]:
        """Dynamo's inputs and those the backend added: ``dbo_row_valid`` (bool ``[T]``,
        ``True`` for the first ``real_rows`` rows; default every row, but ``run_step``'s
        padding rows, which the step context names) when the graph's state threads must not
        count padding rows (:mod:`dbo_compile.passes.state_threads`)."""
        index = self.row_valid_index
        if index is None or len(args) > index:
            return tuple(args)
        t = args[self.token_index]
        n = int(t.shape[0])
        if real_rows is None:
            real_rows = own_rows(n)
        return (*args, torch.arange(n, device=t.device) < real_rows)

    # -- what the two artifacts do differently ----------------------------------------------
    def _decide(self, args: Sequence[Any], min_padded: int, metadata: AttentionMetadata | None,
                host: HostCounts | None, pads_itself: bool) -> StepDecision:
        raise NotImplementedError

    def _run_split(self, padded_args: list[Any], decision: StepDecision) -> tuple[Any, ...]:
        raise NotImplementedError(f"{type(self).__name__} has no split program")


def own_rows(num_tokens: int) -> int:
    """The rows of a step of ``num_tokens`` rows without ``run_step``'s own padding rows (the
    step context's ``real_rows``, when it padded this call's rows)."""
    ctx = current_step_context()
    if ctx.real_rows is not None and ctx.padded_rows == num_tokens:
        return ctx.real_rows
    return num_tokens


def token_count(args: Sequence[Any], index: int | None) -> int | None:
    """Rows of the token dim of the step (``None``: the graph has no token input)."""
    if index is None:
        return None
    t = args[index]
    return int(t.shape[0]) if isinstance(t, torch.Tensor) else None
