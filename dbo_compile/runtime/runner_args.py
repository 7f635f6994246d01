"""Checks of :class:`~dbo_compile.runtime.cudagraph_runner.CudaGraphRunner`'s arguments, at
construction: what would otherwise fail only at ``capture()``, after Dynamo compiled the model,
with an error that does not name the runner's argument (a typo of a runner argument, which
went to the model as one of its keywords; a ``block_size`` other than the KV cache's).

Every check raises :class:`~dbo_compile.errors.GraphRunnerError` saying what was found and
what to pass instead. A check that cannot be made (a plain function as the compiled callable:
no KV cache, no embedding to read) returns why, which the runner logs at INFO.
"""

from __future__ import annotations

import difflib
import inspect
import logging
import operator
from typing import Any, Callable, Mapping, Sequence

import torch

from dbo_compile.errors import GraphRunnerError

__all__ = ["check_block_size", "check_buckets", "check_fractions", "check_model_kwargs",
           "check_vocab_size", "is_int", "log_unchecked", "positive_int"]

#: the runner's logger: the line of :func:`log_unchecked` is the runner's
log = logging.getLogger("dbo_compile.runtime.cudagraph_runner")

#: keywords that never reach the model: the step's own arguments (``runner(...)``), the inputs
#: the runner passes itself, and ``run_step``'s (the runner's steps call it), with why
_NOT_MODEL_KWARGS = {
    **dict.fromkeys(("vetoes", "allow_split", "num_scheduled_tokens"), (
        "an argument of each step, not of the model", "pass it to each step: runner(..., {name}=...)")),
    **dict.fromkeys(("input_ids", "positions", "attn_metadata"), (
        "an input the runner passes itself (from its static buffers) at every step", "remove it")),
    "token_kwargs": ("an argument of run_step, which the runner's own steps call without it "
                     "(they serve only input_ids, positions and attn_metadata)", "remove it"),
    "inputs_embeds": ("a per-token input: the runner copies only input_ids, positions and "
                      "attn_metadata into its static buffers per step", "give token ids"),
}


def is_int(value: Any) -> bool:
    """``value`` is an int or int-like (``operator.index``), ``bool`` included."""
    try:
        operator.index(value)
        return True
    except TypeError:
        return False


def positive_int(name: str, value: Any, optional: bool = False) -> int | None:
    """``value`` as an ``int >= 1`` (any int-like but a ``bool``); ``None`` stays ``None``
    where ``optional``.

    Raises:
        GraphRunnerError: anything else (``"{name} must be [None or ]an int >= 1"``).
    """
    if value is None and optional:
        return None
    if isinstance(value, bool) or not is_int(value) or value < 1:
        raise GraphRunnerError(f"{name} must be {'None or ' if optional else ''}an int >= 1, "
                               f"got {value!r}")
    return int(value)


def check_buckets(buckets: Any, static_buckets: Any) -> tuple[list[int], set[int]]:
    """The runner's buckets (each ``>= 2``: bucket 1 is the graph of 2 rows, see the runner's
    docstring; unsorted, with duplicates) and its static buckets.

    Raises:
        GraphRunnerError: ``buckets`` not a non-empty list of ints ``>= 1``, or a static
            bucket that is not one of them.
    """
    for name, value in (("buckets", buckets), ("static_buckets", static_buckets)):
        if isinstance(value, (str, bytes)):
            raise GraphRunnerError(f"{name} must be a list of ints (token counts), not a "
                                   f"{type(value).__name__}: got {value!r}; pass e.g. {name}=[64]")
    try:
        buckets = list(buckets)
    except TypeError:
        raise GraphRunnerError(f"buckets must be a non-empty list of ints >= 1 (token counts), "
                               f"got {buckets!r}") from None
    bad = [b for b in buckets if isinstance(b, bool) or not is_int(b) or int(b) < 1]
    if not buckets or bad:
        raise GraphRunnerError(f"buckets must be a non-empty list of ints >= 1 (token counts), "
                               f"got {buckets}")
    # a compiled graph's token dim is dynamic from 2 rows (Dynamo specialises sizes 0 and
    # 1) and run_step pads a 1-token step to 2 rows: bucket 1 is the graph of 2 rows
    buckets = [max(int(b), 2) for b in buckets]
    static = list(static_buckets)
    if any(isinstance(b, bool) or not is_int(b) or max(int(b), 2) not in buckets for b in static):
        raise GraphRunnerError(f"static_buckets must be buckets of this runner ({sorted(set(buckets))}), "
                               f"got {static}")
    return buckets, {max(int(b), 2) for b in static}


