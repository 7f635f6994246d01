"""The pass manager: runs pass lists over a graph and the state the passes hand on.

A pass is a :class:`GraphPass` record that its own module exports (``split_ubatch.PASS``):
its name, its function ``run(gm, state)`` and the facts of the :class:`CompileState` it reads
and writes. The pipeline (:mod:`dbo_compile.passes.pipeline`) names the lists; the manager
runs them::

    manager = PassManager()
    gm = manager.run(gm, [lower.PASS, reinplace.PASS, ...], state)

and for each pass, in order:

1. skips it when ``config.disable_passes`` names it (only a pass declared ``optional``: the
   program is correct without it; :func:`check_disabled` refuses the others);
2. checks that every fact it ``reads`` was written before (given to the state, or written by
   an earlier pass), else :class:`~dbo_compile.errors.PipelineError`;
3. times it: ``manager.times[name]`` (``name[tag]`` for a candidate's pass; the keys of
   ``artifact.compile_times``), a DEBUG line ``dbo pass NN name: s``, and torch's
   ``dynamo_timed("dbo.<name>")``, so that torch's compile-time tooling (the
   ``compilation_time_metrics``, the chromium trace tlparse reads) sees our passes;
4. checks that the state fields it replaced are among its ``writes``;
5. dumps the graph after it as the ``trace_structured`` artifact ``dbo_NN_<name>`` (tlparse
   shows them; DEBUG prints them), ``NN`` numbering every pass of the compile;

and lints and recompiles the graph once, at the end of the list, where a pass changed it.

A user pass (vLLM's ``PostGradPassManager.add()``) is one :class:`GraphPass` and one call::

    MY_PASS = GraphPass("my_pass", my_run, reads=("token_symbols",), optional=True)
    handle = register_pass(MY_PASS, after="token_dim")   # handle.remove() takes it out

It then runs in every list holding the pass named by ``after`` (it may name another user
pass), right after it, in registration order; :func:`~dbo_compile.passes.pipeline.pass_names`
lists it, and ``compile_times`` and the dumps name it as any other pass. The compile cache's
key holds each registered user pass's :func:`pass_uuid` (its name, place and source), so an
entry compiled without it, or with another version of it, is not read back.
"""

from __future__ import annotations

import collections
import hashlib
import inspect
import itertools
import logging
import time
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

import torch.fx as fx
from torch._dynamo.utils import dynamo_timed
from torch._logging import trace_structured
from torch.utils.hooks import RemovableHandle

from dbo_compile.config import DboConfig
from dbo_compile.errors import DboConfigError, PipelineError
from dbo_compile.signature import InputSpec, OutputSpec, SplitSignature

if TYPE_CHECKING:
    from dbo_compile.candidates import Candidate
    from dbo_compile.schedule import Schedule

log = logging.getLogger(__name__)

__all__ = ["CompileState", "GraphPass", "PassManager", "check_disabled", "dump_graph",
           "pass_uuid", "register_pass", "registered_passes", "user_pass_keys"]

#: the facts a :class:`CompileState` holds when it is made
GIVEN = ("config", "example_inputs", "input_kinds")


@dataclass
class CompileState:
    """What the passes of one graph hand on to each other: one field per fact, each written
    by one pass (its producer) and read by later ones (its consumers). The manager checks
    that a pass reads only facts written before it (:class:`GraphPass`).

    Attributes:
        config: the options (resolved device defaults; never changed by a pass). Given; read
            by every pass that needs an option.
        example_inputs: one value per Dynamo placeholder. Given; read by ``lower``.
        input_kinds: explicit input kinds for graphs not from Dynamo (``None``: from sources).
            Given; read by ``lower``.
        specs: the input classification. Written by ``lower``; ``state_threads`` adds the
            row-validity input; read by ``find_comm``, ``split_ubatch`` and the artifact.
        token_symbols: the symbols of the token and request dims. Written by ``lower``; read
            by ``token_dim``, ``stream_assign`` (the cost model) and the artifact.
        token_symbol: the symbol of the token dim. Written by ``lower``; read by
            ``token_dim``, ``state_threads`` and the drain plans.
        request_symbols: the symbols of the request dims. Written by ``lower``; read by
            ``token_dim`` (its messages).
        float_guards: ``(input index, value)`` of the floats folded into the graph. Written
            by ``lower`` (:func:`~dbo_compile.lowering.fold_tensorified_floats`); read by the
            artifact.
        output_specs: what each graph output is. Written by ``token_dim``; read by the
            artifact.
        threads: the state threads (in-place updates of shared inputs from the tokens) and
            token-free writes of shared inputs. Written by ``state_threads``; read by
            ``find_comm`` (a fold of token rows) and ``split_ubatch``.
        comms: the issuing comm nodes of the lowered graph. Written by ``find_comm``; read by
            the candidate driver (the schedule's ``meta``, the log).
        signature: how the split graph maps to the lowered one. Written by
            ``split_ubatch``; read by the artifact.
        joined_calls: routed-expert calls joined in the last joined graph. Written by
            ``join_experts``; read by the candidate driver.
        candidate: the schedule candidate being compiled. Written by the candidate driver;
            read by ``stream_assign``.
        schedule: the last candidate's schedule. Written by ``stream_assign``; read by the
            candidate driver.
        unit_graphs: per split graph (``id`` of its ``fx.Graph``), the units its schedule
            candidates share. A memo of ``stream_assign`` (found by the first candidate).
        written: the facts written so far (:data:`GIVEN` at first).
    """

    config: DboConfig
    example_inputs: Sequence[Any]
    input_kinds: Sequence[str] | None = None
    specs: list[InputSpec] = field(default_factory=list)
    token_symbols: frozenset = frozenset()
    token_symbol: Any = None
    request_symbols: frozenset = frozenset()
    float_guards: tuple[tuple[int, float], ...] = ()
    output_specs: tuple[OutputSpec, ...] = ()
    threads: list = field(default_factory=list)
    comms: list[fx.Node] = field(default_factory=list)
    signature: SplitSignature | None = None
    joined_calls: int = 0
    candidate: Candidate | None = None
    schedule: Schedule | None = None
    unit_graphs: dict[int, Any] = field(default_factory=dict)
    written: set[str] = field(default_factory=lambda: set(GIVEN))

    def write(self, **facts: Any) -> None:
        """Set facts outside a pass (the candidate driver's ``candidate``)."""
        for name, value in facts.items():
            setattr(self, name, value)
        self.written |= set(facts)


