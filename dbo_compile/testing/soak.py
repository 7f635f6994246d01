"""The soak: random steps over several Gloo ranks, every rank's outcome checked.

Each rank runs the same model (:class:`~dbo_compile.testing.faults.FaultyMoEModel` with an
EPLB-style expert-load counter, experts sharded over the ranks) compiled with
``backend="dbo"``, through :func:`~dbo_compile.runtime.engine.run_step`, for ``steps`` steps.
Per step, drawn from the seed (:func:`draw_plan`, :func:`draw_rank_step`):

- for the group: with probability ``p_split`` the step is **aimed at a split**: every rank
  draws a step the vote splits (at or past the token threshold, no veto, no shared prefix;
  half of them uniform decode on every rank, at the decode threshold, the others at the
  prefill threshold), so that the split programs, and not only the unsplit one, are what the
  soak mostly runs (the split share is counted: ``split_share``); the other steps are drawn
  freely and mostly run unsplit;
- per rank, in a free step: its token count (mass on 0 (an idle rank), 1, 2 and the
  thresholds +- 1, else uniform up to ``max_tokens``), a request mix (decodes, chunked
  prefills, fresh prompts), with probability ``p_share`` a request reading as cached prefix
  blocks another one writes this step (the prefix-read veto's case), with probability
  ``p_veto`` an engine veto;
- for the group, in any step: with probability ``p_fail`` an injected failure on one rank,
  at a random site (:data:`~dbo_compile.testing.faults.SITES`) and ubatch.

Checked on every rank against a reference (the same model with every expert local, eager, on
the rank's real rows: no padding, no collective): the outputs, the expert-load counter
(bitwise) and the KV cache, unless the step raised; a step that raised must raise the same
project error on every rank (type and message, less the failing rank's own
``"; this rank: ..."``), caused on the failing rank by the injected failure. The ranks'
decisions (split, padded count) must agree. A hang is a rank still running past the limit
(a per-step watchdog, ``step_timeout_s``, dumps every thread's stack to stderr and
ends the rank: a hang is found within that time, whatever the job's own limit).

The KV cache starts every step from the same random contents (``pristine``, drawn once): a
step's check compares the slots it wrote with the reference's (within ``1e-4``) and requires
every other slot to be unchanged (:func:`check_kv_writes`, which also puts the written slots
back). A step's contexts are therefore a function of its own metadata, and so is its
reference: each rank draws its steps from ``contents`` step contents per kind (free, aimed
at a decode split, aimed at a prefill split; :func:`content_key`) and computes a content's
reference once, at its first use (``contents=None``: a new content every step). The group's
step is new every time (the other ranks' contents, the padding to the group's count, the
split point, vetoes, failures). The reference cost a third of a step's CPU time; reused, a
few per cent (``cpu_ms_per_step``: ``draw``, the content and a new one's reference,
``step``, ``check``).

:func:`run_soak` runs it and returns the counts; ``benchmarks/soak.py`` is its command line;
:mod:`dbo_compile.testing.graph_soak` is the one-GPU soak of the CUDA-graph runner.
"""

from __future__ import annotations

import faulthandler
import hashlib
import random
import sys
import time
import zlib
from typing import Any, NamedTuple, Sequence

import torch
import torch.distributed as dist

from dbo_compile.errors import DboError, MultirankError
from dbo_compile.models.batch import Step, make_step
from dbo_compile.models.deepseek import get_config
from dbo_compile.runtime.context import last_called
from dbo_compile.runtime.engine import run_step
from dbo_compile.testing import faults
from dbo_compile.testing.multirank import run_multirank

__all__ = ["PARTS", "SOAK_OPTIONS", "Plan", "check_kv_writes", "content_key", "draw_plan",
           "draw_rank_step", "gather_writes", "pristine_caches", "reason_kind", "run_soak",
           "soak_rank", "soak_veto", "written_slots"]

#: thresholds low enough that CPU-sized steps split often
SOAK_OPTIONS = {"decode_token_threshold": 8, "prefill_token_threshold": 24,
                "schedule_candidates": False}
_BLOCK = 16
_NUM_BLOCKS = 1024
#: the parts of a rank's step whose CPU time the soak reports (``cpu_ms_per_step``)
PARTS = ("draw", "step", "check")


