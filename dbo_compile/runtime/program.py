"""The compiled artifact: per step, pick the split or the unsplit program and run it.

What stays at run time is only what cannot be known at compile time (../shared/DESIGN.md):
whether this step splits (thresholds, split mode, DP vote, vetoes) and how the inputs and the
attention metadata are cut. Outputs are concatenated along the token dim in ubatch order.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch

from dbo_compile.config import DboConfig
from dbo_compile.errors import MetadataError, UBatchExecutionError
from dbo_compile.lowering import InputSpec
from dbo_compile.passes.split_ubatch import SplitSignature
from dbo_compile.runtime.context import current_step_context
from dbo_compile.runtime.metadata import (
    AttentionMetadata,
    HostCounts,
    host_tensor,
    int_list,
    query_lens_from,
)

log = logging.getLogger(__name__)


@dataclass
class StepStats:
    """Counters tests and benchmarks read (``compiled.stats``): the steps served, not the
    CUDA-graph runner's warm-up steps."""

    split_steps: int = 0
    unsplit_steps: int = 0
    last_decision: str = ""
    reasons: dict[str, int] = field(default_factory=dict)

    def count(self, split: bool, reason: str) -> None:
        if not _THREAD.counting:  # the CUDA-graph runner's warm-up steps
            return
        if split:
            self.split_steps += 1
        else:
            self.unsplit_steps += 1
        self.last_decision = reason
        self.reasons[reason] = self.reasons.get(reason, 0) + 1


class _PerThread(threading.local):
    """Per thread (a server may step several models from several threads): the artifact
    called last, and while not None (inside :func:`record_calls`) the list every artifact call
    appends ``(artifact, args)`` to."""
    last_called: Any = None
    recorded: list | None = None
    counting: bool = True


_THREAD = _PerThread()


@contextlib.contextmanager
def record_calls() -> Iterator[list[tuple[Any, tuple[Any, ...]]]]:
    """Within the block, every call of a compiled artifact in this thread appends
    ``(artifact, graph args)`` to the yielded list (the CUDA-graph runner records a step's
    graph inputs with it)."""
    calls: list[tuple[Any, tuple[Any, ...]]] = []
    old, _THREAD.recorded = _THREAD.recorded, calls
    try:
        yield calls
    finally:
        _THREAD.recorded = old


@contextlib.contextmanager
def uncounted() -> Iterator[None]:
    """Within the block, calls in this thread do not count in the artifacts' ``stats``
    (the CUDA-graph runner's synthetic warm-up steps are not served steps)."""
    old, _THREAD.counting = _THREAD.counting, False
    try:
        yield
    finally:
        _THREAD.counting = old


def last_called() -> Any:
    """The compiled artifact that ran the most recent step in this thread (Dynamo may hold
    several for one model: a static and a dynamic graph); its ``last_vote`` is that step's."""
    return _THREAD.last_called


class UnsplitProgram:
    """A graph compiled without a split (no comm op, or it mixes tokens): runs as traced.

    When the graph issues collectives and torch.distributed is initialised, it still takes part
    in the DP vote every call (voting "no split"), so that ranks holding a split program and
    ranks holding this one issue the same collectives in the same order.

    Attributes:
        reason: why the graph was not split (also logged at WARNING when compiled).
        row_local: every output row depends only on the same input row (checked by the
            token-dim analysis), so padding rows cannot change the real rows' results.
    """

    def __init__(self, fn: Callable[..., Any], reason: str, config: DboConfig | None = None,
                 specs: list[InputSpec] | None = None, has_comm: bool = False,
                 fixed_num_tokens: bool = True, row_local: bool = False):
        self.fn = fn
        self.reason = reason
        self.split_program = None
        self.stats = StepStats()
        self.config = config or DboConfig()
        self.specs = specs
        self.has_comm = has_comm
        self.fixed_num_tokens = fixed_num_tokens
        self.row_local = row_local
        self.last_vote: Any = None
        self._token_index = next((s.index for s in specs or [] if s.kind == "token"), None)

    def __call__(self, *args: Any) -> Any:
        _THREAD.last_called = self
        if _THREAD.recorded is not None:
            _THREAD.recorded.append((self, args))
        vote = self.decide(args)
        self.last_vote = vote
        self.stats.count(False, "unsplittable")
        if vote is None:
            return self.fn(*args)
        num_tokens = int(args[self._token_index].shape[0])
        if vote.num_tokens_padded == num_tokens:
            return self.fn(*args)
        padded_args = _pad_args(self.specs, args, num_tokens, vote.num_tokens_padded)
        write_back = _WriteBack(args, padded_args, num_tokens)
        outs = self.fn(*padded_args)
        write_back()
        return tuple(_unpad(o, num_tokens, vote.num_tokens_padded) for o in outs)

    def decide(self, args: Sequence[Any], min_padded: int = 0,
               fixed_num_tokens: bool | None = None) -> Any:
        """This rank's part of the DP vote (always "no split"): the ``VoteResult``, or ``None``
        when the graph issues no collective, has no token input or runs without a group.

        ``min_padded``: report at least this padded token count (the CUDA-graph runner sends
        one past its largest bucket when this rank's step fits no graph, so that every rank runs
        eagerly); ``fixed_num_tokens`` overrides the artifact's own (the runner pads itself)."""
        group = _dp_group(self.config)
        if not self.has_comm or self._token_index is None or group is None:
            return None
        from dbo_compile.runtime.vote import coordinate_across_dp

        n = int(args[self._token_index].shape[0])
        fixed = self.fixed_num_tokens if fixed_num_tokens is None else fixed_num_tokens
        return coordinate_across_dp(n, uniform_decode=False, allow_split=False,
                                    config=self.config, group=group, fingerprint=None,
                                    num_tokens_padded=max(n, min_padded),
                                    fixed_num_tokens=fixed)


