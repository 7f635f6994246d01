"""FULL CUDA graphs per bucket, and the split decision measured on them.

A serving engine that runs a model compiled with ``backend="dbo"`` under CUDA graphs wraps it
in a :class:`CudaGraphRunner`::

    compiled = torch.compile(model, backend="dbo")
    runner = CudaGraphRunner(compiled, buckets=[64, 256, 1024, 4096], max_blocks_per_req=64)
    runner.capture()        # warm-up, on every rank, before serving
    logits = runner(input_ids, positions, attn_metadata, num_scheduled_tokens=[1, 1, 57])

At warm-up, for every bucket (a padded token count, largest first) the runner

1. runs one synthetic step of exactly ``bucket`` tokens through the compiled model (Dynamo
   compiles it; the runner records the artifact and its graph inputs, which become the bucket's
   static input buffers), and a prefill-shaped one that must reach the same compiled graph
   (Inductor compiles nothing for it: :func:`~dbo_compile.runtime.context.traced_only`);
2. captures the **unsplit** program and, when the graph was split, every **split** (DBO)
   program candidate the backend compiled (``schedule_candidates``, ``sm_carveout_candidates``)
   as one CUDA graph each, after warm-up calls on a side stream, all into one memory pool;
3. times the graphs by replaying them (``timing_iters`` replays each, interleaved rounds,
   median, CUDA events), takes the max over every rank of the job and keeps the fastest split
   candidate; with ``split="auto"`` the bucket splits only where that candidate is faster than the
   unsplit graph by ``min_gain`` (fraction, default 3 %: :data:`MIN_GAIN`) or more. The table
   is therefore identical on every rank. ``split="always"``/``"never"`` force it (``"never"``
   captures no split graph). Only graphs whose time can change the choice are timed: none in
   a bucket with one candidate, not the unsplit graph with ``"always"``.

Warm-up is no served step: it leaves the model's state as it was. Its synthetic steps write no
KV (slot ``-1``); every other buffer the programs write in place (an expert-load counter, a
step counter: the artifact's ``state_inputs``, found in the graph) is copied before and put
back after the synthetic steps through the compiled model, the captures, every candidate's
warm-up calls and the timing replays (on the device, no host sync).

Capture refuses what a replay could not serve correctly (``GraphRunnerError``): a step that runs
several compiled graphs (graph breaks); a graph specialised to the warm-up layout (a
prefill-shaped synthetic step is run per bucket too, and must reach the same compiled graph — it
would not if the model branched on a host value such as ``max_query_len``); an unsplit graph
whose padding rows could change its results (not known to be row-local) or be counted in a
buffer it updates (a fold of token rows: Dynamo's graph keeps no padding row out of it); a
bucket that is not a multiple of ``num_ubatches`` (a split step is padded past it); programs
that fold a float the model no longer holds (it changed after ``torch.compile`` traced it:
compile again).

Per step (serving path; never captures):

1. the DP vote (:meth:`~dbo_compile.runtime.artifact.CompiledArtifact.decide_step`:
   thresholds, vetoes, padding to the group's max) on the step's real inputs, its metadata
   checked on the host (from the metadata's host mirrors when given: then no step reads the
   device, see :meth:`CudaGraphRunner.__call__`);
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
``max_blocks_per_req``, runs eagerly through the compiled model (logged once per reason), on
every rank together (such a rank asks the vote for one token past the largest bucket): a
capture never happens after warm-up. So does a step whose model holds another value of a number
the graphs take as an input and bake in (a float attribute under ``torch.compile(dynamic=True)``:
a norm's eps, a rope scale), read again from the model at every step
(:mod:`~dbo_compile.runtime.numbers`): the eager path runs Dynamo's graph with the new value.

Caveat: the timings are taken on synthetic one-token-context steps; with an attention kernel
whose cost grows with the context, long-context steps weigh attention more than measured.

Rules taken from the field: buckets of padded token counts, largest captured first and all
graphs in one pool (vLLM ``CUDAGraphRunner`` / ``cudagraph_capture_sizes``); FULL graphs of
the ubatched program with padding to the DP group's max (vLLM DBO); the decision to split from
measurement, not assumption (``docs/references.md``: over NVLink the split loses below ~8k
tokens/rank).
"""

from __future__ import annotations