class Plan(NamedTuple):
    """The group's draw for one step (the same on every rank).

    Attributes:
        aim_split: every rank draws a step the vote splits (module docstring).
        decode_only: (aimed steps) every rank draws decodes only (the decode threshold).
        fail: a failure is injected on rank ``fail_rank`` at ``site``, in its ``call``-th run
            (the ubatch, in a split step).
    """

    aim_split: bool
    decode_only: bool
    fail: bool
    fail_rank: int
    site: str
    call: int


def draw_plan(seed: int, i: int, world_size: int, p_split: float, p_fail: float) -> Plan:
    """The group's draw for step ``i`` (a function of ``seed`` and ``i`` only: every rank
    draws the same)."""
    rng = random.Random(f"plan/{seed}/{i}")  # (a str seeds one stream per string)
    aim = rng.random() < p_split
    decode_only = aim and rng.random() < 0.5
    return Plan(aim, decode_only, rng.random() < p_fail, rng.randrange(world_size),
                rng.choice(faults.SITES), rng.randrange(2))


def _token_count(rng: random.Random, max_tokens: int, marks: Sequence[int]) -> int:
    if rng.random() < 0.4:
        return rng.choice(marks)
    return rng.randint(3, max_tokens)


def _requests(rng: random.Random, tokens: int, share: bool, only_decode: bool | None = None,
              max_context: int = 120) -> tuple[list[int], list[tuple[int, int]]]:
    """Decodes (context 1..``max_context``), chunked prefills (context 16..80) and fresh
    prompts summing to ``tokens`` query tokens; decodes only (a uniform-decode step) where
    ``only_decode``, or at random (0.3) where it is ``None``. ``share``: a fresh prompt of >=
    16 tokens and a request with a cached block come first (when the count allows), for
    :func:`_share_prefix`."""
    decodes, prefills = [], []
    if only_decode is None:
        only_decode = rng.random() < 0.3
    left = tokens
    if share and tokens >= 17:
        q = rng.randint(16, min(48, tokens - 1))
        prefills.append((0, q))
        decodes.append(rng.randint(16, max_context))
        left -= q + 1
    while left:
        kind = "decode" if only_decode else rng.choice(["decode", "chunk", "fresh"])
        if kind == "decode" or left == 1:
            decodes.append(rng.randint(1, max_context))
            left -= 1
        else:
            q = min(left, rng.randint(2, 48))
            prefills.append((rng.randint(16, 80) if kind == "chunk" else 0, q))
            left -= q
    return decodes, prefills


