"""Codegen: the schedule as ONE Python function with stream switches and event edges.

For every unit, in host order, the generated function

1. waits on its stream for the events of its incoming event edges,
2. calls the unit (after the engine's switch to the unit's ubatch's step state, for a unit
   running an op keyed to state outside the graph: :func:`~dbo_compile.runtime.context.
   ubatch_scope`; a GraphModule holding the stage's ATen ops, the one comm op, or the receive
   phase of a comm op whose backend has one) — units on the comm stream inside
   ``with use(s_comm):`` (a comm backend may place its units on the compute stream: DeepEP
   low-latency sends on the current stream and receives on the send's stream),
3. ``record_stream``s every input made on the other stream (allocator safety, invariant 4),
4. records its event if a unit on the other stream waits for it,
5. drops values after their last use, as eager execution would.

At the end the compute stream joins the comm stream (required for CUDA-graph capture: every
forked stream must rejoin the origin stream), where a unit ran on it: a schedule whose units
all run on the compute stream (DeepEP low-latency's comm units) never forks the comm stream,
and waiting on an event recorded there would depend on work outside the capture
(``cudaErrorStreamCaptureIsolation``). No thread, no host synchronisation.
"""

from __future__ import annotations

import functools
import logging
import operator
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.fx as fx

from dbo_compile.errors import ScheduleError
from dbo_compile.ops.comm import watching_results
from dbo_compile.ops.registry import is_receive, is_wait, step_state_key
from dbo_compile.runtime import streams as _streams
from dbo_compile.runtime.context import enter_ubatch
from dbo_compile.schedule import COMM, Schedule, range_name

log = logging.getLogger(__name__)


@dataclass
class UnitIO:
    """Names of the values a unit reads and writes (split-graph node names)."""

    inputs: list[str]
    outputs: list[str]


def _resolve(node: fx.Node) -> fx.Node:
    """A wait node stands for its issue node's value (a receive is a unit of its own: its
    value is its own)."""
    while is_wait(node) and not is_receive(node):
        node = node.args[0]
    return node


#: units already built for a split graph: ``tuple(unit.nodes)`` -> (callable, UnitIO)
BuiltUnits = dict[tuple[str, ...], tuple[Callable, UnitIO]]
#: unit GraphModules by what they compute (:func:`_unit_key`), shared by every split graph of
#: one compiled artifact and its schedule candidates
UnitModules = dict[tuple, fx.GraphModule]


def _arg_key(a: Any, node_key: Callable[[fx.Node], Any]) -> Any:
    """A hashable stand-in for an argument that equals another's only for the same value of
    the same type (``1``, ``True`` and ``1.0``, or ``0.0`` and ``-0.0``, differ); a node is
    ``node_key(node)``."""
    if isinstance(a, fx.Node):
        return node_key(a)
    if isinstance(a, (list, tuple)):
        return (type(a).__name__, tuple(_arg_key(x, node_key) for x in a))
    if isinstance(a, dict):
        return ("dict", tuple((k, _arg_key(v, node_key)) for k, v in a.items()))
    if isinstance(a, slice):
        return ("slice",) + tuple(_arg_key(x, node_key) for x in (a.start, a.stop, a.step))
    if isinstance(a, float):
        return ("float", repr(a))
    if a is None or isinstance(a, (bool, int, str, torch.dtype, torch.device, torch.layout,
                                   torch.memory_format)):
        return (type(a).__name__, a)
    return ("id", id(a))  # equal only to itself


def _unit_key(root: fx.GraphModule, members: list[fx.Node], inputs: list[fx.Node],
              outputs: list[fx.Node]) -> tuple:
    """What a unit's GraphModule computes, up to node names: its ops in order, each argument
    by position (a member or an input of the unit) or by value, module attributes by
    identity, and which members it returns. Two units with one key run the same code on
    their own inputs (positional): the two ubatches' copies of a stage, the same stage in
    every layer (weights are inputs)."""
    position = {n: ("in", i) for i, n in enumerate(inputs)}
    position.update({n: ("n", i) for i, n in enumerate(members)})

    def arg(a: Any) -> Any:
        return _arg_key(a, lambda n: position[_resolve(n)])

    ops = []
    for n in members:
        target: Any = n.target
        if n.op == "get_attr":
            obj: Any = root
            for part in n.target.split("."):
                obj = getattr(obj, part)
            target = ("attr", id(obj))
        elif n.op == "call_function":
            target = ("fn", id(n.target))
        ops.append((n.op, target, tuple(arg(a) for a in n.args),
                    tuple((k, arg(v)) for k, v in n.kwargs.items())))
    return len(inputs), tuple(ops), tuple(position[o] for o in outputs)


