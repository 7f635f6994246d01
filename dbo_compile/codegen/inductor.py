"""``compute_backend="inductor"``: each compute stage (and the unsplit program) compiled by Inductor.

The split program's compute units are small FX graphs of ATen ops (one stage of one ubatch).
Run as traced, every ATen op is at least one kernel, and a split step runs about twice the
kernels of the unsplit one — measured on 2x H200 it is most of the price of splitting in decode
(README). Inductor fuses the elementwise ops of a stage (norms, residual adds, routing, the
dispatch packing) into a few Triton kernels, for the split and the unsplit program alike, so the
runtime still compares like with like.

:class:`InductorStage` compiles a graph with ``torch._inductor.compile`` (Inductor without
Dynamo) the first time it sees an input signature (shapes, strides, dtypes, devices, int
values) and keeps one compiled callable per signature: the runtime pads token counts to a few
buckets, so a stage compiles once per bucket. Stages that are the same program — the other
ubatch's copy of a stage, the same stage in the next layer (weights are graph inputs) — share
one compilation through a :class:`StageCache`: equal graphs up to node names, called with the
same signature, get the callable Inductor compiled for the first of them (a two-bucket warm-up
of the benchmarks' 4-layer tiny model compiles 15 stages instead of 61). Comm units are never
handed to Inductor: they stay the one comm op they are, issued on the comm stream by the
generated wrapper.

Compiling inside CUDA-graph capture would launch (autotuning) and allocate outside the graph's
pool, so a signature first seen while the current stream is capturing raises
:class:`~dbo_compile.errors.UBatchExecutionError`: warm the bucket up before capturing it
(:class:`~dbo_compile.runtime.cudagraph_runner.CudaGraphRunner` does). Within
:func:`~dbo_compile.runtime.context.traced_only` (the runner's layout probe) a stage compiles
nothing and runs its traced ATen ops.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
import torch._inductor
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from dbo_compile.errors import UBatchExecutionError
from dbo_compile.runtime.context import in_traced_only
from dbo_compile.schedule import annotate_stream

log = logging.getLogger(__name__)

__all__ = ["MAX_SIGNATURES", "InductorStage", "StageCache", "inductor_stage_compiler"]

#: input signatures one stage compiles at most (Dynamo's default recompile limit is also 8)
MAX_SIGNATURES = 8


def _signature(args: tuple[Any, ...]) -> tuple:
    """Everything Inductor specialises on; a comm op's output comes in as one tuple."""
    leaves, spec = pytree.tree_flatten(args)
    key: list[Any] = [spec]
    for a in leaves:
        if isinstance(a, torch.Tensor):
            key.append((tuple(a.shape), a.stride(), a.dtype, a.device, a.requires_grad))
        elif isinstance(a, (int, float, bool, str, type(None))):
            key.append((type(a), a))
        else:
            key.append((type(a), id(a)))
    return tuple(key)


class _Ref:
    """Stands for a node (by position) or a tensor (by identity) in :func:`_program`'s text;
    its ``repr`` is unquoted, so no string argument reads the same."""

    __slots__ = ("text",)

    def __init__(self, text: str):
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _program(gm: fx.GraphModule) -> str:
    """``gm``'s graph as text that two graphs share exactly when they compute the same thing
    from the same inputs: nodes by position instead of name, module attributes (weights,
    submodules), functions and tensor arguments by identity, other arguments and the rest of
    ``meta["custom"]`` (annotations Inductor reads) by ``repr``, which is exact for what ATen
    graphs hold (ints, floats, bools, dtypes, devices, layouts, memory formats). The same
    program may get two texts (an argument whose ``repr`` holds an address), which only costs
    a compilation."""
    refs: dict[fx.Node, _Ref] = {}

    def arg(a: Any) -> Any:
        if isinstance(a, fx.Node):
            return refs[a]
        return _Ref(f"<tensor {id(a)}>") if isinstance(a, torch.Tensor) else a

    lines = []
    for n in gm.graph.nodes:
        refs[n] = _Ref(f"%{len(refs)}")
        if n.op == "placeholder":
            target: Any = "placeholder"  # its name is the node's name
        elif n.op in ("get_attr", "call_module"):
            obj = gm
            for part in n.target.split("."):
                obj = getattr(obj, part)
            target = f"{n.op} {id(obj)}"
        elif n.op == "call_function":
            target = f"{n.target!r} {id(n.target)}"
        else:  # call_method (a name), output
            target = repr(n.target)
        args = fx.node.map_aggregate((n.args, n.kwargs), arg)
        lines.append(f"{n.op} {target} {args!r} {n.meta.get('custom')!r}")
    return "\n".join(lines)