def _share_prefix(step: Any, rng: random.Random) -> bool:
    """Point a request's cached prefix blocks at blocks another request writes this step
    (the step's host-side metadata, before any host mirror or device copy is made)."""
    md = step.attn_metadata
    counts, ctx = step.num_scheduled_tokens, step.context_lens
    readers = [i for i, c in enumerate(ctx) if c >= _BLOCK]
    writers = [i for i, (c, q) in enumerate(zip(ctx, counts)) if c == 0 and q >= _BLOCK]
    if not readers or not writers:
        return False
    r, w = rng.choice(readers), rng.choice(writers)
    n = min(ctx[r] // _BLOCK, counts[w] // _BLOCK)
    md.block_table[r, :n] = md.block_table[w, :n]
    return True


def content_key(plan: Plan, rng: random.Random, i: int, contents: int | None
                ) -> tuple[str, int]:
    """Which step content a rank runs at step ``i`` of ``plan``: its kind (``"free"``,
    ``"decode"``, ``"prefill"``: a free step, one aimed at a decode / prefill split) and one
    of ``contents`` per kind (``None``: ``i``, a new one every step)."""
    kind = "free" if not plan.aim_split else "decode" if plan.decode_only else "prefill"
    return kind, (i if contents is None else rng.randrange(contents))


def draw_rank_step(cfg: Any, key: tuple[str, int], rng: random.Random, *, max_tokens: int,
                   thresholds: tuple[int, int], marks: Sequence[int], p_share: float,
                   num_blocks: int, seed: int, max_context: int = 120) -> tuple[Step, bool]:
    """The step content ``key`` (:func:`content_key`), drawn from ``rng``: ``(step, shared)``
    (a CPU step without host mirrors; ``shared``: a request reads blocks another one writes,
    the prefix-read veto's case).

    ``thresholds``: the (decode, prefill) token counts every rank needs for the vote to
    split; a step aimed at a split draws at least that many (the threshold itself, or one
    more, a fifth of the time), no shared prefix. ``marks``: the token counts a free step
    draws 40 % of the time."""
    kind = key[0]
    if kind != "free":
        low = thresholds[0] if kind == "decode" else thresholds[1]
        tokens = (rng.choice([low, low + 1]) if rng.random() < 0.2
                  else rng.randint(low, max(low, max_tokens)))
        share = False
        decodes, prefills = _requests(rng, tokens, False, True if kind == "decode" else None,
                                      max_context)
    else:
        share = rng.random() < p_share
        decodes, prefills = _requests(rng, _token_count(rng, max_tokens, marks), share,
                                      None, max_context)
    step = make_step(cfg, decode_context_lens=decodes, prefills=prefills, block_size=_BLOCK,
                     num_blocks=num_blocks, seed=seed)
    return step, share and _share_prefix(step, rng)


def soak_veto(metadata: Any, num_scheduled_tokens: Any) -> str:
    """The engine veto of a vetoed step."""
    return "soak veto"


def pristine_caches(model: Any, seed: int) -> list[torch.Tensor]:
    """Seeded ``N(0, 1)`` contents for each of ``model``'s KV caches (new tensors of their
    shapes, dtype and device)."""
    caches = model.kv_caches()
    gen = torch.Generator(device=caches[0].device).manual_seed(seed)  # drawn where they live
    return [torch.randn(c.shape, generator=gen, device=c.device).to(c.dtype) for c in caches]


def written_slots(step: Step) -> torch.Tensor:
    """``[n]`` int64: the cache slots the step's real tokens write (``slot_mapping >= 0``),
    on the step's device."""
    slots = step.attn_metadata.slot_mapping[: step.num_tokens]
    return slots[slots >= 0]


def _slots_view(cache: torch.Tensor) -> torch.Tensor:
    """``[2, num_slots, Hkv * D]`` view of a cache ``[2, num_blocks, block_size, Hkv, D]``."""
    return cache.view(2, -1, cache[0, 0, 0].numel())


def gather_writes(caches: Sequence[torch.Tensor], slots: torch.Tensor) -> list[torch.Tensor]:
    """Per cache, the values at ``slots`` (``[2, n, Hkv * D]`` copies)."""
    return [_slots_view(c)[:, slots].clone() for c in caches]


def check_kv_writes(caches: Sequence[torch.Tensor], base: Sequence[torch.Tensor],
                    slots: torch.Tensor, expected: Sequence[torch.Tensor] | None = None,
                    atol: float = 0.0, keep: torch.Tensor | None = None
                    ) -> tuple[bool | None, bool]:
    """Check a step's KV-cache writes: ``(writes ok, nothing else changed)``.

    Args:
        caches: the model's caches after the step (``[2, num_blocks, block_size, Hkv, D]``).
        base: what they must hold outside the step's written ``slots`` (``[n]`` int64): what
            they held before the step.
        expected: the reference's values at ``slots`` (per cache ``[2, n, Hkv * D]``), which
            the writes must match within ``atol`` (absolute; those of ``keep`` ``[n]`` bool
            only, when given); ``None``: not compared (the first figure is ``None``).

    Then ``base``'s values are copied over the caches' at every written slot and the whole
    caches must equal ``base`` bitwise: a write anywhere else (a padding row, a stale or
    mis-cut slot mapping) is found, and where none was, the caches are ``base`` again."""
    writes_ok: bool | None = None if expected is None else True
    untouched = True
    for i, (c, b) in enumerate(zip(caches, base)):
        fc, fb = _slots_view(c), _slots_view(b)
        if expected is not None:
            got, want = fc[:, slots], expected[i]
            if keep is not None:
                got, want = got[:, keep], want[:, keep]
            if got.numel():
                writes_ok &= bool((got.float() - want.float()).abs().max() <= atol)
        fc[:, slots] = fb[:, slots]
        untouched &= torch.equal(fc, fb)
    return writes_ok, untouched


class _Content(NamedTuple):
    """A step content and its reference (the reference model on it, from the pristine
    caches): the output, the expert-load counter and the KV values at the written slots."""

    step: Step
    shared: bool
    want: torch.Tensor
    load: torch.Tensor
    slots: torch.Tensor
    writes: list[torch.Tensor]


def _reference(ref: Any, step: Step, shared: bool, pristine: Sequence[torch.Tensor]
               ) -> _Content:
    """Run the reference on ``step`` (its caches hold ``pristine``) and put its caches back."""
    ref.expert_load.zero_()
    with torch.no_grad():
        want = ref(step.input_ids, step.positions, step.attn_metadata)
    slots = written_slots(step)
    writes = gather_writes(ref.kv_caches(), slots)
    for c, base in zip(ref.kv_caches(), pristine):
        _slots_view(c)[:, slots] = _slots_view(base)[:, slots]
    return _Content(step, shared, want, ref.expert_load.clone(), slots, writes)


def _msg(e: BaseException) -> str:
    return hashlib.sha256(str(e).split("; this rank:")[0].encode()).hexdigest()[:12]


class _Record(NamedTuple):
    """One rank's step (pickled back to the parent)."""

    split: bool
    padded: int
    reason: str
    err: str  # error type ("FOREIGN ..." for one not the project's own), "" if none
    msg: str  # the error message's hash (the failing rank's own suffix dropped)
    cause: str  # the error's ``__cause__`` type
    injected: bool  # the injected failure fired on this rank
    vetoed: bool
    shared: bool
    tokens: int
    ok_out: bool | None  # None: the step raised
    ok_load: bool | None
    ok_kv: bool | None


def soak_rank(rank: int, world_size: int, steps: int, seed: int, max_tokens: int,
              p_fail: float, p_veto: float, p_share: float, step_timeout_s: float,
              budget_s: float | None = None, p_split: float = 0.7,
              contents: int | None = 256) -> dict:
    """One rank of the soak (module docstring): per step a :class:`_Record`, and the CPU
    milliseconds per step of each part of its steps (:data:`PARTS`: ``draw``, the step's
    content, and its reference where it is new; ``step``; ``check``). ``budget_s``: stop
    before ``steps`` once that many seconds have passed on any rank (the ranks agree by one
    all-reduce per step, so that they stop after the same step)."""
    cfg = get_config("tiny", num_layers=2)
    model = faults.FaultyMoEModel(cfg, ep_group=dist.group.WORLD, seed=0, count_load=True)
    ref = faults.FaultyMoEModel(cfg, seed=0, count_load=True)  # every expert local
    for m in (model, ref):
        m.allocate_kv_cache(_NUM_BLOCKS, _BLOCK)
    pristine = pristine_caches(model, seed)
    for m in (model, ref):
        for c, base in zip(m.kv_caches(), pristine):
            c.copy_(base)
    compiled = torch.compile(model, backend="dbo", options=SOAK_OPTIONS)
    d, p = SOAK_OPTIONS["decode_token_threshold"], SOAK_OPTIONS["prefill_token_threshold"]
    marks = [0, 1, 2, d - 1, d, d + 1, p - 1, p, p + 1]
    cache: dict[tuple[str, int], _Content] = {}
    records = []
    cpu = dict.fromkeys(PARTS, 0.0)
    t0 = time.perf_counter()
    t_first = 0.0
    for i in range(steps):
        if budget_s is not None and i and _out_of_time(time.perf_counter() - t0 > budget_s):
            break
        # the watchdog: a step that does not end dumps every thread's stack and exits (the
        # first step compiles: ten times the limit)
        faulthandler.dump_traceback_later(step_timeout_s * (10 if i == 0 else 1), exit=True)
        t_step = time.perf_counter()
        if rank == 0 and i and i % 100 == 0:
            print(f"soak W={world_size}: step {i}/{steps}, "
                  f"{(t_step - t0 - t_first) / (i - 1):.3f} s/step", file=sys.stderr, flush=True)
        c0 = time.process_time()
        plan = draw_plan(seed, i, world_size, p_split, p_fail)
        rng = random.Random(f"rank/{seed}/{i}/{rank}")  # this rank's own
        key = content_key(plan, rng, i, contents)
        vetoed = key[0] == "free" and rng.random() < p_veto
        content = cache.get(key)
        if content is None:
            name = f"{seed}/{rank}/{key[0]}/{key[1]}"  # the content's own draws
            step, shared = draw_rank_step(
                cfg, key, random.Random(name), max_tokens=max_tokens, thresholds=(d, p),
                marks=marks, p_share=p_share, num_blocks=_NUM_BLOCKS,
                seed=zlib.crc32(name.encode()))
            content = _reference(ref, step, shared, pristine)
            if contents is not None:
                cache[key] = content
        step = content.step
        model.expert_load.zero_()
        c1 = time.process_time()
        err, msg, cause = "", "", ""
        out = None
        armed = plan.fail and rank == plan.fail_rank
        if armed:
            faults.arm(plan.site, plan.call)
        try:
            with torch.no_grad():
                out = run_step(compiled, step.input_ids, step.positions, step.attn_metadata,
                               step.num_scheduled_tokens,
                               vetoes=[soak_veto] if vetoed else ())
        except DboError as e:
            err, msg = type(e).__name__, _msg(e)
            cause = type(e.__cause__).__name__ if e.__cause__ is not None else ""
        except Exception as e:  # noqa: BLE001 - counted: not the project's own error
            err, msg = "FOREIGN " + type(e).__name__, str(e)[:200]
        injected = armed and not faults.disarm()
        c2 = time.process_time()
        vote = last_called().last_vote
        ok_out = ok_load = ok_kv = None
        if not err:
            want = content.want
            ok_out = out.shape == want.shape and (
                out.numel() == 0 or bool((out - want).abs().max() <= 1e-4))
            ok_load = torch.equal(model.expert_load, content.load)
            writes_ok, untouched = check_kv_writes(model.kv_caches(), pristine, content.slots,
                                                   content.writes, atol=1e-4)
            ok_kv = writes_ok and untouched
        if not ok_kv:  # a failed step's writes are undefined: every step starts alike
            for c, base in zip(model.kv_caches(), pristine):
                c.copy_(base)
        cpu["draw"] += c1 - c0
        cpu["step"] += c2 - c1
        cpu["check"] += time.process_time() - c2
        records.append(_Record(bool(vote.should_split), int(vote.num_tokens_padded),
                               (last_called().stats.last_decision or "")[:80], err, msg, cause,
                               injected, vetoed, content.shared, step.num_tokens, ok_out,
                               ok_load, ok_kv))
        if i == 0:
            t_first = time.perf_counter() - t_step
            cpu = dict.fromkeys(PARTS, 0.0)  # the first step compiles: not a step's cost
    faulthandler.cancel_dump_traceback_later()
    total = time.perf_counter() - t0
    n = max(len(records) - 1, 1)
    return {"records": records, "seconds": total, "contents": len(cache),
            "per_step_ms": 1e3 * (total - t_first) / n,
            "cpu_ms_per_step": {k: 1e3 * v / n for k, v in cpu.items()}}


def _out_of_time(mine: bool) -> bool:
    """Whether any rank is past the soak's time budget (one all-reduce on the world group)."""
    flag = torch.tensor([int(mine)])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def reason_kind(reason: str) -> str:
    """A vote's reason for an unsplit step, as a category."""
    for needle, kind in (("prefix_read", "prefix-read veto"), ("soak_veto", "engine veto"),
                         ("vetoed on ranks", "a veto on another rank"),
                         ("below the", "below a threshold"),
                         ("fewer than num_ubatches", "fewer tokens than ubatches")):
        if needle in reason:
            return kind
    return reason[:40] or "?"


def run_soak(world_size: int, steps: int, seed: int = 0, max_tokens: int = 96,
             p_fail: float = 0.02, p_veto: float = 0.1, p_share: float = 0.2,
             step_timeout_s: float = 120.0, timeout_s: float | None = None,
             budget_s: float | None = None, p_split: float = 0.7,
             contents: int | None = 256) -> dict:
    """Run the soak on ``world_size`` Gloo ranks; the counts (a dict, printable as JSON):
    ``steps`` (run: fewer than ``steps_planned`` when ``budget_s`` seconds ran out first),
    ``splits, unsplit, split_share`` (split steps / steps), ``aimed_at_split``,
    ``vetoes (engine), prefix_shared, idle_rank_steps, one_token_rank_steps`` (steps with a
    rank of 0 / 1 tokens), ``injected_failures, agreed_failures, hangs, divergences,
    wrong_outputs, foreign_errors``, the agreed failures by error type (``errors``), the
    unsplit steps' reasons, ``seconds``, ``steps_per_s`` and the ranks' CPU milliseconds per
    step by part (``cpu_ms_per_step``, the most over the ranks), ``contents`` (the most
    step contents a rank ran, whose reference it computed; ``contents_per_kind``: the
    argument, ``None`` for a new content every step)."""
    # hangs are the per-step watchdog's to find (a rank exits with code 1 and its stacks);
    # the job's limit only bounds a run on a machine much slower than expected
    timeout_s = timeout_s or 10 * step_timeout_s + steps * 10.0 * world_size
    counts: dict[str, Any] = dict(world_size=world_size, steps=steps, steps_planned=steps,
                                  seed=seed, p_split=p_split, contents_per_kind=contents,
                                  splits=0, unsplit=0,
                                  split_share=0.0, aimed_at_split=0, vetoes=0, prefix_shared=0,
                                  idle_rank_steps=0, one_token_rank_steps=0,
                                  injected_failures=0, agreed_failures=0, hangs=0,
                                  divergences=0, wrong_outputs=0, foreign_errors=0, errors={},
                                  unsplit_reasons={}, examples=[])
    t0 = time.perf_counter()
    try:
        results = run_multirank(soak_rank, world_size, timeout_s=timeout_s, args=(
            steps, seed, max_tokens, p_fail, p_veto, p_share, step_timeout_s, budget_s,
            p_split, contents))
    except MultirankError as e:
        text = str(e)
        counts["hangs"] = int("still running" in text or "exit code 1)" in text)
        counts["error"] = str(e)[:2000]
        counts["seconds"] = round(time.perf_counter() - t0, 1)
        return counts
    counts["steps"] = steps = min(len(r["records"]) for r in results)
    for i in range(steps):
        per_rank = [r["records"][i] for r in results]
        first = per_rank[0]
        agreed = len({(p.split, p.padded, p.err, p.msg) for p in per_rank}) == 1
        counts["divergences"] += not agreed
        counts["foreign_errors"] += sum(p.err.startswith("FOREIGN") for p in per_rank)
        counts["injected_failures"] += any(p.injected for p in per_rank)
        counts["aimed_at_split"] += draw_plan(seed, i, world_size, p_split, p_fail).aim_split
        counts["vetoes"] += any(p.vetoed for p in per_rank)
        counts["prefix_shared"] += any(p.shared for p in per_rank)
        counts["idle_rank_steps"] += any(p.tokens == 0 for p in per_rank)
        counts["one_token_rank_steps"] += any(p.tokens == 1 for p in per_rank)
        if first.err and agreed:
            counts["agreed_failures"] += 1
            counts["errors"][first.err] = counts["errors"].get(first.err, 0) + 1
            # the failing rank's error comes from the injected failure
            counts["wrong_outputs"] += any(p.injected and p.cause != "InjectedFault"
                                           for p in per_rank)
        elif not first.err and agreed:
            counts["splits" if first.split else "unsplit"] += 1
            counts["wrong_outputs"] += sum(not (p.ok_out and p.ok_load and p.ok_kv)
                                           for p in per_rank)
            counts["wrong_outputs"] += any(p.injected for p in per_rank)  # fired, yet no error
            if not first.split:
                key = reason_kind(first.reason)
                counts["unsplit_reasons"][key] = counts["unsplit_reasons"].get(key, 0) + 1
        if (not agreed or counts["wrong_outputs"]) and len(counts["examples"]) < 5:
            counts["examples"].append({"step": i, "ranks": [p._asdict() for p in per_rank]})
    counts["split_share"] = round(counts["splits"] / max(steps, 1), 3)
    counts["seconds"] = round(time.perf_counter() - t0, 1)
    counts["rank_seconds"] = [round(r["seconds"], 1) for r in results]
    counts["per_step_ms"] = round(max(r["per_step_ms"] for r in results), 1)
    counts["steps_per_s"] = round(1e3 / max(counts["per_step_ms"], 1e-9), 2)
    counts["cpu_ms_per_step"] = {k: round(max(r["cpu_ms_per_step"][k] for r in results), 1)
                                 for k in PARTS}
    counts["contents"] = max(r["contents"] for r in results) if contents else steps
    return counts
