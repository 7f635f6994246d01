"""FULL CUDA graphs per bucket, and the split decision measured on them.

A serving engine that runs a model compiled with ``backend="dbo"`` under CUDA graphs wraps it
in a :class:`CudaGraphRunner`::

    compiled = torch.compile(model, backend="dbo")
    runner = CudaGraphRunner(compiled, buckets=[64, 256, 1024, 4096], max_blocks_per_req=64)
    runner.capture()        # warm-up, on every DP rank, before serving
    logits = runner(input_ids, positions, attn_metadata, num_scheduled_tokens=[1, 1, 57])

At warm-up, for every bucket (a padded token count, largest first) the runner

1. runs one synthetic step of exactly ``bucket`` tokens through the compiled model (Dynamo
   compiles it; the runner records the artifact and its graph inputs, which become the bucket's
   static input buffers);
2. captures the **unsplit** program and, when the graph was split, the **split** (DBO) program
   as one CUDA graph each, after warm-up calls on a side stream, all into one memory pool;
3. times both graphs by replaying them (``timing_iters`` replays each, interleaved rounds,
   median, CUDA events), takes the max over the DP group and, with ``split="auto"``, uses the
   split graph for this bucket only where it is faster by ``min_gain`` (fraction) or more. The
   table is therefore identical on every DP rank. ``split="always"``/``"never"`` force it.

Per step (serving path; never captures):

1. the DP vote (:meth:`DboCompiledModule.decide`: thresholds, vetoes, padding to the group's
   max) on the step's real inputs;
2. the bucket: the smallest one ``>=`` the group's padded token count (so the same on every
   rank); the split graph if the vote splits and the bucket's measured table says so;
3. the step's tokens and attention metadata are copied into the bucket's static buffers: token
   rows padded to the bucket (slot ``-1``: padding writes no KV), requests padded with
   zero-length requests (``query_start_loc`` repeats its last value, ``seq_lens`` 0, block-table
   rows 0); for the split graph, the metadata is cut per ubatch first
   (:func:`~dbo_compile.runtime.ubatch.split_attn_metadata`) and each ubatch padded to its
   captured request capacity (``bucket // num_ubatches`` requests);
4. replay; the output rows of the real tokens are returned (**views of the graph's static
   output**: consume or copy them before the next step).

A step larger than the largest bucket, or whose block table is wider than
``max_blocks_per_req``, runs eagerly through the compiled model (logged once per reason): a
capture never happens after warm-up.

Rules taken from the field: buckets of padded token counts, largest captured first and all
graphs in one pool (vLLM ``CUDAGraphRunner`` / ``cudagraph_capture_sizes``); FULL graphs of
the ubatched program with padding to the DP group's max (vLLM DBO); the decision to split from
measurement, not assumption (../shared/REFERENCES.md: over NVLink the split loses below ~8k
tokens/rank).
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from dbo_compile.errors import DboError
from dbo_compile.runtime.context import step_context
from dbo_compile.runtime.metadata import FIELD_LAYOUT, AttentionMetadata

log = logging.getLogger(__name__)

__all__ = ["BucketGraphs", "CudaGraphRunner", "GraphRunnerError"]


class GraphRunnerError(DboError):
    """The model cannot be run as per-bucket CUDA graphs (e.g. it compiled into several graphs),
    or the runner was used before :meth:`CudaGraphRunner.capture`."""


@dataclass
class BucketGraphs:
    """What was captured for one bucket.

    Attributes:
        tokens: the bucket's padded token count.
        artifact: the compiled artifact (``DboCompiledModule`` or ``UnsplitProgram``).
        args: the static graph inputs (token rows = ``tokens``; ``tokens`` requests).
        split_args: the split program's static per-ubatch inputs (``None``: not split).
        graphs / outs: ``"unsplit"`` and each split schedule variant's graph and static outputs
            (after the choice only ``"unsplit"`` and the chosen variant are kept).
        times_us: replay time of each graph (µs, median, max over the DP group).
        choice: ``"unsplit"`` or the name of the split variant this bucket runs when the vote
            splits.
        best_variant: the fastest split variant (``None``: not split), chosen or not.
    """

    tokens: int
    artifact: Any
    args: list[Any]
    split_args: list[Any] | None = None
    graphs: dict[str, Any] = field(default_factory=dict)
    outs: dict[str, Any] = field(default_factory=dict)
    times_us: dict[str, float] = field(default_factory=dict)
    choice: str = "unsplit"
    best_variant: str | None = None

    @property
    def use_split(self) -> bool:
        return self.choice != "unsplit"

    @property
    def t_unsplit_us(self) -> float:
        return self.times_us["unsplit"]

    @property
    def t_split_us(self) -> float | None:
        """The fastest split variant's time (µs), ``None`` when the graph was not split."""
        split = [t for k, t in self.times_us.items() if k != "unsplit"]
        return min(split) if split else None


