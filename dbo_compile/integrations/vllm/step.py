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
3. when the step splits, cuts the ``CommonAttentionMetadata`` at the vote's padded slices with
   vLLM's own ``split_attn_metadata`` (vLLM DBO's rules, as ours) and builds each ubatch's
   backend metadata with the same builder, and runs the split program under
   :func:`~dbo_compile.runtime.context.ubatch_scope`: before each unit of ubatch ``u`` that
   runs a step-state op (vLLM's attention and KV-cache write), ubatch ``u``'s metadata and
   slot mappings are installed in the forward context; the step's own are restored after.

A step without attention metadata (vLLM's profile and dummy runs) runs the artifact as it is.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from dbo_compile.errors import MetadataError
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


def _ubatch_states(facts: _StepFacts, forward_context: Any, num_tokens_padded: int,
                   num_ubatches: int) -> list[tuple[dict[str, Any], dict[str, torch.Tensor]]]:
    """Per ubatch: the attention metadata by layer (built by the step's own builders from
    vLLM's ``split_attn_metadata`` of its ``CommonAttentionMetadata`` at the vote's padded
    slices) and the slot mapping by layer (the ubatch's rows; padding rows ``-1``).

    Raises:
        MetadataError: a ubatch has no real token (vLLM's cut needs one).
    """
    _, padded = make_ubatch_slices(facts.qlens, num_tokens_padded, num_ubatches)
    real = sum(facts.qlens)
    if any(s.token_slice.start >= real for s in padded):
        raise MetadataError(
            f"vllm: a ubatch of slices {[(s.token_slice.start, s.token_slice.stop) for s in padded]}"
            f" has no real token of {real}: vLLM's metadata cut needs one")
    vslices = [ubatch_utils.UBatchSlice(s.request_slice, s.token_slice) for s in padded]
    states: list[tuple[dict[str, Any], dict[str, torch.Tensor]]] = [({}, {}) for _ in padded]
    for record, names in facts.builds.values():
        parts = ubatch_utils.split_attn_metadata(vslices, record.common)
        for u, cm_u in enumerate(parts):
            md_u = record.group.build_metadata(cm_u, 0, record.common_prefix_len,
                                               **record.kwargs)
            for name in names:
                states[u][0][name] = md_u
    slot_mapping = forward_context.slot_mapping
    for u, s in enumerate(padded):
        for name, slots in (slot_mapping or {}).items():
            states[u][1][name] = slice_token_tensor(slots, s.token_slice, num_real_tokens=real,
                                                    pad_value=PAD_SLOT_ID)
    return states


class VllmStep:
    """What the vLLM backend entry returns: the ``dbo`` artifact run with vLLM's step facts
    (module docstring). ``artifact`` is the :class:`CompiledArtifact` (its ``stats`` count the
    split and unsplit steps, with their reasons)."""

    def __init__(self, artifact: CompiledArtifact, speculative: bool = False):
        self.artifact = artifact
        self.speculative = speculative

    def __call__(self, *args: Any) -> Any:
        artifact = self.artifact
        fc = get_forward_context() if is_forward_context_available() else None
        index = artifact.token_index
        facts = None
        if fc is not None and index is not None:
            facts = _step_facts(fc, int(args[index].shape[0]), self.speculative)
        if facts is None:
            return artifact(*args)
        veto = facts.veto
        vetoes: tuple[Callable[..., Any], ...] = ((lambda md, n: veto),) if veto else ()
        with step_context(num_scheduled_tokens=facts.qlens, block_size=facts.block_size,
                          vetoes=vetoes):
            args = artifact.graph_inputs(args)
            note_call(artifact, args)
            decision = artifact.decide_step(args, metadata=facts.metadata, host=facts.counts)
            if not decision.should_split:
                return artifact.run_decided(args, decision)
            states = _ubatch_states(facts, fc, decision.vote.num_tokens_padded,
                                    artifact.config.num_ubatches)
            saved = (fc.attn_metadata, fc.slot_mapping)

            def enter(u: int) -> None:
                fc.attn_metadata, fc.slot_mapping = states[u]

            try:
                with ubatch_scope(enter):
                    return artifact.run_decided(args, decision)
            finally:
                fc.attn_metadata, fc.slot_mapping = saved
