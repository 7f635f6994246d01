"""The compiled artifact: per step, pick the split or the unsplit program and run it.

What stays at run time is only what cannot be known at compile time (../shared/DESIGN.md):
whether this step splits (thresholds, split mode, DP vote, vetoes) and how the inputs and the
attention metadata are cut. Outputs are concatenated along the token dim in ubatch order.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from dbo_compile.config import DboConfig
from dbo_compile.errors import UBatchExecutionError
from dbo_compile.lowering import InputSpec
from dbo_compile.passes.split_ubatch import SplitSignature
from dbo_compile.runtime.metadata import FIELD_LAYOUT, AttentionMetadata

log = logging.getLogger(__name__)


@dataclass
class StepStats:
    """Counters tests and benchmarks read (``compiled.stats``)."""

    split_steps: int = 0
    unsplit_steps: int = 0
    last_decision: str = ""
    reasons: dict[str, int] = field(default_factory=dict)

    def count(self, split: bool, reason: str) -> None:
        if split:
            self.split_steps += 1
        else:
            self.unsplit_steps += 1
        self.last_decision = reason
        self.reasons[reason] = self.reasons.get(reason, 0) + 1


class UnsplitProgram:
    """A graph compiled without a split (no comm op, or it mixes tokens): runs as traced.

    Attributes:
        reason: why the graph was not split (also logged at WARNING when compiled).
    """

    def __init__(self, fn: Callable[..., Any], reason: str):
        self.fn = fn
        self.reason = reason
        self.split_program = None
        self.stats = StepStats()

    def __call__(self, *args: Any) -> Any:
        self.stats.count(False, "unsplittable")
        return self.fn(*args)


class DboCompiledModule:
    """What the ``dbo`` backend returns to Dynamo for a splittable graph.

    Args:
        unsplit: the unsplit program (same inputs/outputs as the Dynamo graph).
        split_program: the generated split program (:class:`~dbo_compile.codegen.SplitProgram`).
        specs: classification of the graph inputs.
        signature: how split-program inputs/outputs map to the graph's.
        config: options.
    """

    def __init__(self, unsplit: Callable[..., Any], split_program: Any, specs: list[InputSpec],
                 signature: SplitSignature, config: DboConfig):
        self.unsplit = unsplit
        self.split_program = split_program
        self.specs = specs
        self.signature = signature
        self.config = config
        self.stats = StepStats()
        self.reason = None
        self.last_slices: list[Any] = []
        self._token_index = next(s.index for s in specs if s.kind == "token")
        self._fields = {s.field: s.index for s in specs if s.field is not None}

    @property
    def code(self) -> str:
        return self.split_program.code

    @property
    def schedule(self):
        return self.split_program.schedule

    # -- the guards -----------------------------------------------------------------------
    def _query_lens(self, args: Sequence[Any], num_tokens: int) -> list[int]:
        qsl_index = self._fields.get("query_start_loc")
        if qsl_index is None:
            return [1] * num_tokens  # no metadata: every token is its own request
        qsl = args[qsl_index].detach().to("cpu", torch.int64)
        return (qsl[1:] - qsl[:-1]).tolist()

    def decide(self, args: Sequence[Any]) -> tuple[bool, str, list[int]]:
        """``(split?, reason, query lens)`` for this step, from thresholds and split mode."""
        cfg = self.config
        num_tokens = int(args[self._token_index].shape[0])
        qlens = self._query_lens(args, num_tokens)
        if cfg.split == "never":
            return False, "split=never", qlens
        if num_tokens < cfg.num_ubatches:
            return False, f"{num_tokens} tokens < num_ubatches", qlens
        if cfg.split == "always":
            return True, "split=always", qlens
        uniform_decode = bool(qlens) and all(q == 1 for q in qlens)
        threshold = cfg.decode_token_threshold if uniform_decode else cfg.prefill_token_threshold
        if num_tokens >= threshold:
            return True, f">= {'decode' if uniform_decode else 'prefill'} threshold", qlens
        return False, f"< {'decode' if uniform_decode else 'prefill'} threshold {threshold}", qlens

    # -- the split ------------------------------------------------------------------------
    def split_args(self, args: Sequence[Any], qlens: list[int]) -> list[Any]:
        """Per-ubatch inputs in the split program's placeholder order."""
        from dbo_compile.runtime.ubatch import make_ubatch_slices, split_attn_metadata

        n = self.config.num_ubatches
        num_tokens = int(args[self._token_index].shape[0])
        _, padded = make_ubatch_slices(qlens, num_tokens, n)
        self.last_slices = padded
        per_ubatch_md: list[dict[str, torch.Tensor]] | None = None
        if "query_start_loc" in self._fields:
            md = self._metadata(args, num_tokens)
            per_ubatch_md = [m.tensors() for m in split_attn_metadata(padded, md)]
        out: list[Any] = []
        for index, ubatch in self.signature.inputs:
            spec = self.specs[index]
            if ubatch is None:
                out.append(args[index])
            elif spec.kind == "request" or (spec.field is not None and per_ubatch_md is not None):
                out.append(per_ubatch_md[ubatch][spec.field])
            elif spec.kind == "token":
                sl = padded[ubatch].token_slice
                out.append(args[index][sl.start:sl.stop])
            else:
                out.append(None if spec.kind == "size" else args[index])
        for pos, (index, ubatch) in enumerate(self.signature.inputs):
            spec = self.specs[index]
            if spec.kind == "size" and ubatch is not None:
                src, dim = spec.size_of
                out[pos] = out[self.signature.inputs.index((src, ubatch))].shape[dim]
        return out

    def _metadata(self, args: Sequence[Any], num_tokens: int) -> AttentionMetadata:
        f = self._fields
        qsl = args[f["query_start_loc"]]
        num_reqs = int(qsl.shape[0]) - 1
        dev = qsl.device

        def get(name: str, default: Callable[[], torch.Tensor]) -> torch.Tensor:
            return args[f[name]] if name in f else default()

        seq_lens = get("seq_lens", lambda: (qsl[1:] - qsl[:-1]).to(torch.int32))
        qlens = (qsl[1:] - qsl[:-1]).to(torch.int32)
        md = AttentionMetadata(
            query_start_loc=qsl,
            seq_lens=seq_lens,
            num_computed_tokens=get("num_computed_tokens", lambda: (seq_lens - qlens).to(torch.int32)),
            block_table=get("block_table", lambda: torch.zeros(num_reqs, 1, dtype=torch.int32, device=dev)),
            slot_mapping=get("slot_mapping", lambda: torch.full((num_tokens,), -1, dtype=torch.int64, device=dev)),
            max_query_len=int(qlens.max()) if num_reqs else 0,
            max_seq_len=int(seq_lens.max()) if num_reqs else 0,
        )
        return md

    def __call__(self, *args: Any) -> tuple[Any, ...]:
        split, reason, qlens = self.decide(args)
        self.stats.count(split, reason)
        if not split:
            return self.unsplit(*args)
        split_args = self.split_args(args, qlens)
        try:
            outs = self.split_program(*split_args)
        except Exception as e:  # noqa: BLE001 - re-raised with the ubatch context
            raise UBatchExecutionError(
                f"the split program failed ({type(e).__name__}: {e}); the step was aborted, the "
                "next step runs normally"
            ) from e
        result = []
        for idx in self.signature.outputs:
            if len(idx) == 1:
                result.append(outs[idx[0]])
            else:
                result.append(torch.cat([outs[i] for i in idx], dim=0))
        return tuple(result)
