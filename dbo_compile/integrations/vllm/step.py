"""One vLLM forward step through a ``dbo`` artifact: the step facts from vLLM's metadata, the
vetoes, and each ubatch's attention metadata in vLLM's forward context.

vLLM's attention ops read their metadata from the forward context by layer name
(``get_forward_context().attn_metadata[layer_name]``, ``.slot_mapping[layer_name]``), not from
graph inputs. Per step :class:`VllmStep`

1. finds how vLLM built this step's metadata: the plug-in records every
   ``AttentionGroup.build_metadata(common_attn_metadata, ...)`` call
   (:func:`record_builds`), so the ``CommonAttentionMetadata`` and the builder of each
   layer's metadata are known;
2. turns it into our :class:`~dbo_compile.metadata.AttentionMetadata` (host counts from
   ``query_start_loc_cpu`` and ``seq_lens``) and the step facts (tokens per request, the KV
   block size), with vLLM's vetoes (:func:`vllm_veto`: speculative decoding, cascade
   attention, metadata not built by a recorded builder, several KV-cache groups), and lets
   the artifact run its guard: the prefix-read veto (vLLM's ``_allow_microbatching`` rule),
   the thresholds and the DP vote;
3. when the step splits, cuts the ``CommonAttentionMetadata`` at each ubatch's real tokens
   with vLLM's own ``split_attn_metadata`` (vLLM DBO's rules, as ours) and builds each
   ubatch's backend metadata with the group's builder for that ubatch (one per ubatch, as
   vLLM makes them for its own microbatching: :func:`ubatch_builders`), and runs the split
   program under :func:`~dbo_compile.runtime.context.ubatch_scope`: before each unit of
   ubatch ``u`` that runs a step-state op (vLLM's attention and KV-cache write), ubatch
   ``u``'s metadata and slot mappings (rows at the vote's padded slices, padding ``-1``) are
   installed in the forward context; the step's own are restored after. The ubatches' state
   is built at the first such unit, inside the step transaction, so that a failure there
   fails the step on every DP rank (``UBatchExecutionError``), never on one rank after the
   vote. A ubatch without a real token (DP padding) runs with no metadata and no slots.
4. when the step runs unsplit but padded by the DP vote, the slot mappings are padded with
   ``-1`` to the agreed rows.

A step without attention metadata (vLLM's profile and dummy runs) runs the artifact with only
the slot mappings cut or padded; a step whose metadata was not built by a recorded builder
runs unsplit (WARNING once).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from dbo_compile.metadata import AttentionMetadata
from dbo_compile.runtime.artifact import CompiledArtifact
from dbo_compile.runtime.context import note_call, step_context, ubatch_scope
from dbo_compile.runtime.ubatch import PAD_SLOT_ID, make_ubatch_slices, slice_token_tensor

from vllm.forward_context import get_forward_context, is_forward_context_available
from vllm.v1.worker import ubatch_utils
from vllm.v1.worker import utils as worker_utils

log = logging.getLogger(__name__)

__all__ = ["BuildRecord", "VllmStep", "record_builds", "vllm_veto"]


@dataclass
class BuildRecord:
    """One ``AttentionGroup.build_metadata`` call of the model runner: what it built, from
    what, with which builder."""

    metadata: Any
    group: Any
    common: Any
    ubatch_idx: int
    common_prefix_len: int
    kwargs: dict[str, Any] = field(default_factory=dict)


#: layer name -> the last build of its metadata in this process
_BUILDS: dict[str, BuildRecord] = {}


def record_builds() -> None:
    """Wrap ``vllm.v1.worker.utils.AttentionGroup.build_metadata`` so that each call records
    what it built (:class:`BuildRecord`, by layer name). Idempotent; the wrapped call's result
    is unchanged."""
    cls = worker_utils.AttentionGroup
    if getattr(cls.build_metadata, "_dbo_recorded", False):
        return
    original = cls.build_metadata

    def build_metadata(self: Any, common_attn_metadata: Any, ubatch_idx: int = 0,
                       common_prefix_len: int = 0, **kwargs: Any) -> Any:
        md = original(self, common_attn_metadata, ubatch_idx, common_prefix_len, **kwargs)
        record = BuildRecord(md, self, common_attn_metadata, ubatch_idx, common_prefix_len,
                             dict(kwargs))
        for name in self.layer_names:
            _BUILDS[name] = record
        return md

    build_metadata._dbo_recorded = True  # type: ignore[attr-defined]
    build_metadata._dbo_original = original  # type: ignore[attr-defined]
    cls.build_metadata = build_metadata


@dataclass
class _StepFacts:
    metadata: AttentionMetadata
    counts: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    qlens: list[int]
    block_size: int
    builds: dict[int, tuple[BuildRecord, list[str]]]
    veto: str | None


def vllm_veto(forward_context: Any, builds: dict[str, BuildRecord | None],
              speculative: bool) -> str | None:
    """Why vLLM would not microbatch this step, or why its metadata cannot be cut per ubatch
    (``None``: no objection). The prefix-read rule is the artifact's own veto.

    Args:
        forward_context: vLLM's ``ForwardContext`` of the step.
        builds: per attention layer, the recorded build of its metadata (``None``: not
            recorded, or recorded for another object).
        speculative: vLLM runs a drafter (speculative decoding).
    """
    if speculative or isinstance(forward_context.attn_metadata, list):
        return "vllm: speculative decoding (per-draft metadata; vLLM DBO does not split it)"
    missing = sorted(k for k, v in builds.items() if v is None)
    if missing:
        return (f"vllm: the metadata of {missing[0]} was not built through "
                "AttentionGroup.build_metadata this step (cached or captured metadata)")
    records = {id(r): r for r in builds.values() if r is not None}
    if any(r.common_prefix_len for r in records.values()):
        return "vllm: cascade attention (a common prefix shared by the step's requests)"
    if len({id(r.common) for r in records.values()}) > 1:
        return "vllm: several KV-cache groups (one cut of the metadata is supported)"
    if any(r.ubatch_idx for r in records.values()):
        return "vllm: metadata built for vLLM's own ubatches"
    return None


def _step_facts(forward_context: Any, num_rows: int, speculative: bool) -> _StepFacts | None:
    """This step's metadata in our schema and its facts, from the recorded builds of the
    layers in the forward context; ``None`` without attention metadata (a profile run)."""
    attn = forward_context.attn_metadata
    if not attn:
        return None
    layers = attn[0] if isinstance(attn, list) else attn
    builds: dict[str, BuildRecord | None] = {}
    for name, md in sorted(layers.items()):
        r = _BUILDS.get(name)
        builds[name] = r if r is not None and r.metadata is md else None
    veto = vllm_veto(forward_context, builds, speculative)
    record = next((r for r in builds.values() if r is not None), None)
    if record is None:
        return None
    cm = record.common
    num_reqs = int(cm.num_reqs)
    qsl = cm.query_start_loc_cpu[:num_reqs + 1].to(torch.int32)
    seq = cm.seq_lens[:num_reqs].to("cpu", torch.int32)
    qlens_t = qsl[1:] - qsl[:-1]
    ctx = seq - qlens_t
    slots = cm.slot_mapping.to(torch.int64)
    slot_rows = slice_token_tensor(slots, slice(0, num_rows), num_real_tokens=int(qsl[-1]),
                                   pad_value=PAD_SLOT_ID)
    table = cm.block_table_tensor[:num_reqs].to(torch.int32)
    md = AttentionMetadata(
        query_start_loc=qsl.to(slots.device), seq_lens=seq.to(slots.device),
        num_computed_tokens=ctx.to(slots.device), block_table=table, slot_mapping=slot_rows,
        max_query_len=int(qlens_t.max()) if num_reqs else 0,
        max_seq_len=int(seq.max()) if num_reqs else 0,
        query_start_loc_cpu=qsl, seq_lens_cpu=seq, num_computed_tokens_cpu=ctx,
        block_table_cpu=table.cpu(), slot_mapping_cpu=slot_rows.cpu())
    by_record: dict[int, tuple[BuildRecord, list[str]]] = {}
    for name, r in builds.items():
        if r is not None:
            by_record.setdefault(id(r), (r, []))[1].append(name)
    block_size = int(record.group.kv_cache_spec.block_size)
    return _StepFacts(md, (qsl, seq, ctx), qlens_t.tolist(), block_size, by_record, veto)


def ubatch_builders(group: Any, num_ubatches: int) -> None:
    """Give vLLM's ``AttentionGroup`` one metadata builder per ubatch, as vLLM does when its
    own microbatching is on (``create_metadata_builders(num_metadata_builders=...)``): a
    builder keeps state of its last build (MLA's prefill backend holds that build's prefill
    metadata), so ubatch ``u``'s metadata is built by builder ``u`` and ubatch 0's is not
    overwritten by ubatch 1's build. The builders made here are new (a scratch copy of the
    group makes them, with vLLM's own arguments); builder 0 stays vLLM's."""
    have = len(group.metadata_builders)
    if have >= num_ubatches:
        return
    first = group.metadata_builders[0]
    scratch = dataclasses.replace(group, metadata_builders=[])
    scratch.create_metadata_builders(first.vllm_config, first.device, group.kernel_block_size,
                                     num_metadata_builders=num_ubatches)
    group.metadata_builders.extend(scratch.metadata_builders[have:])
    if scratch.kernel_block_table is not None:  # one row per builder
        group.kernel_block_table = scratch.kernel_block_table
    log.debug("dbo: attention group of %s: %d metadata builders (one per ubatch)",
              group.layer_names[:1], num_ubatches)


def _ubatch_states(facts: _StepFacts, forward_context: Any, num_tokens_padded: int,
                   num_ubatches: int) -> list[tuple[dict[str, Any], dict[str, torch.Tensor]]]:
    """Per ubatch: the attention metadata by layer (built by the step's own builders from
    vLLM's ``split_attn_metadata`` of its ``CommonAttentionMetadata`` at the ubatch's real
    tokens) and the slot mapping by layer (the ubatch's rows at the vote's padded slices;
    padding rows ``-1``).

    A ubatch without a real token (DP padding: this rank has fewer tokens than the vote's
    padded count) still runs, its collectives included (``docs/design.md``, invariant 6): its
    metadata is ``None`` for every layer and it has no slot mapping, as in vLLM's own profile
    and dummy runs, so its attention writes no KV cache and reads none (vLLM's CPU attention
    leaves the rows as they are, MLA zeroes them: padding rows either way).
    """
    slices, padded = make_ubatch_slices(facts.qlens, num_tokens_padded, num_ubatches)
    real = sum(facts.qlens)
    names = sorted(forward_context.attn_metadata)
    states: list[tuple[dict[str, Any], dict[str, torch.Tensor]]] = [
        (dict.fromkeys(names), {}) for _ in padded]
    live = [u for u, s in enumerate(slices) if s.token_slice.stop > s.token_slice.start]
    # the metadata covers the ubatch's real tokens, as vLLM's own ubatches without
    # full-CUDA-graph padding (its attention reads rows [0, num_actual_tokens) of a ubatch)
    vslices = [ubatch_utils.UBatchSlice(slices[u].request_slice, slices[u].token_slice)
               for u in live]
    for record, layer_names in facts.builds.values():
        ubatch_builders(record.group, num_ubatches)
        parts = ubatch_utils.split_attn_metadata(vslices, record.common)
        for u, cm_u in zip(live, parts):
            md_u = record.group.build_metadata(cm_u, u, record.common_prefix_len,
                                               **record.kwargs)
            for name in layer_names:
                states[u][0][name] = md_u
    for u in live:
        states[u] = (states[u][0], _slot_rows(forward_context.slot_mapping,
                                              padded[u].token_slice, real))
    return states


def _slot_rows(slot_mapping: dict[str, torch.Tensor] | None, rows: slice,
               real: int | None = None) -> dict[str, torch.Tensor]:
    """vLLM's slot mapping by layer at token rows ``rows``: rows at or past ``real`` (default:
    each tensor's own length) are padding, ``-1`` (no KV write)."""
    return {name: slice_token_tensor(slots, rows, num_real_tokens=real, pad_value=PAD_SLOT_ID)
            for name, slots in (slot_mapping or {}).items()}


