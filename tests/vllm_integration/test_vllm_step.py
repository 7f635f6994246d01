"""vLLM's step facts without an engine: :func:`vllm_veto` and ``_step_facts`` on hand-built
``CommonAttentionMetadata`` (speculative decoding, cascade attention, several KV-cache
groups, metadata not built by a recorded builder), each ubatch's forward-context state (an
empty ubatch included: DP padding), as :class:`VllmStep` installs them, and the backend name
``"dbo"`` under vLLM.

Runs only where vLLM imports (``.ci/run``'s vLLM virtual environment).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm.config",
                    reason="vLLM is not installed (.ci/run tests it in its own venv)")

from vllm.config import CompilationConfig, VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.v1.attention.backend import CommonAttentionMetadata  # noqa: E402

from dbo_compile.errors import DboConfigError  # noqa: E402
from dbo_compile.integrations.vllm import register, step, vllm_backend  # noqa: E402
from dbo_compile.integrations.vllm.step import BuildRecord, _step_facts, _ubatch_states, vllm_veto  # noqa: E402,E501

BLOCK = 16


def _common(qlens: list[int], context: list[int], rows: int | None = None) -> CommonAttentionMetadata:
    """Metadata of requests with ``qlens`` new tokens after ``context`` cached ones; request
    ``i`` owns blocks ``[4i, 4i + 4)``; slots of ``rows`` token rows (padding ``-1``)."""
    qsl = torch.tensor([0] + list(torch.tensor(qlens).cumsum(0).tolist()), dtype=torch.int32)
    seq = torch.tensor([q + c for q, c in zip(qlens, context)], dtype=torch.int32)
    table = torch.arange(4 * len(qlens), dtype=torch.int32).view(len(qlens), 4)
    slots = [int(table[i, p // BLOCK]) * BLOCK + p % BLOCK
             for i, (q, c) in enumerate(zip(qlens, context)) for p in range(c, c + q)]
    slots += [-1] * ((rows or len(slots)) - len(slots))
    return CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=seq, num_reqs=len(qlens),
        num_actual_tokens=int(qsl[-1]), max_query_len=max(qlens), max_seq_len=int(seq.max()),
        block_table_tensor=table, slot_mapping=torch.tensor(slots, dtype=torch.int64),
        seq_lens_cpu_upper_bound=seq)


class _Group:
    """What ``_ubatch_states`` uses of vLLM's ``AttentionGroup``: ``build_metadata`` (here the
    common metadata itself, tagged with the builder index), its builders and block size."""

    def __init__(self, names: list[str], builders: int = 2):
        self.layer_names = names
        self.kv_cache_spec = SimpleNamespace(block_size=BLOCK)
        self.metadata_builders = [object()] * builders
        self.kernel_block_size = None

    def build_metadata(self, cm, ubatch_idx=0, common_prefix_len=0, **kwargs):
        return SimpleNamespace(common=cm, builder=ubatch_idx)


def _context(records: dict[str, BuildRecord | None], slots: torch.Tensor | None = None,
             spec_lists: bool = False) -> tuple[SimpleNamespace, dict[str, BuildRecord | None]]:
    """A forward context whose layers' metadata are the records' (``None``: a metadata object
    no build recorded); the records registered as the step's builds."""
    step._BUILDS.clear()
    attn = {}
    for name, r in records.items():
        if r is None:
            attn[name] = object()
        else:
            attn[name] = r.metadata
            step._BUILDS[name] = r
    fc = SimpleNamespace(attn_metadata=[attn] if spec_lists else attn,
                         slot_mapping={n: slots for n in records} if slots is not None else {})
    return fc, records


def _record(cm: CommonAttentionMetadata, names: list[str], common_prefix_len: int = 0,
            ubatch_idx: int = 0) -> BuildRecord:
    return BuildRecord(SimpleNamespace(tag="md"), _Group(names), cm, ubatch_idx,
                       common_prefix_len)


def test_no_objection_on_a_plain_step():
    r = _record(_common([5, 12], [0, 0]), ["l0", "l1"])
    fc, builds = _context({"l0": r, "l1": r})
    assert vllm_veto(fc, builds, speculative=False) is None


@pytest.mark.parametrize("how", ["drafter", "per-draft metadata"])
def test_speculative_decoding_is_vetoed(how):
    r = _record(_common([3, 3], [10, 20]), ["l0"])
    fc, builds = _context({"l0": r}, spec_lists=how == "per-draft metadata")
    reason = vllm_veto(fc, builds, speculative=how == "drafter")
    assert reason is not None and "speculative decoding" in reason


def test_cascade_attention_is_vetoed():
    r = _record(_common([5, 12], [32, 32]), ["l0"], common_prefix_len=32)
    fc, builds = _context({"l0": r})
    assert "cascade attention" in vllm_veto(fc, builds, speculative=False)


def test_several_kv_cache_groups_are_vetoed():
    a = _record(_common([5, 12], [0, 0]), ["l0"])
    b = _record(_common([5, 12], [0, 0]), ["l1"])
    fc, builds = _context({"l0": a, "l1": b})
    assert "several KV-cache groups" in vllm_veto(fc, builds, speculative=False)