#: the fields of :class:`CompileState` that are facts (all but the bookkeeping)
FACTS = tuple(f.name for f in fields(CompileState) if f.name != "written")


@dataclass(frozen=True)
class GraphPass:
    """One pass: ``run(gm, state)`` changes ``gm`` in place and returns ``None``, or returns
    the new GraphModule that replaces it (``lower``, ``split_ubatch``).

    Attributes:
        name: as in ``compile_times``, the dumps and ``DboConfig.disable_passes``.
        run: the pass.
        reads: the :class:`CompileState` facts it reads (each written before it runs).
        writes: the facts it writes (a field it replaces must be named here).
        changes_graph: the pass adds, removes or rewires nodes (the manager then lints and
            recompiles at the end of the list); ``False`` for passes that only annotate.
        optional: the program is correct without it, so ``DboConfig.disable_passes`` may
            name it (a debug switch); ``False`` for the passes the split depends on.
    """

    name: str
    run: Callable[[fx.GraphModule, CompileState], fx.GraphModule | None]
    reads: tuple[str, ...] = ()
    writes: tuple[str, ...] = ()
    changes_graph: bool = True
    optional: bool = False

    def __post_init__(self) -> None:
        unknown = sorted(set(self.reads + self.writes) - set(FACTS))
        if unknown:
            raise PipelineError(f"pass {self.name!r} names {unknown}, which are no facts of "
                                f"CompileState; the facts are {list(FACTS)}")


# -- user passes --------------------------------------------------------------------------------

#: registered user passes: handle id -> (the pass, the name of the pass it runs after)
_USER_PASSES: collections.OrderedDict[int, tuple[GraphPass, str]] = collections.OrderedDict()


def register_pass(graph_pass: GraphPass, *, after: str) -> RemovableHandle:
    """Run ``graph_pass`` in every pass list right after the pass named ``after`` (a pass of
    the pipeline, :func:`~dbo_compile.passes.pipeline.pass_names`, or a user pass registered
    before), from the next compile on, in this process; passes registered after the same
    pass run in registration order.

    Returns:
        A handle whose ``remove()`` unregisters it.

    Raises:
        PipelineError: another user pass has its name (and at compile time, in
            :func:`~dbo_compile.passes.pipeline.compile_split`: a pipeline pass has its name,
            or ``after`` names no pass).
    """
    taken = {p.name for p, _ in _USER_PASSES.values()}
    if graph_pass.name in taken or graph_pass.name == after:
        raise PipelineError(f"a pass named {graph_pass.name!r} is registered already; give "
                            "the user pass a name of its own")
    handle = RemovableHandle(_USER_PASSES)
    _USER_PASSES[handle.id] = (graph_pass, after)
    return handle


def registered_passes() -> list[tuple[GraphPass, str]]:
    """The user passes, ``(pass, after)`` in registration order."""
    return list(_USER_PASSES.values())


def pass_uuid(graph_pass: GraphPass) -> str:
    """What identifies a pass's code (vLLM's ``InductorPass.uuid()``): its name, its
    function's module and qualified name, and a SHA-256 of the function's source (of its
    ``repr`` where Python cannot find the source: a builtin, a ``functools.partial``)."""
    fn = graph_pass.run
    try:
        source = inspect.getsource(fn)
    except (OSError, TypeError):
        source = repr(fn)
    where = f"{getattr(fn, '__module__', None)}.{getattr(fn, '__qualname__', type(fn).__name__)}"
    return f"{graph_pass.name} {where} {hashlib.sha256(source.encode()).hexdigest()[:16]}"