def _model_of(compiled: Callable[..., Any]) -> Any:
    """The module or function that ``compiled`` (``torch.compile``'s result, or a model
    itself) calls."""
    inner = getattr(compiled, "_orig_mod", None)  # torch's OptimizedModule
    if isinstance(inner, torch.nn.Module):
        return inner
    return getattr(compiled, "_torchdynamo_orig_callable", compiled)


#: why a check of an argument against the model was not made, where no module is found
NO_MODULE = "no nn.Module behind the compiled callable (a plain function)"


def _no_module(model: Any) -> str | None:
    """:data:`NO_MODULE` where ``model`` (:func:`_model_of`'s) is not an ``nn.Module``."""
    return None if isinstance(model, torch.nn.Module) else NO_MODULE


def check_model_kwargs(compiled: Callable[..., Any], model_kwargs: Mapping[str, Any],
                       runner_args: Sequence[str]) -> str | None:
    """Refuse keywords that the runner would pass to the model at every call
    (``compiled(input_ids, positions, attn_metadata, **model_kwargs)``) but that the model's
    forward does not take, or that never reach it.

    Args:
        compiled: the runner's ``compiled``.
        model_kwargs: the keywords the runner did not take itself.
        runner_args: the runner's own argument names (suggested for a typo).

    Returns:
        ``None`` where checked (or no keyword given); why not, where the forward's signature
        cannot be read (nothing is checked against it then).

    Raises:
        GraphRunnerError: a step argument or an input the runner passes itself given as a
            model keyword, or a keyword the forward does not take (no ``**kwargs``), with the
            closest runner or model argument name.
    """
    for name in model_kwargs:
        if name in _NOT_MODEL_KWARGS:
            why, todo = _NOT_MODEL_KWARGS[name]
            raise GraphRunnerError(
                f"CudaGraphRunner: keyword {name}= is {why} (the runner passes its extra keywords "
                f"to the model at every call): {todo.format(name=name)}")
    model = _model_of(compiled)
    fn = model.forward if isinstance(model, torch.nn.Module) else model
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return "the signature of the model's forward cannot be read" if model_kwargs else None
    params = list(sig.parameters.values())
    P = inspect.Parameter
    positional = [p.name for p in params if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)][:3]
    keywords = [p.name for p in params if p.kind in (P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY)
                and p.name not in positional]
    any_keyword = any(p.kind is P.VAR_KEYWORD for p in params)
    where = f"{getattr(fn, '__qualname__', type(model).__name__)}"
    for name in model_kwargs:
        if name in positional:
            raise GraphRunnerError(
                f"CudaGraphRunner: keyword {name}= names the model's argument {name!r} of "
                f"{where}, which the runner passes itself at every step: remove it")
    unknown = [] if any_keyword else [n for n in model_kwargs if n not in keywords]
    if unknown:
        takes = (f"its keywords are {', '.join(keywords)}" if keywords else
                 f"it takes no keyword beyond {', '.join(positional)}, which the runner passes")
        hints = []
        for name in unknown:
            close = difflib.get_close_matches(name, [*runner_args, *keywords], n=1, cutoff=0.75)
            hints += [f" Did you mean {close[0]}= for {name}=?"] if close else []
        raise GraphRunnerError(
            f"CudaGraphRunner: unknown keyword argument(s) {', '.join(n + '=' for n in unknown)}: "
            f"neither an argument of the runner nor a keyword of the model's {where} ({takes}); "
            f"the runner passes its extra keywords to the model at every call.{''.join(hints)} "
            "Fix the name, or remove it")
    return None


def check_block_size(compiled: Callable[..., Any], block_size: int | None) -> str | None:
    """Refuse a ``block_size`` (tokens per KV-cache block) that differs from the model's KV
    cache (``model.kv_caches()``, ``[2, num_blocks, block_size, Hkv, D]`` each, as
    :class:`~dbo_compile.models.deepseek.DeepseekMoEModel`'s).

    Returns:
        ``None`` where checked or ``block_size`` is ``None``; else why it was not checked:
        no ``nn.Module`` behind ``compiled``, a model without ``kv_caches()`` or caches not
        allocated yet (``capture()`` runs the graph with it unchecked).

    Raises:
        GraphRunnerError: ``block_size`` is not the block size of any of the model's caches.
    """
    if block_size is None:
        return None
    model = _model_of(compiled)
    caches = getattr(model, "kv_caches", None)
    if not callable(caches):
        return _no_module(model) or f"{type(model).__name__} has no kv_caches()"
    try:
        caches = list(caches())
    except Exception:  # noqa: BLE001 - not allocated yet (ModelConfigError), or not ours
        return f"the KV cache of {type(model).__name__} is not allocated yet"
    sizes = sorted({int(c.shape[2]) for c in caches if isinstance(c, torch.Tensor) and c.dim() >= 3})
    if sizes and block_size not in sizes:
        has = (f"caches have block sizes {', '.join(map(str, sizes))}" if len(sizes) > 1
               else f"cache has block size {sizes[0]}")
        pick = f"block_size={sizes[0]}" if len(sizes) == 1 else "one of them as block_size"
        raise GraphRunnerError(
            f"CudaGraphRunner: block_size={block_size} passed, but the model's KV {has} (dim 2 "
            "of its [2, num_blocks, block_size, Hkv, D] shape, as model.allocate_kv_cache("
            f"num_blocks, block_size) made it); pass {pick} or none (the "
            "runner then takes the compiled graph's), or allocate the cache with "
            f"block_size={block_size}")
    return None