def build_unit_modules(split_gm: fx.GraphModule, schedule: Schedule,
                       compile_stage: Callable[[fx.GraphModule, Any], Callable] | None = None,
                       built: BuiltUnits | None = None,
                       shared: UnitModules | None = None) -> tuple[list[Callable], list[UnitIO]]:
    """Extract one GraphModule per unit; its inputs are values made outside the unit.

    ``compile_stage(gm, unit)``, if given, turns each stage's (compute unit's) GraphModule into
    the callable the wrapper calls (e.g.
    :func:`~dbo_compile.codegen.inductor.inductor_stage_compiler`); comm units always stay the
    GraphModule of their one comm op. ``built``, shared by the schedule candidates of one
    split graph, hands a unit with the same nodes as one built before
    the same callable (a unit's inputs, outputs and ops do not depend on the order), and
    records the units built here. ``shared`` (:data:`UnitModules`) hands a unit that computes
    what one built before computes (:func:`_unit_key`) that unit's GraphModule instead of a
    new one, where the GraphModule is the callable (comm units; every unit without
    ``compile_stage``): building a GraphModule (Python code generation and ``compile``) was
    most of codegen's time, once per unit and layer.

    Raises:
        ScheduleError: a node of the split graph belongs to no unit of ``schedule``.
    """
    graph = split_gm.graph
    by_name = {n.name: n for n in graph.nodes}
    unit_of = schedule.unit_of_node()
    out_node = next(n for n in graph.nodes if n.op == "output")
    for n in graph.nodes:
        if n.op in ("placeholder", "output") or (is_wait(n) and not is_receive(n)):
            continue
        if n.name not in unit_of:
            raise ScheduleError(f"node {n.name} belongs to no schedule unit")
    modules: list[Callable] = []
    ios: list[UnitIO] = []
    built = {} if built is None else built
    for unit in schedule.units:
        if tuple(unit.nodes) in built:
            module, io = built[tuple(unit.nodes)]
            modules.append(module)
            ios.append(io)
            continue
        members = [by_name[n] for n in unit.nodes]
        member_set = set(members)
        inputs: list[fx.Node] = []
        for n in members:
            for a in n.all_input_nodes:
                src = _resolve(a)
                if src not in member_set and src not in inputs:
                    inputs.append(src)
        outputs = []
        for n in members:
            used_outside = False
            for user in n.users:
                plain_wait = is_wait(user) and not is_receive(user)
                targets = [user] if not plain_wait else list(user.users)
                for t in targets:
                    if t is out_node or (t not in member_set):
                        used_outside = True
            if used_outside:
                outputs.append(n)
        compiled = compile_stage is not None and unit.kind != COMM
        key = None if compiled or shared is None else _unit_key(split_gm, members, inputs,
                                                                 outputs)
        gm = shared.get(key) if key is not None else None
        if gm is None:
            gm = _unit_module(split_gm, unit, members, inputs, outputs)
            if key is not None:
                shared[key] = gm
        built[tuple(unit.nodes)] = (compile_stage(gm, unit) if compiled else gm,
                                    UnitIO([a.name for a in inputs], [o.name for o in outputs]))
        modules.append(built[tuple(unit.nodes)][0])
        ios.append(built[tuple(unit.nodes)][1])
    return modules, ios


def _unit_module(split_gm: fx.GraphModule, unit: Any, members: list[fx.Node],
                 inputs: list[fx.Node], outputs: list[fx.Node]) -> fx.GraphModule:
    sub = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for a in inputs:
        ph = sub.placeholder(a.name)
        ph.meta = dict(a.meta)
        env[a] = ph
    for n in members:
        env[n] = sub.node_copy(n, lambda x: env[_resolve(x)] if _resolve(x) in env else env[x])
    sub.output(tuple(env[o] for o in outputs))
    return fx.GraphModule(split_gm, sub, class_name=f"DboUnit{unit.id}")


