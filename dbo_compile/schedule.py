"""The schedule as data: units, their order on two streams, event edges (ground floor).

Made by :mod:`dbo_compile.passes.stream_assign`, run by :mod:`dbo_compile.codegen`, compared
across ranks by the runtime (:meth:`Schedule.fingerprint`), drawn by :mod:`dbo_compile.viz`.

Words (``docs/design.md``): a *unit* is one entry of the schedule, either a *stage* (a run of
one ubatch's compute between two of its yield points, on the compute stream) or one *comm op*
(a dispatch or combine of one ubatch, on the comm stream).
"""

from __future__ import annotations

import bisect
import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Optional

from dbo_compile.errors import ScheduleError

__all__ = ["COMM", "COMPUTE", "RANGE_PREFIX", "SCHEDULE_VERSION", "STREAM_INDEX", "CommCall",
           "CommPlan", "NullArg", "Schedule", "Timeline", "Unit", "annotate_stream",
           "placed_timeline", "range_name", "simulate"]

COMPUTE, COMM = "compute", "comm"
SCHEDULE_VERSION = 1
#: prefix of the ``record_function`` range generated code opens around each unit
RANGE_PREFIX = "dbo.u"
#: ``node.meta["custom"]["stream"]`` of a node on each stream, in Dynamo's and Inductor's
#: contract (``int | None``: a user stream's index, ``None`` the current stream). The compute
#: stream is the caller's current stream, the comm stream our one side stream.
STREAM_INDEX: dict[str, int | None] = {COMPUTE: None, COMM: 1}


def annotate_stream(node_meta: dict[str, Any], index: int | None) -> None:
    """Set ``node_meta["custom"]["stream"]`` to ``index`` (``None``: remove the key, and
    ``"custom"`` once empty). The ``"custom"`` dict is replaced, never changed in place: the
    copies of a node (ubatch copies, a stage's graph) share it."""
    custom = node_meta.get("custom")
    if index is not None:
        node_meta["custom"] = {**(custom or {}), "stream": index}
    elif isinstance(custom, dict) and "stream" in custom:
        rest = {k: v for k, v in custom.items() if k != "stream"}
        if rest:
            node_meta["custom"] = rest
        else:
            del node_meta["custom"]


@dataclass
class Unit:
    """One schedulable unit: a compute stage or a comm op.

    Attributes:
        id: index in the schedule's host (issue) order.
        kind: ``"compute"`` or ``"comm"``.
        stream: ``"compute"`` or ``"comm"``.
        ubatch: ubatch id, ``None`` for the shared prologue and for joined calls (both ubatches).
        label: ``A`` (attention part, with the previous layer's tail), ``S`` (shared experts),
            ``MLP`` (routed experts), ``D`` (dispatch), ``C`` (combine), ``T`` (final tail),
            ``P`` (shared prologue), ``X`` (any other comm / stage).
        layer: MoE layer index (``None`` if unknown).
        nodes: names of the split-graph nodes it runs, in graph order.
        cost_us: estimated duration (µs).
        start_us / end_us: predicted start/end on its stream (µs from step start).
        phase: ``"issue"``, or ``"receive"`` for the receive phase of a comm op whose backend
            has one (DeepEP low-latency: its receive hook), a unit of its own.
        pool: the result pool a comm unit draws from (``"<backend spec>|<pool>|<group>"``,
            :class:`Schedule` ``pools``), ``None`` if none.
        latency_us: time after the unit ends before what depends on it may start (µs): the
            transfer of an issue whose receive is a unit of its own, in flight while its
            stream runs other units.
    """

    id: int
    kind: str
    stream: str
    ubatch: int | None
    label: str
    layer: int | None
    nodes: list[str]
    cost_us: float
    start_us: float = 0.0
    end_us: float = 0.0
    phase: str = "issue"
    pool: str | None = None
    latency_us: float = 0.0

    @property
    def name(self) -> str:
        sub = "" if self.ubatch is None else str(self.ubatch)
        layer = "" if self.layer is None else f"L{self.layer}."
        phase = "r" if self.phase == "receive" else ""
        return f"{layer}{phase}{self.label}{sub}"