def _embedding_rows(model: Any) -> int | None:
    """Rows of the model's token embedding: an HF model's ``get_input_embeddings()``, or an
    ``embed_tokens`` table (a ``[vocab, hidden]`` tensor, as ours, or an ``nn.Embedding``);
    ``None`` where neither is found."""
    table = None
    get = getattr(model, "get_input_embeddings", None)
    if callable(get):
        try:
            table = get()
        except Exception:  # noqa: BLE001 - not a model that has one
            table = None
    if table is None:
        table = getattr(model, "embed_tokens", None)
    weight = getattr(table, "weight", table)
    if isinstance(weight, torch.Tensor) and weight.dim() == 2:
        return int(weight.shape[0])
    return None


def check_vocab_size(compiled: Callable[..., Any], vocab_size: int | None) -> str | None:
    """Refuse a ``vocab_size`` (token ids) above the rows of the model's token embedding: the
    warm-up's random token ids (below ``vocab_size``) would index past it, an ``IndexError``
    deep in ``capture()``.

    Returns:
        ``None`` where checked or ``vocab_size`` is ``None``; else why it was not checked: no
        ``nn.Module`` behind ``compiled``, or no embedding table found on it
        (:func:`_embedding_rows`).

    Raises:
        GraphRunnerError: ``vocab_size`` > the embedding's rows.
    """
    if vocab_size is None:
        return None
    model = _model_of(compiled)
    rows = _embedding_rows(model)
    if rows is None:
        return _no_module(model) or (f"no token embedding found on {type(model).__name__} "
                                     "(get_input_embeddings() or embed_tokens)")
    if vocab_size > rows:
        raise GraphRunnerError(
            f"CudaGraphRunner: vocab_size={vocab_size} passed, but the model's token embedding "
            f"has {rows} rows (the warm-up's random token ids would index past it); pass "
            f"vocab_size={rows} or less, or none (token id 0 in the warm-up steps)")
    return None


def check_fractions(min_gain: Any, prune_margin: Any) -> tuple[float, float | None]:
    """The runner's ``min_gain`` (a fraction in ``[0, 1)``) and ``prune_margin`` (``None``:
    off, or a fraction in ``[0, 10)``), as floats.

    Raises:
        GraphRunnerError: a value outside its range, a ``bool`` or not a number.
    """
    if isinstance(min_gain, bool) or not isinstance(min_gain, (int, float)) \
            or not 0.0 <= min_gain < 1.0:
        raise GraphRunnerError(f"min_gain must be a fraction in [0, 1), got {min_gain!r}")
    if prune_margin is not None and (isinstance(prune_margin, bool) or not isinstance(
            prune_margin, (int, float)) or not 0.0 <= prune_margin < 10.0):
        raise GraphRunnerError(f"prune_margin must be None (off) or a fraction in [0, 10), "
                               f"got {prune_margin!r}")
    return float(min_gain), prune_margin


def log_unchecked(compiled: Any, block_size: int | None, vocab_size: int | None,
                  model_kwargs: dict[str, Any], runner_args: Any) -> None:
    """Check ``block_size``, ``vocab_size`` and the model keywords against the model behind
    ``compiled`` (:func:`check_block_size`, :func:`check_vocab_size`,
    :func:`check_model_kwargs`; ``runner_args``: the runner's own argument names) and log one
    INFO line naming those that could not be checked, grouped by why.

    Raises:
        GraphRunnerError: as the three checks.
    """
    skipped = {f"block_size={block_size}": check_block_size(compiled, block_size),
               f"vocab_size={vocab_size}": check_vocab_size(compiled, vocab_size),
               "model keywords " + ", ".join(model_kwargs):
                   check_model_kwargs(compiled, model_kwargs, runner_args)}
    by_why: dict[str, list[str]] = {}
    for arg, why in skipped.items():
        if why:
            by_why.setdefault(why, []).append(arg)
    if by_why:  # one line: the arguments left unchecked, grouped by why
        log.info("CudaGraphRunner: %s; capture() runs with them as given", "; ".join(
            f"{', '.join(args)} not checked against the model at construction: {why}"
            for why, args in by_why.items()))