class _EagerGraph:
    """CPU stand-in for a CUDA graph: ``replay()`` re-runs the function on the same static
    inputs and copies its outputs into the static outputs (tests the buffer plumbing)."""

    def __init__(self, fn: Callable[[], Any]):
        self.fn = fn
        self.out = fn()

    def replay(self) -> None:
        for dst, src in zip(_tensors(self.out), _tensors(self.fn())):
            dst.copy_(src)


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


class CudaGraphRunner:
    """Per-bucket FULL CUDA graphs of a ``backend="dbo"`` model (see the module docstring).

    Args:
        compiled: ``torch.compile(model, backend="dbo", ...)``; called as
            ``compiled(input_ids, positions, attn_metadata, **model_kwargs)``.
        buckets: padded token counts to capture (tokens per rank; each ``>= 2``).
        max_blocks_per_req: block-table width (KV blocks per request) of the static buffers.
        block_size: KV-cache block size (tokens), passed to the prefix-read veto.
        timing_iters: replays per graph and timing round at warm-up (3 rounds).
        vocab_size: when given, the synthetic warm-up steps carry random token ids below it
            (seeded, the same on every rank), so that MoE routing, and hence the timings the
            decision rests on, look like real traffic; default all zeros (every token routed
            alike).
        keep_variants: keep every split variant's graph after the choice (benchmarks).
        min_gain: with ``split="auto"``, the split graph is used for a bucket only when
            ``t_split <= (1 - min_gain) * t_unsplit`` (fraction, default 0.0).
        device: where the synthetic warm-up step lives (default: the current CUDA device, else
            CPU, where graphs are replaced by eager re-runs).
        model_kwargs: extra keyword arguments of every model call.

    Raises:
        GraphRunnerError: bad buckets; at :meth:`capture`: the model compiled into more than
            one graph per step, or its artifact is not a ``dbo`` one.
    """

    def __init__(self, compiled: Callable[..., Any], buckets: Sequence[int], *,
                 max_blocks_per_req: int, block_size: int | None = None, timing_iters: int = 10,
                 min_gain: float = 0.0, device: torch.device | str | None = None,
                 vocab_size: int | None = None, keep_variants: bool = False, **model_kwargs: Any):
        bad = [b for b in buckets if not isinstance(b, int) or b < 2]
        if not buckets or bad:
            raise GraphRunnerError(f"buckets must be ints >= 2 (token counts), got {list(buckets)}")
        if not isinstance(max_blocks_per_req, int) or max_blocks_per_req < 1:
            raise GraphRunnerError(f"max_blocks_per_req must be an int >= 1, got {max_blocks_per_req!r}")
        self.compiled = compiled
        self.buckets = sorted(set(buckets))
        self.max_blocks_per_req = max_blocks_per_req
        self.block_size = block_size
        self.timing_iters = timing_iters
        self.min_gain = min_gain
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.model_kwargs = model_kwargs
        self.vocab_size = vocab_size
        self.keep_variants = keep_variants
        self.last_choice: tuple[int, str] | None = None
        self.last_graph: str | None = None
        self.graphs: dict[int, BucketGraphs] = {}
        self.pool: Any = None
        self.eager_steps = 0
        self._warned: set[str] = set()
        self._input_pos: dict[str, int] = {}

    # -- warm-up --------------------------------------------------------------------------
    def _dummy_step(self, tokens: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """``tokens`` one-token requests whose KV writes go nowhere (slot -1)."""
        dev = self.device
        i32 = dict(dtype=torch.int32, device=dev)
        md = AttentionMetadata(
            query_start_loc=torch.arange(tokens + 1, **i32),
            seq_lens=torch.ones(tokens, **i32),
            num_computed_tokens=torch.zeros(tokens, **i32),
            block_table=torch.zeros(tokens, self.max_blocks_per_req, **i32),
            slot_mapping=torch.full((tokens,), -1, dtype=torch.int64, device=dev),
            max_query_len=1, max_seq_len=1)
        if self.vocab_size:
            gen = torch.Generator().manual_seed(tokens)
            ids = torch.randint(0, self.vocab_size, (tokens,), generator=gen).to(dev)
        else:
            ids = torch.zeros(tokens, dtype=torch.int64, device=dev)
        return ids, torch.zeros(tokens, dtype=torch.int64, device=dev), md

    def capture(self) -> dict[int, BucketGraphs]:
        """Capture and time every bucket (largest first). Call on every DP rank, in step.

        Returns:
            ``{bucket: BucketGraphs}`` (also ``self.graphs``).
        """
        from dbo_compile.runtime.engine import run_step
        from dbo_compile.runtime.program import record_calls

        cuda = self.device.type == "cuda"
        if cuda and self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        for tokens in sorted(self.buckets, reverse=True):
            ids, pos, md = self._dummy_step(tokens)
            with torch.no_grad(), record_calls() as calls:
                run_step(self.compiled, ids, pos, md, [1] * tokens, block_size=self.block_size,
                         **self.model_kwargs)
            if len(calls) != 1:
                raise GraphRunnerError(
                    f"one step ran {len(calls)} compiled graphs (graph breaks, or not compiled "
                    "with backend='dbo'); FULL CUDA graphs need the whole step in one graph: "
                    "remove the graph breaks (TORCH_LOGS=graph_breaks shows them)")
            art, args = calls[0]
            args = list(args)
            if not self._input_pos:
                self._input_pos = self._map_inputs(args, ids, pos, md)
            bucket = BucketGraphs(tokens, art, args)
            with torch.no_grad():
                self._capture_bucket(bucket, cuda)
            self.graphs[tokens] = bucket
        self._decide_buckets()
        log.info("dbo graphs: %s", self.describe())
        return self.graphs

    @staticmethod
    def _map_inputs(args: Sequence[Any], ids: torch.Tensor, pos: torch.Tensor,
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

    def _capture_bucket(self, b: BucketGraphs, cuda: bool) -> None:
        art = b.artifact
        unsplit = art.unsplit if hasattr(art, "unsplit") else art.fn
        self._graph(b, "unsplit", lambda: unsplit(*b.args), cuda)
        if getattr(art, "split_program", None) is not None:
            b.split_args = art.split_args(b.args, [1] * b.tokens)
            for name, program in art.variants.items():
                self._graph(b, name, _split_fn(program, b.split_args, art.signature.outputs), cuda)
        b.times_us = self._time(b)

    def _graph(self, b: BucketGraphs, name: str, fn: Callable[[], Any], cuda: bool) -> None:
        if not cuda:
            g = _EagerGraph(fn)
            b.graphs[name], b.outs[name] = g, g.out
            return
        from dbo_compile.runtime.cudagraph import capture

        b.graphs[name], b.outs[name] = capture(fn, warmup=2, pool=self.pool)

    def _time(self, b: BucketGraphs) -> dict[str, float]:
        """Replay time of each graph of ``b`` (µs): interleaved rounds, median, max over DP."""
        cuda = self.device.type == "cuda"
        samples: dict[str, list[float]] = {n: [] for n in b.graphs}
        for _round in range(3):
            for name, g in b.graphs.items():
                g.replay()
                if cuda:
                    torch.cuda.synchronize()
                    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                          for _ in range(self.timing_iters)]
                    for s, e in ev:
                        s.record()
                        g.replay()
                        e.record()
                    torch.cuda.synchronize()
                    samples[name] += [s.elapsed_time(e) * 1e3 for s, e in ev]
                else:
                    for _ in range(self.timing_iters):
                        t0 = time.perf_counter()
                        g.replay()
                        samples[name].append((time.perf_counter() - t0) * 1e6)
        names = list(b.graphs)
        med = _max_over_dp(b.artifact, [statistics.median(samples[n]) for n in names])
        return dict(zip(names, med))

    def _decide_buckets(self) -> None:
        """Per bucket: the fastest split variant, and whether it runs at all (``split`` mode);
        the other variants' graphs are dropped."""
        for b in self.graphs.values():
            mode = b.artifact.config.split
            split = {k: t for k, t in b.times_us.items() if k != "unsplit"}
            best = min(split, key=lambda k: (split[k], k)) if split else None
            b.best_variant = best
            if best is None or mode == "never":
                b.choice = "unsplit"
            elif mode == "always":
                b.choice = best
            else:
                b.choice = best if split[best] <= (1.0 - self.min_gain) * b.t_unsplit_us else "unsplit"
            if not self.keep_variants:
                for name in [k for k in b.graphs if k not in ("unsplit", best)]:
                    del b.graphs[name], b.outs[name]

    def describe(self) -> str:
        """One line per bucket: times and the choice."""
        rows = []
        for t in sorted(self.graphs):
            b = self.graphs[t]
            split = "-" if b.t_split_us is None else f"{b.t_split_us:.0f}"
            rows.append(f"{t}: unsplit {b.t_unsplit_us:.0f} us, split {split} us -> {b.choice}")
        return "; ".join(rows)

    # -- serving path ---------------------------------------------------------------------
    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata,
                 num_scheduled_tokens: Sequence[int], *, vetoes: Sequence[Any] = (),
                 allow_split: bool = True) -> Any:
        """Run one step (every DP rank calls it once per step, ranks without work too).

        Args:
            input_ids: ``[num_tokens]`` int64 (token dim; padding rows allowed at the end).
            positions: ``[num_tokens]`` int64.
            attn_metadata: the step's metadata; its block table at most ``max_blocks_per_req``
                wide (else the step runs eagerly).
            num_scheduled_tokens: tokens per request (host ints).
            vetoes / allow_split: as :func:`dbo_compile.runtime.engine.run_step`.

        Returns:
            The model's output for the real tokens (rows ``[:num_tokens]``): a view of the
            graph's static output, valid until the next step.

        Raises:
            GraphRunnerError: called before :meth:`capture`.
            DpVoteError: as the compiled model's vote.
        """
        if not self.graphs:
            raise GraphRunnerError("CudaGraphRunner: call capture() (warm-up) before serving steps")
        n = int(input_ids.shape[0])
        ctx = dict(num_scheduled_tokens=list(num_scheduled_tokens), block_size=self.block_size,
                   vetoes=tuple(vetoes), allow_split=allow_split)
        largest = self.graphs[self.buckets[-1]]
        real_args = self._graph_args(largest.args, input_ids, positions, attn_metadata)
        with step_context(**ctx):
            vote, qlens = self._vote(largest.artifact, real_args, n)
        padded = n if vote is None else vote.num_tokens_padded
        tokens = next((t for t in self.buckets if t >= padded), None)
        wide = attn_metadata.block_table.shape[1] > self.max_blocks_per_req
        if tokens is None or wide:
            reason = (f"{padded} tokens > largest bucket {self.buckets[-1]}" if tokens is None
                      else f"block table width {attn_metadata.block_table.shape[1]} > "
                           f"max_blocks_per_req {self.max_blocks_per_req}")
            return self._eager(reason, input_ids, positions, attn_metadata, ctx)
        b = self.graphs[tokens]
        split = bool(vote is not None and vote.should_split and b.use_split)
        self.last_choice = (tokens, "split" if split else "unsplit")
        name = b.choice if split else "unsplit"
        self.last_graph = name
        self.load_step(tokens, input_ids, positions, attn_metadata, qlens, split=split)
        b.graphs[name].replay()
        outs = tuple(_real_rows(o, n, tokens) for o in b.outs[name])
        return outs[0] if len(outs) == 1 else outs

    def load_step(self, tokens: int, input_ids: torch.Tensor, positions: torch.Tensor,
                  attn_metadata: AttentionMetadata, num_scheduled_tokens: Sequence[int], *,
                  split: bool) -> None:
        """Copy a step into bucket ``tokens``'s static buffers of the unsplit (``split=False``)
        or split graphs, without voting (the serving path calls it after the vote; benchmarks
        and tests call it to replay a graph on a chosen step).

        Raises:
            GraphRunnerError: no such bucket, the step does not fit it, or ``split`` for a
                bucket whose graph was not split.
        """
        b = self.graphs.get(tokens)
        n = int(input_ids.shape[0])
        if b is None or n > tokens:
            raise GraphRunnerError(f"step of {n} tokens does not fit a captured bucket "
                                   f"({tokens} not in {sorted(self.graphs)} or too small)")
        args = self._graph_args(b.args, input_ids, positions, attn_metadata)
        padded_args = _pad_token_rows(b.artifact.specs, args, n, tokens)
        if split:
            if b.split_args is None:
                raise GraphRunnerError(f"bucket {tokens} has no split graph (graph not split)")
            per_ubatch = b.artifact.split_args(padded_args, list(num_scheduled_tokens))
            _copy_into(b.split_args, per_ubatch, b.artifact.signature.inputs, b.artifact.specs)
        else:
            _copy_into(b.args, padded_args, [(i, None) for i in range(len(b.args))],
                       b.artifact.specs)

    def _graph_args(self, static: Sequence[Any], ids: torch.Tensor, pos: torch.Tensor,
                    md: AttentionMetadata) -> list[Any]:
        args = list(static)
        named = {"input_ids": ids, "positions": pos, **md.tensors()}
        for name, i in self._input_pos.items():
            args[i] = named[name]
        return args

    def _vote(self, art: Any, args: list[Any], n: int) -> tuple[Any, list[int]]:
        if hasattr(art, "split_program") and art.split_program is not None:
            vote, reason, qlens = art.decide(args)
            art.stats.count(vote.should_split, reason)
            return vote, qlens
        return art.decide(args), [1] * n

    def _eager(self, reason: str, ids, pos, md, ctx) -> Any:
        if reason not in self._warned:
            self._warned.add(reason)
            log.warning("dbo graphs: step runs eagerly (no capture after warm-up): %s", reason)
        self.eager_steps += 1
        from dbo_compile.runtime.engine import run_step

        return run_step(self.compiled, ids, pos, md, **ctx, **self.model_kwargs)