def _stateless_ubatches(forward_context: Any, num_tokens_padded: int,
                        num_ubatches: int) -> list[tuple[Any, dict[str, torch.Tensor]]]:
    """Per ubatch of a step without recorded metadata (vLLM's profile and dummy runs: no
    attention metadata): the step's metadata as it is, and the slot mapping at the ubatch's
    rows (the artifact's even cut of the padded rows)."""
    _, padded = make_ubatch_slices([1] * num_tokens_padded, num_tokens_padded, num_ubatches)
    return [(forward_context.attn_metadata, _slot_rows(forward_context.slot_mapping,
                                                       s.token_slice)) for s in padded]


class VllmStep:
    """What the vLLM backend entry returns: the ``dbo`` artifact run with vLLM's step facts
    (module docstring). ``artifact`` is the :class:`CompiledArtifact` (its ``stats`` count the
    split and unsplit steps, with their reasons)."""

    def __init__(self, artifact: CompiledArtifact, speculative: bool = False):
        self.artifact = artifact
        self.speculative = speculative
        self._warned: set[str] = set()

    def __call__(self, *args: Any) -> Any:
        artifact = self.artifact
        fc = get_forward_context() if is_forward_context_available() else None
        index = artifact.token_index
        if fc is None or index is None:
            return artifact(*args)
        num_rows = int(args[index].shape[0])
        facts = _step_facts(fc, num_rows, self.speculative)
        n = artifact.config.num_ubatches
        if facts is not None:
            veto = facts.veto
            vetoes: tuple[Callable[..., Any], ...] = ((lambda md, q: veto),) if veto else ()
            step = step_context(num_scheduled_tokens=facts.qlens, block_size=facts.block_size,
                                vetoes=vetoes)
            metadata, host, real = facts.metadata, facts.counts, sum(facts.qlens)
        else:
            if fc.attn_metadata:  # metadata, but not how it was built: it cannot be cut
                self._warn_once("vllm: this step's attention metadata was not built through a "
                                "recorded AttentionGroup.build_metadata; such steps run unsplit")
            # vLLM's profile and dummy runs have none: nothing to cut but the slot mapping
            step = step_context(allow_split=not fc.attn_metadata)
            metadata, host, real = None, None, None
        saved = (fc.attn_metadata, fc.slot_mapping)
        states: list[tuple[Any, dict[str, torch.Tensor]]] = []

        def enter(u: int) -> None:
            # built at the first ubatch unit, inside the step transaction: a failure here is
            # every rank's UBatchExecutionError, not a lone rank's error after the vote
            if not states:
                padded = artifact.last_vote.num_tokens_padded
                states.extend(_ubatch_states(facts, fc, padded, n) if facts is not None
                              else _stateless_ubatches(fc, padded, n))
            fc.attn_metadata, fc.slot_mapping = states[u]

        with step, ubatch_scope(enter):
            args = artifact.graph_inputs(args)
            note_call(artifact, args)
            try:
                decision = artifact.decide_step(args, metadata=metadata, host=host)
                vote = decision.vote
                if vote is not None and not decision.should_split and \
                        vote.num_tokens_padded > num_rows:
                    # DP padding of an unsplit step: the padding rows write no KV either
                    fc.slot_mapping = _slot_rows(saved[1], slice(0, vote.num_tokens_padded),
                                                 real)
                return artifact.run_decided(args, decision)
            finally:
                fc.attn_metadata, fc.slot_mapping = saved

    def _warn_once(self, message: str) -> None:
        if message not in self._warned:
            self._warned.add(message)
            log.warning("dbo: %s", message)

