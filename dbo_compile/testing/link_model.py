"""The emulated link against a real one, from results files (``benchmarks/emulated_vs_real.py``,
``benchmarks/calibrate.py``): the bytes each collective of a step moves on the ``torch``
backend and on the emulated link, the modelled time of the emulated link's comm, the asked link
whose modelled time is a measured one, and the side-by-side rows of a real and an emulated
results file. Plain arithmetic on JSON (no device).

Bytes are per rank and step, bf16 (:data:`ITEMSIZE`); times in µs; links in GB/s per
direction.
"""

from __future__ import annotations

import math
import re
from typing import Any

import torch

from dbo_compile.ops.comm import payload_layout
from dbo_compile.ops.emulated import EmulatedWorld
from dbo_compile.ops.emulated.link import MAX_CHUNKS

__all__ = ["CHUNK_SETUP_US", "ITEMSIZE", "asked_link", "compare", "emulated_comm_bytes",
           "emulated_comm_us", "link_us", "parse_setup", "torch_comm_bytes", "ubatches"]

ITEMSIZE = 2  # bf16, every run here
#: the emulated link's round trip (:mod:`dbo_compile.ops.emulated.link`): n chunks (at most
#: ``MAX_CHUNKS``), the way back one chunk behind, this set-up time per chunk (µs)
CHUNK_SETUP_US = 3.0


def link_us(nbytes: float, gbps: float) -> float:
    """The emulated link's round trip of ``nbytes`` at ``gbps`` (µs)."""
    t = nbytes / (gbps * 1e3)
    n = max(1, min(MAX_CHUNKS, round(math.sqrt(t / CHUNK_SETUP_US))))
    return t * (1 + 1 / n) + CHUNK_SETUP_US * n


def parse_setup(setup: str, machine: str = "") -> dict[str, Any]:
    """The fields of a results file's ``setup`` line (bench_moe / bench_emulated): ``preset``,
    ``moe_layers``, ``carve-out`` and every ``key=value`` (its first word); ``compute_backend``
    ``auto`` resolved as the package does (Inductor on CUDA: a ``machine`` naming a GPU)."""
    out = {"preset": setup.split(",")[0].strip()}
    m = re.search(r"(\d+) layers \((\d+) MoE\)", setup) or re.search(r"(\d+) MoE layers", setup)
    if m:
        out["moe_layers"] = int(m.groups()[-1])
    for k, v in re.findall(r"([A-Za-z_][\w-]*)=([^,;]+)", setup):
        out[k] = v.split()[0]
    if out.get("compute_backend") == "auto":
        out["compute_backend"] = "inductor" if "NVIDIA" in machine or "GPU" in machine else "aten"
    c = re.search(r"carve-out candidates ([^,;]+)", setup)
    out["carve-out"] = "none" if "no carve-out" in setup else c.group(1).split()[0] if c else "?"
    return out


def ubatches(tokens: int) -> list[int]:
    """The two ubatches' tokens of a bucket (``bench_moe`` / ``bench_emulated``: ``T // 2``,
    ``T − T // 2``)."""
    return [tokens // 2, tokens - tokens // 2]


def torch_comm_bytes(cfg: Any, moe_layers: int, tokens: int, ep: int) -> list[tuple[str, int, int]]:
    """``(kind, peer bytes, self bytes)`` per rank of each collective of one step of the
    ``torch`` backend, in the order of ``bench_moe.py``'s ``comm_only_fn`` (bf16)."""
    _, cols = payload_layout(cfg.hidden_size, torch.bfloat16, cfg.top_k)
    out = []
    for _ in range(moe_layers):
        for kind, c in (("dispatch", cols), ("combine", cfg.hidden_size)):
            for t in ubatches(tokens):
                out.append((kind, (ep - 1) * t * c * ITEMSIZE, t * c * ITEMSIZE))
    return out


def emulated_comm_bytes(cfg: Any, moe_layers: int, tokens: int, w: int) -> list[tuple[str, int]]:
    """``(kind, link bytes)`` of each round trip of one step of the emulated EP-``w`` world
    (its static capacity; ``dbo_compile.testing.moe.comm_only_fn``'s order)."""
    world = EmulatedWorld(w, cfg.num_experts, cfg.top_k)
    return [(kind, world.link_bytes(kind, t, cfg.hidden_size, ITEMSIZE))
            for _ in range(moe_layers) for kind in ("dispatch", "combine") for t in ubatches(tokens)]


def emulated_comm_us(nbytes: list[int], gbps: float, copy_gbps: float,
                     model: tuple[float, float] = (0.0, 1.0)) -> float:
    """Modelled comm alone of the emulated link at an asked ``gbps`` (µs): ``model = (c, s)``,
    ``ops · c + s · Σ link_us(bytes, min(gbps, copy_gbps))``."""
    c, s = model
    ops = [b for b in nbytes if b]
    return c * len(ops) + s * sum(link_us(b, min(gbps, copy_gbps)) for b in ops)


def asked_link(nbytes: list[int], target_us: float, copy_gbps: float,
               model: tuple[float, float]) -> float | None:
    """The asked link (GB/s) whose modelled emulated comm is ``target_us``; ``None`` where even
    the copy engines' rate is too slow."""
    if emulated_comm_us(nbytes, copy_gbps, copy_gbps, model) > target_us:
        return None
    lo, hi = 0.05, copy_gbps
    for _ in range(60):
        mid = math.sqrt(lo * hi)
        if emulated_comm_us(nbytes, mid, copy_gbps, model) > target_us:
            lo = mid
        else:
            hi = mid
    return hi


def compare(real: dict, emulated: list[tuple[str, dict]], tol: float) -> list[dict]:
    """Rows of the side-by-side table: per emulated row of world size 2 the real row of its
    link and bucket, and the relative differences (``emulated / real − 1``)."""
    by = {(r.get("link"), r["phase"], r["tokens_per_rank"]): r for r in real["rows"]}
    out = []
    for link, doc in emulated:
        for e in doc["rows"]:
            if e.get("world_size") != 2 or e.get("t_dbo_graph_us") is None:
                continue
            r = by.get((link, e["phase"], e["tokens_per_rank"]))
            if r is None or r.get("t_dbo_graph_us") is None:
                continue
            row = {"link": link, "phase": e["phase"], "tokens": e["tokens_per_rank"],
                   "gbps": e.get("link_gbps"), "real": r, "emu": e, "diff": {}}
            for key in ("t_baseline_us", "t_dbo_graph_us", "t_chosen_us", "t_comm_us",
                        "t_split_nocomm_us", "speedup", "chosen_vs_baseline"):
                a, b = r.get(key), e.get(key)
                row["diff"][key] = (b / a - 1) if a and b else None
            row["flags"] = [k for k in ("t_baseline_us", "t_dbo_graph_us", "t_chosen_us")
                            if row["diff"][k] is not None and abs(row["diff"][k]) > tol]
            out.append(row)
    return out
