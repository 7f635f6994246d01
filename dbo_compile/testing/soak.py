"""The soak: random steps over several Gloo ranks, every rank's outcome checked.

Each rank runs the same model (:class:`~dbo_compile.testing.faults.FaultyMoEModel` with an
EPLB-style expert-load counter, experts sharded over the ranks) compiled with
``backend="dbo"``, through :func:`~dbo_compile.runtime.engine.run_step`, for ``steps`` steps.
Per step, drawn from the seed:

- per rank: its token count (mass on 0, 1, 2 and the thresholds +- 1, else uniform up to
  ``max_tokens``), a request mix (decodes, chunked prefills, fresh prompts), with
  probability ``p_share`` a request reading as cached prefix blocks another one writes this
  step (the prefix-read veto's case), with probability ``p_veto`` an engine veto;
- for the group: with probability ``p_fail`` an injected failure on one rank, at a random
  site (:data:`~dbo_compile.testing.faults.SITES`) and ubatch.

Checked on every rank against a reference (the same model with every expert local, eager, on
the rank's real rows: no padding, no collective): the outputs, the expert-load counter
(bitwise) and the KV cache, unless the step raised; a step that raised must raise the same
project error on every rank (type and message, less the failing rank's own
``"; this rank: ..."``), caused on the failing rank by the injected failure. The ranks'
decisions (split, padded count) must agree. A hang is a rank still running past the limit
(a per-step watchdog, ``step_timeout_s``, dumps every thread's stack to stderr and
ends the rank: a hang is found within that time, whatever the job's own limit).

:func:`run_soak` runs it and returns the counts; ``benchmarks/soak.py`` is its command line.
"""

from __future__ import annotations

import faulthandler
import hashlib
import random
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from dbo_compile.errors import DboError, MultirankError
from dbo_compile.models.batch import fill_kv_cache, make_step
from dbo_compile.models.deepseek import get_config
from dbo_compile.runtime.context import last_called
from dbo_compile.runtime.engine import run_step
from dbo_compile.testing import faults
from dbo_compile.testing.multirank import run_multirank

__all__ = ["SOAK_OPTIONS", "run_soak", "soak_rank"]

#: thresholds low enough that CPU-sized steps split often
SOAK_OPTIONS = {"decode_token_threshold": 8, "prefill_token_threshold": 24,
                "schedule_candidates": False}
_BLOCK = 16
_NUM_BLOCKS = 1024


def _token_count(rng: random.Random, max_tokens: int) -> int:
    d, p = SOAK_OPTIONS["decode_token_threshold"], SOAK_OPTIONS["prefill_token_threshold"]
    if rng.random() < 0.4:
        return rng.choice([0, 1, 2, d - 1, d, d + 1, p - 1, p, p + 1])
    return rng.randint(3, max_tokens)


def _requests(rng: random.Random, tokens: int, share: bool
              ) -> tuple[list[int], list[tuple[int, int]]]:
    """Decodes (context 1..120), chunked prefills (context 16..80) and fresh prompts summing
    to ``tokens`` query tokens; sometimes decodes only (a uniform-decode step). ``share``: a
    fresh prompt of >= 16 tokens and a request with a cached block come first (when the
    count allows), for :func:`_share_prefix`."""
    decodes, prefills = [], []
    only_decode = rng.random() < 0.3
    left = tokens
    if share and tokens >= 17:
        q = rng.randint(16, min(48, tokens - 1))
        prefills.append((0, q))
        decodes.append(rng.randint(16, 120))
        left -= q + 1
    while left:
        kind = "decode" if only_decode else rng.choice(["decode", "chunk", "fresh"])
        if kind == "decode" or left == 1:
            decodes.append(rng.randint(1, 120))
            left -= 1
        else:
            q = min(left, rng.randint(2, 48))
            prefills.append((rng.randint(16, 80) if kind == "chunk" else 0, q))
            left -= q
    return decodes, prefills


def _share_prefix(step: Any, rng: random.Random) -> bool:
    """Point a request's cached prefix blocks at blocks another request writes this step."""
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


def soak_veto(metadata: Any, num_scheduled_tokens: Any) -> str:
    """The engine veto of a vetoed step."""
    return "soak veto"


