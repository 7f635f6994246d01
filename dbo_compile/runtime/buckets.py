"""What the CUDA-graph runner keeps per bucket, and how a step meets the captured static
buffers (:mod:`~dbo_compile.runtime.cudagraph_runner` captures and replays them).

- :class:`BucketGraphs`: one bucket's graphs, static inputs and outputs, times and choice (its
  warm-up seconds by part: :data:`WARMUP_PARTS`);
- :func:`check_artifact`: what a bucket refuses to capture;
- :func:`map_inputs` / :func:`graph_args`: where a step's inputs sit among the graph inputs;
  :func:`local_misfit`: why a step fits no captured graph on this rank;
- :func:`copy_into`: a step's inputs copied into the static ones, request-indexed metadata
  padded with zero-length requests to the captured request capacity;
- :class:`OutputMap`: the model's return value in terms of the graph's flat outputs, cut to the
  step's real token rows on replay;
- :func:`serving_buckets`: a serving engine's bucket list (decode sizes, then prefill sizes);
- :func:`memory_report`: the CUDA-graph memory of the captured buckets; :func:`bucket_stats`,
  :func:`describe`, :func:`warmup_text`: the runner's per-bucket report;
- :func:`dummy_step`: the synthetic warm-up step (its request layout,
  :func:`capture_qlens`: the captured request capacity); :func:`copy_plan`: which static inputs a
  step is copied into; :func:`split_program_fn`: a split candidate as the callable captured.
"""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.utils._pytree as pytree

from dbo_compile.candidates import UNSPLIT_GRAPHS, UNSPLIT_OVERLAP
from dbo_compile.errors import GraphRunnerError
from dbo_compile.metadata import FIELD_LAYOUT, AttentionMetadata
from dbo_compile.runtime.artifact import CompiledArtifact
from dbo_compile.runtime.context import last_outputs
from dbo_compile.runtime.numbers import InputNumbers, changed_reason
from dbo_compile.runtime.padding import join_ubatch_outputs

log = logging.getLogger(__name__)


#: the prefill buckets of :func:`serving_buckets` (tokens per rank)
PREFILL_BUCKETS = (1024, 2048, 4096, 8192)


