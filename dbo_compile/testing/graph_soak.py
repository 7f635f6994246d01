"""The soak of the CUDA-graph runner on one GPU: random steps of an emulated EP world served
by :class:`~dbo_compile.runtime.cudagraph_runner.CudaGraphRunner`, checked against the
one-device reference.

One process (spawned, so that a hang is counted, not waited for) holds rank 0 of an emulated
EP-``W`` world (``comm_backend="emulated"``, :mod:`dbo_compile.ops.emulated`: the model
holds ``E / W`` experts, the remote share of every dispatch and combine crosses the link),
compiled with ``split="always"`` (so that every step of two or more tokens the vote lets
split replays a split graph) and captured per bucket by the runner. Its reference is
``model.emulated_reference()`` (all ``E`` experts, the ``local`` backend, eager, on the
step's real rows). Both count their routing into an expert-load counter
(:func:`~dbo_compile.testing.faults.count_expert_load`, a state buffer the captured graphs
update in place).

Per step, drawn from the seed as the multi-rank soak's (:mod:`dbo_compile.testing.soak`,
one rank): with probability ``p_split`` a step aimed at a split (at least 2 tokens, no veto,
no shared prefix); else a free step: a token count (mass on 0, 1, 2, 3, every bucket and
its neighbours and one past the largest bucket, which runs eagerly; else uniform up to a
little past the largest bucket), a request mix, a shared prefix (``p_share``: the
prefix-read veto), an engine veto (``p_veto``), a block table wider than the runner's
(``p_wide``: eagerly). No
failures are injected: any error is counted as a wrong output. The buckets hold 1 (a single
decode request: CudaGraphRunner captures it at 2 rows, the compiled graph's smallest) and an
odd bucket (unsplit graph only: a split step runs in the next even bucket).

Checked at **every** step: the step ran the graph and bucket it must (the smallest bucket
that holds it; split unless vetoed or below 2 tokens; eagerly when it fits no bucket), the
output is finite, the expert-load counter (zeroed before the step) holds exactly
``tokens * top_k * MoE layers`` counts (no padding row counted, none lost), and the KV cache
changed at the step's written slots only (bitwise elsewhere:
:func:`~dbo_compile.testing.soak.check_kv_writes` against a copy taken before the step).
Every ``check_every``-th step also runs the reference on that copy: the output, the
counter per expert and the written KV slots must match it. Two computations of the same
step with other row counts and kernels differ in the last bits, and a token whose two best
experts' gate logits lie that close (its routing margin,
:func:`~dbo_compile.testing.faults.routing_margins`) may be routed to another expert: where
the counters differ, the requests of the tokens whose margin is below ``tie_tol`` (and, in
a shared-prefix step, the whole step) are excused from the comparison (counted:
``routing_flip_steps``, ``excused_rows``) and the counters may differ by those tokens'
slots only; a difference without such a token is a wrong output. Before the first step,
``capture()`` must have left the counter and the KV cache as they were
(``capture_changed_state``).

A step that does not end within ``step_timeout_s`` dumps every thread's stack and ends the
process: a hang. :func:`run_graph_soak` returns the counts; ``python benchmarks/soak.py
--gpu`` is its command line.
"""

from __future__ import annotations

import collections
import faulthandler
import random
import sys
import time
from typing import Any, NamedTuple

import torch

from dbo_compile.errors import DboError, MultirankError
from dbo_compile.models.batch import Step, make_step
from dbo_compile.models.deepseek import DeepseekMoEModel, get_config
from dbo_compile.runtime.cudagraph_runner import CudaGraphRunner
from dbo_compile.testing import faults, soak
from dbo_compile.testing.multirank import run_multirank

__all__ = ["SIZES", "TOLERANCES", "GraphSoak", "graph_soak_rank", "run_graph_soak"]

#: the model (``get_config`` preset and overrides), the emulated world size and the buckets
#: of each size: ``"gpu"``, DeepSeek-V2-Lite's routing (64 experts, top-6, 2 shared) at a
#: reduced width, 4 layers; ``"cpu"``, a tiny model for the CPU test of the same code path
SIZES: dict[str, dict[str, Any]] = {
    "gpu": {"preset": "deepseek-v2-lite", "world_size": 8, "buckets": (1, 4, 16, 33, 64, 256),
            "overrides": {"num_layers": 4, "vocab_size": 4096, "first_k_dense_replace": 0,
                          "hidden_size": 1024, "moe_intermediate_size": 512, "num_heads": 8,
                          "num_kv_heads": 8}},
    "cpu": {"preset": "tiny", "world_size": 8, "buckets": (1, 4, 16, 32),
            "overrides": {"num_layers": 2, "num_experts": 16, "top_k": 3}},
}
#: per dtype: ``tol``, the largest difference from the reference (relative to the
#: reference's largest magnitude, of the output or of the written KV values); ``tie_tol``,
#: the routing margin (gate logits) below which a token may route otherwise
TOLERANCES = {"float32": {"tol": 1e-3, "tie_tol": 1e-3},
              "bfloat16": {"tol": 5e-2, "tie_tol": 5e-2}}
