"""How the compiled programs' inputs and outputs map to the Dynamo graph's (ground floor).

:class:`InputSpec` (one per graph input) is made by :func:`dbo_compile.lowering.classify_inputs`;
:class:`SplitSignature` by :func:`dbo_compile.passes.split_ubatch.split_ubatch`. The runtime
reads both every step to cut the inputs per ubatch and to join the outputs.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["INPUT_KINDS", "OUTPUT_KINDS", "ROW_VALID_INPUT", "InputSpec", "OutputSpec",
           "SplitSignature"]

#: the kinds of graph input (:attr:`InputSpec.kind`)
INPUT_KINDS = ("shared", "token", "request", "size", "scalar", "host_mirror")
#: the name of the input the backend adds to a graph whose state threads must not count padding
#: rows (bool ``[T]``, ``True`` for real rows; :mod:`dbo_compile.passes.state_threads`); the
#: artifact appends it to the caller's inputs
ROW_VALID_INPUT = "dbo_row_valid"
#: the kinds of graph output (:attr:`OutputSpec.kind`)
OUTPUT_KINDS = ("token", "shared", "size", "const", "unknown")


@dataclass(frozen=True)
class InputSpec:
    """How one graph input is treated by the split.

    Attributes:
        index: position among the graph's placeholders.
        name: placeholder name.
        source: Dynamo source (``L['input_ids']``) or ``""`` when the graph did not come from
            Dynamo.
        kind: one of :data:`INPUT_KINDS`: ``"shared"`` (weights, KV caches, 0-dim tensors: one
            tensor for all ubatches), ``"token"`` (dim 0 is the token dim, sliced per ubatch),
            ``"request"`` (a request-indexed attention-metadata field, rebuilt per ubatch),
            ``"size"`` (a SymInt that is the size of another input's dim), ``"scalar"``
            (passed through unchanged) or ``"host_mirror"`` (a metadata field's host copy,
            ``<field>_cpu``: the runtime's, never cut per ubatch; a graph reading one is not
            split).
        field: the ``AttentionMetadata`` field of a ``request``/``token`` metadata input.
        size_of: ``(input index, dim)`` of the tensor dim a ``size`` input measures.
    """

    index: int
    name: str
    source: str
    kind: str
    field: str | None = None
    size_of: tuple[int, int] | None = None

    @property
    def per_ubatch(self) -> bool:
        return self.kind in ("token", "request", "size")


@dataclass(frozen=True)
class OutputSpec:
    """What one graph output is, so that every entry (the artifact's call, ``run_step``, the
    CUDA-graph runner) returns it at the caller's real token count ``T`` whatever the
    program ran at (a DP-padded count, a bucket, ``run_step``'s 2 rows for 1 token).

    Attributes:
        kind: one of :data:`OUTPUT_KINDS`: ``"token"`` (a tensor whose dim 0 is
            ``coef * T``: its first ``coef * T`` rows are real), ``"shared"`` (a tensor
            independent of the token count), ``"size"`` (an int ``coef * T + offset``, e.g.
            ``input_ids.shape[0]``), ``"const"`` (not a graph value), ``"unknown"`` (any other:
            an unsplit graph's output the analysis could not classify; rows past ``T`` of a
            tensor whose dim 0 is the padded count are dropped).
        coef, offset: as above.
    """

    kind: str
    coef: int = 1
    offset: int = 0

    def size(self, num_tokens: int) -> int:
        """The value of a ``"size"`` output at ``num_tokens`` tokens (the rows of a
        ``"token"`` output)."""
        return self.coef * num_tokens + self.offset


@dataclass(frozen=True)
class SplitSignature:
    """How the split graph's inputs and outputs map to the unsplit graph's.

    Attributes:
        inputs: per split-graph placeholder, ``(original input index, ubatch or None)``.
        outputs: per original output, the split-graph output indices: one per ubatch for a
            per-ubatch output (concatenate them along dim 0 in ubatch order), one for a shared
            output.
        num_ubatches: number of ubatch copies.
    """

    inputs: tuple[tuple[int, int | None], ...]
    outputs: tuple[tuple[int, ...], ...]
    num_ubatches: int

    def token_outputs(self) -> list[bool]:
        """Per original output: token-indexed (one split output per ubatch, concatenated) or
        not."""
        return [len(idx) > 1 for idx in self.outputs]