def _msg(e: BaseException) -> str:
    return hashlib.sha256(str(e).split("; this rank:")[0].encode()).hexdigest()[:12]


def soak_rank(rank: int, world_size: int, steps: int, seed: int, max_tokens: int,
              p_fail: float, p_veto: float, p_share: float, step_timeout_s: float,
              budget_s: float | None = None) -> dict:
    """One rank of the soak (module docstring): per step a record
    ``(split, padded, error type or "", message hash, cause, injected, vetoed, shared,
    outputs ok, counter ok, kv ok)``. ``budget_s``: stop before ``steps`` once that many
    seconds have passed on any rank (the ranks agree by one all-reduce per step, so that they
    stop after the same step)."""
    cfg = get_config("tiny", num_layers=2)
    model = faults.FaultyMoEModel(cfg, ep_group=dist.group.WORLD, seed=0, count_load=True)
    ref = faults.FaultyMoEModel(cfg, seed=0, count_load=True)  # every expert local
    for m in (model, ref):
        m.allocate_kv_cache(_NUM_BLOCKS, _BLOCK)
    compiled = torch.compile(model, backend="dbo", options=SOAK_OPTIONS)
    records = []
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
                  f"{(t_step - t0 - t_first) / (i - 1):.2f} s/step", file=sys.stderr, flush=True)
        group_rng = random.Random(seed * 1_000_003 + i)  # the same on every rank
        rng = random.Random((seed * 1_000_003 + i) * 64 + rank)  # this rank's own
        fail = group_rng.random() < p_fail
        fail_rank = group_rng.randrange(world_size)
        site = group_rng.choice(faults.SITES)
        call = group_rng.randrange(2)
        share = rng.random() < p_share
        decodes, prefills = _requests(rng, _token_count(rng, max_tokens), share)
        step = make_step(cfg, decode_context_lens=decodes, prefills=prefills, block_size=_BLOCK,
                         num_blocks=_NUM_BLOCKS, seed=i * 64 + rank)
        shared = share and _share_prefix(step, rng)
        vetoed = rng.random() < p_veto
        for m in (model, ref):
            fill_kv_cache(m, step, seed=i)
            m.expert_load.zero_()
        with torch.no_grad():
            want = ref(step.input_ids, step.positions, step.attn_metadata)
        err, cause, injected = "", "", False
        out = None
        if fail and rank == fail_rank:
            faults.arm(site, call)
        try:
            with torch.no_grad():
                out = run_step(compiled, step.input_ids, step.positions, step.attn_metadata,
                               step.num_scheduled_tokens,
                               vetoes=[soak_veto] if vetoed else ())
            msg = ""
        except DboError as e:
            err, msg = type(e).__name__, _msg(e)
            cause = type(e.__cause__).__name__ if e.__cause__ is not None else ""
        except Exception as e:  # noqa: BLE001 - counted: not the project's own error
            err, msg = "FOREIGN " + type(e).__name__, str(e)[:200]
        injected = fail and rank == fail_rank and not faults.disarm()
        vote = last_called().last_vote
        ok_out = ok_load = ok_kv = None
        if not err:
            ok_out = out.shape == want.shape and (
                out.numel() == 0 or bool((out - want).abs().max() <= 1e-4))
            ok_load = torch.equal(model.expert_load, ref.expert_load)
            ok_kv = all(torch.allclose(a, b, rtol=0, atol=1e-4)
                        for a, b in zip(model.kv_caches(), ref.kv_caches()))
        for a, b in zip(model.kv_caches(), ref.kv_caches()):
            a.copy_(b)  # a failed step's writes are undefined: every step starts alike
        records.append((bool(vote.should_split), int(vote.num_tokens_padded),
                        (last_called().stats.last_decision or "")[:80], err, msg, cause,
                        injected, vetoed, shared, ok_out, ok_load, ok_kv))
        if i == 0:
            t_first = time.perf_counter() - t_step
    faulthandler.cancel_dump_traceback_later()
    total = time.perf_counter() - t0
    return {"records": records, "seconds": total,
            "per_step_ms": 1e3 * (total - t_first) / max(len(records) - 1, 1)}