_BLOCK = 16
_MAX_CONTEXT = 120
#: block-table width of the runner's static buffers (a context up to 127 tokens and a
#: query up to 48 fit; a wider table runs eagerly)
_MAX_BLOCKS = 8


class _Record(NamedTuple):
    """One step (pickled back to the parent); the ``ok_*`` of the reference's checks are
    ``None`` where it did not run."""

    kind: str  # "free", "decode", "prefill" (soak.content_key)
    tokens: int
    vetoed: bool
    shared: bool
    wide: bool
    graph: str  # "split", "unsplit" or "eager" ("" when the step raised)
    bucket: int  # the bucket replayed (0: eager)
    checked: bool
    err: str
    ok_decision: bool | None  # the graph and bucket the step must take
    finite: bool | None
    load_total_ok: bool | None
    untouched: bool | None  # the KV cache changed at the written slots only
    ok_out: bool | None
    ok_load: bool | None
    ok_kv: bool | None
    flip: bool
    excused_rows: int


def _marks(buckets: tuple[int, ...]) -> list[int]:
    out = {0, 1, 2, 3, buckets[-1] + 1}
    for b in buckets:
        out |= {b - 1, b, b + 1}
    return sorted(out)


def _wide_step(cfg: Any, rng: random.Random, num_blocks: int, seed: int) -> Step:
    """A decode (with a few more) whose block table is wider than the runner's."""
    ctx = _MAX_BLOCKS * _BLOCK + rng.randint(0, 31)
    return make_step(cfg, decode_context_lens=[ctx] + [rng.randint(1, 60)
                                                       for _ in range(rng.randint(0, 3))],
                     prefills=[], block_size=_BLOCK, num_blocks=num_blocks, seed=seed)


def _excused(step: Step, margins: torch.Tensor, tie_tol: float, shared: bool) -> torch.Tensor:
    """``[tokens]`` bool: the tokens of the requests that hold a token routed by a hair (the
    reference's margin below ``tie_tol``); every token of a shared-prefix step that has one
    (a reader reads its writer's KV)."""
    near = (margins < tie_tol).cpu()
    qlens = torch.tensor(step.num_scheduled_tokens, dtype=torch.int64)
    req = torch.repeat_interleave(torch.arange(len(qlens)), qlens)
    if shared and bool(near.any()):
        return torch.ones_like(near)
    return torch.isin(req, req[near])


