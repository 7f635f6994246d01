"""The two compiled artifacts: :class:`SplitArtifact` (the split program with its guards) and
:class:`UnsplitArtifact` (the way out). Their names before issue 30, ``DboCompiledModule`` and
``UnsplitProgram``, still import, with a ``DeprecationWarning``.

What stays at run time is only what cannot be known at compile time (``docs/design.md``):
whether this step splits (thresholds, split mode, DP vote, vetoes) and how the inputs and the
attention metadata are cut. Outputs are concatenated along the token dim in ubatch order. The
per-step sequence both share (guard, pad, run, write back, unpad) is
:class:`~dbo_compile.runtime.artifact.CompiledArtifact`'s.
"""

from __future__ import annotations

import functools
import logging
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from dbo_compile.config import DboConfig
from dbo_compile.errors import MetadataError
from dbo_compile.metadata import (
    AttentionMetadata,
    HostCounts,
    host_tensor,
    int_list,
    query_lens_from,
)
from dbo_compile.runtime.artifact import (
    CompiledArtifact,
    StepDecision,
    StepStats,
    dp_group,
    own_rows,
)
from dbo_compile.runtime.context import (
    counting,
    current_step_context,
    in_ubatch_scope,
    last_called,
    record_calls,
    uncounted,
)
from dbo_compile.runtime.padding import join_ubatch_outputs
from dbo_compile.runtime.ubatch import cut_step, make_ubatch_slices
from dbo_compile.runtime.vetoes import check_vetoes
from dbo_compile.runtime.vote import coordinate_across_dp
from dbo_compile.schedule import CommPlan
from dbo_compile.signature import InputSpec, OutputSpec, SplitSignature

log = logging.getLogger(__name__)

__all__ = ["SplitArtifact", "SplitRecord", "StepStats", "UnsplitArtifact", "last_called",
           "record_calls", "uncounted"]


class UnsplitArtifact(CompiledArtifact):
    """A graph compiled without a split (no comm op, or it mixes tokens): runs as traced.

    When the graph issues collectives and torch.distributed is initialised, it still takes part
    in the DP vote every call (voting "no split"), so that ranks holding a split program and
    ranks holding this one issue the same collectives in the same order.

    Args:
        fn: the unsplit program (``unsplit``).
        reason: why the graph was not split (the backend logs it at WARNING when it compiles the
            graph; the first counted step's warning that DBO is off does not repeat it).
        config: options.
        specs: the classification of the graph inputs (``None``: could not be classified).
        has_comm: the graph issues collectives (then it votes).
        fixed_num_tokens: the program runs only at its traced token count (a static graph).
        row_local: every output row depends only on the same input row (checked by the
            token-dim analysis), so padding rows cannot change the real rows' results.
        compile_times: seconds per compile pass run before the graph was found unsplittable.
        output_specs: what each output is (``None``: not classified).
        unsplit_plan: the collectives ``fn`` issues, in order (``None``: not drainable).
        state_inputs: the inputs ``fn`` writes in place (``CompiledArtifact.state_inputs``).
        unsplit_collectives: the fingerprint of the collectives ``fn`` issues (their order,
            dtypes, static sizes: ``CompiledArtifact.unsplit_collectives``), which it votes.
        folds_token_rows: the graph folds token rows into a buffer it updates (found by the
            state-thread pass before the graph was found unsplittable): ``fn`` cannot keep
            padding rows out of it.

    A step is padded (to the DP group's count, by ``run_step`` to two rows) only where padding
    rows change neither its results nor its buffers (:meth:`~CompiledArtifact.padding_hazard`:
    row-local, no fold of token rows); else it runs at its own rows, and the DP vote raises
    ``DpVoteError`` on every rank when the group would pad it.
    """

    def __init__(self, fn: Callable[..., Any], reason: str, config: DboConfig | None = None,
                 specs: list[InputSpec] | None = None, has_comm: bool = False,
                 fixed_num_tokens: bool = True, row_local: bool = False,
                 compile_times: dict[str, float] | None = None,
                 output_specs: Sequence[OutputSpec] | None = None,
                 unsplit_plan: CommPlan = None, state_inputs: Sequence[int] = (),
                 unsplit_collectives: str | None = None, folds_token_rows: bool = False):
        super().__init__(unsplit=fn, config=config or DboConfig(), specs=specs, reason=reason,
                         row_local=row_local, compile_times=compile_times,
                         output_specs=output_specs, unsplit_plan=unsplit_plan,
                         state_inputs=state_inputs, unsplit_collectives=unsplit_collectives,
                         folds_token_rows=folds_token_rows)
        self.has_comm = has_comm
        self.fixed_num_tokens = fixed_num_tokens
        self._warned = False
        #: why this program's steps cannot be padded (fixed at compile time; ``None``: they can)
        self._hazard = self.padding_hazard()

    def _decide(self, args: Sequence[Any], min_padded: int, metadata: AttentionMetadata | None,
                host: HostCounts | None, pads_itself: bool) -> StepDecision:
        """This rank's part of the DP vote (always "no split"); no vote when the graph issues
        no collective, has no token input or runs without a group. ``pads_itself``: the
        caller pads to its own buckets, so the artifact's fixed token count does not apply.
        A graph that cannot be padded (:meth:`padding_hazard`) votes its own rows."""
        if not self._warned and self.has_comm and counting():
            # a server's log is read by its steps; the reason is the backend's to log (once,
            # where it decided to compile unsplit), this only points there
            self._warned = True
            log.warning("dbo: DBO is off for this graph, its steps run unsplit (why: the "
                        "'compiling this graph unsplit' warning of its compile, or the "
                        "artifact's .reason)")
        group = dp_group(self.config)
        n = None if self.token_index is None else int(args[self.token_index].shape[0])
        hazard = None if n is None else self._hazard
        if not self.has_comm or n is None or group is None:
            return StepDecision(None, "unsplittable", [1] * (n or 0), unpaddable=hazard)
        own = n if hazard is None else own_rows(n)
        vote = coordinate_across_dp(own, uniform_decode=False, allow_split=False,
                                    config=self.config, group=group, fingerprint=None,
                                    num_tokens_padded=own if hazard else max(n, min_padded),
                                    fixed_num_tokens=self.fixed_num_tokens and not pads_itself,
                                    collectives=self.unsplit_collectives, unpaddable=hazard)
        return StepDecision(vote, "unsplittable", [1] * n, unpaddable=hazard)