def _out_of_time(mine: bool) -> bool:
    """Whether any rank is past the soak's time budget (one all-reduce on the world group)."""
    flag = torch.tensor([int(mine)])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def _reason_kind(reason: str) -> str:
    """Rank 0's reason for an unsplit step, as a category."""
    for needle, kind in (("prefix_read", "prefix-read veto"), ("soak_veto", "engine veto"),
                         ("vetoed on ranks", "a veto on another rank"),
                         ("below the", "below a threshold"),
                         ("fewer than num_ubatches", "fewer tokens than ubatches")):
        if needle in reason:
            return kind
    return reason[:40] or "?"


def run_soak(world_size: int, steps: int, seed: int = 0, max_tokens: int = 96,
             p_fail: float = 0.02, p_veto: float = 0.05, p_share: float = 0.1,
             step_timeout_s: float = 120.0, timeout_s: float | None = None,
             budget_s: float | None = None) -> dict:
    """Run the soak on ``world_size`` Gloo ranks; the counts (a dict, printable as JSON):
    ``steps`` (run: fewer than ``steps_planned`` when ``budget_s`` seconds ran out first),
    ``splits, unsplit, vetoes (engine), prefix_shared, injected_failures, agreed_failures,
    hangs, divergences, wrong_outputs, foreign_errors``, the agreed failures by error type
    (``errors``), the unsplit steps' reasons, and ``seconds``."""
    # hangs are the per-step watchdog's to find (a rank exits with code 1 and its stacks);
    # the job's limit only bounds a run on a machine much slower than expected
    timeout_s = timeout_s or 10 * step_timeout_s + steps * 10.0 * world_size
    counts: dict[str, Any] = dict(world_size=world_size, steps=steps, steps_planned=steps,
                                  seed=seed, splits=0,
                                  unsplit=0, vetoes=0, prefix_shared=0, injected_failures=0,
                                  agreed_failures=0, hangs=0, divergences=0, wrong_outputs=0,
                                  foreign_errors=0, errors={}, unsplit_reasons={}, examples=[])
    t0 = time.perf_counter()
    try:
        results = run_multirank(soak_rank, world_size, timeout_s=timeout_s, args=(
            steps, seed, max_tokens, p_fail, p_veto, p_share, step_timeout_s, budget_s))
    except MultirankError as e:
        text = str(e)
        counts["hangs"] = int("still running" in text or "exit code 1)" in text)
        counts["error"] = str(e)[:2000]
        counts["seconds"] = round(time.perf_counter() - t0, 1)
        return counts
    counts["steps"] = steps = min(len(r["records"]) for r in results)
    for i in range(steps):
        per_rank = [r["records"][i] for r in results]
        split, padded, reason = per_rank[0][0], per_rank[0][1], per_rank[0][2]
        agreed = len({(p[0], p[1], p[3], p[4]) for p in per_rank}) == 1
        counts["divergences"] += not agreed
        counts["foreign_errors"] += sum(p[3].startswith("FOREIGN") for p in per_rank)
        counts["injected_failures"] += any(p[6] for p in per_rank)
        counts["vetoes"] += any(p[7] for p in per_rank)
        counts["prefix_shared"] += any(p[8] for p in per_rank)
        errs = [p[3] for p in per_rank]
        if errs[0] and agreed:
            counts["agreed_failures"] += 1
            counts["errors"][errs[0]] = counts["errors"].get(errs[0], 0) + 1
            # the failing rank's error comes from the injected failure
            counts["wrong_outputs"] += any(p[6] and p[5] != "InjectedFault" for p in per_rank)
        elif not errs[0] and agreed:
            counts["splits" if split else "unsplit"] += 1
            counts["wrong_outputs"] += sum(not (p[9] and p[10] and p[11]) for p in per_rank)
            counts["wrong_outputs"] += any(p[6] for p in per_rank)  # fired, yet no error
            if not split:
                key = _reason_kind(reason)
                counts["unsplit_reasons"][key] = counts["unsplit_reasons"].get(key, 0) + 1
        if (not agreed or counts["wrong_outputs"]) and len(counts["examples"]) < 5:
            counts["examples"].append({"step": i, "ranks": per_rank})
    counts["seconds"] = round(time.perf_counter() - t0, 1)
    counts["rank_seconds"] = [round(r["seconds"], 1) for r in results]
    counts["per_step_ms"] = round(max(r["per_step_ms"] for r in results), 1)
    return counts