@dataclass
class Schedule:
    """The schedule as data (JSON-serialisable through :meth:`to_json`).

    Attributes:
        units: in host issue order.
        deps: unit dependencies ``(src, dst)``: data edges and hidden (KV-cache) edges.
        hidden_deps: the subset of ``deps`` that are not FX data edges.
        event_edges: the minimal cross-stream edges; each is one event record/wait.
        num_ubatches, scheduler, config_fingerprint: what produced it
            (:meth:`DboConfig.fingerprint <dbo_compile.config.DboConfig.fingerprint>`).
        predicted_step_us: makespan of the simulated two-stream timeline (µs).
        serial_us: sum of all unit costs (everything on one stream), µs.
        meta: facts about how it was made (comm ops per ubatch, joined experts, candidate;
            ``hold_fraction``: the share of SMs its transfers hold, where its timeline had
            the hold model, :class:`Timeline`).
        pools: per result pool the comm units draw from (their ``pool``), its declaration
            (``live``, ``in_flight``: ``dbo_compile.ops.comm.ResultPool``), which the schedule
            honours (``hidden_deps`` holds the edges it added).
        comm_backends: the comm backend specs the graph's comm ops are bound to, sorted.
    """

    units: list[Unit]
    deps: list[tuple[int, int]]
    hidden_deps: list[tuple[int, int]]
    event_edges: list[tuple[int, int]]
    num_ubatches: int
    scheduler: str
    config_fingerprint: str
    predicted_step_us: float = 0.0
    serial_us: float = 0.0
    meta: dict[str, Any] = field(default_factory=dict)
    pools: dict[str, dict[str, Any]] = field(default_factory=dict)
    comm_backends: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["version"] = SCHEDULE_VERSION
        d["deps"] = [list(e) for e in self.deps]
        d["hidden_deps"] = [list(e) for e in self.hidden_deps]
        d["event_edges"] = [list(e) for e in self.event_edges]
        for u, unit in zip(d["units"], self.units):
            u["name"] = unit.name
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Schedule:
        units = [Unit(**{k: v for k, v in u.items() if k != "name"}) for u in d["units"]]
        return cls(
            units=units,
            deps=[tuple(e) for e in d["deps"]],
            hidden_deps=[tuple(e) for e in d["hidden_deps"]],
            event_edges=[tuple(e) for e in d["event_edges"]],
            num_ubatches=d["num_ubatches"],
            scheduler=d["scheduler"],
            config_fingerprint=d["config_fingerprint"],
            predicted_step_us=d.get("predicted_step_us", 0.0),
            serial_us=d.get("serial_us", 0.0),
            meta=d.get("meta", {}),
            pools=d.get("pools", {}),
            comm_backends=d.get("comm_backends", []),
        )

    def unit_of_node(self) -> dict[str, int]:
        return {n: u.id for u in self.units for n in u.nodes}

    def fingerprint(self) -> str:
        """16 hex digits of SHA-256 over the order of collectives this schedule issues
        (``(ubatch, label, layer, phase)`` of each comm unit, and the ubatch count), the comm
        backends and the pool declarations they honour: what every DP rank must issue
        identically (``docs/design.md``, invariant 2), compared by the DP vote. Not the code
        itself: ranks that saw different token counts may hold a static and a dynamic Dynamo
        graph with the same collective order."""
        order = [(u.ubatch, u.label, u.layer) + (() if u.phase == "issue" else (u.phase,))
                 for u in self.units if u.kind == COMM]
        what: tuple = (self.num_ubatches, order)
        if self.pools or self.comm_backends:
            what += (sorted(self.comm_backends), sorted((k, sorted(v.items()))
                                                        for k, v in self.pools.items()))
        return hashlib.sha256(repr(what).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class NullArg:
    """A tensor argument of a *null* comm call (the same collective, a payload that routes
    and adds nothing), made at run time.

    Attributes:
        shape: per dim ``(a, b)``: the dim is ``a * tokens + b``, ``tokens`` the token count
            of the call's ubatch (of the step, for an unsplit program).
        dtype: a ``torch.dtype``.
        device: where the tensor lives (``"cpu"``, ``"cuda:0"``).
        fill: its value (``registry.OpInfo.null_fill``).
    """

    shape: tuple[tuple[int, int], ...]
    dtype: Any
    device: str
    fill: float | int

    def dims(self, tokens: int) -> list[int]:
        return [a * tokens + b for a, b in self.shape]


@dataclass(frozen=True)
class CommCall:
    """One collective a program issues, as a rank whose step failed issues it again (its
    peers wait in it): ``op(*args, **kwargs)`` with each :class:`NullArg` made at run time.

    Attributes:
        op: the comm op (``torch.ops.dbo.dispatch.default``, ...).
        args: its positional arguments, tensors as :class:`NullArg`, the rest constants
            (expert count, group name).
        ubatch: the ubatch whose token count sizes it (``None``: the step's, unsplit).
        name: the unit's name (``L0.D1``) or the node's, for messages.
        kwargs: its keyword arguments, constants (e.g. a bound backend's name).
    """

    op: Any
    args: tuple[Any, ...]
    ubatch: int | None
    name: str
    kwargs: tuple[tuple[str, Any], ...] = ()


#: the collectives of one program in issue order (the split program's host order, the
#: unsplit program's graph order); ``None``: the program issues a collective that has no
#: null call (a rank failing in it cannot complete its peers' collectives)
CommPlan = Optional[tuple[CommCall, ...]]


def range_name(unit: Unit) -> str:
    """Profiler range of ``unit`` in generated code: ``dbo.u{id}.{name}`` (e.g. ``dbo.u5.L0.MLP0``);
    ``python -m dbo_compile.viz --profile`` matches kernels to units by it."""
    return f"{RANGE_PREFIX}{unit.id}.{unit.name}"


class Timeline:
    """Two in-order streams (compute, comm) simulated unit by unit: a unit starts when its
    stream is free and its dependencies have ended. The one model of a schedule's time, used
    by the list scheduler to pick units and by :func:`simulate` to time a fixed order.

    A unit's ``latency_us`` (the transfer of an issue whose receive is a unit of its own) holds
    the rank's one link: transfers run one after another in placement order, each starting
    when its issue ended and the link is free (two ops in flight share the link's bandwidth;
    they do not each get all of it).

    **Hold model** (``hold_fraction`` = held SMs / the device's SMs, ``f``; 0: off). Comm
    kernels that move the data with SMs of their own hold them for the transfer: DeepEP's
    normal-mode kernels hold 20-24 SMs, the emulated link's ``hold_sms`` option holds ``N``
    (the hold kernel's semantics: :mod:`dbo_compile.ops.emulated.hold`). With ``f > 0``:

    - a transfer's SMs are held over ``[h, h + latency_us)`` µs, ``h`` the latest of its begin
      on the link, the end of the compute unit running on the compute stream at that begin
      (it fills every SM; the hold waits for it to retire) and the end of the previous hold
      (the hold kernels run in turn on the issuing stream), so holds never overlap;
    - its dependents may start at the later of the copies' end and the hold's end, and its
      issuing stream (the comm stream) is busy until the hold's end;
    - a unit of the compute stream placed later does its ``cost_us`` of work at pace 1
      outside the holds and ``1 - f`` inside them (compute beside a hold runs on the other
      SMs), so it ends later where it overlaps one.

    Placement order is time order only roughly: a compute unit placed before a transfer whose
    hold it overlaps keeps its times (the list scheduler places units in nearly increasing
    start order, so this is rare). A placement costs ``O(log H)`` plus the holds the unit
    spans (``H`` holds so far), so a deep model stays linear in its units.

    Args:
        preds: per unit id, the ids it depends on.
        hold_fraction: the share of the device's SMs a transfer holds, ``0 <= f < 1``
            (:func:`dbo_compile.passes.cost_model.hold_fraction`); 0: the timeline without
            holds, unchanged.

    Raises:
        ScheduleError: ``hold_fraction`` outside ``[0, 1)``.
    """

    def __init__(self, preds: dict[int, list[int]], hold_fraction: float = 0.0):
        if not 0.0 <= hold_fraction < 1.0:  # NaN fails too
            raise ScheduleError(f"Timeline: hold_fraction={hold_fraction!r} must be in [0, 1) "
                                "(held SMs / the device's SMs)")
        self.preds = preds
        self.free = {COMPUTE: 0.0, COMM: 0.0}
        #: when the link is free of the transfers placed so far
        self.link_free = 0.0
        #: per placed send, its transfer's ``(start, end)`` on the link (µs)
        self.transfers: dict[int, tuple[float, float]] = {}
        self.end: dict[int, float] = {}
        #: when a placed unit's dependents may start (its end plus its ``latency_us``)
        self.ready: dict[int, float] = {}
        self.hold_fraction = hold_fraction
        #: per placed send, the ``(start, end)`` its SMs are held (µs; empty without holds)
        self.holds: dict[int, tuple[float, float]] = {}
        # the holds' starts and ends in time order (they never overlap), and the compute
        # stream's units' starts and ends (in order: the stream runs one at a time)
        self._hold_starts: list[float] = []
        self._hold_ends: list[float] = []
        self._compute_starts: list[float] = []
        self._compute_ends: list[float] = []

    def start_of(self, unit: Unit, extra: Iterable[int] = ()) -> float:
        """When ``unit`` would start if placed next (its dependencies, and the units
        ``extra`` it would also wait for, must be placed)."""
        preds = list(self.preds[unit.id]) + list(extra)
        return max([self.free[unit.stream]] + [self.ready[p] for p in preds])

    def place(self, unit: Unit, extra: Iterable[int] = ()) -> tuple[float, float]:
        """Place ``unit`` next on its stream (after ``extra`` too); its ``(start, end)`` in µs."""
        start = self.start_of(unit, extra)
        if self.hold_fraction and unit.stream == COMPUTE:
            end = self._end_beside_holds(start, unit.cost_us)
            self._compute_starts.append(start)
            self._compute_ends.append(end)
        else:
            end = start + unit.cost_us
        self.end[unit.id] = end
        self.free[unit.stream] = end
        if unit.latency_us > 0:
            begin = max(end, self.link_free)
            self.link_free = begin + unit.latency_us
            self.transfers[unit.id] = (begin, self.link_free)
            self.ready[unit.id] = self.link_free
            if self.hold_fraction:
                held = self._hold(begin, unit.latency_us)
                self.holds[unit.id] = held
                self.ready[unit.id] = max(self.link_free, held[1])
                self.free[unit.stream] = max(end, held[1])
        else:
            self.ready[unit.id] = end
        return start, end

    def _hold(self, begin: float, duration: float) -> tuple[float, float]:
        """Record the hold of a transfer beginning at ``begin`` (µs) for ``duration`` µs and
        return its ``(start, end)``: from ``begin``, the end of the compute unit running then
        and the previous hold's end, whichever is latest."""
        h = max(begin, self._hold_ends[-1] if self._hold_ends else 0.0)
        k = bisect.bisect_right(self._compute_starts, begin) - 1
        if k >= 0 and self._compute_ends[k] > begin:
            h = max(h, self._compute_ends[k])
        self._hold_starts.append(h)
        self._hold_ends.append(h + duration)
        return h, h + duration

    def _end_beside_holds(self, start: float, work: float) -> float:
        """The end (µs) of ``work`` µs of compute from ``start``: pace 1 outside the holds,
        ``1 - hold_fraction`` inside them."""
        t, pace = start, 1.0 - self.hold_fraction
        for k in range(bisect.bisect_right(self._hold_ends, start), len(self._hold_ends)):
            hs, he = self._hold_starts[k], self._hold_ends[k]
            if hs > t:  # unheld until this hold
                if work <= hs - t:
                    return t + work
                work -= hs - t
                t = hs
            if work <= (he - t) * pace:  # ends inside this hold
                return t + work / pace
            work -= (he - t) * pace
            t = he
        return t + work

    @property
    def makespan(self) -> float:
        return max(self.ready.values(), default=0.0)


def predecessors(units: Iterable[Unit], deps: Iterable[tuple[int, int]]) -> dict[int, list[int]]:
    """Per unit id, the ids it depends on (in ``deps`` order)."""
    preds: dict[int, list[int]] = {u.id: [] for u in units}
    for a, b in deps:
        preds[b].append(a)
    return preds


def placed_timeline(units: list[Unit], deps: list[tuple[int, int]],
                    hold_fraction: float = 0.0) -> Timeline:
    """Place ``units`` (already in host order) on a :class:`Timeline`, setting their
    ``start_us``/``end_us``; the timeline holds the makespan, the transfers and the holds.

    Raises:
        ScheduleError: ``hold_fraction`` outside ``[0, 1)``.
    """
    timeline = Timeline(predecessors(units, deps), hold_fraction)
    for u in units:
        u.start_us, u.end_us = timeline.place(u)
    return timeline


def simulate(units: list[Unit], deps: list[tuple[int, int]], hold_fraction: float = 0.0
             ) -> float:
    """Set ``start_us``/``end_us`` of units (already in host order); return the makespan (µs).
    ``hold_fraction``: the share of SMs a transfer holds (:class:`Timeline`'s hold model).

    Raises:
        ScheduleError: ``hold_fraction`` outside ``[0, 1)``.
    """
    return placed_timeline(units, deps, hold_fraction).makespan