def generate(split_gm: fx.GraphModule, schedule: Schedule, ios: list[UnitIO]) -> tuple[str, int]:
    """Python source of ``dbo_step(self, *inputs)`` and the number of events it uses."""
    graph = split_gm.graph
    placeholders = [n.name for n in graph.nodes if n.op == "placeholder"]
    out_node = next(n for n in graph.nodes if n.op == "output")
    outputs = [(_resolve(a).name if isinstance(a, fx.Node) else repr(a)) for a in out_node.args[0]]
    stream_of_value: dict[str, str] = {p: "compute" for p in placeholders}
    for unit, io in zip(schedule.units, ios):
        for o in io.outputs:
            stream_of_value[o] = unit.stream
    producers_with_events = sorted({a for a, _ in schedule.event_edges})
    event_index = {u: i for i, u in enumerate(producers_with_events)}
    join_event = len(event_index)
    num_events = join_event + 1
    waits_for: dict[int, list[int]] = {}
    for a, b in schedule.event_edges:
        waits_for.setdefault(b, []).append(a)
    last_use: dict[str, int] = {}
    for unit, io in zip(schedule.units, ios):
        for name in io.inputs:
            last_use[name] = unit.id
    keep_alive = set(outputs) | set(placeholders)
    by_name = {n.name: n for n in graph.nodes}
    # units running an op keyed to step state outside the graph (vLLM's attention): the
    # engine's per-ubatch state is installed first (runtime.context.ubatch_scope)
    stateful = {u.id for u in schedule.units if u.ubatch is not None and any(
        n in by_name and step_state_key(by_name[n]) is not None for n in u.nodes)}

    lines = [
        "def dbo_step(self, " + ", ".join(placeholders) + "):",
        f"    # {len(schedule.units)} units, {len(schedule.event_edges)} event edges, "
        f"scheduler={schedule.scheduler}, predicted {schedule.predicted_step_us:.1f} us "
        f"(serial {schedule.serial_us:.1f} us)",
        "    s_compute, s_comm, ev = self.streams.get(device_of((" + ", ".join(placeholders) + ",)))",
        "    units = self.units",
    ]
    for unit, io in zip(schedule.units, ios):
        stream = "s_comm" if unit.stream == COMM else "s_compute"
        lines.append(f"    # [{unit.id}] {unit.name} ({unit.kind}, {len(unit.nodes)} nodes, "
                     f"est {unit.cost_us:.1f} us)")
        indent = "    "
        if unit.stream == COMM:
            lines.append(f"    with use(s_comm), rf({range_name(unit)!r}):")
            indent = "        "
        else:
            lines.append(f"    with rf({range_name(unit)!r}):")
            indent = "        "
        for p in sorted(waits_for.get(unit.id, [])):
            lines.append(f"{indent}wait({stream}, ev[{event_index[p]}])  # after [{p}]")
        if unit.id in stateful:
            lines.append(f"{indent}enter_ubatch({unit.ubatch})  # its step state (host)")
        outs = ", ".join(io.outputs)
        call = f"units[{unit.id}](" + ", ".join(io.inputs) + ")"
        if io.outputs:
            lines.append(f"{indent}({outs},) = {call}")
        else:
            lines.append(f"{indent}{call}")
        for name in io.inputs:
            if stream_of_value.get(name, "compute") != unit.stream:
                lines.append(f"{indent}keep({name}, {stream})")
        if unit.id in event_index:
            lines.append(f"{indent}record(ev[{event_index[unit.id]}], {stream})")
        dead = [n for n in io.inputs if last_use.get(n) == unit.id and n not in keep_alive]
        if dead:
            lines.append(f"{indent}del {', '.join(dead)}")
    if any(u.stream == COMM for u in schedule.units):
        lines.append("    # join: the compute stream waits for the comm stream's last op")
        lines.append(f"    record(ev[{join_event}], s_comm)")
        lines.append(f"    wait(s_compute, ev[{join_event}])")
    else:
        lines.append("    # no unit ran on the comm stream: nothing to join (not forked)")
    lines.append("    return (" + "".join(f"{o}, " for o in outputs) + ")")
    return "\n".join(lines) + "\n", num_events