import logging
import operator
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from dbo_compile.errors import GraphRunnerError, UBatchExecutionError
from dbo_compile.metadata import FIELD_LAYOUT, AttentionMetadata, HostCounts
from dbo_compile.ops.comm import run_watched
from dbo_compile.runtime.artifact import CompiledArtifact
from dbo_compile.runtime.capture import capture, run_draining, state_kept
from dbo_compile.runtime.context import (
    last_outputs,
    record_calls,
    step_context,
    traced_only,
    uncounted,
)
from dbo_compile.runtime.engine import run_step
from dbo_compile.runtime.numbers import InputNumbers
from dbo_compile.runtime.padding import join_ubatch_outputs, pad_args
from dbo_compile.runtime.vote import min_split_tokens, vote_device
from dbo_compile.timing import samples_us

log = logging.getLogger(__name__)

#: default ``min_gain``: a split candidate must beat the unsplit graph by 3 % at warm-up. On
#: one H200 (2026-12-01, emulated EP-16 / 64, decode 64) warm-up and later timings of the same
#: graphs differed by up to 3 %: splits chosen at 0.6 % / 1.0 % faster measured 1.6 % / 2.0 %
#: slower (``benchmarks/results/emulated_v2lite_worlds_pipelined_h200_2026-12-01.json``).
MIN_GAIN = 0.03

__all__ = ["BucketGraphs", "CudaGraphRunner", "EagerGraph", "GraphRunnerError", "OutputMap",
           "WARMUP_PARTS", "split_program_fn"]

#: the parts of a bucket's warm-up time (:attr:`BucketGraphs.warmup_s`), in order
WARMUP_PARTS = ("record", "probe", "warmup_runs", "capture", "timing", "total")


@dataclass
class BucketGraphs:
    """What was captured for one bucket.

    Attributes:
        tokens: the bucket's padded token count.
        artifact: the compiled artifact (a
            :class:`~dbo_compile.runtime.artifact.CompiledArtifact`).
        args: the static graph inputs (token rows = ``tokens``; ``tokens`` requests).
        split_args: the split program's static per-ubatch inputs (``None``: not split).
        graphs / outs: ``"unsplit"`` and each split schedule candidate's graph and static
            outputs (after the choice only ``"unsplit"`` and the chosen candidate are kept).
        times_us: replay time (µs, median, max over the DP group) of each graph whose time
            can change the choice: the split candidates, and with ``split="auto"`` the unsplit
            graph; nothing where there is one graph to choose from (no split graph, or
            ``"always"`` with one candidate).
        choice: ``"unsplit"`` or the name of the split candidate this bucket runs when the vote
            splits.
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
    """

    tokens: int
    artifact: CompiledArtifact
    args: list[Any]
    split_args: list[Any] | None = None
    graphs: dict[str, Any] = field(default_factory=dict)
    outs: dict[str, Any] = field(default_factory=dict)
    times_us: dict[str, float] = field(default_factory=dict)
    choice: str = "unsplit"
    best_candidate: str | None = None
    input_pos: dict[str, int] = field(default_factory=dict)
    warmup_s: dict[str, float] = field(default_factory=dict)
    graph_s: dict[str, float] = field(default_factory=dict)
    out_map: OutputMap | None = None
    numbers: InputNumbers | None = None

    @property
    def use_split(self) -> bool:
        return self.choice != "unsplit"

    @property
    def t_unsplit_us(self) -> float | None:
        """The unsplit graph's time (µs), ``None`` when it was not timed (see ``times_us``)."""
        return self.times_us.get("unsplit")

    @property
    def t_split_us(self) -> float | None:
        """The fastest split candidate's time (µs), ``None`` when none was timed."""
        split = [t for k, t in self.times_us.items() if k != "unsplit"]
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


def _tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]


class EagerGraph:
    """CPU stand-in for a CUDA graph: ``replay()`` re-runs the function on the same static
    inputs and copies its outputs into the static outputs (``out``; tests the buffer
    plumbing). The runner captures with it where there is no CUDA; so do the benchmarks'
    CPU smoke runs."""

    def __init__(self, fn: Callable[[], Any]):
        self.fn = fn
        self.out = run_draining(fn)

    def replay(self) -> None:
        for dst, src in zip(_tensors(self.out), _tensors(run_draining(self.fn))):
            dst.copy_(src)