class GraphSoak:
    """The soak's model, reference and captured runner (module docstring), and its steps.

    Args:
        size: a key of :data:`SIZES` (``"gpu"`` on the current CUDA device, ``"cpu"``).
        dtype_name: a key of :data:`TOLERANCES`.
        seed: the weights, the KV cache's first contents and every step's draws.
        compute_backend: the ``compute_backend`` option.

    Attributes:
        capture_s: seconds of ``capture()``.
        capture_changed_state: the state ``capture()`` changed (``"expert_load"``,
            ``"kv_cache[i]"``); it is put back before the first step.
    """

    def __init__(self, size: str, dtype_name: str = "float32", seed: int = 0,
                 compute_backend: str = "aten"):
        self.cuda = size == "gpu"
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.cuda else (
            torch.device("cpu"))
        if self.cuda:
            torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32: TOLERANCES
            torch.backends.cudnn.allow_tf32 = False
        spec = SIZES[size]
        self.tol = TOLERANCES[dtype_name]
        self.seed = seed
        w, self.buckets = spec["world_size"], tuple(spec["buckets"])
        self.cfg = cfg = get_config(spec["preset"], **spec["overrides"])
        # a few steps past the largest bucket run eagerly
        self.max_tokens = self.buckets[-1] + max(2, self.buckets[-1] // 32)
        self.num_blocks = self.max_tokens * _MAX_BLOCKS + 64
        self.marks = _marks(self.buckets)
        self.model = model = DeepseekMoEModel(cfg, dtype=getattr(torch, dtype_name),
                                              device=self.device, seed=seed,
                                              emulated_world_size=w)
        faults.count_expert_load(model)
        model.allocate_kv_cache(self.num_blocks, _BLOCK)
        for c, base in zip(model.kv_caches(), soak.pristine_caches(model, seed)):
            c.copy_(base)
        self.ref = model.emulated_reference()  # its caches: copies of the model's
        faults.count_expert_load(self.ref, record_margins=True)
        self.slots_per_token = cfg.top_k * cfg.num_moe_layers
        compiled = torch.compile(model, backend="dbo", options={
            "split": "always", "comm_backend": "emulated",
            "comm_backend_options": {"world_size": w}, "compute_backend": compute_backend})
        self.runner = CudaGraphRunner(compiled, self.buckets, max_blocks_per_req=_MAX_BLOCKS,
                                      block_size=_BLOCK, vocab_size=cfg.vocab_size,
                                      timing_iters=3 if self.cuda else 1, device=self.device)
        self.buckets = tuple(self.runner.buckets)  # as served: bucket 1 is the graph of 2 rows
        state = {"expert_load": model.expert_load,
                 **{f"kv_cache[{i}]": c for i, c in enumerate(model.kv_caches())}}
        before = {name: t.clone() for name, t in state.items()}
        t0 = time.perf_counter()
        with torch.no_grad():
            self.runner.capture()
        self.capture_s = time.perf_counter() - t0
        self.capture_changed_state = [name for name, t in state.items()
                                      if not torch.equal(t, before[name])]
        for name, t in state.items():
            t.copy_(before[name])

    def draw(self, i: int, p_split: float, p_veto: float, p_share: float, p_wide: float
             ) -> tuple[Step, str, bool, bool, bool]:
        """Step ``i``: ``(step on the device with host mirrors, kind, vetoed, shared,
        wide)``."""
        plan = soak.draw_plan(self.seed, i, 1, p_split, 0.0)
        rng = random.Random(f"graph/{self.seed}/{i}")
        kind = soak.content_key(plan, rng, i, None)[0]
        free = kind == "free"
        vetoed = free and rng.random() < p_veto
        wide = free and rng.random() < p_wide
        if wide:
            step, shared = _wide_step(self.cfg, rng, self.num_blocks, seed=i), False
        else:
            step, shared = soak.draw_rank_step(
                self.cfg, (kind, i), rng, max_tokens=self.max_tokens, thresholds=(2, 2),
                marks=self.marks, p_share=p_share, num_blocks=self.num_blocks, seed=i,
                max_context=_MAX_CONTEXT)
        step = Step(step.input_ids, step.positions, step.attn_metadata.with_host_mirrors(),
                    step.num_scheduled_tokens, step.context_lens, step.block_size,
                    step.num_blocks).to(self.device)
        return step, kind, vetoed, shared, wide

    def step(self, step: Step, kind: str, vetoed: bool, shared: bool, wide: bool,
             checked: bool) -> _Record:
        """Serve ``step`` through the runner and check it (module docstring)."""
        model, ref = self.model, self.ref
        caches, ref_caches = model.kv_caches(), ref.kv_caches()
        for r, c in zip(ref_caches, caches):
            r.copy_(c)  # the state before the step: the reference's input, the check's base
        model.expert_load.zero_()
        n = step.num_tokens
        try:
            with torch.no_grad():
                out = self.runner(step.input_ids, step.positions, step.attn_metadata,
                                  step.num_scheduled_tokens,
                                  vetoes=[soak.soak_veto] if vetoed else ()).clone()
        except Exception as e:  # noqa: BLE001 - no failure is injected: any error is wrong
            err = f"{type(e).__name__}: {e}" if isinstance(e, DboError) else (
                f"FOREIGN {type(e).__name__}: {e}")
            for c, r in zip(caches, ref_caches):
                c.copy_(r)
            return _Record(kind, n, vetoed, shared, wide, "", 0, checked, err[:300], None,
                           None, None, None, None, None, None, False, 0)
        last = self.runner.last_choice
        graph, bucket = ("eager", 0) if last[0] == "eager" else (last[1], int(last[0]))
        ok_decision = (graph, bucket) == _expected_graph(n, self.buckets, vetoed, shared, wide)
        slots = soak.written_slots(step)
        finite = bool(torch.isfinite(out).all())
        load = model.expert_load.clone()
        load_total_ok = float(load.sum()) == n * self.slots_per_token
        ok_out = ok_load = None
        flip, excused_rows = False, 0
        expected = keep = None
        atol = 0.0
        if checked:
            ref.expert_load.zero_()
            with torch.no_grad():
                want = ref(step.input_ids, step.positions, step.attn_metadata).float()
            expected = soak.gather_writes(ref_caches, slots)
            diff = float((load - ref.expert_load).abs().sum()) / 2
            keep_rows = torch.ones(n, dtype=torch.bool)
            if diff:
                flip = True
                keep_rows = ~_excused(step, faults.routing_margins(ref), self.tol["tie_tol"],
                                      shared)
                excused_rows = int((~keep_rows).sum())
            ok_load = load_total_ok and diff <= excused_rows * self.slots_per_token
            rows = keep_rows.to(out.device)
            scale = float(want.abs().max()) if want.numel() else 0.0
            ok_out = out.shape == want.shape and (
                not bool(rows.any()) or float((out.float()[rows] - want[rows]).abs().max())
                <= self.tol["tol"] * max(scale, 1e-6))
            keep = keep_rows[step.attn_metadata.slot_mapping_cpu[:n] >= 0].to(slots.device)
            kv_scale = max((float(e.abs().max()) for e in expected if e.numel()), default=0.0)
            atol = self.tol["tol"] * max(kv_scale, 1e-6)
        ok_kv, untouched = soak.check_kv_writes(caches, ref_caches, slots, expected, atol=atol,
                                                keep=keep)
        if not untouched:
            for c, r in zip(caches, ref_caches):
                c.copy_(r)
        return _Record(kind, n, vetoed, shared, wide, graph, bucket, checked, "", ok_decision,
                       finite, load_total_ok, untouched, ok_out, ok_load, ok_kv, flip,
                       excused_rows)


def graph_soak_rank(rank: int, world_size: int, steps: int, seed: int, size: str,
                    dtype_name: str, check_every: int, p_split: float, p_veto: float,
                    p_share: float, p_wide: float, step_timeout_s: float,
                    budget_s: float | None, compute_backend: str) -> dict:
    """The soak (module docstring) in this process (a one-rank job of
    :func:`~dbo_compile.testing.multirank.run_multirank`): per step a :class:`_Record`, the
    capture's figures and what it changed. ``budget_s``: stop stepping after that many
    seconds."""
    if size == "gpu":
        torch.cuda.set_device(0)
    faulthandler.dump_traceback_later(10 * step_timeout_s, exit=True)  # build and capture
    soaked = GraphSoak(size, dtype_name, seed, compute_backend)
    records = []
    t0 = time.perf_counter()
    for i in range(steps):
        if budget_s is not None and time.perf_counter() - t0 > budget_s:
            break
        faulthandler.dump_traceback_later(step_timeout_s, exit=True)
        if i and i % 1000 == 0:
            print(f"graph soak: step {i}/{steps}, {(time.perf_counter() - t0) / i * 1e3:.1f} "
                  "ms/step", file=sys.stderr, flush=True)
        drawn = soaked.draw(i, p_split, p_veto, p_share, p_wide)
        records.append(soaked.step(*drawn, checked=i % check_every == 0))
    faulthandler.cancel_dump_traceback_later()
    return {"records": records, "seconds": time.perf_counter() - t0,
            "capture_s": soaked.capture_s,
            "capture_changed_state": soaked.capture_changed_state,
            "stats": soaked.runner.stats,
            "device": torch.cuda.get_device_name() if soaked.cuda else "cpu",
            "torch": torch.__version__}


def _expected_graph(n: int, buckets: tuple[int, ...], vetoed: bool, shared: bool,
                    wide: bool) -> tuple[str, int]:
    """The graph and bucket a step of ``n`` tokens must run (``split="always"``): eagerly
    when it fits no bucket (too many tokens, too wide a block table); split when it has two
    tokens or more and nothing vetoes it (an engine veto, a prefix read), padded to an even
    count; the smallest bucket that holds it (``buckets`` as the runner serves them: bucket 1
    is its graph of 2 rows), an even one for a split step."""
    if n > buckets[-1] or wide:
        return "eager", 0
    split = n >= 2 and not vetoed and not shared
    need = n + n % 2 if split else n
    return ("split" if split else "unsplit"), min(
        b for b in buckets if b >= need and (not split or b % 2 == 0))


def run_graph_soak(steps: int, seed: int = 0, size: str = "gpu", dtype: str = "float32",
                   check_every: int = 10, p_split: float = 0.7, p_veto: float = 0.1,
                   p_share: float = 0.2, p_wide: float = 0.01, step_timeout_s: float = 60.0,
                   budget_s: float | None = None, compute_backend: str = "aten",
                   timeout_s: float | None = None) -> dict:
    """Run the soak (module docstring) in a spawned process; the counts (a dict, printable
    as JSON): ``steps`` (``steps_planned``: asked for; fewer when ``budget_s`` seconds of
    stepping ran out), ``checked`` (against the reference), the steps by graph
    (``split_replays, unsplit_replays, eager_steps``) and by bucket (``by_bucket``), by kind
    (``zero_token_steps, one_token_steps, vetoes, prefix_shared, wide_tables,
    aimed_at_split``), ``routing_flip_steps, excused_rows``, ``hangs, errors,
    wrong_outputs`` (the steps that failed a check: ``failed_checks`` by check),
    ``capture_changed_state``, ``capture_s``, ``seconds`` (stepping), ``steps_per_s``, and
    ``examples`` of failed steps.

    Raises:
        ValueError: ``size`` or ``dtype`` unknown, or ``check_every < 1``.
    """
    if size not in SIZES or dtype not in TOLERANCES or check_every < 1:
        raise ValueError(f"size must be one of {sorted(SIZES)}, dtype one of "
                         f"{sorted(TOLERANCES)} and check_every >= 1; got {size!r}, "
                         f"{dtype!r}, {check_every}")
    timeout_s = timeout_s or 15 * step_timeout_s + (budget_s or steps * 1.0)
    counts: dict[str, Any] = dict(
        size=size, dtype=dtype, world_size=SIZES[size]["world_size"],
        buckets=list(SIZES[size]["buckets"]), compute_backend=compute_backend,
        steps=0, steps_planned=steps, seed=seed, check_every=check_every, checked=0,
        split_replays=0, unsplit_replays=0, eager_steps=0, by_bucket={}, zero_token_steps=0,
        one_token_steps=0, vetoes=0, prefix_shared=0, wide_tables=0, aimed_at_split=0,
        routing_flip_steps=0, excused_rows=0, hangs=0, errors=0, wrong_outputs=0,
        failed_checks={}, capture_changed_state=[], examples=[])
    try:
        (result,) = run_multirank(graph_soak_rank, 1, timeout_s=timeout_s, args=(
            steps, seed, size, dtype, check_every, p_split, p_veto, p_share, p_wide,
            step_timeout_s, budget_s, compute_backend))
    except MultirankError as e:
        text = str(e)
        counts["hangs"] = int("still running" in text or "exit code 1)" in text)
        counts["error"] = text[:3000]
        return counts
    records = result["records"]
    counts.update(steps=len(records), capture_s=round(result["capture_s"], 1),
                  capture_changed_state=result["capture_changed_state"],
                  device=result["device"], torch=result["torch"],
                  seconds=round(result["seconds"], 1),
                  steps_per_s=round(len(records) / max(result["seconds"], 1e-9), 1),
                  runner_warmup_s={k: round(v, 2)
                                   for k, v in result["stats"]["warmup_s"].items()})
    failed: collections.Counter = collections.Counter()
    for i, r in enumerate(records):
        counts["checked"] += r.checked
        counts["zero_token_steps"] += r.tokens == 0
        counts["one_token_steps"] += r.tokens == 1
        counts["vetoes"] += r.vetoed
        counts["prefix_shared"] += r.shared
        counts["wide_tables"] += r.wide
        counts["aimed_at_split"] += r.kind != "free"
        counts["routing_flip_steps"] += r.flip
        counts["excused_rows"] += r.excused_rows
        if r.err:
            counts["errors"] += 1
            bad = ["error"]
        else:
            counts[{"split": "split_replays", "unsplit": "unsplit_replays",
                    "eager": "eager_steps"}[r.graph]] += 1
            if r.bucket:
                counts["by_bucket"][str(r.bucket)] = counts["by_bucket"].get(str(r.bucket), 0) + 1
            bad = [name for name, ok in (("decision", r.ok_decision), ("finite", r.finite),
                                         ("load_total", r.load_total_ok),
                                         ("kv_untouched", r.untouched), ("output", r.ok_out),
                                         ("load", r.ok_load), ("kv_writes", r.ok_kv))
                   if ok is False]
        failed.update(bad)
        counts["wrong_outputs"] += bool(bad)
        if bad and len(counts["examples"]) < 5:
            counts["examples"].append({"step": i, "failed": bad, **r._asdict()})
    counts["failed_checks"] = dict(failed)
    counts["split_share"] = round(counts["split_replays"] / max(len(records), 1), 3)
    return counts
