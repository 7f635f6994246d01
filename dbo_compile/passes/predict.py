"""The runner's predictions: each program's step time at a bucket's token count, from the
calibrated cost model (:mod:`dbo_compile.runtime.prune` says what they decide and how).

The compile puts :func:`predict_bucket` on the artifact (``artifact.predict``), so that the
runtime, which imports no compile stage, can call it. With ``cache_dir`` the predictions are
stored beside the compile cache (``cache_dir/prune/<compile-cache key>.json``): an artifact read
back from the cache has no traced graph to predict from, and a warm restart prunes as the cold
start did.
"""

from __future__ import annotations

import json
import logging
import math
import os
import tempfile
from typing import Any, Callable, Sequence

import torch

from dbo_compile.passes.calibrate import (
    predict_split,
    predict_unsplit,
    unit_features,
    unsplit_features,
)
from dbo_compile.passes.cost_model import CLASSES, Figures
from dbo_compile.runtime.prune import BucketPrediction

log = logging.getLogger(__name__)

__all__ = ["predict_bucket"]


def _comm_cost(cal: dict[str, Any], config: Any) -> tuple[Callable[[float], float], bool]:
    """The µs of a comm op moving ``nbytes`` over the link, and whether the calibration
    covers it (the emulated world's fitted round trip) or the config's figures stand in."""
    figs = cal.get("figures", {})
    comm, link = figs.get("comm"), figs.get("comm_link")
    opts = dict(config.comm_backend_options or ())
    if (config.comm_backend == "emulated" and isinstance(comm, dict) and isinstance(link, dict)
            and "link_gbps" in opts):
        gbps = min(float(opts["link_gbps"]), float(link.get("copy_gbps") or math.inf))
        setup, chunks = float(link.get("chunk_setup_us", 3.0)), int(link.get("max_chunks", 16))

        def emulated(nbytes: float) -> float:  # benchmarks/calibrate.py: link_us
            t = nbytes / (gbps * 1e3)
            n = max(1, min(chunks, round(math.sqrt(t / setup))))
            return comm["launch_us"] + comm["link_scale"] * (t * (1 + 1 / n) + setup * n)
        return emulated, True
    return (lambda nbytes: config.comm_latency_us + nbytes / (config.link_gbps * 1e3)), False


def predict_bucket(artifact: Any, tokens: int, candidates: Sequence[str],
                   device: Any = None) -> BucketPrediction:
    """Predicted µs of the unsplit program and of each split candidate of ``artifact`` (a
    compiled :class:`~dbo_compile.runtime.program.DboCompiledModule`) at a bucket of
    ``tokens`` rows per rank (the module docstring). ``device``: where the graphs run (the
    runner's); a calibration is a GPU's, so none is made off CUDA, nor on a GPU whose name is
    not in the calibration's ``machine``. Never raises: a prediction that cannot be made is
    ``BucketPrediction(None, why=...)``."""
    config = artifact.config
    try:
        cal = config.calibration_data()
    except Exception as e:  # noqa: BLE001 - a prediction never fails the warm-up
        return BucketPrediction(None, why=f"calibration unreadable: {e}")
    if cal is None:
        return BucketPrediction(None, why="no calibration (DboConfig.calibration)")
    other = _other_machine(cal, device)
    if other:
        return BucketPrediction(None, why=other)
    memo = _memo_path(artifact)
    if artifact.token_symbols is None:  # read from the compile cache: no traced graph
        stored = _read_memo(memo, tokens, candidates) if memo else None
        return stored or BucketPrediction(
            None, why="artifact read from the compile cache, no prediction stored for this "
                      "bucket")
    try:
        figs = cal["figures"]
        compute = {c: Figures(**{k: v for k, v in figs[c].items()
                                 if k in ("tflops", "gbps", "launch_us", "us_per_row")})
                   for c in CLASSES if c != "comm" and c in figs}
        link, covered = _comm_cost(cal, config)

        def cost(f: tuple) -> float:
            cls, flops, nbytes, rows = f
            if cls == "comm":
                return link(nbytes)
            return compute[cls].cost_us(flops, nbytes, rows) if cls in compute else 0.0

        slow = cal.get("overlap_slowdown") or {}
        slowdown = (float(slow.get("compute", 1.0)), float(slow.get("comm", 1.0)))
        fusion = cal.get("fusion")  # a calibration on Inductor's fused runs
        us = {"unsplit": predict_unsplit(cost, {"unsplit": unsplit_features(artifact, tokens)},
                                         fusion=fusion)}
        for name in candidates:
            program = artifact.candidates[name]
            feats = unit_features(artifact, name, tokens)
            step = {"schedule": program.schedule.to_dict(),
                    "features": {str(i): fs for i, fs in feats.items()}}
            us[name] = predict_split(cost, step, slowdown=slowdown, fusion=fusion)[0]
    except Exception as e:  # noqa: BLE001
        log.info("dbo graphs: no prediction for bucket %d: %s: %s", tokens, type(e).__name__, e)
        return BucketPrediction(None, why=f"prediction failed: {type(e).__name__}: {e}")
    err = (cal.get("check") or {}).get("worst_abs_err")
    error = float(err) if covered and isinstance(err, (int, float)) else None
    prediction = BucketPrediction(us, error)
    if memo:
        _write_memo(memo, tokens, prediction)
    return prediction


def _other_machine(cal: dict[str, Any], device: Any) -> str | None:
    """Why the calibration does not describe ``device`` (``None``: it does, or no device)."""
    if device is None:
        return None
    if device.type != "cuda":
        return f"graphs on {device.type}: the calibration is a GPU's"
    name, machine = torch.cuda.get_device_name(device), str(cal.get("machine", ""))
    if name not in machine:
        return f"the calibration was measured on {machine!r}, this is {name!r}"
    return None


def _memo_path(artifact: Any) -> str | None:
    """Where the predictions of ``artifact``'s graph are kept for a warm restart, whose
    artifact comes from the compile cache without the traced graphs they are made from:
    ``cache_dir/prune/<compile-cache key>.json`` (the key sees the graph, the options, the
    calibration's content and this package's source). ``None``: no ``cache_dir``."""
    key, directory = artifact.cache_key, artifact.config.cache_dir
    if not key or not directory:
        return None
    return os.path.join(os.path.expanduser(directory), "prune", f"{key}.json")


def _read_memo(path: str, tokens: int, candidates: Sequence[str]) -> BucketPrediction | None:
    try:
        with open(path) as f:
            entry = json.load(f).get(str(tokens))
        us = {k: float(v) for k, v in entry["us"].items()}
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None
    if set(us) != {"unsplit", *candidates}:
        return None
    error = entry.get("error")
    return BucketPrediction(us, float(error) if isinstance(error, (int, float)) else None)


def _write_memo(path: str, tokens: int, prediction: BucketPrediction) -> None:
    """Add bucket ``tokens``'s prediction to the file (a temporary file renamed into place:
    two ranks writing leave one whole file; a directory that cannot be written only logs)."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, ValueError):
            data = {}
        data[str(tokens)] = {"us": prediction.us, "error": prediction.error}
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
        os.replace(tmp, path)
    except OSError as e:
        log.info("dbo graphs: predictions not stored in %s: %s", path, e)