def serving_buckets(max_decode: int = 512, prefill: Sequence[int] = PREFILL_BUCKETS) -> list[int]:
    """A serving engine's CUDA-graph bucket list, for ``CudaGraphRunner(buckets=...)``: the
    decode sizes 1, 2, 4, 8, then each power of two from 16 and one and a half times it (16, 24,
    32, 48, ... 384, 512) up to ``max_decode`` tokens, then the ``prefill`` sizes above it.
    With the defaults: 1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 1024, 2048,
    4096, 8192 (19 buckets). The shape follows the engines' own lists, dense where decode
    batches are small and geometric above: vLLM captures 1, 2, 4 and every multiple of 8 (of 16
    past 256) up to its ``max_cudagraph_capture_size``; SGLang 1, 2, 4, 8, 12, 16, 24, 32, ...
    A step runs in the smallest bucket that holds it, so a step pays at most ~50 % padding rows
    past 8 tokens.

    Raises:
        GraphRunnerError: ``max_decode`` not an int >= 1, or a prefill size not an int.
    """
    if isinstance(max_decode, bool) or not isinstance(max_decode, int) or max_decode < 1:
        raise GraphRunnerError(f"max_decode must be an int >= 1 (tokens), got {max_decode!r}")
    bad = [t for t in prefill if isinstance(t, bool) or not isinstance(t, int)]
    if bad:
        raise GraphRunnerError(f"prefill bucket sizes must be ints (tokens), got {bad}")
    sizes = [1, 2, 4, 8]
    p = 16
    while p <= max_decode:
        sizes += [p, p + p // 2]
        p *= 2
    decode = [t for t in sizes if t <= max_decode]
    return decode + sorted({t for t in prefill if t > max_decode})


#: the parts of a bucket's warm-up time (:attr:`BucketGraphs.warmup_s`), in order
WARMUP_PARTS = ("record", "probe", "warmup_runs", "capture", "timing", "total")


@dataclass
class BucketGraphs:
    """What was captured for one bucket.

    Attributes:
        tokens: the bucket's padded token count.
        artifact: the compiled artifact (a
            :class:`~dbo_compile.runtime.artifact.CompiledArtifact`).
        args: the static graph inputs (token rows = ``tokens``; ``tokens`` requests, or
            ``min(tokens, max(max_num_reqs, 2))`` with the runner's ``max_num_reqs``).
        split_args: the split program's static per-ubatch inputs (``None``: not split);
            ``tokens // num_ubatches`` requests per ubatch, or
            ``min(tokens // num_ubatches, max(max_num_reqs, 2))``.
        graphs / outs: ``"unsplit"``, ``"unsplit-overlap"`` (the unsplit program on the two
            streams, where the artifact has one: ``DboConfig.unsplit_overlap``) and each split
            schedule candidate's graph and static outputs (after the choice only
            ``"unsplit"``, ``unsplit_choice`` and the chosen candidate are kept).
        times_us: replay time (µs, median, max over the DP group) of each graph whose time
            can change the choice: the split candidates, and with ``split="auto"`` the unsplit
            graph; nothing where there is one graph to choose from (no split graph, or
            ``"always"`` with one candidate).
        choice: ``"unsplit"`` or the name of the split candidate this bucket runs when the vote
            splits.
        unsplit_choice: the unsplit graph this bucket runs when the step is not split:
            ``"unsplit"`` or, where it was faster by ``min_gain``, ``"unsplit-overlap"``.
        best_candidate: the fastest split candidate (``None``: not split), chosen or not.
        input_pos: graph-input position of each step input (``input_ids``, ``positions``,
            metadata fields) in ``args``.
        warmup_s: seconds of this bucket's warm-up by part (:data:`WARMUP_PARTS`):
            ``record``, the synthetic step through the compiled model (for the first bucket
            Dynamo and the backend's compile; Inductor compiling the stages the step runs for
            this bucket's signature); ``probe``, the prefill-shaped step; ``warmup_runs``, the
            eager calls before each capture (where the other candidates' stages compile);
            ``capture``, the captures themselves (CPU: the one eager run); ``timing``, the
            timed replays; ``total``, all of it (with the choice and bookkeeping).
        graph_s: per captured graph, its warm-up calls and capture (seconds).
        out_map: how the model's return value is built from the graph's flat outputs.
        numbers: the number inputs of the graph and the values the capture baked in.
        stage_kinds: per Inductor stage this bucket's graphs run (by name), the code it runs:
            ``"dynamic"`` (compiled once with symbolic sizes, shared with other buckets),
            ``"static"`` (compiled for this bucket's shapes) or ``"aten"`` (its traced ATen
            ops: a compile limit or an Inductor failure, warned at capture); empty with
            ``compute_backend="aten"``.
        prune: which split candidates were captured and timed, which pruned and why
            (:class:`~dbo_compile.runtime.prune.PrunePlan`; ``None``: no split graph asked).
        graph_bytes: per captured graph, the memory pool's growth by its capture (bytes;
            ``None`` off CUDA).
        dropped: each of DBO's optional graphs (``"unsplit-overlap"``, a split candidate)
            not captured for memory -> why: out of GPU memory at its capture, on this rank or
            another, or ``graph_memory_budget`` reached (:mod:`~.graph_memory`).
    """

    tokens: int
    artifact: CompiledArtifact
    args: list[Any]
    split_args: list[Any] | None = None
    graphs: dict[str, Any] = field(default_factory=dict)
    outs: dict[str, Any] = field(default_factory=dict)
    times_us: dict[str, float] = field(default_factory=dict)
    choice: str = "unsplit"
    unsplit_choice: str = "unsplit"
    best_candidate: str | None = None
    input_pos: dict[str, int] = field(default_factory=dict)
    warmup_s: dict[str, float] = field(default_factory=dict)
    graph_s: dict[str, float] = field(default_factory=dict)
    out_map: OutputMap | None = None
    numbers: InputNumbers | None = None
    stage_kinds: dict[str, str] = field(default_factory=dict)
    prune: Any = None
    graph_bytes: dict[str, int | None] = field(default_factory=dict)
    dropped: dict[str, str] = field(default_factory=dict)

    @property
    def use_split(self) -> bool:
        return self.choice != "unsplit"

    @property
    def t_unsplit_us(self) -> float | None:
        """The unsplit graph's time (µs), ``None`` when it was not timed (see ``times_us``)."""
        return self.times_us.get("unsplit")

    @property
    def t_unsplit_best_us(self) -> float | None:
        """The time (µs) of the unsplit graph this bucket runs (``unsplit_choice``): the
        baseline of its speedup; ``None`` when it was not timed."""
        return self.times_us.get(self.unsplit_choice)

    @property
    def t_split_us(self) -> float | None:
        """The fastest split candidate's time (µs), ``None`` when none was timed."""
        split = [t for k, t in self.times_us.items() if k not in UNSPLIT_GRAPHS]
        return min(split) if split else None


@dataclass(frozen=True)
class OutputMap:
    """The model's return value in terms of the graph's flat outputs, recorded at warm-up:
    a replay returns the eager structure (tuples, lists, dicts, nesting), not the flat tuple.

    Attributes:
        tree: the pytree spec of the model's return value.
        leaves: per leaf ``("out", i)`` (flat graph output ``i``), ``("size", i)`` (graph
            output ``i``, an int evaluated at the step's token count) or ``("const", value)``.
    """

    tree: Any
    leaves: tuple[tuple[str, Any], ...]

    @classmethod
    def of(cls, ret: Any, tokens: int) -> OutputMap:
        """Map ``ret`` (what ``run_step`` returned for a synthetic step of ``tokens`` rows) to
        the flat outputs of the artifact call that made it (:func:`~.context.last_outputs`).

        Raises:
            GraphRunnerError: a tensor of ``ret`` is no graph output (an input returned
                as it is, or a tensor made outside the compiled graph): a replay could not
                refresh it.
        """
        record = last_outputs()
        flat, specs = record if record is not None else ((), None)
        specs = specs if specs is not None and len(specs) == len(flat) else [None] * len(flat)
        index = {id(o): i for i, o in enumerate(flat) if isinstance(o, torch.Tensor)}
        sizes = [i for i, spec in enumerate(specs) if spec is not None and spec.kind == "size"]
        paths, tree = pytree.tree_flatten_with_path(ret)
        leaves: list[tuple[str, Any]] = []
        for path, leaf in paths:
            if isinstance(leaf, torch.Tensor):
                if id(leaf) not in index:
                    raise GraphRunnerError(
                        f"the model's output {pytree.keystr(path) or '(the return value)'} is "
                        "no output of the compiled graph (an input returned as it is, or a "
                        "tensor made outside the graph): a replayed CUDA graph cannot refresh "
                        "it; compute it inside the model")
                leaves.append(("out", index[id(leaf)]))
            elif isinstance(leaf, int) and not isinstance(leaf, bool) and any(
                    specs[i].size(tokens) == leaf for i in sizes):
                leaves.append(("size", next(i for i in sizes if specs[i].size(tokens) == leaf)))
            else:
                leaves.append(("const", leaf))
        return cls(tree, tuple(leaves))

    def build(self, static: Sequence[Any], specs: Sequence[Any] | None, n: int,
              rows: int) -> Any:
        """The return value of a replay: static outputs cut to the ``n`` real tokens (of the
        bucket's ``rows``), sizes at ``n``."""
        specs = specs if specs is not None and len(specs) == len(static) else [None] * len(static)
        values = []
        for kind, v in self.leaves:
            if kind == "out":
                values.append(_real_rows(static[v], n, rows, specs[v]))
            elif kind == "size":
                values.append(specs[v].size(n))
            else:
                values.append(v)
        return pytree.tree_unflatten(values, self.tree)


def _real_rows(out: Any, n: int, rows: int, spec: Any) -> Any:
    """The real rows of a token-indexed output (``spec``: its ``OutputSpec``; unclassified:
    any output whose dim 0 is the bucket's row count)."""
    if not isinstance(out, torch.Tensor) or not out.dim():
        return out
    if spec is not None and spec.kind == "token":
        return out[: spec.coef * n]
    if spec is not None and spec.kind != "unknown":
        return out
    return out[:n] if out.shape[0] == rows else out


def copy_into(static: list[Any], new: Sequence[Any], inputs: Sequence[tuple[int, int | None]],
               specs: Sequence[Any], positions: Sequence[int] | None = None) -> None:
    """Copy a step's (per-ubatch) inputs into the captured static ones.

    Shared inputs are the same objects (skipped). Token-indexed tensors have the captured
    shape (else ``GraphRunnerError``). Request-indexed metadata is padded to the captured
    request count with zero-length requests (see the module docstring). Ints (sizes) are not
    copied: the graph keeps its captured token sizes, which the bucket's padding reproduces,
    and its captured request capacity, which the request padding fills. ``positions``: the
    only positions that can differ (default: all).
    """
    for pos in range(len(inputs)) if positions is None else positions:
        index = inputs[pos][0]
        dst, src = static[pos], new[pos]
        if dst is src:
            continue
        spec = specs[index]
        if isinstance(dst, torch.Tensor):
            if FIELD_LAYOUT.get(spec.field or "") == "request":
                _copy_request_padded(dst, src, spec.field)
            elif dst.shape == src.shape:
                dst.copy_(src)
            else:
                raise GraphRunnerError(
                    f"graph input {spec.name} ({spec.kind}): step shape {tuple(src.shape)} != "
                    f"captured {tuple(dst.shape)}")


def _copy_request_padded(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    r = src.shape[0] - (1 if name == "query_start_loc" else 0)
    cap = dst.shape[0] - (1 if name == "query_start_loc" else 0)
    if r > cap:
        raise GraphRunnerError(f"{name}: {r} requests > captured capacity {cap}")
    if name == "query_start_loc":
        dst[: r + 1].copy_(src)
        dst[r + 1:].copy_(src[-1:].expand(cap - r))
    elif name == "block_table":
        dst.zero_()
        dst[:r, : src.shape[1]].copy_(src)
    else:
        dst[:r].copy_(src)
        dst[r:].zero_()


def local_misfit(tokens: int, width: int, num_reqs: int, changed: Any, largest: int,
                 max_blocks_per_req: int, max_num_reqs: int | None) -> str | None:
    """Why this rank's step fits no captured graph of the
    :class:`~.cudagraph_runner.CudaGraphRunner`, or ``None`` where it fits: ``tokens`` rows
    over the ``largest`` bucket, a block table ``width`` over ``max_blocks_per_req``,
    ``num_reqs`` requests over ``max_num_reqs``, or ``changed`` numbers the graphs bake in
    (:func:`~.numbers.changed_reason`). Such a step runs eagerly on every rank together."""
    if tokens > largest:
        return f"{tokens} tokens > largest bucket {largest}"
    if width > max_blocks_per_req:
        return f"block table width {width} > max_blocks_per_req {max_blocks_per_req}"
    if max_num_reqs is not None and num_reqs > max_num_reqs:
        return f"{num_reqs} requests > max_num_reqs {max_num_reqs}"
    return changed_reason(changed) if changed else None


def check_artifact(art: CompiledArtifact, tokens: int, args: Sequence[Any]) -> None:
    """What bucket ``tokens`` refuses to capture (module docstring of
    :mod:`~.cudagraph_runner`).

    Raises:
        GraphRunnerError: padding rows could change the results, or the programs fold a
            float the model no longer holds (``args``: the graph inputs).
    """
    hazard = art.padding_hazard()
    if hazard is not None:
        raise GraphRunnerError(
            f"bucket {tokens}: {hazard}, so a step cannot be padded to a bucket. Serve it "
            "without CudaGraphRunner (run_step runs it at the step's own token count), or "
            "make the model row-local and its buffer updates foldable")
    stale = art.stale_floats(args)
    if stale:
        raise GraphRunnerError(
            f"bucket {tokens}: the compiled programs fold floats the model no longer holds "
            f"(source, compiled, now: {[(art.specs[i].source, old, new) for i, old, new in stale]}"
            "; changed after torch.compile traced them): their graphs would serve the old "
            "values. Compile the model again (torch._dynamo.reset(), then torch.compile) "
            "and capture() again")


def map_inputs(args: Sequence[Any], ids: torch.Tensor, pos: torch.Tensor,
               md: AttentionMetadata) -> dict[str, int]:
    """Graph-input position of each step input (by identity with the synthetic step's)."""
    named = {"input_ids": ids, "positions": pos, **md.tensors()}
    where = {}
    for name, t in named.items():
        hits = [i for i, a in enumerate(args) if a is t]
        if hits:
            where[name] = hits[0]
    if "input_ids" not in where:
        raise GraphRunnerError("the compiled graph does not take input_ids as an input")
    return where


def graph_args(b: BucketGraphs, ids: torch.Tensor, pos: torch.Tensor,
               md: AttentionMetadata) -> list[Any]:
    """The graph inputs of ``b`` with a step's own in place (``input_ids``, ``positions``, the
    metadata's tensors; the row-valid mask all true: every row of the step is real)."""
    args = list(b.args)
    named = {"input_ids": ids, "positions": pos, **md.tensors()}
    for name, i in b.input_pos.items():
        args[i] = named[name]
    valid = b.artifact.row_valid_index
    if valid is not None:  # every row of the step is real; the bucket's padding is not
        args[valid] = torch.ones(int(ids.shape[0]), dtype=torch.bool, device=ids.device)
    return args


def memory_report(graphs: dict[int, BucketGraphs], cuda: bool) -> dict[str, Any]:
    """CUDA-graph memory of the captured set (bytes; ``None`` off CUDA, where no graph holds
    memory): per bucket the pool's growth by the capture of its ``unsplit`` graph and of its
    split graphs (``split``: the kept ones; ``split_all``: every candidate captured, the
    dropped ones included), per graph (``graphs``), and the ``total`` over the buckets. The
    runner captures every graph of every bucket into one memory pool (``pool_shared``, as
    vLLM's), largest bucket first, so a graph costs what the pool had to grow for it: a
    later graph reuses blocks the earlier ones freed, and ``split`` is what DBO's graphs cost
    over the unsplit ones (:func:`~dbo_compile.runtime.capture.capture`'s ``pool_bytes``)."""
    buckets: dict[int, dict[str, Any]] = {}
    for t, b in sorted(graphs.items()):
        by = b.graph_bytes
        split_all = [v or 0 for k, v in by.items() if k != "unsplit"]
        split_kept = [v or 0 for k, v in by.items() if k != "unsplit" and k in b.graphs]
        buckets[t] = {"unsplit": by.get("unsplit") if cuda else None,
                      "split": sum(split_kept) if cuda else None,
                      "split_all": sum(split_all) if cuda else None,
                      "graphs": dict(by)}
    total = {k: sum(v[k] or 0 for v in buckets.values()) if cuda else None
             for k in ("unsplit", "split", "split_all")}
    return {"pool_shared": True, "buckets": buckets, "total": total}


def capture_qlens(tokens: int, max_num_reqs: int | None, num_ubatches: int = 1) -> list[int]:
    """Tokens per request of the synthetic step whose request buffers a bucket of ``tokens``
    rows captures: per ubatch (the token slices cut at ``k * tokens // num_ubatches``, as the
    split cuts a step padded to the bucket) ``c = min(rows, max(max_num_reqs, 2))`` requests
    of equal lengths (ceil / floor), none crossing a cut, so that each ubatch's static buffers
    hold ``c`` requests. ``num_ubatches=1``: the unsplit graph's ``min(tokens, max(M, 2))``.

    A step of at most ``M`` requests never has more than ``min(rows, M)`` in one ubatch (each
    has a token there), however unevenly they fall. At least 2: the compiled graph is traced
    for 2 or more requests (Dynamo specialises a size of 1). ``max_num_reqs=None``: ``tokens``
    one-token requests, capacity ``tokens`` (``tokens // num_ubatches`` per ubatch).

    Example::

        >>> capture_qlens(16, 3, 2)
        [3, 3, 2, 3, 3, 2]
    """
    if max_num_reqs is None:
        return [1] * tokens
    cuts = [k * tokens // num_ubatches for k in range(num_ubatches + 1)]
    qlens: list[int] = []
    for rows in (b - a for a, b in zip(cuts, cuts[1:])):
        reqs = min(rows, max(max_num_reqs, 2))
        qlens += [rows // reqs + (1 if i < rows % reqs else 0) for i in range(reqs)]
    return qlens


def split_capture_args(b: BucketGraphs, max_num_reqs: int | None, device: torch.device,
                       max_blocks_per_req: int, vocab_size: int | None) -> list[Any]:
    """The split program's static per-ubatch inputs of ``b``: its recorded step cut per
    ubatch (``bucket // num_ubatches`` one-token requests each); with ``max_num_reqs``, a
    synthetic step of :func:`capture_qlens` requests per ubatch, cut as a served step is."""
    art = b.artifact
    if max_num_reqs is None:
        return art.split_args(b.args, [1] * b.tokens)
    qlens = capture_qlens(b.tokens, max_num_reqs, art.config.num_ubatches)
    ids, pos, md, _ = dummy_step(b.tokens, device, max_blocks_per_req, vocab_size, qlens=qlens)
    return art.split_args(graph_args(b, ids, pos, md), qlens)


def dummy_step(tokens: int, device: torch.device, max_blocks_per_req: int,
               vocab_size: int | None, prefill: bool = False,
               qlens: Sequence[int] | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
    """A synthetic step of ``tokens`` rows whose KV writes go nowhere (slot -1):
    ``tokens`` one-token requests, or (``prefill``) two requests of half the tokens each, or
    requests of ``qlens`` tokens each (:func:`capture_qlens`; they sum to ``tokens``).

    Returns ``(input_ids, positions, attn_metadata, qlens)`` on ``device``: ``[tokens]`` int64
    ids (random below ``vocab_size``, seeded by ``tokens``, when given; else zeros), ``[tokens]``
    int64 zero positions, metadata with a ``max_blocks_per_req``-wide zero block table, and the
    tokens per request (host ints). The CUDA-graph runner's warm-up steps."""
    dev = device
    i32 = dict(dtype=torch.int32, device=dev)
    if qlens is not None:
        qlens = [int(q) for q in qlens]
        if sum(qlens) != tokens or min(qlens, default=1) < 1:
            raise GraphRunnerError(f"synthetic step of {tokens} rows: request lengths {qlens} "
                                   "must be >= 1 and sum to the rows")
    else:
        qlens = [tokens // 2, tokens - tokens // 2] if prefill else [1] * tokens
    qsl = torch.tensor([0] + qlens, **i32).cumsum(0, dtype=torch.int32)
    md = AttentionMetadata(
        query_start_loc=qsl,
        seq_lens=torch.tensor(qlens, **i32),
        num_computed_tokens=torch.zeros(len(qlens), **i32),
        block_table=torch.zeros(len(qlens), max_blocks_per_req, **i32),
        slot_mapping=torch.full((tokens,), -1, dtype=torch.int64, device=dev),
        max_query_len=max(qlens, default=0), max_seq_len=max(qlens, default=0))
    if vocab_size:
        gen = torch.Generator().manual_seed(tokens)
        ids = torch.randint(0, vocab_size, (tokens,), generator=gen).to(dev)
    else:
        ids = torch.zeros(tokens, dtype=torch.int64, device=dev)
    return ids, torch.zeros(tokens, dtype=torch.int64, device=dev), md, qlens


def bucket_stats(graphs: dict[int, BucketGraphs]) -> dict[int, dict[str, Any]]:
    """Per bucket (sorted): its ``warmup_s`` by part, the graphs it captured (``graph_s``,
    seconds, and ``graphs_captured``) and timed, its choices, how many of its Inductor stages
    run dynamic / static / ATen code (``stage_kinds``), ``prune``
    (:class:`~dbo_compile.runtime.prune.PrunePlan`) and ``dropped`` (the optional graphs not
    captured for memory, with why): the runner's ``stats["buckets"]``."""
    return {t: {"warmup_s": dict(b.warmup_s), "graph_s": dict(b.graph_s),
                "graphs_captured": len(b.graph_s), "timed": sorted(b.times_us),
                "choice": b.choice, "unsplit_choice": b.unsplit_choice,
                "stage_kinds": dict(collections.Counter(b.stage_kinds.values())),
                "prune": None if b.prune is None else b.prune.to_dict(),
                "dropped": dict(b.dropped)}
            for t, b in sorted(graphs.items())}


def describe(graphs: dict[int, BucketGraphs]) -> str:
    """One line per bucket (sorted): replay times (µs) and the choice."""
    rows = []
    for t in sorted(graphs):
        b = graphs[t]
        unsplit, split, overlap = ("-" if v is None else f"{v:.0f}" for v in (
            b.t_unsplit_us, b.t_split_us, b.times_us.get(UNSPLIT_OVERLAP)))
        extra = "" if b.artifact.unsplit_overlap is None else f", {UNSPLIT_OVERLAP} {overlap} us"
        rows.append(f"{t}: unsplit {unsplit} us{extra}, split {split} us -> {b.choice}"
                    + ("" if b.unsplit_choice == "unsplit" else f" ({b.unsplit_choice})"))
    return "; ".join(rows)


def copy_plan(b: BucketGraphs, split: bool
              ) -> tuple[Sequence[tuple[int, int | None]], Sequence[Any], list[int]]:
    """:func:`copy_into`'s ``inputs``, ``specs`` and ``positions`` for the unsplit graph of
    ``b`` (``split=False``) or its split program: only the positions a step can change (the
    step's own inputs, token-indexed inputs, which are padded per step, and whatever is cut
    per ubatch); the others (weights, KV caches) are the captured objects themselves."""
    art = b.artifact
    step = set(b.input_pos.values()) | {s.index for s in art.specs if s.kind == "token"}
    if split:
        inputs = art.signature.inputs
        positions = [pos for pos, (index, ubatch) in enumerate(inputs)
                     if ubatch is not None or index in step]
    else:
        inputs = tuple((i, None) for i in range(len(b.args)))
        positions = sorted(step)
    return inputs, art.specs, positions


def warmup_text(seconds: dict[str, float]) -> str:
    """Warm-up ``seconds`` by part, in :data:`WARMUP_PARTS` order, for the log."""
    return ", ".join(f"{part} {seconds[part]:.2f} s" for part in WARMUP_PARTS if part in seconds)


def split_program_fn(program: Any, split_args: list[Any], art: CompiledArtifact,
                     tokens: int) -> Callable[[], Any]:
    """``program`` (a split schedule candidate of ``art``) as a zero-argument callable over the
    static per-ubatch inputs ``split_args`` (a bucket's ``BucketGraphs.split_args``); its
    outputs concatenated in ubatch order, token-indexed ones at the bucket's ``tokens`` rows:
    what the runner captures per candidate, and what the benchmarks time beside it."""
    outputs, specs = art.signature.outputs, art.output_specs
    return lambda: join_ubatch_outputs(program(*split_args), outputs, specs, tokens)