class SplitProgram:
    """The compiled split program: unit callables plus the generated ``dbo_step``.

    Attributes:
        code: the generated Python source (also logged at DEBUG under ``dbo_compile``).
        schedule: the :class:`~dbo_compile.schedule.Schedule` it runs.
        split_gm: the split graph (joined, for a joined candidate) whose nodes the units run.
        carveout_sms: on CUDA, SMs kept free of compute while the program runs, so that
            comm kernels find SMs (a CUDA graph captured from the call keeps it); ``None``:
            none.
        carveout_mode: how (``DboConfig.sm_carveout_mode``, :func:`~dbo_compile.runtime.
            streams.sm_carveout`): ``"cublas"``, GEMMs only; ``"green_context"``, every
            compute kernel.

    The schedule candidates of one split graph pass the same ``built`` dict, so that they share
    their units' callables, and every program of an artifact the same ``modules`` dict, so
    that units computing the same thing share one GraphModule (:func:`build_unit_modules`).
    """

    carveout_mode: str = "cublas"

    def __init__(self, split_gm: fx.GraphModule, schedule: Schedule,
                 compile_stage: Callable[[fx.GraphModule, Any], Callable] | None = None,
                 carveout_sms: int | None = None, built: BuiltUnits | None = None,
                 modules: UnitModules | None = None):
        self.schedule = schedule
        self.split_gm = split_gm  # the graph the schedule's units name (a cost model reads it)
        self.carveout_sms = carveout_sms
        self.units, self.unit_io = build_unit_modules(split_gm, schedule, compile_stage, built,
                                                      modules)
        self.code, self.num_events = generate(split_gm, schedule, self.unit_io)
        self._load()

    @functools.cached_property
    def enters_ubatch(self) -> bool:
        """The program runs ops keyed to step state outside the graph, so it calls
        ``enter_ubatch`` (:func:`~dbo_compile.runtime.context.ubatch_scope`)."""
        return "enter_ubatch(" in self.code

    @classmethod
    def from_parts(cls, schedule: Schedule, units: list[Callable], unit_io: list[UnitIO],
                   code: str, num_events: int, carveout_sms: int | None = None) -> SplitProgram:
        """The program a :class:`SplitProgram` of these parts was (the compile cache,
        :mod:`dbo_compile.codegen.cache`, stores the parts): no split graph needed."""
        program = cls.__new__(cls)
        program.schedule, program.carveout_sms = schedule, carveout_sms
        program.split_gm = None  # not stored
        program.units, program.unit_io = list(units), list(unit_io)
        program.code, program.num_events = code, num_events
        program._load()
        return program

    def _load(self) -> None:
        """Streams and events; ``dbo_step`` is compiled at the first call (a candidate the
        runner never times, or a warm start's, costs no Python compile of its code)."""
        self.streams = _streams.StreamSet(self.num_events)
        self._fn: Callable | None = None
        #: the first call ran under :func:`~dbo_compile.ops.comm.watching_results`
        self._results_checked = False
        log.debug("generated dbo_step:\n%s", self.code)

    def _compiled(self) -> Callable:
        if self._fn is None:
            namespace: dict[str, Any] = {
                "use": _streams.use, "record": _streams.record, "wait": _streams.wait,
                "keep": _streams.keep, "device_of": _streams.device_of, "operator": operator,
                "torch": torch, "rf": torch.profiler.record_function,
                "enter_ubatch": enter_ubatch,
            }
            exec(compile(self.code, "<dbo_step>", "exec"), namespace)  # noqa: S102 - our codegen
            self._fn = namespace["dbo_step"]
        return self._fn

    def __call__(self, *args: Any) -> tuple[Any, ...]:
        """Run the schedule on one step's per-ubatch inputs. The first call checks that no comm
        backend reuses result memory it did not declare (:func:`~dbo_compile.ops.comm.
        watching_results`; raises ``CommBackendError`` naming the ``ResultPool`` to declare)."""
        if not self._results_checked:
            with watching_results():
                out = self._run(*args)
            self._results_checked = True
            return out
        return self._run(*args)

    def _run(self, *args: Any) -> tuple[Any, ...]:
        fn = self._fn or self._compiled()
        if self.carveout_sms is None:
            return fn(self, *args)
        with _streams.sm_carveout(self.carveout_sms, _streams.device_of(args),
                                  self.carveout_mode):
            return fn(self, *args)
