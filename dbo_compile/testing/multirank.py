"""Run a function on N rank processes joined by a Gloo process group (CPU collectives).

Example::

    def body(rank, world_size, x):
        import torch.distributed as dist
        t = torch.ones(1) * rank
        dist.all_reduce(t)
        return t.item()

    assert run_multirank(body, 2, args=(1,)) == [1.0, 1.0]

Without CUDA the ranks are forked from a fork server that imported torch, Dynamo and this
package once per calling process (:data:`FORKSERVER_PRELOAD`): a spawned rank spends ~4 s of
CPU importing them, every time. With CUDA each rank is spawned (a fresh interpreter).

:func:`run_multirank_each` runs several bodies on one group of ranks, one after another: a
rank's first compile in a process and the imports a body needs (transformers: seconds of CPU
per rank) are paid once for all of them instead of once per body.

The ranks meet through a file store in the call's own temporary directory, not a TCP port:
a port found free and then bound by the ranks could be taken in between by another launcher
(two pytest-xdist workers, another user's job).
"""

from __future__ import annotations

import datetime
import os
import pickle
import tempfile
import time
import traceback
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dbo_compile.errors import MultirankError

#: What the fork server imports before it forks ranks: what every rank imports anyway.
FORKSERVER_PRELOAD = ("torch", "torch._dynamo", "torch.distributed", "dbo_compile.backend",
                      "dbo_compile.testing")
#: The start methods :func:`run_multirank` takes (``None``: its choice by the CUDA rule above).
START_METHODS = ("forkserver", "spawn")


def _worker(rank: int, world_size: int, store_path: str, fn: Callable, args: Sequence[Any],
            result_dir: str, timeout_s: float, env: dict[str, str]) -> None:
    # the caller's environment now (a forked rank has the fork server's, from its start)
    os.environ.clear()
    os.environ.update(env)
    threads = env.get("OMP_NUM_THREADS")
    if threads:
        # torch took its thread count when this process imported it (unpickling ``fn``, or
        # the fork server's preload), before ``env`` was set: apply it (else every rank runs
        # as many threads as there are cores, and the ranks' OpenMP threads spin against
        # each other)
        torch.set_num_threads(int(threads))
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    out_path = os.path.join(result_dir, f"rank{rank}.pkl")
    try:
        dist.init_process_group(
            "gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        result = fn(rank, world_size, *args)
        payload = ("ok", result)
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        payload = ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
    with open(out_path, "wb") as f:
        pickle.dump(payload, f)
    if dist.is_initialized():
        try:
            # no rank tears its Gloo pairs down while a peer is still connecting them: a rank
            # whose function returned at once closed the mesh under a peer still in
            # init_process_group ("connectFullMesh failed: Connection closed by peer", CI of
            # 2026-12-07); bounded, so that a peer that failed costs seconds, not the timeout
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=min(timeout_s, 30.0)),
                                   wait_all_ranks=True)
        except Exception:  # noqa: BLE001 - a peer's failure is reported by its own result
            pass
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass


def _context(start_method: str | None) -> mp.context.BaseContext:
    if start_method is None:
        # a forked rank may not use CUDA if the fork server touched it: spawn them there
        start_method = "spawn" if torch.cuda.is_available() else "forkserver"
    if start_method not in START_METHODS:
        raise MultirankError(f"start_method={start_method!r}: expected one of {START_METHODS}")
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(list(FORKSERVER_PRELOAD))  # no effect once it runs
    return ctx


