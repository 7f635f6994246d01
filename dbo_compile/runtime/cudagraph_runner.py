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
2. captures the **unsplit** program (with ``unsplit_overlap`` also ``"unsplit-overlap"``, the
   shared experts beside the dispatch) and, when the graph was split, the **split** (DBO)
   candidates (``schedule_candidates``, ``sm_carveout_candidates``) that can win at this bucket
   (with a calibration, those predicted within ``prune_margin`` of the best: :mod:`.prune`;
   else all) as one CUDA graph each, after warm-up calls on a side stream, every graph into one
   memory pool (:meth:`CudaGraphRunner.memory_report`); an optional graph that runs out of GPU
   memory or would pass ``graph_memory_budget`` is left out (why: ``stats``,
   :mod:`.graph_memory`); the unsplit graph's OOM is a ``GraphRunnerError``;
3. times the graphs by replay (``timing_iters`` each, interleaved rounds, median, CUDA events),
   takes the max over every rank (so the table is identical on every rank) and keeps the
   fastest split candidate, and ``"unsplit-overlap"`` where it beats the serial unsplit graph
   by ``min_gain``; with ``split="auto"`` the bucket splits only where that candidate beats the
   unsplit graph kept by ``min_gain`` (default 3 %: :data:`MIN_GAIN`). ``split="always"`` /
   ``"never"`` force it (``"never"`` captures no split graph). Only graphs whose time can change
   the choice are timed.

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
buffer it updates (a fold of token rows: Dynamo's graph keeps no padding row out of it);
programs that fold a float the model no longer holds (it changed after ``torch.compile`` traced it:
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
   captured request capacity (``bucket // num_ubatches`` requests; with ``max_num_reqs=M``
   ``min(bucket, M)`` unsplit and ``min(bucket // num_ubatches, M)`` per ubatch);
4. replay; the output rows of the real tokens are returned (**views of the graph's static
   output**: consume or copy them before the next step).

A step larger than the largest bucket, whose block table is wider than
``max_blocks_per_req``, or with more than ``max_num_reqs`` requests, runs eagerly through the
compiled model (logged once per reason), on every rank together (such a rank asks the vote for
one token past the largest bucket): a capture never happens after warm-up. So does a step
whose model holds another value of a number the graphs take as an input and bake in (a float
attribute under ``torch.compile(dynamic=True)``: a norm's eps, a rope scale), read again from
the model at every step (:mod:`~dbo_compile.runtime.numbers`): the eager path runs Dynamo's
graph with the new value.

Caveat: the timings are taken on synthetic one-token-context steps; with an attention kernel
whose cost grows with the context, long-context steps weigh attention more than measured.

Rules taken from the field: buckets of padded token counts, largest captured first and all
graphs in one pool (vLLM ``CUDAGraphRunner`` / ``cudagraph_capture_sizes``); FULL graphs of
the ubatched program with padding to the DP group's max (vLLM DBO); the decision to split from
measurement, not assumption (``docs/references.md``: over NVLink the split loses below ~8k
tokens/rank).
"""

from __future__ import annotations

import contextlib
import logging
import inspect
import time
from typing import Any, Callable, Sequence

import torch

from dbo_compile.candidates import UNSPLIT_GRAPHS, UNSPLIT_OVERLAP
from dbo_compile.errors import GraphRunnerError, UBatchExecutionError
from dbo_compile.metadata import AttentionMetadata, HostCounts
from dbo_compile.ops.comm import run_watched
from dbo_compile.runtime.artifact import CompiledArtifact
from dbo_compile.runtime.bucket_timing import decide, max_over_ranks, time_graphs, timed_graphs
from dbo_compile.runtime.buckets import (
    WARMUP_PARTS,
    BucketGraphs,
    OutputMap,
    bucket_stats,
    capture_qlens,
    check_artifact,
    copy_into,
    copy_plan,
    describe,
    dummy_step,
    graph_args,
    local_misfit,
    map_inputs,
    memory_report,
    split_capture_args,
    split_program_fn,
    warmup_text,
)
from dbo_compile.runtime.capture import EagerGraph, capture, state_kept
from dbo_compile.runtime.context import (
    record_calls,
    record_stage_calls,
    static_stages,
    step_context,
    traced_only,
    uncounted,
)
from dbo_compile.runtime.engine import run_step
from dbo_compile.runtime.graph_memory import capture_optional, oom_head, oom_in, unsplit_oom_error
from dbo_compile.runtime.numbers import InputNumbers, changed_numbers
from dbo_compile.runtime.padding import pad_args
from dbo_compile.runtime.prune import DEFAULT_PRUNE_MARGIN, agreed, artifact_predictor, plan
from dbo_compile.runtime.runner_args import (check_buckets, check_fractions, log_unchecked,
                                             positive_int)
from dbo_compile.runtime.vote import bucket_never_splits

log = logging.getLogger(__name__)

#: default ``min_gain``: a split candidate must beat the unsplit graph by 3 % at warm-up. On
#: one H200 (2026-12-01, emulated EP-16 / 64, decode 64) warm-up and later timings of the same
#: graphs differed by up to 3 %: splits chosen at 0.6 % / 1.0 % faster measured 1.6 % / 2.0 %
#: slower (``benchmarks/results/emulated_v2lite_worlds_pipelined_h200_2026-12-01.json``).
MIN_GAIN = 0.03

__all__ = ["BucketGraphs", "CudaGraphRunner", "EagerGraph", "GraphRunnerError", "OutputMap",
           "WARMUP_PARTS", "split_program_fn"]


class CudaGraphRunner:
    """Per-bucket FULL CUDA graphs of a ``backend="dbo"`` model (see the module docstring).

    Args:
        compiled: ``torch.compile(model, backend="dbo", ...)``; called as
            ``compiled(input_ids, positions, attn_metadata, **model_kwargs)``.
        buckets: padded token counts to capture (tokens per rank; each ``>= 1``). Bucket 1
            (a single decode request) is captured at 2 rows, the smallest the compiled graph
            takes (``run_step`` pads a 1-token step to 2 rows: Dynamo specialises sizes 0 and
            1), so it is bucket 2. A bucket that is not a multiple of ``num_ubatches``
            captures the unsplit graph only; a split step runs in the smallest bucket that
            holds it and is such a multiple.
        max_blocks_per_req: block-table width (KV blocks per request) of the static buffers.
        max_num_reqs: the most requests a step holds (the engine's bound: vLLM
            ``max_num_seqs``, SGLang ``max_running_requests``): each bucket's static request
            buffers (``query_start_loc``, ``seq_lens``, ``num_computed_tokens``, block-table
            rows) hold ``min(bucket, M)`` requests, each ubatch's of the split graph
            ``min(bucket // num_ubatches, M)`` (a step's requests may all fall into one
            ubatch), at least 2 (:func:`~.buckets.capture_qlens`); a step with more runs
            eagerly. ``None``: ``bucket`` (``bucket // num_ubatches``). Why: docs/serving.md.
        block_size: KV-cache block size (tokens), passed to the prefix-read veto; default the
            block size of the compiled graph's KV caches; where the model has ``kv_caches()``
            (allocated), it must be one of theirs.
        timing_iters: replays per graph and timing round at warm-up (3 rounds).
        vocab_size: when given, the synthetic warm-up steps carry random token ids below it
            (seeded, the same on every rank), so that MoE routing, and hence the timings the
            decision rests on, look like real traffic; default all zeros (every token routed
            alike); at most the rows of the model's token embedding, where it has one.
        keep_candidates: keep every split candidate's graph after the choice (benchmarks).
        static_buckets: buckets whose Inductor stages are compiled for the bucket's own shapes
            (as vLLM's ``compile_sizes``); every other bucket runs the stages compiled once
            with a symbolic token dim (``compute_backend="inductor"``;
            :class:`~dbo_compile.codegen.inductor.InductorStage`). Default none: on one H200
            the symbolic-size stages measured as fast as static ones (``docs/serving.md``).
        min_gain: with ``split="auto"``, the split graph is used for a bucket only when
            ``t_split <= (1 - min_gain) * t_unsplit`` (fraction, default :data:`MIN_GAIN`
            = 0.03: the warm-up timing's noise, so that a split chosen by a margin inside it
            never runs slower than the unsplit graph).
        prune_margin: time only the split candidates that can win (:mod:`~.prune`): with a
            calibration, the unsplit graph, the candidate the cost model predicts fastest at
            the bucket's token count and every one predicted within this fraction of it
            (default :data:`~.prune.DEFAULT_PRUNE_MARGIN` = 0.10) are captured and timed, and
            a bucket whose best split cannot win by ``min_gain`` even with the calibration's
            error is not split; ``None``: every candidate (as without a calibration).
        predictor: ``(artifact, tokens, candidates) -> BucketPrediction``, the predictions
            the pruning rests on (default the artifact's,
            :func:`dbo_compile.passes.predict.predict_bucket`, on ``device``: none
            off CUDA or on a GPU the calibration was not measured on; tests).
        device: where the synthetic warm-up step lives (default: the current CUDA device, else
            CPU, where graphs are replaced by eager re-runs).
        graph_memory_budget: bytes the shared graph pool may grow by for DBO's optional
            graphs (split candidates, ``"unsplit-overlap"``) over all buckets
            (``memory_report()``'s ``split_all``, dropped candidates included): once reached,
            the remaining ones are not captured (reason ``"memory budget"`` in ``stats``;
            checked before each capture: the one that crosses it is kept);
            ``None`` (default): no limit. Whatever the budget, an optional graph whose capture
            runs out of GPU memory is dropped (one WARNING per bucket) and the bucket chooses
            among the graphs captured. Off CUDA graphs hold no pool memory: no effect (said
            once).
        model_kwargs: extra keyword arguments of every model call: only keywords its forward
            takes (:func:`~.runner_args.check_model_kwargs`).

    ``block_size``, ``vocab_size`` and ``model_kwargs`` are checked against the model where
    one is found (an ``nn.Module`` with a KV cache, a token embedding, a readable forward); an
    argument that cannot be checked (a plain function as ``compiled``, a cache allocated
    later) is named, with why, in one INFO line of this module's logger.

    Raises:
        GraphRunnerError: bad buckets, ``max_blocks_per_req``, ``timing_iters``,
            ``max_num_reqs`` or ``graph_memory_budget`` (an int >= 1 or ``None``; not a
            bool), a
            ``block_size`` other than the model's KV cache's, a model keyword its forward does
            not take (a typo of a runner argument) or that is a step's own argument
            (``vetoes``, ``allow_split``), or a CUDA device without CUDA; at :meth:`capture`:
            what the module docstring lists.
    """

    def __init__(self, compiled: Callable[..., Any], buckets: Sequence[int], *,
                 max_blocks_per_req: int, max_num_reqs: int | None = None,
                 block_size: int | None = None, timing_iters: int = 10,
                 min_gain: float | None = None, device: torch.device | str | None = None,
                 vocab_size: int | None = None, keep_candidates: bool = False,
                 static_buckets: Sequence[int] = (),
                 prune_margin: float | None = DEFAULT_PRUNE_MARGIN,
                 predictor: Callable[..., Any] | None = None,
                 graph_memory_budget: int | None = None, **model_kwargs: Any):
        buckets, self.static_buckets = check_buckets(buckets, static_buckets)
        max_blocks_per_req = positive_int("max_blocks_per_req", max_blocks_per_req)
        self.max_num_reqs = positive_int("max_num_reqs", max_num_reqs, optional=True)
        timing_iters = positive_int("timing_iters", timing_iters)
        vocab_size = positive_int("vocab_size", vocab_size, optional=True)
        block_size = positive_int("block_size", block_size, optional=True)
        if isinstance(graph_memory_budget, float) and graph_memory_budget.is_integer():
            graph_memory_budget = int(graph_memory_budget)  # bytes written as 8e9
        self.graph_memory_budget = positive_int("graph_memory_budget (bytes)",
                                                graph_memory_budget, optional=True)
        self.min_gain, self.prune_margin = check_fractions(
            MIN_GAIN if min_gain is None else min_gain, prune_margin)
        log_unchecked(compiled, block_size, vocab_size, model_kwargs, _RUNNER_ARGS)
        self.compiled = compiled
        self.buckets = sorted(set(buckets))
        self.max_blocks_per_req = max_blocks_per_req
        self.block_size = block_size
        self.timing_iters = timing_iters
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.predictor = predictor or artifact_predictor(self.device)
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
    def _record(self, tokens: int, prefill: bool
                ) -> tuple[Any, list[Any], dict[str, int], OutputMap, tuple[Any, ...]]:
        """Run one synthetic step through the compiled model; its artifact, graph args, the
        positions of the step's inputs among them, where the model's outputs come from, and
        the step's ``(input_ids, positions, attn_metadata)``."""
        layout = None if prefill else capture_qlens(tokens, self.max_num_reqs)
        ids, pos, md, qlens = dummy_step(tokens, self.device, self.max_blocks_per_req,
                                         self.vocab_size, prefill, layout)
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
        return (art, list(args), map_inputs(args, ids, pos, md), OutputMap.of(ret, tokens),
                (ids, pos, md))

    def capture(self) -> dict[int, BucketGraphs]:
        """Capture and time every bucket (largest first). Call on every rank of the job, in
        step (the timings are maxed over all ranks, so that every rank picks the same graph).

        Returns:
            ``{bucket: BucketGraphs}`` (also ``self.graphs``).

        Raises:
            GraphRunnerError: the step runs several compiled graphs (graph breaks), or the
                compiled graph depends on the step's layout (Dynamo compiled another graph for
                a prefill-shaped step than for a decode-shaped one, e.g. on ``max_query_len``):
                a replayed graph would then ignore that dependence; a bucket's unsplit graph
                ran out of GPU memory at capture (raised from the ``torch.OutOfMemoryError``;
                the message says what the allocator held and what to do). A split candidate
                that runs out of memory is dropped instead (``stats["buckets"][b]["dropped"]``).
        """
        cuda = self.device.type == "cuda"
        if cuda and self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        self._copy_plans.clear()
        for tokens in sorted(self.buckets, reverse=True):
            static = static_stages() if tokens in self.static_buckets else contextlib.nullcontext()
            with record_stage_calls() as stage_kinds, static:
                self._capture_one(tokens, cuda)
            self.graphs[tokens].stage_kinds = dict(sorted(stage_kinds.items()))
            aten = [name for name, kind in stage_kinds.items() if kind == "aten"]
            if aten:
                log.warning("dbo graphs: bucket %d: %d compiled stage(s) run their traced ATen "
                            "ops, not Inductor's code (%s): see the warnings above for why",
                            tokens, len(aten), ", ".join(aten[:8]) + (" ..." if len(aten) > 8 else ""))
            log.info("dbo graphs: warm-up of bucket %d: %s", tokens,
                     warmup_text(self.graphs[tokens].warmup_s))
        log.info("dbo graphs: %s", self.describe())
        log.info("dbo graphs: warm-up %s", warmup_text(self.warmup_s()))
        return self.graphs

    def _capture_one(self, tokens: int, cuda: bool) -> None:
        """Record, capture, time and decide one bucket (into ``self.graphs[tokens]``)."""
        t0 = time.perf_counter()
        art, args, input_pos, out_map, step = self._record(tokens, prefill=False)
        t1 = time.perf_counter()
        if tokens >= 4:
            # only which graph Dynamo picks matters: Inductor stages run their traced
            # ATen ops for the probe's signatures, which no captured graph replays
            with traced_only():
                other = self._record(tokens, prefill=True)[0]
            if other is not art:
                raise GraphRunnerError(
                    f"bucket {tokens}: a prefill-shaped step ran another compiled graph than "
                    "a decode-shaped one (Dynamo specialised on the step's layout, e.g. "
                    "max_query_len or the request count); a replayed CUDA graph would "
                    "ignore that. Keep layout-dependent host values out of the model")
        check_artifact(art, tokens, args)
        # any step's arguments give the scope its number sources are read in: the recorded one
        numbers = InputNumbers(self.compiled, art.specs, args, step, self.model_kwargs)
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
            decide(bucket, self.min_gain, self.keep_candidates)
        bucket.warmup_s["total"] = time.perf_counter() - t0
        self.graphs[tokens] = bucket

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
        ``warmup_s`` by part, the graphs it captured and timed, its choice, how many of its
        Inductor stages run dynamic / static / ATen code (``stage_kinds``) and ``prune``
        (which split candidates were captured or pruned and why, :class:`~.prune.PrunePlan`),
        per bucket (``buckets``), ``eager_steps`` (steps that fit no bucket since) and
        ``memory`` (:meth:`memory_report`)."""
        return {
            "warmup_s": self.warmup_s(),
            "buckets": bucket_stats(self.graphs),
            "eager_steps": self.eager_steps,
            "memory": self.memory_report(),
        }

    def memory_report(self) -> dict[str, Any]:
        """CUDA-graph memory of the captured set per bucket, unsplit vs split graphs (bytes;
        ``None`` off CUDA): :func:`~.buckets.memory_report`."""
        return memory_report(self.graphs, self.device.type == "cuda")

    def _capture_bucket(self, b: BucketGraphs, cuda: bool) -> None:
        art = b.artifact
        earlier = list(self.graphs.values())
        try:
            self._graph(b, "unsplit", lambda: run_watched(art.unsplit, *b.args), cuda)
        except Exception as e:  # noqa: BLE001 - an OOM, or an error an OOM caused
            oom = oom_in(e)
            if oom is None:
                raise
            raise unsplit_oom_error(b, oom, cuda, earlier) from e
        # DBO's optional graphs: dropped where they do not fit (:mod:`.graph_memory`)
        optional: list[tuple[str, Callable[[], Any] | str]] = []
        if art.unsplit_overlap is not None:  # the same inputs, outputs and collectives
            optional.append((UNSPLIT_OVERLAP,
                             lambda: run_watched(art.unsplit_overlap, *b.args)))
        # no step of this bucket can split (the vote's own rules): no split graph
        if art.is_split and bucket_never_splits(b.tokens, art.config) is None:
            names = list(art.candidates)
            prediction = (None if self.prune_margin is None
                          else agreed(self.predictor(art, b.tokens, names), names, max_over_ranks))
            b.prune = plan(names, prediction, margin=self.prune_margin, min_gain=self.min_gain,
                           mode=art.config.split)
            inputs_oom = None
            if b.prune.timed:
                try:
                    b.split_args = split_capture_args(b, self.max_num_reqs, self.device,
                                                      self.max_blocks_per_req, self.vocab_size)
                except torch.OutOfMemoryError as e:
                    inputs_oom = (f"bucket {b.tokens}: the split graphs' static per-ubatch inputs "
                                  f"ran out of GPU memory ({oom_head(e)})")
            for name in b.prune.timed:
                optional.append((name, inputs_oom or split_program_fn(
                    art.candidates[name], b.split_args, art, b.tokens)))
        capture_optional(b, optional, self._graph, cuda=cuda, budget=self.graph_memory_budget,
                         earlier=earlier, over_ranks=max_over_ranks, warned=self._warned)
        if not any(k not in UNSPLIT_GRAPHS for k in b.graphs):
            b.split_args = None  # no split graph left to read them
        t0 = time.perf_counter()
        b.times_us = self._time(b, timed_graphs(b, art.config.split))
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
        b.graph_bytes[name] = int(times["pool_bytes"]) if cuda else None
        for part, key in (("warmup_runs", "warmup_s"), ("capture", "capture_s")):
            b.warmup_s[part] = b.warmup_s.get(part, 0.0) + times[key]

    def _time(self, b: BucketGraphs, names: Sequence[str]) -> dict[str, float]:
        """Replay time of the graphs ``names`` of ``b`` (µs): :func:`.bucket_timing.time_graphs`."""
        return time_graphs(b, names, self.timing_iters, self.device.type == "cuda")

    def describe(self) -> str:
        """One line per bucket: times and the choice."""
        return describe(self.graphs)

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
            num_scheduled_tokens: tokens per request (host ints); more than ``max_num_reqs``
                requests: the step runs eagerly.
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
        real_args = graph_args(largest, input_ids, positions, attn_metadata)
        # the graphs bake in the numbers the model held at capture (the vote's artifact sees
        # the captured ones in real_args): one that changed sends the step down the eager path
        changed = changed_numbers(self.graphs, (input_ids, positions, attn_metadata),
                                  self.model_kwargs)
        misfit = local_misfit(n, int(attn_metadata.block_table.shape[1]),
                              len(ctx["num_scheduled_tokens"]), changed, self.buckets[-1],
                              self.max_blocks_per_req, self.max_num_reqs)
        # a step that fits no graph on *this* rank asks for one token past the largest bucket,
        # so that the vote sends every rank down the eager path together (never a hang)
        min_padded = 0 if misfit is None else self.buckets[-1] + 1
        with step_context(**ctx):
            # the runner pads into its own buffers: a static graph's fixed size does not apply
            decision = largest.artifact.decide_step(
                real_args, min_padded=min_padded, metadata=attn_metadata, pads_itself=True)
        vote = decision.vote
        # no vote (a graph without collectives): this rank alone decides
        padded = max(n, min_padded) if vote is None else vote.num_tokens_padded
        # a split step (padded to a multiple of num_ubatches) runs where a split graph is
        split_step, n_ub = decision.should_split, largest.artifact.config.num_ubatches
        tokens = next((t for t in self.buckets
                       if t >= padded and (not split_step or t % n_ub == 0)), None)
        if tokens is None:
            if split_step and padded <= self.buckets[-1]:
                reason = (f"the split step of {padded} tokens fits no bucket that is a multiple "
                          f"of num_ubatches={n_ub} (buckets {self.buckets})")
            else:
                reason = misfit or (
                    f"the DP vote padded the step to {padded} tokens (> largest bucket "
                    f"{self.buckets[-1]}): another rank's step fits no captured graph, or its "
                    "model changed a number the graphs bake in")
            self.last_choice, self.last_graph = ("eager", reason), None
            return self._eager(reason, input_ids, positions, attn_metadata, ctx)
        b = self.graphs[tokens]
        split = decision.should_split and b.use_split
        self.last_choice = (tokens, "split" if split else "unsplit")
        name = b.choice if split else b.unsplit_choice
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
        ids, pos, md, qlens = dummy_step(0, self.device, self.max_blocks_per_req,
                                         self.vocab_size)
        self._load(b.tokens, ids, pos, md, qlens, split, None, validated=False)
        with state_kept([b.args[i] for i in b.artifact.state_inputs]):
            b.graphs[name].replay()

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
        args = graph_args(b, input_ids, positions, attn_metadata)
        padded_args = pad_args(b.artifact.specs, args, n, tokens)
        if split:
            if b.split_args is None:
                raise GraphRunnerError(f"bucket {tokens} has no split graph (graph not split)")
            if host is None and "query_start_loc" in b.input_pos:
                host = attn_metadata.host_counts()
            per_ubatch = b.artifact.split_args(padded_args, list(num_scheduled_tokens), host=host,
                                               validated=validated)
            copy_into(b.split_args, per_ubatch, *self._copy_plan(b, split=True))
        else:
            copy_into(b.args, padded_args, *self._copy_plan(b, split=False))

    def _copy_plan(self, b: BucketGraphs, split: bool
                   ) -> tuple[Sequence[tuple[int, int | None]], Sequence[Any], list[int]]:
        """:func:`~.buckets.copy_plan` of ``b``, worked out once per bucket and kind of graph:
        a large model has hundreds of inputs."""
        key = (b.tokens, split)
        if key not in self._copy_plans:
            self._copy_plans[key] = copy_plan(b, split)
        return self._copy_plans[key]

    def _eager(self, reason: str, ids, pos, md, ctx) -> Any:
        if reason not in self._warned:
            self._warned.add(reason)
            log.warning("dbo graphs: step runs eagerly (no capture after warm-up): %s", reason)
        self.eager_steps += 1
        return run_step(self.compiled, ids, pos, md, **ctx, **self.model_kwargs)


#: the runner's own argument names (a model keyword close to one is suggested as its typo)
_RUNNER_ARGS = tuple(n for n in inspect.signature(CudaGraphRunner.__init__).parameters
                     if n not in ("self", "model_kwargs"))