class CudaGraphRunner:
    """Per-bucket FULL CUDA graphs of a ``backend="dbo"`` model (see the module docstring).

    Args:
        compiled: ``torch.compile(model, backend="dbo", ...)``; called as
            ``compiled(input_ids, positions, attn_metadata, **model_kwargs)``.
        buckets: padded token counts to capture (tokens per rank; each ``>= 2``).
        max_blocks_per_req: block-table width (KV blocks per request) of the static buffers.
        block_size: KV-cache block size (tokens), passed to the prefix-read veto; default the
            block size of the compiled graph's KV caches.
        timing_iters: replays per graph and timing round at warm-up (3 rounds).
        vocab_size: when given, the synthetic warm-up steps carry random token ids below it
            (seeded, the same on every rank), so that MoE routing, and hence the timings the
            decision rests on, look like real traffic; default all zeros (every token routed
            alike).
        keep_candidates: keep every split candidate's graph after the choice (benchmarks).
        min_gain: with ``split="auto"``, the split graph is used for a bucket only when
            ``t_split <= (1 - min_gain) * t_unsplit`` (fraction, default :data:`MIN_GAIN`
            = 0.03: the warm-up timing's noise, so that a split chosen by a margin inside it
            never runs slower than the unsplit graph).
        device: where the synthetic warm-up step lives (default: the current CUDA device, else
            CPU, where graphs are replaced by eager re-runs).
        model_kwargs: extra keyword arguments of every model call.

    Raises:
        GraphRunnerError: bad buckets, ``max_blocks_per_req`` or ``timing_iters``, or a CUDA
            device without CUDA; at :meth:`capture`: what the module docstring lists.
    """

    def __init__(self, compiled: Callable[..., Any], buckets: Sequence[int], *,
                 max_blocks_per_req: int, block_size: int | None = None, timing_iters: int = 10,
                 min_gain: float | None = None, device: torch.device | str | None = None,
                 vocab_size: int | None = None, keep_candidates: bool = False, **model_kwargs: Any):
        buckets = list(buckets)
        bad = [b for b in buckets if isinstance(b, bool) or not _is_int(b) or int(b) < 2]
        if not buckets or bad:
            raise GraphRunnerError(f"buckets must be ints >= 2 (token counts), got {buckets}")
        buckets = [int(b) for b in buckets]
        if not isinstance(max_blocks_per_req, int) or max_blocks_per_req < 1:
            raise GraphRunnerError(f"max_blocks_per_req must be an int >= 1, got {max_blocks_per_req!r}")
        if isinstance(timing_iters, bool) or not isinstance(timing_iters, int) or timing_iters < 1:
            raise GraphRunnerError(f"timing_iters must be an int >= 1, got {timing_iters!r}")
        self.compiled = compiled
        self.buckets = sorted(set(buckets))
        self.max_blocks_per_req = max_blocks_per_req
        self.block_size = block_size
        self.timing_iters = timing_iters
        if min_gain is None:
            min_gain = MIN_GAIN
        if (isinstance(min_gain, bool) or not isinstance(min_gain, (int, float))
                or not 0.0 <= min_gain < 1.0):
            raise GraphRunnerError(f"min_gain must be a fraction in [0, 1), got {min_gain!r}")
        self.min_gain = float(min_gain)
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise GraphRunnerError(f"device {self.device} requested but CUDA is not available; "
                                   "use device='cpu' (graphs are then eager re-runs)")
        self.model_kwargs = model_kwargs
        self.vocab_size = vocab_size
        self.keep_candidates = keep_candidates
        self.last_choice: tuple[Any, str] | None = None
        self.last_graph: str | None = None
        self.graphs: dict[int, BucketGraphs] = {}
        self.pool: Any = None
        self.eager_steps = 0
        self._warned: set[str] = set()
        self._copy_plans: dict[tuple[int, bool], tuple[Any, Any, list[int]]] = {}

    # -- warm-up --------------------------------------------------------------------------
    def _dummy_step(self, tokens: int, prefill: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """A synthetic step of ``tokens`` rows whose KV writes go nowhere (slot -1):
        ``tokens`` one-token requests, or (``prefill``) two requests of half the tokens each."""
        dev = self.device
        i32 = dict(dtype=torch.int32, device=dev)
        qlens = [tokens // 2, tokens - tokens // 2] if prefill else [1] * tokens
        qsl = torch.tensor([0] + qlens, **i32).cumsum(0, dtype=torch.int32)
        md = AttentionMetadata(
            query_start_loc=qsl,
            seq_lens=torch.tensor(qlens, **i32),
            num_computed_tokens=torch.zeros(len(qlens), **i32),
            block_table=torch.zeros(len(qlens), self.max_blocks_per_req, **i32),
            slot_mapping=torch.full((tokens,), -1, dtype=torch.int64, device=dev),
            max_query_len=max(qlens, default=0), max_seq_len=max(qlens, default=0))
        if self.vocab_size:
            gen = torch.Generator().manual_seed(tokens)
            ids = torch.randint(0, self.vocab_size, (tokens,), generator=gen).to(dev)
        else:
            ids = torch.zeros(tokens, dtype=torch.int64, device=dev)
        return ids, torch.zeros(tokens, dtype=torch.int64, device=dev), md, qlens

    def _record(self, tokens: int, prefill: bool
                ) -> tuple[Any, list[Any], dict[str, int], OutputMap]:
        """Run one synthetic step through the compiled model; its artifact, graph args, the
        positions of the step's inputs among them, and where the model's outputs come from."""
        ids, pos, md, qlens = self._dummy_step(tokens, prefill)
        with torch.no_grad(), record_calls() as calls, uncounted():
            ret = run_step(self.compiled, ids, pos, md, qlens, block_size=self.block_size,
                           **self.model_kwargs)
        if len(calls) != 1:
            raise GraphRunnerError(
                f"one step ran {len(calls)} compiled graphs (graph breaks, or not compiled "
                "with backend='dbo'); FULL CUDA graphs need the whole step in one graph: "
                "remove the graph breaks (TORCH_LOGS=graph_breaks shows them)")
        art, args = calls[0]
        if not isinstance(art, CompiledArtifact) or art.specs is None:
            raise GraphRunnerError(f"the compiled graph ({type(art).__name__}) has no input "
                                   "classification; compile with backend='dbo'")
        return art, list(args), self._map_inputs(args, ids, pos, md), OutputMap.of(ret, tokens)

    def capture(self) -> dict[int, BucketGraphs]:
        """Capture and time every bucket (largest first). Call on every rank of the job, in
        step (the timings are maxed over all ranks, so that every rank picks the same graph).

        Returns:
            ``{bucket: BucketGraphs}`` (also ``self.graphs``).

        Raises:
            GraphRunnerError: the step runs several compiled graphs (graph breaks), or the
                compiled graph depends on the step's layout (Dynamo compiled another graph for
                a prefill-shaped step than for a decode-shaped one, e.g. on ``max_query_len``):
                a replayed graph would then ignore that dependence.
        """
        cuda = self.device.type == "cuda"
        if cuda and self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        self._copy_plans.clear()
        for tokens in sorted(self.buckets, reverse=True):
            t0 = time.perf_counter()
            art, args, input_pos, out_map = self._record(tokens, prefill=False)
            t1 = time.perf_counter()
            if tokens >= 4:
                # only which graph Dynamo picks matters: Inductor stages run their traced
                # ATen ops for the probe's signatures, which no captured graph replays
                with traced_only():
                    other, _, _, _ = self._record(tokens, prefill=True)
                if other is not art:
                    raise GraphRunnerError(
                        f"bucket {tokens}: a prefill-shaped step ran another compiled graph than "
                        "a decode-shaped one (Dynamo specialised on the step's layout, e.g. "
                        "max_query_len or the request count); a replayed CUDA graph would "
                        "ignore that. Keep layout-dependent host values out of the model")
            self._check_artifact(art, tokens, args)
            ids, pos, md, _ = self._dummy_step(tokens)
            numbers = InputNumbers(self.compiled, art.specs, args, (ids, pos, md),
                                   self.model_kwargs)
            bucket = BucketGraphs(tokens, art, args, input_pos=input_pos, out_map=out_map,
                                  numbers=numbers)
            bucket.warmup_s.update(record=t1 - t0, probe=time.perf_counter() - t1)
            # the captures, every candidate's warm-up calls and the timing replays (on a GPU
            # too: a replay writes the real buffers) are no served step: the buffers the
            # programs write in place end as they were (the synthetic steps through the
            # compiled model see to theirs: ``uncounted``; the KV cache: slot -1 rows)
            with torch.no_grad(), state_kept([args[i] for i in art.state_inputs]):
                self._capture_bucket(bucket, cuda)
            with torch.no_grad():
                self._decide_bucket(bucket)
            bucket.warmup_s["total"] = time.perf_counter() - t0
            self.graphs[tokens] = bucket
            log.info("dbo graphs: warm-up of bucket %d: %s", tokens, _parts(bucket.warmup_s))
        log.info("dbo graphs: %s", self.describe())
        log.info("dbo graphs: warm-up %s", _parts(self.warmup_s()))
        return self.graphs

    def warmup_s(self) -> dict[str, float]:
        """Seconds of the warm-up by part (:data:`WARMUP_PARTS`), summed over the buckets."""
        out = dict.fromkeys(WARMUP_PARTS, 0.0)
        for b in self.graphs.values():
            for part, seconds in b.warmup_s.items():
                out[part] += seconds
        return out

    @property
    def stats(self) -> dict[str, Any]:
        """What the runner did: ``warmup_s`` (:meth:`warmup_s`), per bucket its
        ``warmup_s`` by part, the graphs it captured and timed and its choice
        (``buckets``), and ``eager_steps`` (steps that fit no bucket since)."""
        return {
            "warmup_s": self.warmup_s(),
            "buckets": {t: {"warmup_s": dict(b.warmup_s), "graph_s": dict(b.graph_s),
                            "graphs_captured": len(b.graph_s), "timed": sorted(b.times_us),
                            "choice": b.choice}
                        for t, b in sorted(self.graphs.items())},
            "eager_steps": self.eager_steps,
        }

    @staticmethod
    def _check_artifact(art: CompiledArtifact, tokens: int, args: Sequence[Any]) -> None:
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
        n = art.config.num_ubatches
        if art.is_split and tokens % n:
            raise GraphRunnerError(
                f"bucket {tokens} is not a multiple of num_ubatches={n}: a split step is padded "
                f"to a multiple of it ({tokens + n - tokens % n}), so this bucket's split graph "
                f"would never run at its size; use {tokens - tokens % n} or {tokens + n - tokens % n}")

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
        self._graph(b, "unsplit", lambda: run_watched(art.unsplit, *b.args), cuda)
        # no step of this bucket can split (the vote's own thresholds): capture no split graph
        never = b.tokens < min_split_tokens(art.config)
        if art.is_split and not never:
            b.split_args = art.split_args(b.args, [1] * b.tokens)
            for name, program in art.candidates.items():
                self._graph(b, name, split_program_fn(program, b.split_args, art, b.tokens), cuda)
        t0 = time.perf_counter()
        b.times_us = self._time(b, _timed(b, art.config.split))
        b.warmup_s["timing"] = time.perf_counter() - t0

    def _graph(self, b: BucketGraphs, name: str, fn: Callable[[], Any], cuda: bool) -> None:
        times = {"warmup_s": 0.0}
        t0 = time.perf_counter()
        if cuda:
            b.graphs[name], b.outs[name] = capture(fn, warmup=2, pool=self.pool, times=times)
        else:
            g = EagerGraph(fn)
            b.graphs[name], b.outs[name] = g, g.out
            times["capture_s"] = time.perf_counter() - t0
        b.graph_s[name] = time.perf_counter() - t0
        for part, key in (("warmup_runs", "warmup_s"), ("capture", "capture_s")):
            b.warmup_s[part] = b.warmup_s.get(part, 0.0) + times[key]

    def _time(self, b: BucketGraphs, names: Sequence[str]) -> dict[str, float]:
        """Replay time of the graphs ``names`` of ``b`` (µs): interleaved rounds, median, max
        over every rank (``names`` must be the same on every rank)."""
        if not names:
            return {}
        cuda = self.device.type == "cuda"
        samples: dict[str, list[float]] = {n: [] for n in names}
        for _round in range(3):
            for name in names:
                samples[name] += samples_us(b.graphs[name].replay, self.timing_iters, warmup=1,
                                            cuda=cuda)
        med = _max_over_ranks([statistics.median(samples[n]) for n in names])
        return dict(zip(names, med))

    def _decide_bucket(self, b: BucketGraphs) -> None:
        """The fastest split candidate, and whether it runs at all (``split`` mode); the other
        candidates' graphs are dropped at once, so that later captures reuse their memory."""
        mode = b.artifact.config.split
        split = [k for k in b.graphs if k != "unsplit"]
        best = min(split, key=lambda k: (b.times_us[k], k)) if len(split) > 1 else (
            split[0] if split else None)
        b.best_candidate = best
        if best is None or mode == "never":
            b.choice = "unsplit"
        elif mode == "always":
            b.choice = best
        else:
            faster = b.times_us[best] <= (1.0 - self.min_gain) * b.times_us["unsplit"]
            b.choice = best if faster else "unsplit"
        if not self.keep_candidates:
            for name in [k for k in b.graphs if k not in ("unsplit", best)]:
                del b.graphs[name], b.outs[name]

    def describe(self) -> str:
        """One line per bucket: times and the choice."""
        rows = []
        for t in sorted(self.graphs):
            b = self.graphs[t]
            unsplit, split = ("-" if v is None else f"{v:.0f}" for v in (b.t_unsplit_us, b.t_split_us))
            rows.append(f"{t}: unsplit {unsplit} us, split {split} us -> {b.choice}")
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
                wide (else the step runs eagerly); with host mirrors where the caller has them.
            num_scheduled_tokens: tokens per request (host ints).
            vetoes / allow_split: as :func:`dbo_compile.runtime.engine.run_step`.

        Returns:
            The model's output for the real tokens (rows ``[:num_tokens]``): a view of the
            graph's static output, valid until the next step.

        Host syncs (each device read waits for the GPU to drain): none when ``attn_metadata``
        carries its host mirrors (``*_cpu``, see :mod:`~dbo_compile.metadata`) and the
        DP vote runs over a CPU (Gloo) group: the vote and the split take the counts from
        ``query_start_loc_cpu``, ``seq_lens_cpu`` and ``num_computed_tokens_cpu``, the
        prefix-read veto (``block_size`` given) takes ``slot_mapping_cpu`` and
        ``block_table_cpu``, and the split's per-ubatch counts go to the GPU from pinned memory
        without blocking. Without mirrors: one read of the counts, and one of the slots and
        block table for the veto. Not avoidable here: a vote over an NCCL group reads its
        table back; a step that fits no bucket runs eagerly (as ``run_step``).

        Raises:
            GraphRunnerError: called before :meth:`capture`.
            DpVoteError: as the compiled model's vote (also for bad metadata or host mirrors).
            UBatchExecutionError: this rank's step failed between the vote and the replay
                (copying it into the static buffers): the graph is replayed with padding rows
                only, so that the peers, who replay the same graph, finish theirs with valid
                outputs; only this rank raises. A step that runs eagerly (fits no bucket) is
                a step transaction as ``run_step``'s.
        """
        if not self.graphs:
            raise GraphRunnerError("CudaGraphRunner: call capture() (warm-up) before serving steps")
        n = int(input_ids.shape[0])
        ctx = dict(num_scheduled_tokens=list(num_scheduled_tokens), block_size=self.block_size,
                   vetoes=tuple(vetoes), allow_split=allow_split)
        largest = self.graphs[self.buckets[-1]]
        real_args = self._graph_args(largest, input_ids, positions, attn_metadata)
        width = int(attn_metadata.block_table.shape[1])
        # the graphs bake in the numbers the model held at capture (the vote's artifact sees
        # the captured ones in real_args): one that changed sends the step down the eager path
        changed = self._changed_numbers((input_ids, positions, attn_metadata))
        fits = n <= self.buckets[-1] and width <= self.max_blocks_per_req and not changed
        # a step that fits no graph on *this* rank asks for one token past the largest bucket,
        # so that the vote sends every rank down the eager path together (never a hang)
        min_padded = 0 if fits else self.buckets[-1] + 1
        with step_context(**ctx):
            # the runner pads into its own buffers: a static graph's fixed size does not apply
            decision = largest.artifact.decide_step(
                real_args, min_padded=min_padded, metadata=attn_metadata, pads_itself=True)
        vote = decision.vote
        # no vote (a graph without collectives): this rank alone decides
        padded = max(n, min_padded) if vote is None else vote.num_tokens_padded
        tokens = next((t for t in self.buckets if t >= padded), None)
        if tokens is None:
            if n > self.buckets[-1]:
                reason = f"{n} tokens > largest bucket {self.buckets[-1]}"
            elif width > self.max_blocks_per_req:
                reason = f"block table width {width} > max_blocks_per_req {self.max_blocks_per_req}"
            elif changed:
                reason = self._changed_reason(changed)
            else:
                reason = (f"the DP vote padded the step to {padded} tokens (> largest bucket "
                          f"{self.buckets[-1]}): another rank's step fits no captured graph, "
                          "or its model changed a number the graphs bake in")
            self.last_choice, self.last_graph = ("eager", reason), None
            return self._eager(reason, input_ids, positions, attn_metadata, ctx)
        b = self.graphs[tokens]
        split = decision.should_split and b.use_split
        self.last_choice = (tokens, "split" if split else "unsplit")
        name = b.choice if split else "unsplit"
        self.last_graph = name
        try:
            self._load(tokens, input_ids, positions, attn_metadata, decision.qlens, split,
                       decision.host, validated=True)
        except Exception as e:  # noqa: BLE001 - the peers replay this graph: replay it too
            self._replay_padding(b, name, split)
            raise UBatchExecutionError(
                f"this rank's step failed before its graph replay ({type(e).__name__}: {e}); "
                "the graph was replayed with padding rows only (they write nothing), so that "
                "the other ranks' collectives completed and their outputs are valid; this "
                "rank's step is aborted, the next step runs normally") from e
        b.graphs[name].replay()
        return b.out_map.build(b.outs[name], b.artifact.output_specs, n, tokens)

    def _replay_padding(self, b: BucketGraphs, name: str, split: bool) -> None:
        """Replay graph ``name`` of ``b`` on a step of zero tokens (every row padding: slot -1,
        zero-length requests): this rank takes part in the graph's collectives without data,
        as its peers, who replay the same graph, expect (a replay cannot stop halfway). The
        buffers the programs write in place are put back (a step counter: the step did not
        happen on this rank)."""
        ids, pos, md, qlens = self._dummy_step(0)
        self._load(b.tokens, ids, pos, md, qlens, split, None, validated=False)
        with state_kept([b.args[i] for i in b.artifact.state_inputs]):
            b.graphs[name].replay()

    def _changed_numbers(self, step: tuple[Any, ...]) -> list[tuple[int, str, Any, Any, Any]]:
        """``(graph input index, source, captured, now, artifact)`` of each number input of a
        captured graph that the model holds another value of now (:mod:`.numbers`; one read
        per compiled graph, not per bucket)."""
        out, seen = [], set()
        for b in self.graphs.values():
            if b.numbers is None or not b.numbers.entries or id(b.artifact) in seen:
                continue
            seen.add(id(b.artifact))
            out += [(*c, b.artifact) for c in b.numbers.changed(step, self.model_kwargs)]
        return out

    @staticmethod
    def _changed_reason(changed: list[tuple[int, str, Any, Any, Any]]) -> str:
        """The eager path's reason for numbers that changed after capture, and what to do."""
        folded = any(i in dict(art.float_guards) for i, _, _, _, art in changed)
        what = ", ".join(f"{src} {old!r} -> {new!r}" for _, src, old, new, _ in changed)
        fix = ("compile the model again (torch._dynamo.reset(), then torch.compile: the "
               "backend folded it into its programs) and capture() again" if folded
               else "capture() again")
        return (f"the model changed numbers the captured graphs bake in ({what}); steps run "
                f"eagerly until you {fix}")

    def load_step(self, tokens: int, input_ids: torch.Tensor, positions: torch.Tensor,
                  attn_metadata: AttentionMetadata, num_scheduled_tokens: Sequence[int], *,
                  split: bool, host: HostCounts | None = None) -> None:
        """Copy a step into bucket ``tokens``'s static buffers of the unsplit (``split=False``)
        or split graphs, without voting (the serving path calls it after the vote; benchmarks
        and tests call it to replay a graph on a chosen step).

        ``host``: the metadata's :meth:`~AttentionMetadata.host_counts` when the caller has
        them (the serving path passes the vote's); else the split takes them from the
        metadata's host mirrors, or reads them from the device in one copy.

        Raises:
            GraphRunnerError: no such bucket, the step does not fit it, or ``split`` for a
                bucket whose graph was not split.
        """
        self._load(tokens, input_ids, positions, attn_metadata, num_scheduled_tokens, split, host,
                   validated=False)

    def _load(self, tokens: int, input_ids: torch.Tensor, positions: torch.Tensor,
              attn_metadata: AttentionMetadata, num_scheduled_tokens: Sequence[int], split: bool,
              host: HostCounts | None, validated: bool) -> None:
        """:meth:`load_step`; ``validated``: the vote validated the metadata with ``host``."""
        b = self.graphs.get(tokens)
        n = int(input_ids.shape[0])
        if b is None or n > tokens:
            raise GraphRunnerError(f"step of {n} tokens does not fit a captured bucket "
                                   f"({tokens} not in {sorted(self.graphs)} or too small)")
        args = self._graph_args(b, input_ids, positions, attn_metadata)
        padded_args = pad_args(b.artifact.specs, args, n, tokens)
        if split:
            if b.split_args is None:
                raise GraphRunnerError(f"bucket {tokens} has no split graph (graph not split)")
            if host is None and "query_start_loc" in b.input_pos:
                host = attn_metadata.host_counts()
            per_ubatch = b.artifact.split_args(padded_args, list(num_scheduled_tokens), host=host,
                                               validated=validated)
            _copy_into(b.split_args, per_ubatch, *self._copy_plan(b, split=True))
        else:
            _copy_into(b.args, padded_args, *self._copy_plan(b, split=False))

    def _copy_plan(self, b: BucketGraphs, split: bool
                   ) -> tuple[Sequence[tuple[int, int | None]], Sequence[Any], list[int]]:
        """``_copy_into``'s ``inputs``, ``specs`` and ``positions`` for the unsplit graph of
        ``b`` or its split program: only the positions a step can change (the step's own
        inputs, token-indexed inputs, which are padded per step, and whatever is cut per
        ubatch); the others (weights, KV caches) are the captured objects themselves. Worked
        out once per bucket: a large model has hundreds of inputs."""
        key = (b.tokens, split)
        if key not in self._copy_plans:
            art = b.artifact
            step = set(b.input_pos.values()) | {s.index for s in art.specs if s.kind == "token"}
            if split:
                inputs = art.signature.inputs
                positions = [pos for pos, (index, ubatch) in enumerate(inputs)
                             if ubatch is not None or index in step]
            else:
                inputs = tuple((i, None) for i in range(len(b.args)))
                positions = sorted(step)
            self._copy_plans[key] = (inputs, art.specs, positions)
        return self._copy_plans[key]

    @staticmethod
    def _graph_args(b: BucketGraphs, ids: torch.Tensor, pos: torch.Tensor,
                    md: AttentionMetadata) -> list[Any]:
        args = list(b.args)
        named = {"input_ids": ids, "positions": pos, **md.tensors()}
        for name, i in b.input_pos.items():
            args[i] = named[name]
        valid = b.artifact.row_valid_index
        if valid is not None:  # every row of the step is real; the bucket's padding is not
            args[valid] = torch.ones(int(ids.shape[0]), dtype=torch.bool, device=ids.device)
        return args

    def _eager(self, reason: str, ids, pos, md, ctx) -> Any:
        if reason not in self._warned:
            self._warned.add(reason)
            log.warning("dbo graphs: step runs eagerly (no capture after warm-up): %s", reason)
        self.eager_steps += 1
        return run_step(self.compiled, ids, pos, md, **ctx, **self.model_kwargs)


def _parts(seconds: dict[str, float]) -> str:
    return ", ".join(f"{part} {seconds[part]:.2f} s" for part in WARMUP_PARTS if part in seconds)


def _is_int(value: Any) -> bool:
    try:
        operator.index(value)
        return True
    except TypeError:
        return False


def _timed(b: BucketGraphs, mode: str) -> list[str]:
    """The graphs of ``b`` whose times can change its choice (``split`` mode ``mode``): the
    split candidates, and with ``"auto"`` the unsplit graph; none where fewer than two remain."""
    names = [k for k in b.graphs if k != "unsplit" or mode == "auto"]
    return names if len(names) > 1 else []


def split_program_fn(program: Any, split_args: list[Any], art: CompiledArtifact,
                     tokens: int) -> Callable[[], Any]:
    """``program`` (a split schedule candidate of ``art``) as a zero-argument callable over the
    static per-ubatch inputs ``split_args`` (a bucket's ``BucketGraphs.split_args``); its
    outputs concatenated in ubatch order, token-indexed ones at the bucket's ``tokens`` rows:
    what the runner captures per candidate, and what the benchmarks time beside it."""
    outputs, specs = art.signature.outputs, art.output_specs
    return lambda: join_ubatch_outputs(program(*split_args), outputs, specs, tokens)


def _max_over_ranks(values: list[float]) -> list[float]:
    """Elementwise max over every rank of the job (the default group), not only the DP vote's
    group: the graphs' collectives may span other ranks (EP), which must replay the same
    schedule candidate."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=vote_device(dist.group.WORLD))
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


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


def _copy_into(static: list[Any], new: Sequence[Any], inputs: Sequence[tuple[int, int | None]],
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