def run_multirank(fn: Callable[..., Any], world_size: int, args: Sequence[Any] = (),
                  timeout_s: float = 240.0, env: dict[str, str] | None = None,
                  start_method: str | None = None) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes over Gloo.

    ``fn`` must be importable (a module-level function). Each rank runs with the caller's
    environment updated by ``env`` (``OMP_NUM_THREADS`` 1 unless ``env`` says otherwise);
    what torch and this package read at import comes from the environment the fork server
    started with (``start_method="spawn"``: the caller's). ``start_method``: ``"forkserver"``,
    ``"spawn"``, or ``None``: spawn if CUDA is available, else the fork server. Returns the
    per-rank results in rank order.

    Raises:
        MultirankError: a rank raised (its traceback is in the message), the ranks did not
            finish within ``timeout_s`` seconds (a hang is reported, never waited out), or
            ``start_method`` is not one of :data:`START_METHODS`.
    """
    return _launch(fn, world_size, args, timeout_s, timeout_s, env, start_method)


def _launch(fn: Callable[..., Any], world_size: int, args: Sequence[Any], timeout_s: float,
            collective_timeout_s: float, env: dict[str, str] | None,
            start_method: str | None) -> list[Any]:
    ctx = _context(start_method)
    env = dict(env or {})
    env.setdefault("OMP_NUM_THREADS", "1")
    env = {**os.environ, **env}
    with tempfile.TemporaryDirectory() as result_dir:
        procs = [
            ctx.Process(target=_worker, args=(r, world_size, os.path.join(result_dir, "store"),
                                              fn, tuple(args), result_dir,
                                              collective_timeout_s, env), daemon=True)
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        results, errors = [], []
        for r in range(world_size):
            path = os.path.join(result_dir, f"rank{r}.pkl")
            if not os.path.exists(path):
                errors.append(f"rank {r}: no result (exit code {procs[r].exitcode})")
                results.append(None)
                continue
            with open(path, "rb") as f:
                status, value = pickle.load(f)
            if status == "error":
                errors.append(f"rank {r}: {value}")
            results.append(value)
        if hung:
            raise MultirankError(
                f"ranks {hung} still running after {timeout_s:.0f} s (a hang or deadlock); "
                + "; ".join(errors)
            )
        if errors:
            raise MultirankError("\n".join(errors))
        return results


def _each(rank: int, world_size: int, calls: Sequence[tuple[str, Callable, Sequence[Any]]],
          reset: Callable[[], Any] | None) -> list[tuple[str, str, Any]]:
    """One rank of :func:`run_multirank_each`: the bodies in order, each from a reset Dynamo,
    ``reset()`` and the RNG state the rank started with; stops at the first error."""
    rng = torch.get_rng_state()
    done = []
    for name, fn, args in calls:
        torch._dynamo.reset()
        if reset is not None:
            reset()
        torch.set_rng_state(rng)
        try:
            done.append((name, "ok", fn(rank, world_size, *args)))
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            # the other ranks may wait in a collective of this body: the group is not
            # trusted for the next one
            done.append((name, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
            break
    torch._dynamo.reset()
    return done


def run_multirank_each(calls: dict[str, tuple[Callable[..., Any], Sequence[Any]]],
                       world_size: int, timeout_s: float = 240.0,
                       env: dict[str, str] | None = None, start_method: str | None = None,
                       reset: Callable[[], Any] | None = None
                       ) -> dict[str, list[Any] | MultirankError]:
    """Run several bodies on one group of ``world_size`` ranks, one after another.

    ``calls`` maps a name to ``(fn, args)``; each ``fn(rank, world_size, *args)`` runs as under
    :func:`run_multirank` (same environment and start method), in the order given, and starts
    from a reset Dynamo (``torch._dynamo.reset()``), after ``reset()`` (an importable
    function, e.g. :func:`dbo_compile.backend.reset_artifacts`: the package's state a body
    reads; this floor does not import the backend), and from the torch RNG state the rank
    started with, as a body launched alone would. ``timeout_s`` bounds each body: the whole run
    gets ``timeout_s`` times the number of bodies, a collective ``timeout_s``.

    Returns each name's per-rank results in rank order, or the :class:`MultirankError` of that
    body: a rank raised (its traceback in the message), or the body did not run because an
    earlier one failed (a rank that raised leaves the group where the others cannot follow, so
    the run stops there), or the ranks did not finish in time (every unfinished body gets it).

    Raises:
        MultirankError: ``start_method`` is not one of :data:`START_METHODS`.
    """
    _context(start_method)  # a bad start method raises here, not as every body's result
    ordered = [(name, fn, tuple(args)) for name, (fn, args) in calls.items()]
    try:
        per_rank = _launch(_each, world_size, (ordered, reset), timeout_s * max(1, len(ordered)),
                           timeout_s, env, start_method)
    except MultirankError as e:
        return {name: e for name, _, _ in ordered}
    out: dict[str, list[Any] | MultirankError] = {}
    failed = None
    for name, _, _ in ordered:
        entries = [next((d for d in done if d[0] == name), None) for done in per_rank]
        errors = [f"rank {r}: {d[2]}" for r, d in enumerate(entries) if d and d[1] == "error"]
        if errors:
            out[name] = MultirankError("\n".join(errors))
            failed = failed or name
        elif any(d is None for d in entries):
            out[name] = MultirankError(f"{name!r} did not run: {failed!r} failed before it "
                                       "on the same ranks")
        else:
            out[name] = [d[2] for d in entries]
    return out