def test_metadata_not_built_through_a_recorded_builder_is_vetoed():
    r = _record(_common([5, 12], [0, 0]), ["l0"])
    fc, _ = _context({"l0": r, "l1": None})
    builds = {"l0": r, "l1": None}
    assert "l1 was not built" in vllm_veto(fc, builds, speculative=False)


def test_step_facts_from_common_metadata():
    """Three requests (one decode with context, a fresh prefill, a chunk after 16 cached
    tokens), 40 rows of which 25 real: our metadata, the counts and the veto."""
    cm = _common([1, 8, 16], [20, 0, 16], rows=40)
    r = _record(cm, ["l0", "l1"], common_prefix_len=0)
    fc, _ = _context({"l0": r, "l1": r})
    facts = _step_facts(fc, num_rows=40, speculative=True)
    assert facts.qlens == [1, 8, 16]
    assert facts.block_size == BLOCK
    assert facts.veto is not None and "speculative" in facts.veto
    md = facts.metadata
    assert md.query_start_loc_cpu.tolist() == [0, 1, 9, 25]
    assert md.seq_lens_cpu.tolist() == [21, 8, 32]
    assert md.num_computed_tokens_cpu.tolist() == [20, 0, 16]
    assert md.slot_mapping.shape == (40,) and md.slot_mapping[25:].eq(-1).all()
    assert md.max_query_len == 16 and md.max_seq_len == 32
    ((record, names),) = facts.builds.values()
    assert record is r and sorted(names) == ["l0", "l1"]


def test_step_facts_none_without_metadata_or_records():
    assert _step_facts(SimpleNamespace(attn_metadata=None, slot_mapping=None), 8, False) is None
    fc, _ = _context({"l0": None})
    assert _step_facts(fc, 8, False) is None


def test_ubatch_states_with_an_empty_ubatch():
    """DP padding: this rank has 17 real tokens, the vote padded the step to 46 rows, so
    ubatch 1 (rows 23..46) has none: its metadata is ``None`` for every layer and it has no
    slot mapping (no KV write, no read), and ubatch 0's metadata covers the 17 tokens, built
    by builder 0 (before: ``MetadataError`` after the vote, on this rank only)."""
    cm = _common([5, 12], [0, 0])
    slots = torch.cat([cm.slot_mapping, torch.full((29,), -1)])
    r = _record(cm, ["l0", "l1"])
    fc, _ = _context({"l0": r, "l1": r}, slots=slots)
    facts = _step_facts(fc, num_rows=46, speculative=False)
    states = _ubatch_states(facts, fc, num_tokens_padded=46, num_ubatches=2)
    (md0, slots0), (md1, slots1) = states
    assert md0["l0"].common.num_actual_tokens == 17 and md0["l0"].builder == 0
    assert slots0["l0"].shape == (23,) and slots0["l0"][17:].eq(-1).all()
    assert md1 == {"l0": None, "l1": None} and slots1 == {}


def test_ubatch_states_cut_a_request_and_use_one_builder_per_ubatch():
    """A 26-token request and a 5-token one, 31 rows (padded to 32): ubatch 0 holds the first
    16 rows, ubatch 1 the rest: the cut request's continuation keeps its full seq_len, each
    ubatch's metadata is built by its own builder (a builder keeps state of its last build)."""
    cm = _common([26, 5], [0, 0])
    r = _record(cm, ["l0"])
    fc, _ = _context({"l0": r}, slots=torch.cat([cm.slot_mapping, torch.full((1,), -1)]))
    facts = _step_facts(fc, num_rows=32, speculative=False)
    (md0, _), (md1, slots1) = _ubatch_states(facts, fc, num_tokens_padded=32, num_ubatches=2)
    c0, c1 = md0["l0"].common, md1["l0"].common
    assert (md0["l0"].builder, md1["l0"].builder) == (0, 1)
    assert c0.query_start_loc_cpu.tolist() == [0, 16] and c0.seq_lens.tolist() == [16]
    assert c1.query_start_loc_cpu.tolist() == [0, 10, 15] and c1.seq_lens.tolist() == [26, 5]
    assert c1.num_actual_tokens == 15 and slots1["l0"].shape == (16,)


def test_the_name_dbo_is_the_vllm_entry_and_other_modes_are_refused():
    """``compilation_config backend="dbo"`` resolves to the vLLM entry (not the plain Dynamo
    backend, which has no step facts); a compilation mode other than 2 is refused by name."""
    register()
    config = VllmConfig(compilation_config=CompilationConfig(mode=2, backend="dbo"))
    assert config.compilation_config.init_backend(config) is vllm_backend
    # mode 1 (stock torch.compile, with guards); vLLM itself refuses "dbo" in mode 3
    config1 = VllmConfig(compilation_config=CompilationConfig(mode=1, backend="dbo"))
    assert config1.compilation_config.init_backend(config1) is vllm_backend
    with set_current_vllm_config(config1), pytest.raises(DboConfigError, match="mode 2"):
        vllm_backend(None, [])