def _layout(args: tuple[Any, ...]) -> tuple:
    """What compiled code may assume of its tensor inputs beyond :func:`_signature`: which
    alias each other (index of the first input on the same storage) and which are 16-byte
    aligned (Inductor's alignment)."""
    leaves = [a for a in pytree.tree_leaves(args) if isinstance(a, torch.Tensor)]
    first: dict[int, int] = {}
    out = []
    for i, t in enumerate(leaves):
        try:
            storage = t.untyped_storage().data_ptr()
        except Exception:  # noqa: BLE001 - a tensor without storage aliases nothing
            storage = -1 - i
        out.append((first.setdefault(storage, i), t.storage_offset() * t.element_size() % 16 == 0))
    return tuple(out)


class StageCache:
    """Compiled callables shared by the stages of one split program (and its schedule
    candidates): stages whose graphs are the same program (:func:`_program`) and that are called
    with the same input signature and :func:`_layout` use the callable Inductor compiled for
    the first of them. A compilation Inductor failed is shared too (the stages then run their
    own traced ATen ops).

    Attributes:
        compiles: Inductor compilations run (one per distinct program and signature).
        reused: first calls of a stage with a signature served by another stage's compilation.
    """

    def __init__(self):
        self.compiles = 0
        self.reused = 0
        self._fns: dict[tuple, Callable | None] = {}
        self._lock = threading.Lock()

    def get(self, key: tuple) -> tuple[bool, Callable | None]:
        """``(found, callable)``; the callable is ``None`` where Inductor failed."""
        with self._lock:
            if key in self._fns:
                self.reused += 1
                return True, self._fns[key]
            return False, None

    def put(self, key: tuple, fn: Callable | None) -> None:
        with self._lock:
            self.compiles += 1
            self._fns[key] = fn


def _drop_stream_annotations(gm: fx.GraphModule) -> None:
    """The wrapper already runs the whole stage on its stream; Inductor would read a
    ``meta["custom"]["stream"]`` (a user's annotation: stages of our own carry none, see
    :mod:`dbo_compile.passes.meta`) as a request to switch streams inside the stage."""
    for n in gm.graph.nodes:
        annotate_stream(n.meta, None)


def _fake_inputs(args: tuple[Any, ...]) -> list[Any]:
    """Static-shape fake copies of ``args`` in a fake mode that has a shape env: Inductor's FX
    graph cache needs one (without it every stage bypasses the cache, and the stage of the next
    layer, identical but for its weights, compiles again)."""
    mode = FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=True)
    return [pytree.tree_map_only(torch.Tensor, lambda t: mode.from_tensor(t, static_shapes=True), a)
            for a in args]


def _as_traced(fn: Callable, tuple_out: bool) -> Callable:
    """Inductor returns a tuple-output graph's outputs as a list: give them back as the traced
    graph does."""
    if not tuple_out:
        return fn

    def call(*args: Any) -> Any:
        out = fn(*args)
        return tuple(out) if isinstance(out, list) else out

    return call


def _capturing(args: tuple[Any, ...]) -> bool:
    if not torch.cuda.is_available():
        return False
    return any(isinstance(a, torch.Tensor) and a.is_cuda for a in pytree.tree_leaves(args)) and \
        torch.cuda.is_current_stream_capturing()


