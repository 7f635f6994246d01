"""The schedule candidates: which schedules a split graph is compiled with, and their programs.

A *candidate* is one schedule of a split graph: a scheduler run under changed cost figures,
on the split graph with or without joined experts (:class:`Candidate`). The backend compiles
the primary schedule (the config's own) and, with ``DboConfig.schedule_candidates``, those of
:data:`CANDIDATES`; each split program may also run with an SM carve-out
(``DboConfig.sm_carveout_candidates``). The CUDA-graph runner times the programs per bucket
and keeps the fastest. Every function here is deterministic in the config, so that every rank
compiles the same candidates.

Ground floor: :mod:`dbo_compile.config` validates candidate names against this table, and the
candidate driver (:mod:`dbo_compile.passes.candidate_driver`) and the compile cache
(:mod:`dbo_compile.codegen.cache`) build the programs from it.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dbo_compile.config import DboConfig

__all__ = ["CANDIDATES", "DEFAULT_CANDIDATES", "SCHEDULE_CANDIDATES", "UNSPLIT_GRAPHS",
           "UNSPLIT_OVERLAP", "Candidate",
           "candidate_programs", "candidates_of", "carveout_sms", "primary_candidate",
           "bad_carveout", "program_variants", "split_carveout"]


@dataclass(frozen=True)
class Candidate:
    """One schedule candidate: a scheduler run under changed cost figures, on the split graph
    with or without joined experts. The backend compiles the primary schedule and, with
    ``DboConfig.schedule_candidates``, those of :data:`CANDIDATES`; the CUDA-graph runner
    times them per bucket and keeps the fastest.

    Attributes:
        name: ``scheduler[@link/N][+join]``, e.g. ``"list@link/16+join"``.
        scheduler: ``"list"``, ``"naive"``, ``"staged"`` or ``"staged-d2"``
            (``DboConfig.scheduler``).
        link_divisor: the cost model's ``link_gbps`` is divided by it (comm-heavy networks:
            measured on 2x H200, NCCL through host memory moves ~6x less than the default
            figure).
        join_experts: schedule the split graph whose routed experts are joined across the
            ubatches (:mod:`dbo_compile.passes.join_experts`).
    """

    name: str
    scheduler: str
    link_divisor: int = 1
    join_experts: bool = False

    def apply(self, config: DboConfig) -> DboConfig:
        """``config`` with this candidate's scheduler, link figure and join."""
        changes: dict[str, Any] = dict(scheduler=self.scheduler, join_experts=self.join_experts)
        if self.link_divisor != 1:
            changes["link_gbps"] = config.link_gbps / self.link_divisor
        return config.replace(**changes)


#: the schedule candidates besides the primary, in compile order (``schedule_candidates=True``
#: compiles all of them)
CANDIDATES: tuple[Candidate, ...] = (
    Candidate("list", "list"),
    Candidate("list@link/4", "list", link_divisor=4),
    Candidate("list@link/16", "list", link_divisor=16),
    Candidate("naive", "naive"),
    Candidate("list+join", "list", join_experts=True),
    Candidate("list@link/16+join", "list", link_divisor=16, join_experts=True),
    Candidate("staged", "staged"),
    Candidate("staged-d2", "staged-d2"),
)
#: the names of :data:`CANDIDATES`, valid in ``DboConfig.schedule_candidates`` (also with a
#: carve-out suffix, ``"list@link/16+sms16"``)
SCHEDULE_CANDIDATES: tuple[str, ...] = tuple(c.name for c in CANDIDATES)
#: ``DboConfig.schedule_candidates``'s default: the candidates that were ever the fastest
#: split graph on 2x H200 (``benchmarks/results/latest.json``, ``t_variants_us``), the
#: staged order, the fastest at 5 of 8 buckets of the emulated EP worlds on one H100
#: (2026-12-07), and ``list@link/4``, the fastest at 15 of 24 emulated-world rows on one H200
#: (2026-12-01) and at 2 of 4 EP-8 buckets on one H100 with every candidate timed (2.5 / 3.5 %
#: ahead of the next, 2026-12-07; ``docs/config.md`` "Why the defaults"). With the primary
#: (``list``) 6 split graphs per bucket instead of 16.
DEFAULT_CANDIDATES: tuple[str, ...] = ("list@link/4", "list@link/16+sms16", "list+join",
                                       "list@link/16+join", "staged")
#: the name of the unsplit program on the two streams (``DboConfig.unsplit_overlap``,
#: :mod:`dbo_compile.passes.unsplit_overlap`) among a bucket's graphs
UNSPLIT_OVERLAP = "unsplit-overlap"
#: the names of the unsplit graphs a bucket may capture (the serial one first): what runs a
#: step that is not split; the runner keeps the faster
UNSPLIT_GRAPHS: tuple[str, ...] = ("unsplit", UNSPLIT_OVERLAP)
_CARVEOUT_SUFFIX = re.compile(r"^(?P<base>.+)\+sms(?P<sms>[1-9][0-9]*)$")