@dataclass
class SplitRecord:
    """What a split artifact is made of: the pipeline's compile, or a compile-cache entry read
    back (:mod:`dbo_compile.codegen.cache`; then ``split_gm`` and ``token_symbols`` are
    ``None``: no traced graph).

    Attributes:
        unsplit: the unsplit program; takes the graph's inputs at any token count.
        candidates: every compiled split program by schedule-candidate name, the primary
            first (``config.schedule_candidates``, :mod:`dbo_compile.candidates`). The eager
            path runs the primary; :class:`~dbo_compile.runtime.cudagraph_runner.CudaGraphRunner`
            picks one per bucket by measurement.
        specs: classification of the graph inputs.
        signature: how split-program inputs/outputs map to the graph's.
        config: options.
        program_alias: each compiled candidate's name -> the name of the candidate whose
            program (host order) it runs.
        compile_times: seconds per compile pass (:mod:`dbo_compile.passes.manager`).
        kv_block_sizes: the KV block sizes of the graph's paged-KV ops
            (:func:`~dbo_compile.ops.registry.kv_block_sizes`), which the prefix-read veto
            uses when the caller passes no ``block_size`` (``()``: none; ``None``: not static).
        output_specs: what each graph output is.
        split_plan / unsplit_plan: the collectives of the primary split program / ``unsplit``
            in issue order (:func:`~dbo_compile.runtime.drain.drain_plan`).
        float_guards: ``(input index, value)`` of the floats folded into the programs
            (``torch.compile(dynamic=True)`` passes float attributes as 0-dim tensors, on
            whose value Dynamo does not guard): each call compares them (host reads of CPU
            tensors); a step where one changed runs ``guard_fallback`` (Dynamo's graph,
            unsplit), with a WARNING the first time.
        guard_fallback: Dynamo's graph, unsplit (``None``: no float folded).
        state_inputs: the inputs the programs write in place (``CompiledArtifact.state_inputs``).
        split_collectives / unsplit_collectives: the fingerprints of the collectives the
            primary split program / ``unsplit`` issue, in issue order: ops, dtypes, static
            sizes, constants (:func:`~dbo_compile.ops.registry.comm_fingerprint`).
        unsplit_overlap: the unsplit program on the two streams
            (:mod:`~dbo_compile.passes.unsplit_overlap`; ``None``: not compiled).
        lowered_gm: the lowered graph (a cache entry's may be rebuilt at its first use).
        split_gm: the (unjoined) split graph.
        token_symbols: the symbols of the token and request dims in those graphs (the cost
            model's, a calibration's).
        cache_key: the compile-cache key of the graph (``None``: no ``cache_dir``); what is
            stored beside the entry for it (the runner's predictions: :mod:`.prune`) is keyed
            by it.
        predict: ``(artifact, tokens, candidates, device=None) -> BucketPrediction``, the
            predictions the runner prunes its candidates by (:mod:`.prune`; set by the
            compile: the runtime imports no compile stage).
    """

    unsplit: Callable[..., Any]
    candidates: dict[str, Any]
    specs: list[InputSpec]
    signature: SplitSignature
    config: DboConfig
    program_alias: dict[str, str] = field(default_factory=dict)
    compile_times: dict[str, float] = field(default_factory=dict)
    kv_block_sizes: tuple[int, ...] | None = ()
    output_specs: Sequence[OutputSpec] | None = None
    split_plan: CommPlan = None
    unsplit_plan: CommPlan = None
    float_guards: Sequence[tuple[int, float]] = ()
    guard_fallback: Callable[..., Any] | None = None
    state_inputs: Sequence[int] = ()
    split_collectives: str | None = None
    unsplit_collectives: str | None = None
    unsplit_overlap: Callable[..., Any] | None = None
    lowered_gm: Any = None
    split_gm: Any = None
    token_symbols: frozenset | None = None
    cache_key: str | None = None
    predict: Callable[..., Any] | None = None


