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
"""

from __future__ import annotations

import datetime
import os
import pickle
import socket
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: Sequence[Any],
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
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
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
    ctx = _context(start_method)
    port = _free_port()
    env = dict(env or {})
    env.setdefault("OMP_NUM_THREADS", "1")
    env = {**os.environ, **env}
    with tempfile.TemporaryDirectory() as result_dir:
        procs = [
            ctx.Process(target=_worker, args=(r, world_size, port, fn, tuple(args), result_dir,
                                              timeout_s, env), daemon=True)
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
