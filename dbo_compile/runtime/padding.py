"""Padding a step to the agreed token count, and joining the ubatches' outputs.

The DP vote agrees on one padded token count for every rank (``docs/design.md``); the compiled
programs then run on inputs padded to it and return outputs without the padding rows:

    pad_args -> run -> WriteBack -> unpad

Padding rows write nothing (slot ``-1``, zeros elsewhere). Token-indexed inputs the step pads
are copies, so rows a program writes in place are copied back (:class:`WriteBack`).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from dbo_compile.signature import InputSpec, OutputSpec

__all__ = ["WriteBack", "join_ubatch_outputs", "pad_args", "restore_outputs", "unpad"]


def pad_args(specs: Sequence[InputSpec], args: Sequence[Any], num_tokens: int,
             padded: int) -> list[Any]:
    """The graph inputs with every token-indexed tensor padded from ``num_tokens`` to
    ``padded`` rows along the token dim (``slot_mapping`` rows ``-1``, others zeros) and
    token-count ``size`` inputs set to ``padded``; the other inputs are the same objects.
    ``padded < num_tokens`` cuts the last rows off instead (views: ``run_step``'s own padding
    rows, for a program that must not see them)."""
    out = list(args)
    if padded == num_tokens:
        return out
    for spec in specs:
        if spec.kind == "token":
            t = args[spec.index]
            if padded < num_tokens:
                out[spec.index] = t[:padded]
                continue
            fill = -1 if spec.field == "slot_mapping" else 0
            pad = t.new_full((padded - num_tokens, *t.shape[1:]), fill)
            out[spec.index] = torch.cat([t, pad], dim=0)
        elif spec.kind == "size":
            src, dim = spec.size_of
            if dim == 0 and specs[src].kind == "token":
                out[spec.index] = padded
    return out


class WriteBack:
    """Token-indexed inputs the step pads are copies: rows the program writes in place (a KV
    cache indexed by request, e.g. transformers' StaticCache) are copied back to the caller's
    tensor after the step. In-place writes are detected by the tensor version counter; an
    inference tensor (made under ``torch.inference_mode``, as vLLM runs its model) has none,
    so its rows are always copied back (unwritten rows are equal: the copy changes nothing)."""

    def __init__(self, original: Sequence[Any], padded: Sequence[Any], num_tokens: int):
        # a cut input (``pad_args`` to fewer rows) is a view of the caller's tensor, its writes
        # are the caller's (compared by storage: an inference tensor's view has no ``_base``)
        self.pairs = [(o, p, None if p.is_inference() else p._version)
                      for o, p in zip(original, padded)
                      if isinstance(p, torch.Tensor) and p is not o and isinstance(o, torch.Tensor)
                      and p.untyped_storage().data_ptr() != o.untyped_storage().data_ptr()]
        self.num_tokens = num_tokens

    def __call__(self) -> None:
        for orig, pad, version in self.pairs:
            if version is None or pad._version != version:
                orig.copy_(pad[: self.num_tokens])


def unpad(out: Any, num_tokens: int, padded: int) -> Any:
    """The first ``num_tokens`` rows of a ``[padded, ...]`` tensor; anything else unchanged."""
    if padded != num_tokens and isinstance(out, torch.Tensor) and out.dim() and out.shape[0] == padded:
        return out[:num_tokens]
    return out


def restore_outputs(outs: Sequence[Any], specs: Sequence[OutputSpec] | None, num_tokens: int,
                    padded: int) -> tuple[Any, ...]:
    """The graph's outputs at the caller's ``num_tokens`` from a run at ``padded`` tokens:
    token outputs cut to their ``coef * num_tokens`` real rows, size outputs evaluated at
    ``num_tokens``, others as they are (``specs`` ``None`` or an ``"unknown"`` output: rows
    past ``num_tokens`` of a tensor of ``padded`` rows are dropped)."""
    if specs is None or len(specs) != len(outs):
        return tuple(unpad(o, num_tokens, padded) for o in outs)
    out = []
    for o, spec in zip(outs, specs):
        if spec.kind == "token" and isinstance(o, torch.Tensor) and padded != num_tokens:
            o = o[: spec.coef * num_tokens]
        elif spec.kind == "size":
            o = spec.size(num_tokens)
        elif spec.kind == "unknown":
            o = unpad(o, num_tokens, padded)
        out.append(o)
    return tuple(out)


def join_ubatch_outputs(outs: Sequence[Any], outputs: Sequence[Sequence[int]],
                        specs: Sequence[OutputSpec] | None = None,
                        num_tokens: int | None = None) -> tuple[Any, ...]:
    """The graph's outputs from the split program's: a token-indexed output (several split
    outputs, one per ubatch) is concatenated along the token dim in ubatch order; a size output
    (one int per ubatch) is evaluated at the step's ``num_tokens`` (with ``specs``); any other
    is taken as it is. ``outputs`` is ``SplitSignature.outputs``."""
    joined = []
    for i, idx in enumerate(outputs):
        spec = specs[i] if specs is not None and i < len(specs) else None
        if spec is not None and spec.kind == "size" and num_tokens is not None:
            joined.append(spec.size(num_tokens))
        elif len(idx) == 1:
            joined.append(outs[idx[0]])
        else:
            joined.append(torch.cat([outs[j] for j in idx], dim=0))
    return tuple(joined)