def _dp_group(config: DboConfig) -> Any:
    """The group of the DP vote: ``config.dp_group_name``, else WORLD when distributed."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return None
    if config.dp_group_name:
        from torch.distributed.distributed_c10d import _resolve_process_group

        return _resolve_process_group(config.dp_group_name)
    return dist.group.WORLD if dist.get_world_size() > 1 else None


def _pad_args(specs: list[InputSpec], args: Sequence[Any], num_tokens: int,
              padded: int) -> list[Any]:
    """Token-indexed inputs padded with rows that write nothing (slot -1, zeros)."""
    out = list(args)
    if padded == num_tokens:
        return out
    for spec in specs:
        if spec.kind == "token":
            t = args[spec.index]
            fill = -1 if spec.field == "slot_mapping" else 0
            pad = t.new_full((padded - num_tokens, *t.shape[1:]), fill)
            out[spec.index] = torch.cat([t, pad], dim=0)
        elif spec.kind == "size":
            src, dim = spec.size_of
            if dim == 0 and specs[src].kind == "token":
                out[spec.index] = padded
    return out


class DboCompiledModule:
    """What the ``dbo`` backend returns to Dynamo for a splittable graph.

    Per call (one step): read the host-side step facts (:mod:`.context`), check the vetoes,
    vote with the other DP ranks (:func:`~dbo_compile.runtime.vote.coordinate_across_dp`:
    split?, padded token count), pad the token-indexed inputs to the agreed count (padding
    rows: slot -1, zeros), run the split program (inputs and attention metadata cut per ubatch)
    or the unsplit one, and return the outputs without the padding rows, concatenated in
    ubatch order.

    Args:
        unsplit: the unsplit program; takes the graph's inputs at any token count.
        split_program: the generated split program (:class:`~dbo_compile.codegen.SplitProgram`).
        specs: classification of the graph inputs.
        signature: how split-program inputs/outputs map to the graph's.
        config: options.
        variants: every compiled schedule of the split program by name (the primary,
            ``split_program``, included; ``config.schedule_candidates``). The eager path runs
            the primary; :class:`~dbo_compile.runtime.graphs.CudaGraphRunner` picks one per
            bucket by measurement.

    Raises (per call):
        DpVoteError: the DP ranks compiled different schedules or configs.
        UBatchExecutionError: an op of the split program raised; the next step runs normally.
    """

    def __init__(self, unsplit: Callable[..., Any], split_program: Any, specs: list[InputSpec],
                 signature: SplitSignature, config: DboConfig,
                 variants: dict[str, Any] | None = None):
        import hashlib

        self.unsplit = unsplit
        self.split_program = split_program
        self.variants = dict(variants) if variants else {config.scheduler: split_program}
        self.specs = specs
        self.signature = signature
        self.config = config
        self.stats = StepStats()
        self.reason = None
        self.last_slices: list[Any] = []
        self.last_vote: Any = None
        self._token_index = next(s.index for s in specs if s.kind == "token")
        self._fields = {s.field: s.index for s in specs if s.field is not None}
        #: the order of collectives the split program issues: must be identical on every DP
        #: rank (checked by the DP vote). Not the code itself: ranks that saw different token
        #: counts may hold a static and a dynamic Dynamo graph with the same schedule.
        comm_order = [(u.ubatch, u.label, u.layer) for u in split_program.schedule.units
                      if u.kind == "comm"]
        self.fingerprint = hashlib.sha256(
            repr((config.num_ubatches, comm_order)).encode()).hexdigest()[:16]

    @property
    def code(self) -> str:
        return self.split_program.code

    @property
    def schedule(self):
        return self.split_program.schedule

    # -- the guards -----------------------------------------------------------------------
    @staticmethod
    def _veto(md: AttentionMetadata | None, qlens: list[int],
              host: HostCounts | None) -> str | None:
        """The step's veto (``qlens``: the metadata's query lens, Python ints)."""
        from dbo_compile.runtime.vetoes import _check_vetoes

        ctx = current_step_context()
        if not ctx.allow_split:
            return "engine: allow_split=False"
        if md is None or (ctx.block_size is None and not ctx.vetoes):
            return None
        return _check_vetoes(md, list(qlens), ctx.block_size, ctx.vetoes, host)  # vetoes' own

    def decide(self, args: Sequence[Any], min_padded: int = 0, *,
               metadata: AttentionMetadata | None = None,
               host: HostCounts | None = None) -> tuple[Any, str, list[int]]:
        """The DP vote for this step: ``(VoteResult, reason, query lens)``.

        Every rank of the DP group calls this once per step (ranks with zero tokens too).

        Args:
            args: the step's graph inputs.
            min_padded: report at least this padded token count (see ``UnsplitProgram``).
            metadata: the step's metadata when the caller holds it (the CUDA-graph runner):
                checked and vetoed as it is, host mirrors included, instead of being rebuilt
                from ``args`` (which carry no mirrors).
            host: the metadata's :meth:`~AttentionMetadata.host_counts` when the caller has
                them.

        Device reads: none with the metadata's host mirrors (or ``host``, and for the
        prefix-read veto ``slot_mapping_cpu`` / ``block_table_cpu``); else the counts in one
        copy and the veto's slots and block table in another. ``config.check_host_mirrors``
        adds a read of every mirrored field (debugging).
        """
        from dbo_compile.runtime.vote import coordinate_across_dp

        num_tokens = int(args[self._token_index].shape[0])
        has_md = "query_start_loc" in self._fields
        given = current_step_context().num_scheduled_tokens
        qlens: list[int] | None = None
        local_error = None
        veto = None
        try:
            md = None
            if has_md:
                md, host = self._metadata(args, num_tokens, metadata, host)
                if self.config.check_host_mirrors:
                    md.check_host_mirrors()
                md.validate(host=host)
                qlens = _scheduled_tokens(given, host[0])
                if sum(qlens) > num_tokens:
                    raise MetadataError(f"{sum(qlens)} scheduled tokens but only {num_tokens} rows")
            veto = self._veto(md, qlens or [], host) if self.config.split != "never" else None
        except MetadataError as e:
            local_error = f"{type(e).__name__}: {e}"
        if qlens is None:  # no metadata (every token its own request), or it failed its checks
            qlens = [1] * num_tokens if given is None else int_list(given)
        real = sum(qlens) if has_md else num_tokens
        uniform_decode = bool(qlens) and qlens.count(1) == len(qlens)
        vote = coordinate_across_dp(
            real, uniform_decode=uniform_decode, allow_split=veto is None, config=self.config,
            group=_dp_group(self.config), fingerprint=self.fingerprint,
            num_tokens_padded=max(num_tokens, real, min_padded), local_error=local_error)
        reason = "split" if vote.should_split else (veto or vote.reason or "not split")
        return vote, reason, qlens

    # -- the split ------------------------------------------------------------------------
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
        from dbo_compile.runtime import ubatch

        n = self.config.num_ubatches
        num_tokens = int(args[self._token_index].shape[0])
        per_ubatch_md: list[dict[str, torch.Tensor]] | None = None
        if "query_start_loc" in self._fields:
            md, counts = self._metadata(args, num_tokens, host=host)
            if not validated:
                md.validate(host=counts)
            cu = counts[0].tolist()
            _, padded = ubatch._slices_at_offsets(cu, ubatch._split_points(num_tokens, n),
                                                  num_tokens)
            parts = ubatch._split_validated(padded, md, counts, cu, check_parts=not validated)
            per_ubatch_md = [m.tensors() for m in parts]
        else:  # no metadata: every token is its own request
            _, padded = ubatch.make_ubatch_slices([1] * num_tokens, num_tokens, n)
        self.last_slices = padded
        out: list[Any] = []
        for index, ubatch, field_name, kind in self._split_plan:
            if ubatch is None:
                out.append(args[index])
            elif field_name is not None and per_ubatch_md is not None:
                out.append(per_ubatch_md[ubatch][field_name])
            elif kind == "token":
                sl = padded[ubatch].token_slice
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
        return [(index, ubatch, self.specs[index].field, self.specs[index].kind)
                for index, ubatch in self.signature.inputs]

    @functools.cached_property
    def _split_sizes(self) -> list[tuple[int, int, int]]:
        """Per-ubatch size inputs: ``(position, position of the tensor it measures, dim)``."""
        return [(pos, self.signature.inputs.index((self.specs[index].size_of[0], ubatch)),
                 self.specs[index].size_of[1])
                for pos, (index, ubatch) in enumerate(self.signature.inputs)
                if ubatch is not None and self.specs[index].kind == "size"]

    def _metadata(self, args: Sequence[Any], num_tokens: int,
                  metadata: AttentionMetadata | None = None, host: HostCounts | None = None
                  ) -> tuple[AttentionMetadata, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """The step's metadata (``metadata``, else rebuilt from the graph inputs) and its counts
        on the host (``host``, else :meth:`AttentionMetadata.host_counts`: its mirrors, or the
        one device read)."""
        if metadata is not None:
            counts = metadata.host_counts() if host is None else host
            return metadata, tuple(host_tensor(h) for h in counts)  # type: ignore[return-value]
        f = self._fields
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

    def __call__(self, *args: Any) -> tuple[Any, ...]:
        if _THREAD.recorded is not None:
            _THREAD.recorded.append((self, args))
        vote, reason, qlens = self.decide(args)
        self.last_vote = vote
        _THREAD.last_called = self
        self.stats.count(vote.should_split, reason)
        num_tokens = int(args[self._token_index].shape[0])
        padded_args = _pad_args(self.specs, args, num_tokens, vote.num_tokens_padded)
        write_back = _WriteBack(args, padded_args, num_tokens)
        if not vote.should_split:
            outs = self.unsplit(*padded_args)
            write_back()
            return tuple(_unpad(o, num_tokens, vote.num_tokens_padded) if len(idx) > 1 else o
                         for o, idx in zip(outs, self.signature.outputs))
        split_args = self.split_args(padded_args, qlens)
        try:
            outs = self.split_program(*split_args)
        except Exception as e:  # noqa: BLE001 - re-raised with the ubatch context
            raise UBatchExecutionError(
                f"the split program failed in a ubatch ({type(e).__name__}: {e}); the step was "
                "aborted, the next step runs normally"
            ) from e
        write_back()
        return tuple(_unpad(o, num_tokens, vote.num_tokens_padded) if len(idx) > 1 else o
                     for o, idx in zip(join_ubatch_outputs(outs, self.signature.outputs),
                                       self.signature.outputs))


def join_ubatch_outputs(outs: Sequence[Any], outputs: Sequence[Sequence[int]]) -> tuple[Any, ...]:
    """The graph's outputs from the split program's: a token-indexed output (several split
    outputs, one per ubatch) is concatenated along the token dim in ubatch order; any other is
    taken as it is. ``outputs`` is ``SplitSignature.outputs``."""
    return tuple(outs[idx[0]] if len(idx) == 1 else torch.cat([outs[i] for i in idx], dim=0)
                 for idx in outputs)


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


class _WriteBack:
    """Token-indexed inputs the step pads are copies: rows the program writes in place (a KV
    cache indexed by request, e.g. transformers' StaticCache) are copied back to the caller's
    tensor after the step. In-place writes are detected by the tensor version counter."""

    def __init__(self, original: Sequence[Any], padded: Sequence[Any], num_tokens: int):
        self.pairs = [(o, p, p._version) for o, p in zip(original, padded)
                      if isinstance(p, torch.Tensor) and p is not o and isinstance(o, torch.Tensor)]
        self.num_tokens = num_tokens

    def __call__(self) -> None:
        for orig, pad, version in self.pairs:
            if pad._version != version:
                orig.copy_(pad[: self.num_tokens])


def _unpad(out: Any, num_tokens: int, padded: int) -> Any:
    if padded != num_tokens and isinstance(out, torch.Tensor) and out.dim() and out.shape[0] == padded:
        return out[:num_tokens]
    return out