class SplitArtifact(CompiledArtifact):
    """What the ``dbo`` backend returns to Dynamo for a splittable graph.

    Per call (one step): read the host-side step facts (:mod:`.context`), check the vetoes,
    vote with the other DP ranks (:func:`~dbo_compile.runtime.vote.coordinate_across_dp`:
    split?, padded token count), pad the token-indexed inputs to the agreed count (padding
    rows: slot -1, zeros), run the split program (inputs and attention metadata cut per ubatch)
    or the unsplit one, and return the outputs without the padding rows, concatenated in
    ubatch order.

    Args:
        record: what it is made of (:class:`SplitRecord`); its fields are attributes of the
            artifact, and ``split_program`` is the first of its ``candidates``.

    Attributes:
        fingerprint: the primary schedule's
            :meth:`~dbo_compile.schedule.Schedule.fingerprint` (its order of collectives)
            and ``split_collectives`` (their dtypes and static sizes), which the DP vote
            compares across the ranks with a split program; every rank's vote also carries
            ``unsplit_collectives``.

    Raises (per call):
        DpVoteError: the DP ranks compiled different schedules or configs, or one rank's
            step failed its checks before the vote (on every rank).
        UBatchExecutionError: an op of the program raised on some rank (on every rank: the
            step transaction, :mod:`~dbo_compile.runtime.step_txn`); the next step runs
            normally.
    """

    def __init__(self, record: SplitRecord):
        split_program = next(iter(record.candidates.values()))
        super().__init__(unsplit=record.unsplit, config=record.config, specs=record.specs,
                         reason=None, row_local=True, split_program=split_program,
                         candidates=record.candidates, signature=record.signature,
                         compile_times=record.compile_times, output_specs=record.output_specs,
                         split_plan=record.split_plan, unsplit_plan=record.unsplit_plan,
                         state_inputs=record.state_inputs,
                         unsplit_collectives=record.unsplit_collectives,
                         float_guards=record.float_guards, guard_fallback=record.guard_fallback)
        self.split_collectives = record.split_collectives
        self.unsplit_overlap = record.unsplit_overlap
        self.fingerprint = f"{split_program.schedule.fingerprint()}/{record.split_collectives}"
        self.kv_block_sizes = record.kv_block_sizes
        self._warned_block_size = False
        self.program_alias = dict(record.program_alias)
        self.lowered_gm = record.lowered_gm
        self.split_gm = record.split_gm
        self.token_symbols = record.token_symbols
        self.cache_key = record.cache_key
        self.predict = record.predict

    @property
    def code(self) -> str:
        return self.split_program.code

    @property
    def schedule(self):
        return self.split_program.schedule

    # -- the guard --------------------------------------------------------------------------
    def _veto(self, md: AttentionMetadata | None, qlens: list[int],
              host: HostCounts | None) -> str | None:
        """The step's veto (``qlens``: the metadata's query lens, Python ints). The
        prefix-read veto runs on every step with metadata, with the KV block size of the
        graph's caches (``kv_block_sizes``), or the caller's, which must agree with them.

        Raises:
            MetadataError: the caller's ``block_size`` is not the KV cache's.
        """
        ctx = current_step_context()
        if not ctx.allow_split:
            return "engine: allow_split=False"
        if getattr(self.split_program, "enters_ubatch", False) and not in_ubatch_scope():
            return ("step-state ops (keyed to engine state outside the graph, e.g. vLLM's "
                    "attention) and no engine switch of that state per ubatch "
                    "(runtime.context.ubatch_scope; under vLLM: "
                    "dbo_compile.integrations.vllm.vllm_backend)")
        if md is None:
            return None
        sizes = self._veto_block_sizes(ctx.block_size)
        if sizes == () and not ctx.vetoes:
            return None  # no paged KV read: nothing to veto
        return check_vetoes(md, qlens, block_size=sizes or None, vetoes=ctx.vetoes, host=host,
                            unknown_block_size=sizes is None)

    def _veto_block_sizes(self, given: int | None) -> tuple[int, ...] | None:
        """The block sizes the prefix-read veto checks: the caller's ``given`` (checked against
        the graph's caches), else the graph's; ``()``: the graph reads no block table;
        ``None``: it does, through an op whose block size is unknown (warned once)."""
        known = self.kv_block_sizes
        if given is not None:
            if known and given not in known:
                raise MetadataError(
                    f"block_size={given} passed, but the graph's KV cache{'s have' if len(known) > 1 else ' has'} "
                    f"block size {', '.join(map(str, known))} (dim 2 of its [2, num_blocks, "
                    "block_size, Hkv, D] shape): pass the cache's block size, or none")
            return (given,)
        if known:
            return known
        if "block_table" not in self.metadata_inputs:
            return ()
        if not self._warned_block_size:
            self._warned_block_size = True
            log.warning("dbo: the prefix-read veto needs the KV block size: the graph reads the "
                        "block table through an op not declared with register_paged_kv_op and no "
                        "block_size was passed; steps with cached prefixes and >= 2 requests run "
                        "unsplit (pass block_size= or declare the op)")
        return None

    def _decide(self, args: Sequence[Any], min_padded: int, metadata: AttentionMetadata | None,
                host: HostCounts | None, pads_itself: bool) -> StepDecision:
        """The DP vote for this step.

        Device reads: none with the metadata's host mirrors (or ``host``, and for the
        prefix-read veto ``slot_mapping_cpu`` / ``block_table_cpu``); else the counts in one
        copy and the veto's slots and block table in another. ``config.check_host_mirrors``
        adds a read of every mirrored field (debugging).
        """
        num_tokens = int(args[self.token_index].shape[0])
        # the graph's metadata inputs, or the engine's when the graph reads it elsewhere (vLLM's
        # attention reads it from the forward context): checked, vetoed and voted on alike
        has_md = self.takes_metadata or metadata is not None
        given = current_step_context().num_scheduled_tokens
        qlens: list[int] | None = None
        local_error = None
        veto = None
        counts = None
        fallback = False
        try:
            md = None
            if has_md:
                md, counts = self._metadata(args, num_tokens, metadata, host)
                if self.config.check_host_mirrors:
                    md.check_host_mirrors()
                md.validate(host=counts)
                qlens = _scheduled_tokens(given, counts[0])
                if sum(qlens) > num_tokens:
                    raise MetadataError(f"{sum(qlens)} scheduled tokens but only {num_tokens} rows")
            veto = self._veto(md, qlens or [], counts) if self.config.split != "never" else None
            if self.float_guards and self.guard_missed(args):
                fallback, veto = True, "a float attribute folded into the program changed"
        except Exception as e:  # noqa: BLE001 - raised on every rank by the vote, never here
            local_error = f"{type(e).__name__}: {e}"
        if qlens is None:  # no metadata (every token its own request), or it failed its checks
            qlens = [1] * num_tokens
            if given is not None and local_error is None:
                try:
                    qlens = int_list(given)
                except Exception as e:  # noqa: BLE001 - raised on every rank by the vote
                    local_error = f"num_scheduled_tokens: {type(e).__name__}: {e}"
        real = sum(qlens) if has_md else num_tokens
        uniform_decode = bool(qlens) and qlens.count(1) == len(qlens)
        padded = max(num_tokens, real, min_padded)
        # Dynamo's graph, for a changed float, may not be able to keep padding rows out
        hazard = self.padding_hazard(fallback=True) if fallback else None
        if hazard is not None:
            padded = own_rows(num_tokens)
            real = min(real, padded)
        vote = coordinate_across_dp(
            real, uniform_decode=uniform_decode, allow_split=veto is None, config=self.config,
            group=dp_group(self.config), fingerprint=self.fingerprint,
            num_tokens_padded=padded, local_error=local_error,
            collectives=self.unsplit_collectives, unpaddable=hazard)
        reason = "split" if vote.should_split else (veto or vote.reason or "not split")
        return StepDecision(vote, reason, qlens, counts if metadata is not None else None,
                            fallback=fallback, unpaddable=hazard)

    # -- the split --------------------------------------------------------------------------
    def _run_split(self, padded_args: list[Any], decision: StepDecision) -> tuple[Any, ...]:
        split_args = self.split_args(padded_args, decision.qlens)
        outs = self.split_program(*split_args)  # a failure: the step transaction's
        return join_ubatch_outputs(outs, self.signature.outputs, self.output_specs,
                                   int(padded_args[self.token_index].shape[0]))

    def split_args(self, args: Sequence[Any], qlens: list[int], *,
                   host: HostCounts | None = None, validated: bool = False) -> list[Any]:
        """Per-ubatch inputs in the split program's placeholder order.

        Args:
            args: the graph inputs, padded to the step's token count.
            qlens: tokens per request (the vote's query lens). When the graph takes the
                metadata, its host ``query_start_loc`` (the same counts, cumulated: the vote
                checked them) places the ubatch slices.
            host: the metadata's :meth:`~AttentionMetadata.host_counts` when the caller has
                them (the vote read them): the split then reads nothing from the device.
            validated: the metadata was validated with ``host`` already (by the vote): it is
                not checked again, nor are the ubatch parts made from it (valid by
                construction; :func:`~dbo_compile.runtime.ubatch.split_attn_metadata` checks
                them).

        Raises:
            MetadataError: the metadata is inconsistent, or a request has no token.
        """
        n = self.config.num_ubatches
        num_tokens = int(args[self.token_index].shape[0])
        per_ubatch_md: list[dict[str, torch.Tensor]] | None = None
        if self.takes_metadata:
            md, counts = self._metadata(args, num_tokens, host=host)
            if not validated:
                md.validate(host=counts)
            padded, parts = cut_step(md, counts, num_tokens, n, check_parts=not validated)
            per_ubatch_md = [m.tensors() for m in parts]
        else:  # no metadata: every token is its own request
            _, padded = make_ubatch_slices([1] * num_tokens, num_tokens, n)
        self.last_slices = padded
        out: list[Any] = []
        for index, u, field_name, kind in self._split_plan:
            if u is None:
                out.append(args[index])
            elif field_name is not None and per_ubatch_md is not None:
                out.append(per_ubatch_md[u][field_name])
            elif kind == "token":
                sl = padded[u].token_slice
                out.append(args[index][sl.start:sl.stop])
            else:
                out.append(None if kind == "size" else args[index])
        for pos, src_pos, dim in self._split_sizes:
            out[pos] = out[src_pos].shape[dim]
        return out

    @functools.cached_property
    def _split_plan(self) -> list[tuple[int, int | None, str | None, str]]:
        """Per split-program input: ``(graph input index, ubatch, metadata field, kind)``
        (looked up once: :meth:`split_args` runs every step)."""
        return [(index, u, self.specs[index].field, self.specs[index].kind)
                for index, u in self.signature.inputs]

    @functools.cached_property
    def _split_sizes(self) -> list[tuple[int, int, int]]:
        """Per-ubatch size inputs: ``(position, position of the tensor it measures, dim)``."""
        return [(pos, self.signature.inputs.index((self.specs[index].size_of[0], u)),
                 self.specs[index].size_of[1])
                for pos, (index, u) in enumerate(self.signature.inputs)
                if u is not None and self.specs[index].kind == "size"]

    def _metadata(self, args: Sequence[Any], num_tokens: int,
                  metadata: AttentionMetadata | None = None, host: HostCounts | None = None
                  ) -> tuple[AttentionMetadata, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """The step's metadata (``metadata``, else rebuilt from the graph inputs) and its counts
        on the host (``host``, else :meth:`AttentionMetadata.host_counts`: its mirrors, or the
        one device read)."""
        if metadata is not None:
            counts = metadata.host_counts() if host is None else host
            return metadata, tuple(host_tensor(h) for h in counts)  # type: ignore[return-value]
        f = self.metadata_inputs
        qsl = args[f["query_start_loc"]]
        num_reqs = int(qsl.shape[0]) - 1
        dev = qsl.device

        def get(name: str, default: Callable[[], torch.Tensor]) -> torch.Tensor:
            return args[f[name]] if name in f else default()

        def qlens() -> torch.Tensor:  # device work only for fields the graph does not take
            return (qsl[1:] - qsl[:-1]).to(torch.int32)

        seq_lens = get("seq_lens", qlens)
        md = AttentionMetadata(
            query_start_loc=qsl,
            seq_lens=seq_lens,
            num_computed_tokens=get("num_computed_tokens", lambda: (seq_lens - qlens()).to(torch.int32)),
            block_table=get("block_table", lambda: torch.zeros(num_reqs, 1, dtype=torch.int32, device=dev)),
            slot_mapping=get("slot_mapping", lambda: torch.full((num_tokens,), -1, dtype=torch.int64, device=dev)),
            max_query_len=0,
            max_seq_len=0,
        )
        qsl_h, seq_h, ctx_h = (host_tensor(h) for h in (md.host_counts() if host is None else host))
        if num_reqs:
            md.max_query_len = int((qsl_h[1:] - qsl_h[:-1]).max())
            md.max_seq_len = int(seq_h.max())
        return md, (qsl_h, seq_h, ctx_h)


def _scheduled_tokens(given: Sequence[int] | torch.Tensor | None,
                      query_start_loc: torch.Tensor) -> list[int]:
    """The step's query lens from the metadata's host offsets ``[R+1]``. The engine's
    ``num_scheduled_tokens`` (the step context's), when given, must be them, and ``>= 1`` each:
    checked before the vote, so that a mismatch raises on every rank instead of breaking the
    split on one rank after the others entered the step's collectives."""
    md_lens = query_lens_from(query_start_loc)
    if given is None:
        return md_lens  # read from query_start_loc: consistent by construction
    # the usual case compares the lists without a loop in Python
    qlens = md_lens if list(given) == md_lens else int_list(given)
    if qlens and min(qlens) < 1:
        bad = [(i, q) for i, q in enumerate(qlens) if q < 1]
        raise MetadataError(f"num_scheduled_tokens must be >= 1 per request, got {bad[:4]} "
                            "(index, count); leave requests without tokens out of the step")
    if qlens is md_lens:
        return md_lens
    first = next((i for i, (a, b) in enumerate(zip(qlens, md_lens)) if a != b),
                 min(len(qlens), len(md_lens)))
    raise MetadataError(
        f"num_scheduled_tokens ({len(qlens)} requests, {sum(qlens)} tokens) disagree with "
        f"the metadata's query lens ({len(md_lens)} requests, {sum(md_lens)} tokens) from "
        f"request {first}; pass the counts the metadata was built from")


#: the artifacts' names before issue 30 (``codegen.wrapper.SplitProgram`` is the generated
#: split program, not an artifact)
_RENAMED = {"DboCompiledModule": "SplitArtifact", "UnsplitProgram": "UnsplitArtifact"}


def __getattr__(name: str) -> Any:
    """``DboCompiledModule`` / ``UnsplitProgram``: the classes under their new names, with a
    ``DeprecationWarning``."""
    if name in _RENAMED:
        warnings.warn(f"dbo_compile.runtime.program.{name} is now {_RENAMED[name]}; import "
                      "that name", DeprecationWarning, stacklevel=2)
        return globals()[_RENAMED[name]]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