def _split_fn(program: Any, split_args: list[Any], outputs: Sequence[Sequence[int]]):
    """The split program over static per-ubatch inputs; outputs concatenated in ubatch order."""

    def run() -> tuple[Any, ...]:
        outs = program(*split_args)
        return tuple(outs[i[0]] if len(i) == 1 else torch.cat([outs[j] for j in i], 0)
                     for i in outputs)

    return run


def _max_over_dp(art: Any, values: list[float]) -> list[float]:
    from dbo_compile.runtime.program import _dp_group

    group = _dp_group(art.config)
    if group is None:
        return values
    import torch.distributed as dist

    from dbo_compile.runtime.vote import _table_device

    t = torch.tensor(values, dtype=torch.float64, device=_table_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


def _real_rows(out: Any, n: int, rows: int) -> Any:
    if isinstance(out, torch.Tensor) and out.dim() and out.shape[0] == rows:
        return out[:n]
    return out


def _pad_token_rows(specs: Sequence[Any], args: Sequence[Any], n: int, rows: int) -> list[Any]:
    from dbo_compile.runtime.program import _pad_args

    return _pad_args(list(specs), args, n, rows)


def _copy_into(static: list[Any], new: Sequence[Any], inputs: Sequence[tuple[int, int | None]],
               specs: Sequence[Any]) -> None:
    """Copy a step's (per-ubatch) inputs into the captured static ones.

    Shared inputs are the same objects (skipped). Token-indexed tensors have the captured
    shape. Request-indexed metadata is padded to the captured request count with zero-length
    requests (see the module docstring); ints must equal the captured ones except request
    counts, which the graph was captured at capacity.
    """
    for pos, (index, _ubatch) in enumerate(inputs):
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