def user_pass_keys() -> list[str]:
    """One line per registered user pass, ``"<pass_uuid> after <name>"``, in registration
    order: what the compile cache's key adds for them (``[]``: none registered)."""
    return [f"{pass_uuid(p)} after {after}" for p, after in _USER_PASSES.values()]


def with_user_passes(passes: Iterable[GraphPass]) -> list[GraphPass]:
    """``passes`` with each registered user pass right after the pass it names."""
    out: list[GraphPass] = []

    def add(p: GraphPass) -> None:
        out.append(p)
        for user, after in _USER_PASSES.values():
            if after == p.name:
                add(user)

    for p in passes:
        add(p)
    return out


def check_disabled(config: DboConfig, passes: Iterable[GraphPass]) -> None:
    """``config.disable_passes`` names only optional passes of ``passes`` (every pass list).

    Raises:
        DboConfigError: a name that is no pass, or a pass the split needs; names the passes
            that can be disabled.
    """
    passes = list(passes)
    optional = [p.name for p in passes if p.optional]
    bad = [n for n in config.disable_passes if n not in optional]
    if bad:
        known = {p.name for p in passes}
        what = ", ".join(f"{n!r} ({'needed by the split' if n in known else 'no pass'})"
                         for n in bad)
        raise DboConfigError(f"DboConfig.disable_passes: cannot disable {what}; the passes "
                             f"that can be disabled are {optional}")


# -- the manager --------------------------------------------------------------------------------


class PassManager:
    """Runs pass lists (module docstring).

    Attributes:
        times: seconds per pass (``name``, or ``name[tag]`` for a candidate's), in the order
            run: the artifact's ``compile_times``.
    """

    def __init__(self):
        self.times: dict[str, float] = {}
        self._number = itertools.count()
        self._last = -1

    def run(self, gm: fx.GraphModule, passes: Sequence[GraphPass], state: CompileState,
            tag: str = "") -> fx.GraphModule:
        """Run ``passes`` (with the user passes registered after them) over ``gm``; returns
        the graph after the last one.

        Raises:
            PipelineError: a pass reads a fact nothing wrote before it, or replaces a field
                of the state it does not declare.
            (and whatever a pass raises)
        """
        changed = False
        for p in with_user_passes(passes):
            if p.name in state.config.disable_passes:
                log.debug("dbo pass %s: disabled (DboConfig.disable_passes)", p.name)
                continue
            missing = [f for f in p.reads if f not in state.written]
            if missing:
                raise PipelineError(f"pass {p.name!r} reads {missing}, which no pass before it "
                                    f"wrote (written: {sorted(state.written)}); run it after "
                                    "their producers (CompileState lists them)")
            before = {f: getattr(state, f) for f in FACTS}
            out = self.time(p.name, p.run, gm, state, tag=tag)
            replaced = [f for f in FACTS if getattr(state, f) is not before[f]]
            undeclared = [f for f in replaced if f not in p.writes]
            if undeclared:
                raise PipelineError(f"pass {p.name!r} wrote {undeclared} but declares writes="
                                    f"{p.writes}; declare every fact it writes")
            state.written |= set(p.writes)
            if out is not None:
                gm, changed = out, False  # a new module, made consistent by its pass
            changed |= p.changes_graph
            dump_graph(f"{self._last:02d}_{p.name}", gm)
        if changed:
            gm.graph.lint()
            gm.recompile()
        return gm

    def time(self, name: str, fn: Callable[..., Any], *args: Any, tag: str = "") -> Any:
        """``fn(*args)``, timed as pass ``name`` (``name[tag]``)."""
        key = f"{name}[{tag}]" if tag else name
        self._last = next(self._number)
        t0 = time.perf_counter()
        with dynamo_timed(f"dbo.{name}"):
            out = fn(*args)
        dt = time.perf_counter() - t0
        self.times[key] = self.times.get(key, 0.0) + dt
        log.debug("dbo pass %02d %s: %.3f s", self._last, key, dt)
        return out


def dump_graph(name: str, gm: fx.GraphModule) -> None:
    """The graph after a pass, as a ``trace_structured`` artifact ``dbo_<name>`` and at DEBUG
    (formatted only when someone listens)."""
    try:
        trace_structured("artifact", metadata_fn=lambda: {"name": f"dbo_{name}",
                                                          "encoding": "string"},
                         payload_fn=lambda: gm.print_readable(print_output=False))
    except Exception:  # noqa: BLE001 - logging must never break compilation
        pass
    if log.isEnabledFor(logging.DEBUG):
        log.debug("dbo graph after %s:\n%s", name, gm.graph.python_code("self").src)
