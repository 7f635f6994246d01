"""The persistent compile cache (``DboConfig.cache_dir``): a warm start skips our passes.

A server pays the backend's compile on every start and scale-out; with ``cache_dir`` set,
the first process writes what the pipeline made for each Dynamo graph, and a later process
with the same model and options reads it back instead of lowering, splitting, scheduling and
generating code again (vLLM caches its compiled artifacts the same way; Inductor's stages hit
Inductor's own FX-graph cache, which this leaves alone).

**Key** (:func:`cache_key`): a SHA-256 of everything the compiled artifact is a function of:
the Dynamo graph (ops by qualified name, arguments, wiring, each node's decoder layer, which
the lowering reads), its inputs (names and Dynamo sources, which classify them; dtypes,
devices, sizes and strides, symbolic where Dynamo made them dynamic, so that one entry serves
every token count of a dynamic graph), the values the programs bake in besides the graph's
constants (:func:`~dbo_compile.lowering.baked_inputs`: the floats folded under
``dynamic=True``, a norm's eps or a rope scale, and scalar inputs traced as constants; the
world size of each process group a comm op names, static in the ops' fake shapes), the
explicit input kinds of a graph not from Dynamo, the config fingerprint
(:meth:`~dbo_compile.config.DboConfig.fingerprint`, resolved device defaults included), the
torch version, and the package's version and source (a digest of its ``.py``
files: an edited checkout never reads an entry an older one wrote), and the registered user
passes (:func:`~dbo_compile.passes.manager.pass_uuid`: name, place, source). The lowering is a
function of these, so the key determines the lowered graph the issue asks to key by, and a
lookup needs no lowering (AOTAutograd was most of the compile time).

**Entry** (one file ``<key>.pkl`` per graph, a pickle; the record :class:`SplitEntry`, its
fields by name): the lowered graph (the unsplit program), the input classification, the
split signature, and per distinct schedule candidate its schedule, generated wrapper and
unit graphs (shared between candidates and between units that compute the same, as
compiled), or for an unsplittable graph the reason (:class:`UnsplittableEntry`).
:func:`store` writes a compiled artifact's record, :func:`load` reads one back.
Graphs are stored node by node with their names
(:func:`~dbo_compile.codegen.graph_store.dump_graph`), so that a unit rebuilt
from the cache is the same program text as the one compiled, and Inductor's FX-graph cache,
keyed by it, hits for it too.

**Trust and safety**: an entry is pickled Python, read only from the configured directory
(as Inductor's cache is). Writes go to a temporary file renamed into place (two ranks or
processes writing one key leave one whole file). A file that cannot be read, unpickles to
something else, names another key or other versions, or fails to rebuild is ignored with a
WARNING naming the file and why, and the graph is compiled as if there were no entry (the
new entry then replaces it); so is an entry whose folded floats are not this graph's
(checked on read as well, :func:`load`). A directory that cannot be written only
logs a WARNING. Nothing is ever evicted.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import pickle
import tempfile
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Sequence

import torch
import torch.fx as fx

import dbo_compile
from dbo_compile.candidates import candidate_programs, carveout_sms
from dbo_compile.codegen.graph_store import dump_graph, dump_plan, load_graph, load_plan
from dbo_compile.codegen.wrapper import SplitProgram
from dbo_compile.config import DboConfig
from dbo_compile.errors import CommBackendError, UnsplittableGraphError
from dbo_compile.lowering import baked_inputs, layer_of, source_name
from dbo_compile.ops.comm import ep_world_size
from dbo_compile.ops.registry import comm_group_name
from dbo_compile.runtime.program import SplitRecord
from dbo_compile.schedule import Schedule

if TYPE_CHECKING:
    from dbo_compile.codegen.stages import StageCompiler

log = logging.getLogger(__name__)

__all__ = ["FORMAT", "SplitEntry", "UnsplittableEntry", "cache_key", "dump_graph", "dump_plan",
           "load", "load_graph", "load_plan", "read_entry", "store", "store_unsplittable",
           "write_entry"]

#: bump when the entry layout (:class:`SplitEntry`, :class:`UnsplittableEntry`) changes (part
#: of the key and checked in every entry)
FORMAT = 3


@functools.lru_cache(maxsize=1)
def package_digest() -> str:
    """SHA-256 (16 hex digits) of ``dbo_compile``'s version and of every ``.py`` file of the
    package (paths and contents), computed once per process."""
    root = os.path.dirname(os.path.abspath(dbo_compile.__file__))
    h = hashlib.sha256(dbo_compile.__version__.encode())
    for folder, dirs, files in os.walk(root):
        dirs.sort()
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                h.update(os.path.relpath(path, root).encode())
                with open(path, "rb") as f:
                    h.update(f.read())
    return h.hexdigest()[:16]


def _target_name(target: Any) -> str:
    """A name of an FX target that is the same in every process (or ``repr`` with an
    address, which only makes the key miss)."""
    if isinstance(target, str):
        return target
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket,
                           torch._ops.HigherOrderOperator)):
        return f"op:{target}"
    module = getattr(target, "__module__", None)
    qualname = getattr(target, "__qualname__", None)
    if module and qualname and "<locals>" not in qualname:
        return f"fn:{module}.{qualname}"
    return repr(target)


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return (f"T({value.dtype},{value.device},{tuple(str(s) for s in value.shape)},"
                f"{tuple(str(s) for s in value.stride())},{value.requires_grad})")
    if isinstance(value, torch.SymInt):
        return f"S({value.node.expr})"
    return f"{type(value).__name__}({value!r})"


def cache_key(gm: fx.GraphModule, example_inputs: Sequence[Any], config: DboConfig,
              input_kinds: Sequence[str] | None = None, user_passes: Sequence[str] = ()) -> str:
    """The key of ``gm``'s entry (see the module docstring): 64 hex digits. ``user_passes``:
    the registered user passes' identities
    (:func:`~dbo_compile.passes.manager.user_pass_keys`; they change the programs)."""
    index: dict[fx.Node, int] = {}
    lines = [f"dbo-cache {FORMAT} torch {torch.__version__} package {package_digest()}",
             f"config {config.fingerprint()} kinds {list(input_kinds or [])}"]
    if user_passes:
        lines.append(f"user passes {list(user_passes)!r}")

    def arg(a: Any) -> Any:
        return fx.node.map_aggregate(a, lambda x: f"%{index[x]}" if isinstance(x, fx.Node)
                                     else (f"<tensor {_tensor_digest(x)}>"
                                           if isinstance(x, torch.Tensor) else x))

    # what the programs bake in besides the graph: the values of the inputs the lowering folds
    # or traces as constants (lowering.baked_inputs: a norm's eps under dynamic=True), and the
    # size of each process group a comm op names (its fake shapes, [W*T, H], are static in W)
    lines.append(f"baked {list(baked_inputs(gm, example_inputs))!r}")
    lines.append(f"groups {_group_sizes(gm)!r}")
    placeholders = 0
    for n in gm.graph.nodes:
        index[n] = len(index)
        if n.op == "placeholder":
            example = n.meta.get("example_value", n.meta.get("val"))
            if example is None and placeholders < len(example_inputs):
                example = example_inputs[placeholders]
            placeholders += 1
            # the name too: a graph without Dynamo sources is classified by it
            lines.append(f"placeholder {n.name} {source_name(n)!r} {_describe(example)}")
            continue
        if n.op == "get_attr":
            obj: Any = gm
            for part in n.target.split("."):
                obj = getattr(obj, part)
            target = f"attr {n.target} {_tensor_digest(obj) if isinstance(obj, torch.Tensor) else id(obj)}"
        else:
            target = _target_name(n.target)
        lines.append(f"{n.op} {target} {arg(n.args)!r} {arg(n.kwargs)!r} {layer_of(n)!r}")
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def _group_sizes(gm: fx.GraphModule) -> list[tuple[str, Any]]:
    """``(name, world size)`` of each process group the graph's comm ops name (``None``: a
    name that resolves to no group here), sorted."""
    sizes: dict[str, Any] = {}
    for n in gm.graph.nodes:
        name = comm_group_name(n)
        if name is not None and name not in sizes:
            try:
                sizes[name] = ep_world_size(name)
            except CommBackendError:  # the bind pass refused it for our own ops
                sizes[name] = None
    return sorted(sizes.items())


def _tensor_digest(t: torch.Tensor) -> str:
    """A constant tensor's dtype, shape and values (a module attribute baked in the graph)."""
    data = t.detach().cpu().contiguous()
    return hashlib.sha256(repr((data.dtype, tuple(data.shape))).encode()
                          + data.view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


# -- entries -----------------------------------------------------------------------------------


def _path(directory: str, key: str) -> str:
    return os.path.join(os.path.expanduser(directory), f"{key}.pkl")


def write_entry(directory: str, key: str, payload: dict[str, Any]) -> bool:
    """Write ``payload`` as the entry of ``key`` (atomically); ``False`` (and a WARNING) where
    the directory cannot be written or the payload pickled."""
    path = _path(directory, key)
    entry = {"format": FORMAT, "key": key, "torch": torch.__version__,
             "package": package_digest(), "payload": payload}
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        data = pickle.dumps(entry, protocol=pickle.HIGHEST_PROTOCOL)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=f".{key[:16]}.",
                                   suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
    except Exception as e:  # noqa: BLE001 - a cache that cannot be written is only slower
        log.warning("dbo: compile cache: could not write %s (%s: %s)", path, type(e).__name__, e)
        return False
    log.info("dbo: compile cache: wrote %s (%d bytes)", path, len(data))
    return True


def read_entry(directory: str, key: str) -> dict[str, Any] | None:
    """The payload of ``key``'s entry, or ``None``: no entry, or one that is ignored (a
    WARNING says which file and why: unreadable, corrupt, another key or other versions)."""
    path = _path(directory, key)
    if not os.path.exists(path):
        return None
    try:
        with open(path, "rb") as f:
            entry = pickle.load(f)
    except Exception as e:  # noqa: BLE001 - a corrupt entry is ignored, never used
        log.warning("dbo: compile cache: ignoring %s: cannot be read (%s: %s)", path,
                    type(e).__name__, e)
        return None
    expected = {"format": FORMAT, "key": key, "torch": torch.__version__,
                "package": package_digest()}
    if not isinstance(entry, dict) or not isinstance(entry.get("payload"), dict):
        log.warning("dbo: compile cache: ignoring %s: not an entry", path)
        return None
    stale = {k: entry.get(k) for k, v in expected.items() if entry.get(k) != v}
    if stale:
        log.warning("dbo: compile cache: ignoring %s: stale (%s, expected %s)", path, stale,
                    {k: expected[k] for k in stale})
        return None
    return entry["payload"]


def ignore(directory: str, key: str, why: BaseException) -> None:
    """Log that ``key``'s entry, read but not usable, is ignored (it is then rewritten)."""
    log.warning("dbo: compile cache: ignoring %s: it does not rebuild (%s: %s)",
                _path(directory, key), type(why).__name__, why)


def unit_graphs(units: Sequence[Callable]) -> list[fx.GraphModule]:
    """The GraphModule behind each unit callable (an Inductor stage's traced graph)."""
    return [getattr(u, "gm", u) for u in units]


# -- the entry records ------------------------------------------------------------------------


class _Entry:
    """An entry record: its payload (what the file holds) is its fields by name and its
    ``kind``; :func:`load` picks the record by ``kind``."""

    kind: ClassVar[str] = ""

    def payload(self) -> dict[str, Any]:
        return {"kind": self.kind, **{f.name: getattr(self, f.name) for f in fields(self)}}

    @classmethod
    def from_payload(cls, payload: dict[str, Any]) -> Any:
        """Raises ``KeyError`` for a payload missing a field (an entry of another layout)."""
        return cls(**{f.name: payload[f.name] for f in fields(cls)})


@dataclass
class SplitEntry(_Entry):
    """The entry of a split graph (:data:`FORMAT`), ``kind`` ``"split"``.

    Attributes:
        specs / signature / kv_block_sizes / output_specs / float_guards / state_inputs:
            the :class:`~dbo_compile.runtime.program.SplitRecord`'s; ``alias``: its
            ``program_alias``.
        lowered: the lowered graph (:func:`dump_graph`).
        units: the unit graphs, each once: ``(graph, an Inductor stage?, why it runs ATen)``.
        programs: per distinct candidate program ``(name, schedule dict, unit index per
            schedule unit, unit_io, wrapper code, number of events)``, the primary first.
        split_plan / unsplit_plan: the drain plans (:func:`dump_plan`).
        collectives: ``(split_collectives, unsplit_collectives)``.
    """

    kind: ClassVar[str] = "split"
    specs: list
    signature: Any
    lowered: dict[str, Any]
    units: list[tuple[dict[str, Any], bool, str | None]]
    programs: list[tuple]
    alias: dict[str, str]
    kv_block_sizes: Any
    output_specs: Any
    split_plan: Any
    unsplit_plan: Any
    float_guards: tuple
    state_inputs: tuple
    collectives: tuple

    @classmethod
    def of(cls, record: SplitRecord, programs: dict[str, SplitProgram]) -> SplitEntry:
        """The entry of a compiled artifact's ``record`` and its distinct candidate
        ``programs`` (unit graphs stored once each).

        Raises:
            ValueError: a graph that cannot be stored (:func:`dump_graph`).
        """
        callables: dict[int, int] = {}
        units: list[tuple[dict, bool, str | None]] = []
        entries = []
        for name, prog in programs.items():
            index = []
            for fn in prog.units:
                if id(fn) not in callables:  # (graph, an Inductor stage?, why it runs ATen)
                    callables[id(fn)] = len(units)
                    units.append((dump_graph(getattr(fn, "gm", fn)),
                                  not isinstance(fn, fx.GraphModule),
                                  getattr(fn, "aten_reason", None)))
                index.append(callables[id(fn)])
            entries.append((name, prog.schedule.to_dict(), index, prog.unit_io, prog.code,
                            prog.num_events))
        return cls(record.specs, record.signature, dump_graph(record.lowered_gm), units, entries,
                   record.program_alias, record.kv_block_sizes, record.output_specs,
                   dump_plan(record.split_plan), dump_plan(record.unsplit_plan),
                   tuple(record.float_guards), tuple(record.state_inputs),
                   (record.split_collectives, record.unsplit_collectives))

    def rebuild(self, config: DboConfig, stages: StageCompiler, gm: fx.GraphModule
                ) -> tuple[SplitRecord, dict[str, SplitProgram]]:
        """The artifact's record and its distinct programs, as compiled; ``gm``: the bound
        Dynamo graph (the float guards' fallback compiles it unsplit)."""
        made = [load_graph(data) for data, _, _ in self.units]
        programs: dict[str, SplitProgram] = {}
        staged_fns: dict[int, Callable] = {}
        compile_stage = stages.compile_stage
        for name, sched, index, unit_io, code, num_events in self.programs:
            schedule = Schedule.from_dict(sched)
            fns = []
            for unit, i in zip(schedule.units, index):
                fn = made[i]
                _, staged, aten_reason = self.units[i]
                if staged and compile_stage is not None:
                    if i not in staged_fns:  # one stage per unit graph, as compiled
                        staged_fns[i] = compile_stage(fn, unit)
                        # the rebuilt graph has no meta["val"] to find a value int in
                        staged_fns[i].aten_reason = aten_reason or staged_fns[i].aten_reason
                    fn = staged_fns[i]
                fns.append(fn)
            programs[name] = SplitProgram.from_parts(schedule, fns, unit_io, code, num_events,
                                                     carveout_sms=carveout_sms(config))
        lowered = stages.lowered_from_cache(self.lowered)
        record = SplitRecord(
            stages.unsplit(lowered), candidate_programs(programs, self.alias, config),
            self.specs, self.signature, config, program_alias=self.alias,
            kv_block_sizes=self.kv_block_sizes, output_specs=self.output_specs,
            split_plan=load_plan(self.split_plan), unsplit_plan=load_plan(self.unsplit_plan),
            float_guards=self.float_guards,
            guard_fallback=stages.unsplit(gm) if self.float_guards else None,
            state_inputs=self.state_inputs, split_collectives=self.collectives[0],
            unsplit_collectives=self.collectives[1], lowered_gm=lowered,
            split_gm=None,  # not stored: nothing runs it
            token_symbols=None)  # no traced graphs to read them in (calibrate.py refuses)
        return record, programs


@dataclass
class UnsplittableEntry(_Entry):
    """The entry of a graph the passes found unsplittable (:data:`FORMAT`), ``kind``
    ``"unsplittable"``: the error's message and, in the other fields, the facts the raiser
    set on it (:class:`~dbo_compile.errors.UnsplittableGraphError`'s attributes, by name: a
    new fact is one field here)."""

    kind: ClassVar[str] = "unsplittable"
    reason: str
    row_local: bool = False
    state_inputs: tuple = ()
    folds_token_rows: bool = False

    @classmethod
    def of(cls, error: UnsplittableGraphError) -> UnsplittableEntry:
        facts = [f.name for f in fields(cls)][1:]
        return cls(str(error), **{name: getattr(error, name) for name in facts})

    def error(self) -> UnsplittableGraphError:
        """The error, as the compile raised it (its message marked ``(compile cache)``)."""
        e = UnsplittableGraphError(f"{self.reason} (compile cache)")
        for f in fields(self)[1:]:
            setattr(e, f.name, getattr(self, f.name))
        return e


def store(directory: str, key: str, record: SplitRecord,
          programs: dict[str, SplitProgram]) -> bool:
    """Write the entry of a compiled artifact (:meth:`SplitEntry.of`); ``False`` (and a
    WARNING) where it cannot be stored or written."""
    try:
        entry = SplitEntry.of(record, programs)
    except ValueError as e:
        log.warning("dbo: compile cache: not writing this graph: %s", e)
        return False
    return write_entry(directory, key, entry.payload())


def store_unsplittable(directory: str, key: str, error: UnsplittableGraphError) -> bool:
    """Write that ``key``'s graph is unsplittable, and why."""
    return write_entry(directory, key, UnsplittableEntry.of(error).payload())


def load(directory: str, key: str, gm: fx.GraphModule, config: DboConfig,
         stages: StageCompiler, folds: tuple[tuple[int, float], ...]
         ) -> tuple[SplitRecord, dict[str, SplitProgram]] | None:
    """The record and distinct programs of ``key``'s entry (``None``: no usable entry, the
    graph is compiled); ``gm``: the bound Dynamo graph (the float guards' fallback compiles it
    unsplit); ``folds``: the floats this graph's lowering would fold
    (:func:`~dbo_compile.lowering.folded_floats`), which must be the entry's (they are part
    of the key; an entry folding others is ignored).

    Raises:
        UnsplittableGraphError: the entry says the graph is unsplittable (why, as compiled).
    """
    payload = read_entry(directory, key)
    if payload is None:
        return None
    try:
        if payload.get("kind") == UnsplittableEntry.kind:
            verdict = UnsplittableEntry.from_payload(payload).error()
        else:
            verdict = None
            entry = SplitEntry.from_payload(payload)
            if tuple(entry.float_guards) != tuple(folds):
                raise ValueError(f"its programs fold the floats (input, value) "
                                 f"{list(entry.float_guards)}, this graph's inputs hold "
                                 f"{list(folds)}")
            record, programs = entry.rebuild(config, stages, gm)
    except Exception as e:  # noqa: BLE001 - an entry that does not rebuild is ignored
        ignore(directory, key, e)
        return None
    if verdict is not None:
        raise verdict
    log.info("dbo: compile cache: read %s's entry (%d candidate programs)", key[:16],
             len(programs))
    return record, programs