_ANY_SMS_SUFFIX = re.compile(r"^(?P<base>.+)\+sms(?P<sms>.*)$")


def bad_carveout(name: Any) -> bool:
    """Whether ``name`` is a candidate of :data:`SCHEDULE_CANDIDATES` with a ``+sms`` suffix
    that is no SM count (``"list@link/4+sms0"``, ``"list+join+sms"``): the name is valid, the
    carve-out (SMs, an int >= 1 without leading zeros) is not."""
    if not isinstance(name, str) or split_carveout(name)[1] is not None:
        return False
    m = _ANY_SMS_SUFFIX.match(name)
    return bool(m) and m.group("base") in SCHEDULE_CANDIDATES


def split_carveout(name: str) -> tuple[str, int | None]:
    """``("list@link/16", 16)`` for ``"list@link/16+sms16"``; ``(name, None)`` without a
    carve-out suffix."""
    m = _CARVEOUT_SUFFIX.match(name)
    if m and m.group("base") in SCHEDULE_CANDIDATES:
        return m.group("base"), int(m.group("sms"))
    return name, None


def primary_candidate(config: DboConfig) -> Candidate:
    """The candidate ``config`` itself asks for: its scheduler at its own figures, joined with
    ``join_experts``."""
    join = "+join" if config.join_experts else ""
    return Candidate(config.scheduler + join, config.scheduler, join_experts=config.join_experts)


def candidates_of(config: DboConfig) -> list[Candidate]:
    """The candidates whose schedules are compiled for a graph, the primary first: the
    primary, then with ``schedule_candidates`` every entry of :data:`CANDIDATES` (or named in
    the tuple, with or without a carve-out suffix) whose name is not the primary's.
    Deterministic in ``config``, so that every rank compiles the same candidates."""
    primary = primary_candidate(config)
    out = [primary]
    keep = config.schedule_candidates
    if keep:
        bases = set() if keep is True else {split_carveout(n)[0] for n in keep}
        out += [c for c in CANDIDATES if c.name != primary.name and (keep is True or c.name in bases)]
    return out


def program_variants(config: DboConfig) -> list[tuple[str, str, int | None]]:
    """The split programs a graph gets, the primary first: ``(name, schedule candidate,
    SM carve-out or None)``, e.g. ``("list@link/16+sms16", "list@link/16", 16)``.

    ``schedule_candidates`` ``True``, ``False`` or a tuple without carve-out suffixes: each
    compiled candidate (:func:`candidates_of`), then each again with every carve-out of
    ``sm_carveout_candidates``. A tuple with suffixes (the default): the primary and exactly
    the entries named, a ``+smsN`` entry where ``N`` is one of the resolved
    ``sm_carveout_candidates`` and otherwise (CPU, or ``()``) its schedule without one.
    Call with the resolved config (``sm_carveout_candidates`` not ``None``)."""
    compiled = [c.name for c in candidates_of(config)]
    carveouts = tuple(config.sm_carveout_candidates or ())
    keep = config.schedule_candidates
    if not isinstance(keep, tuple) or all(split_carveout(n)[1] is None for n in keep):
        return [(n, n, None) for n in compiled] + [
            (f"{n}+sms{sms}", n, sms) for sms in carveouts for n in compiled]
    out = [(compiled[0], compiled[0], None)]
    for name in keep:
        base, sms = split_carveout(name)
        if sms is not None and sms not in carveouts:
            name, sms = base, None
        if name not in [v[0] for v in out]:
            out.append((name, base, sms))
    return out


def candidate_programs(programs: dict[str, Any], alias: dict[str, str],
                       config: DboConfig) -> dict[str, Any]:
    """The split programs of an artifact by name (:func:`program_variants`, the primary
    first): ``programs[alias[candidate]]`` for a variant without a carve-out, a copy of it
    with the carve-out (same code and units) for one with. ``programs``: one program per
    distinct host order (objects with ``carveout_sms`` and ``carveout_mode`` attributes, the
    latter set from ``config.sm_carveout_mode``); ``alias`` maps each
    compiled candidate to the program of its host order; a variant of a candidate not
    compiled (no routed-expert call to join) or of a program already listed is left out."""
    out: dict[str, Any] = {}
    seen: set[tuple[int, int | None]] = set()
    for name, base, sms in program_variants(config):
        if base not in alias or (id(programs[alias[base]]), sms) in seen:
            continue
        prog = programs[alias[base]]
        seen.add((id(prog), sms))
        if sms is None:
            out[alias[base]] = prog
        else:
            out[name] = copy.copy(prog)
            out[name].carveout_sms = sms
    for prog in out.values():  # how a carve-out (a variant's, or comm_sms) is kept
        prog.carveout_mode = config.sm_carveout_mode
    return out


def carveout_sms(config: DboConfig) -> int | None:
    """SMs the split programs carve out of compute: ``comm_sms``, else the comm backend's
    option ``comm_sms`` (the emulated world's: the SMs its comm kernels would hold), else
    none."""
    if config.comm_sms is not None:
        return config.comm_sms
    return dict(config.comm_backend_options).get("comm_sms") or None