class InductorStage:
    """A graph compiled by Inductor, once per input signature.

    Args:
        gm: a GraphModule of ATen ops (a schedule unit, or the whole unsplit program); its
            parameters and buffers (``get_attr``) are lifted to inputs by Inductor.
        name: for logs and errors, e.g. ``"unit 12 (u0.L1.experts)"``.
        cache: shared with the other stages of the program, so that stages computing the same
            program compile once (:class:`StageCache`); default: a cache of its own.

    Calling it with tensors of a new signature compiles (seconds; inference graph, whatever the
    caller's grad mode: the backend compiles inference steps); later calls with the same
    signature run the compiled code. The traced ATen graph runs instead, with a warning, where
    compiling would not pay or cannot work:

    - the graph takes an int input that is not a tensor size (a step counter, a cache
      position): compiled code bakes ints in, so every new value would compile again;
    - after :data:`MAX_SIGNATURES` signatures (Dynamo's default recompile limit): the eager
      path (no buckets) with ever new token counts must not compile every step;
    - Inductor raised while compiling this signature.

    Within :func:`~dbo_compile.runtime.context.traced_only`, a signature not compiled yet runs the traced ATen graph and
    compiles nothing.

    Raises UBatchExecutionError if the first call with a signature happens during CUDA-graph
    capture (and outside ``traced_only``).
    """

    def __init__(self, gm: fx.GraphModule, name: str, cache: StageCache | None = None):
        _drop_stream_annotations(gm)
        self.gm = gm
        self.name = name
        self.cache = cache if cache is not None else StageCache()
        self._program = _program(gm)
        self.compiled: dict[tuple, Callable] = {}
        self.compile_s = 0.0
        self.uncompiled_calls = 0
        self._lock = threading.Lock()
        out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        self._tuple_out = isinstance(out, tuple)
        value_ints = _value_int_inputs(gm)
        self.aten_reason: str | None = None
        if value_ints:
            self.aten_reason = (
                f"int input(s) {value_ints} are values, not tensor sizes (e.g. a step counter): "
                "compiled code would be specialised to each value")
            log.warning("dbo: %s runs its traced ATen ops, not Inductor: %s", name,
                        self.aten_reason)

    def __call__(self, *args: Any) -> Any:
        if self.aten_reason is not None:
            self.uncompiled_calls += 1
            with torch.no_grad():  # like the compiled stages: no autograd history
                return self.gm(*args)
        key = _signature(args)
        fn = self.compiled.get(key)
        if fn is None:
            if in_traced_only():
                with torch.no_grad():
                    return self.gm(*args)
            if len(self.compiled) >= MAX_SIGNATURES:
                if self.uncompiled_calls == 0:
                    log.warning(
                        "dbo: %s has been compiled by Inductor for %d input signatures; new ones "
                        "run the traced ATen ops. Pad token counts to a few buckets "
                        "(CudaGraphRunner does) or use compute_backend='aten'.", self.name,
                        MAX_SIGNATURES)
                self.uncompiled_calls += 1
                fn = self.gm
            else:
                fn = self._compile(key, args)
        with torch.no_grad():
            return fn(*args)

    def _compile(self, key: tuple, args: tuple[Any, ...]) -> Callable:
        if _capturing(args):
            shapes = [tuple(a.shape) for a in pytree.tree_leaves(args) if isinstance(a, torch.Tensor)]
            raise UBatchExecutionError(
                f"dbo: {self.name} meets input shapes {shapes} for the first time during CUDA-graph "
                "capture; Inductor cannot compile inside a capture. Run the step once eagerly at "
                "this bucket before capturing it (CudaGraphRunner.warmup does).")
        with self._lock:
            fn = self.compiled.get(key)
            if fn is not None:
                return fn
            shared_key = (self._program, key, _layout(args))
            found, fn = self.cache.get(shared_key)
            if found:
                log.debug("dbo: %s runs the code Inductor compiled for the same program and "
                          "signature", self.name)
                fn = self.gm if fn is None else fn
                self.compiled[key] = fn
                return fn
            t0 = time.perf_counter()
            # a fresh GraphModule over a copy of the graph (weights shared): Inductor rewrites
            # the graph it is given (e.g. a single output into a tuple), and self.gm must stay
            # the traced program for the next signature and for the ATen fallback
            gm = fx.GraphModule(self.gm, copy.deepcopy(self.gm.graph))
            try:
                with torch.no_grad():  # an inference graph even if the caller records autograd
                    fn = _as_traced(torch._inductor.compile(gm, _fake_inputs(args)), self._tuple_out)
            except Exception as e:  # noqa: BLE001 - a stage Inductor cannot compile still runs
                log.warning("dbo: Inductor could not compile %s (%s: %s); it runs its traced ATen "
                            "ops for these input shapes", self.name, type(e).__name__,
                            str(e).splitlines()[0][:300] if str(e) else "")
                fn = self.gm
                self.cache.put(shared_key, None)
            else:
                log.info("dbo: Inductor compiled %s for signature %d (%.2f s)", self.name,
                         len(self.compiled) + 1, time.perf_counter() - t0)
                self.cache.put(shared_key, fn)
            self.compile_s += time.perf_counter() - t0
            self.compiled[key] = fn
        return fn


def _value_int_inputs(gm: fx.GraphModule) -> list[str]:
    """Placeholders holding a symbolic int that is no tensor input's size or stride."""
    def val(n: fx.Node) -> Any:
        return n.meta.get("val", n.meta.get("example_value"))

    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    size_symbols: set = set()
    for n in placeholders:
        for t in pytree.tree_leaves(val(n)):
            if isinstance(t, torch.Tensor):
                for d in (*t.shape, *t.stride()):
                    if isinstance(d, torch.SymInt):
                        size_symbols |= d.node.expr.free_symbols
    return [n.name for n in placeholders
            if isinstance(val(n), torch.SymInt)
            and not val(n).node.expr.free_symbols <= size_symbols]


def inductor_stage_compiler() -> Callable[[fx.GraphModule, Any], Callable]:
    """A ``compile_stage`` for :class:`~dbo_compile.codegen.wrapper.SplitProgram`: every stage
    becomes an :class:`InductorStage`, all sharing one :class:`StageCache` (the same program
    compiles once for all stages, ubatches and schedule candidates)."""
    cache = StageCache()

    def compile_stage(gm: fx.GraphModule, unit: Any) -> Callable:
        return InductorStage(gm, f"unit {unit.id} ({unit.name})", cache)

    return compile_stage
