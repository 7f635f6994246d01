"""``compute_backend="inductor"``: each compute stage (and the unsplit program) compiled by Inductor.

The split program's compute units are small FX graphs of ATen ops (one stage of one ubatch).
Run as traced, every ATen op is at least one kernel, and a split step runs about twice the
kernels of the unsplit one — measured on 2x H200 it is most of the price of splitting in decode
(README). Inductor fuses the elementwise ops of a stage (norms, residual adds, routing, the
dispatch packing) into a few Triton kernels, for the split and the unsplit program alike, so the
runtime still compares like with like.

:class:`InductorStage` compiles a graph with ``torch._inductor.compile`` (Inductor without
Dynamo). Where the traced graph holds symbolic sizes (Dynamo traced the token dim, and the
request count, as symbols: the runner's buckets, ``dynamic=True``), the first compilation keeps
them symbolic and serves every later input signature its shape-env guards admit: one
compilation for all of a serving engine's buckets, as vLLM compiles one graph with a symbolic
batch size (measured on 2026-12-02 before this: a 12-bucket warm-up ran 73 Inductor
compilations, one per bucket and stage, 100-109 s of its 122-133 s). A signature the guards
refuse, and every signature of a graph traced with static shapes, compiles for its static
shapes (at most :data:`MAX_SIGNATURES` per stage, then the traced ATen ops, warned). Stages
that are the same program — the other ubatch's copy of a stage, the same stage in the next
layer (weights are graph inputs) — share one compilation through a :class:`StageCache`: equal
graphs up to node names, called with the same signature (or admitted by the same symbolic
compilation), get the callable Inductor compiled for the first of them. Comm units are never
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
from torch._dynamo.source import LocalSource
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

from dbo_compile.errors import UBatchExecutionError
from dbo_compile.runtime.context import in_static_stages, in_traced_only, note_stage_call
from dbo_compile.schedule import annotate_stream

log = logging.getLogger(__name__)

__all__ = ["MAX_DYNAMIC", "MAX_SIGNATURES", "InductorStage", "StageCache", "inductor_stage_compiler"]

#: static input signatures one stage compiles at most (Dynamo's default recompile limit is also 8)
MAX_SIGNATURES = 8
#: dynamic compilations one stage runs at most (one per static part of the signature, e.g. a
#: new input alignment); past it, new signatures take the static path
MAX_DYNAMIC = 2


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
        compiles: Inductor compilations run (one per distinct program and signature, or per
            program and static key for a symbolic-size compilation).
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


class _Dynamic:
    """One dynamic compilation of a stage: its static key (the signature with the symbolic
    sizes left out, and the layout), the guard expression over the inputs it left symbolic (the
    shape env's, from compiling), the callable (``None``: Inductor failed)."""

    __slots__ = ("env", "guards", "fn")

    def __init__(self, env: ShapeEnv | None, guards: str | None, fn: Callable | None):
        self.env, self.guards, self.fn = env, guards, fn

    def admits(self, checked: list[Any]) -> bool:
        if self.fn is None:
            return False
        return self.guards is None or bool(self.env.evaluate_guards_expression(self.guards, checked))


def _symbolic_dims(gm: fx.GraphModule) -> list[Any] | None:
    """Which inputs the traced graph holds symbolic sizes for, per flat input (placeholders in
    order, each one's value flattened): for a tensor, one bool per dim; for an int that is a
    size, ``True``; else ``False``. ``None`` when nothing is symbolic or a placeholder carries
    no traced value (a graph traced with static shapes, ``fx.symbolic_trace``): the stage then
    compiles per signature only."""
    out: list[Any] = []
    for n in gm.graph.nodes:
        if n.op != "placeholder":
            continue
        if "val" not in n.meta and "example_value" not in n.meta:
            return None
        v = n.meta.get("val", n.meta.get("example_value"))
        for leaf in pytree.tree_leaves(v):
            if isinstance(leaf, torch.Tensor):
                out.append(tuple(isinstance(d, torch.SymInt) and bool(d.node.expr.free_symbols)
                                 for d in leaf.shape))
            else:
                out.append(isinstance(leaf, torch.SymInt) and bool(leaf.node.expr.free_symbols))
    return out if any(any(d) if isinstance(d, tuple) else d for d in out) else None


def _concrete(x: Any) -> int | None:
    return x if isinstance(x, int) else None


def _dynamic_inputs(args: tuple[Any, ...], dims: list[Any]
                    ) -> tuple[tuple, list[Any], list[Any], list[Any], ShapeEnv] | None:
    """Fake copies of ``args`` whose sizes are symbolic where the traced graph's are (a symbol
    each, no duck sizing: two sizes are assumed equal only where the graph needs it, and then
    guarded; sizes 0 and 1 specialised, as Dynamo does), in a fake mode with a fresh shape env.

    Returns ``(key, fake args, checked args, their fakes, env)``: ``key`` is what a call must
    match exactly (pytree structure; per tensor its concrete sizes and strides, dtype, device;
    other values as :func:`_signature`), the checked args are the inputs with a symbolic part,
    which the guards of a compilation test instead. ``None`` when ``args`` do not line up with
    the traced inputs."""
    leaves, spec = pytree.tree_flatten(args)
    if len(leaves) != len(dims):
        return None
    env = ShapeEnv()
    mode = FakeTensorMode(shape_env=env, allow_non_fake_inputs=True)
    key: list[Any] = [spec]
    fakes: list[Any] = []
    checked: list[Any] = []
    checked_fakes: list[Any] = []
    for i, (a, d) in enumerate(zip(leaves, dims)):
        src = LocalSource(f"dbo_stage_input_{i}")
        if isinstance(a, torch.Tensor) and isinstance(d, tuple) and len(d) == a.dim() and any(d):
            ctx = StatelessSymbolicContext(
                dynamic_sizes=[DimDynamic.DYNAMIC if x else DimDynamic.STATIC for x in d])
            f = mode.from_tensor(a, source=src, symbolic_context=ctx)
            key.append((tuple(_concrete(x) for x in f.shape), tuple(_concrete(x) for x in f.stride()),
                        a.dtype, a.device, a.requires_grad))
            checked.append(a)
            checked_fakes.append(f)
        elif isinstance(a, torch.Tensor):
            f = mode.from_tensor(a, static_shapes=True)
            key.append((tuple(a.shape), a.stride(), a.dtype, a.device, a.requires_grad))
        elif d is True and isinstance(a, int) and not isinstance(a, bool):
            f = env.create_symintnode(env.create_symbol(a, src, DimDynamic.DYNAMIC), hint=a,
                                      source=src)
            if isinstance(f, int):  # 0 or 1: specialised
                key.append((int, a))
            else:
                key.append((int, None))
                checked.append(a)
                checked_fakes.append(f)
        else:
            f = a
            key.append(_signature((a,))[1:])
        fakes.append(f)
    return tuple(key), list(pytree.tree_unflatten(fakes, spec)), checked, checked_fakes, env


class InductorStage:
    """A graph compiled by Inductor: once with a dynamic token dim, or once per input signature.

    Args:
        gm: a GraphModule of ATen ops (a schedule unit, or the whole unsplit program); its
            parameters and buffers (``get_attr``) are lifted to inputs by Inductor.
        name: for logs and errors, e.g. ``"unit 12 (u0.L1.experts)"``.
        cache: shared with the other stages of the program, so that stages computing the same
            program compile once (:class:`StageCache`); default: a cache of its own.

    Calling it with tensors of a new signature compiles (seconds; inference graph, whatever the
    caller's grad mode: the backend compiles inference steps); later calls with the same
    signature run the compiled code. Where the traced graph holds symbolic sizes (Dynamo traced
    the token dim, and what follows it, as symbols: the runner's buckets and ``dynamic=True``),
    the first compilation keeps those sizes symbolic (the token dim, the request count, ...)
    and serves every later signature its shape-env guards admit: one compilation for all the
    buckets, as vLLM compiles one graph with a symbolic batch size. A signature the guards
    refuse (Inductor specialised a size), or met inside :func:`~dbo_compile.runtime.context.static_stages`
    (a bucket the runner compiles for its own shapes, as vLLM's ``compile_sizes``), compiles
    for its static shapes. The traced ATen graph runs instead, with a warning, where
    compiling would not pay or cannot work:

    - the graph takes an int input that is not a tensor size (a step counter, a cache
      position): compiled code bakes ints in, so every new value would compile again;
    - after :data:`MAX_SIGNATURES` static signatures (Dynamo's default recompile limit): the
      eager path (no buckets) with ever new token counts must not compile every step;
    - Inductor raised while compiling this signature.

    Each call inside :func:`~dbo_compile.runtime.context.record_stage_calls` is recorded with
    the kind of code it ran (``"dynamic"``, ``"static"``, ``"aten"``): the runner reports it
    per bucket. Within :func:`~dbo_compile.runtime.context.traced_only`, a signature not
    compiled yet runs the traced ATen graph and compiles nothing.

    Raises UBatchExecutionError if the first call with a signature happens during CUDA-graph
    capture (and outside ``traced_only``).

    Attributes:
        compiled: callable per input signature met (a dynamic compilation serves several).
        kinds: per input signature met, ``"dynamic"``, ``"static"`` or ``"aten"``.
    """

    def __init__(self, gm: fx.GraphModule, name: str, cache: StageCache | None = None):
        _drop_stream_annotations(gm)
        self.gm = gm
        self.name = name
        self.cache = cache if cache is not None else StageCache()
        self._program = _program(gm)
        self.compiled: dict[tuple, Callable] = {}
        self.kinds: dict[tuple, str] = {}
        self.compile_s = 0.0
        self.uncompiled_calls = 0
        self._static = 0
        self._dynamic: dict[tuple, _Dynamic] = {}
        self._lock = threading.Lock()
        out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        self._tuple_out = isinstance(out, tuple)
        self._dims = _symbolic_dims(gm)
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
            note_stage_call(self.name, "aten")
            with torch.no_grad():  # like the compiled stages: no autograd history
                return self.gm(*args)
        key = _signature(args)
        fn = self.compiled.get(key)
        if fn is None:
            if in_traced_only():
                with torch.no_grad():
                    return self.gm(*args)
            fn = self._resolve(key, args)
        note_stage_call(self.name, self.kinds.get(key, "aten"))
        with torch.no_grad():
            return fn(*args)

    def _resolve(self, key: tuple, args: tuple[Any, ...]) -> Callable:
        """The code for a signature met for the first time (recorded in ``compiled``, except
        the ATen fallback past the limit)."""
        if self._dims is not None and not in_static_stages():
            fn = self._dynamic_fn(key, args)
            if fn is not None:
                return fn
        if self._static >= MAX_SIGNATURES:
            if self.uncompiled_calls == 0:
                log.warning(
                    "dbo: %s has been compiled by Inductor for %d input signatures; new ones "
                    "run the traced ATen ops. Pad token counts to a few buckets "
                    "(CudaGraphRunner does) or use compute_backend='aten'.", self.name,
                    MAX_SIGNATURES)
            self.uncompiled_calls += 1
            return self.gm
        return self._compile(key, args)

    def _dynamic_fn(self, key: tuple, args: tuple[Any, ...]) -> Callable | None:
        """The dynamic compilation that admits ``args`` (compiling it the first time its
        static key is met), or ``None``: the static path then serves them."""
        inputs = _dynamic_inputs(args, self._dims)
        if inputs is None:
            return None
        dyn_key, fake_args, checked, checked_fakes, env = inputs
        dyn_key = (dyn_key, _layout(args))
        entry = self._dynamic.get(dyn_key)
        if entry is None:
            if len(self._dynamic) >= MAX_DYNAMIC:
                return None
            self._check_not_capturing(args)
            with self._lock:
                shared_key = (self._program, "dynamic", dyn_key)
                found, entry = self.cache.get(shared_key)
                if not found:
                    entry = self._compile_dynamic(fake_args, checked_fakes, env)
                    self.cache.put(shared_key, entry)
                self._dynamic[dyn_key] = entry
        if not entry.admits(checked):
            return None
        self.compiled[key] = entry.fn
        self.kinds[key] = "dynamic" if checked else "static"  # nothing symbolic: sizes 0/1
        return entry.fn

    def _compile_dynamic(self, fake_args: list[Any], checked_fakes: list[Any], env: ShapeEnv
                         ) -> _Dynamic:
        t0 = time.perf_counter()
        gm = fx.GraphModule(self.gm, copy.deepcopy(self.gm.graph))
        try:
            with torch.no_grad():
                fn = _as_traced(torch._inductor.compile(gm, fake_args), self._tuple_out)
            guards = env.produce_guards_expression(checked_fakes, ignore_static=True)
        except Exception as e:  # noqa: BLE001 - the static path still serves every signature
            log.warning("dbo: Inductor could not compile %s with symbolic sizes (%s: %s); it "
                        "compiles per input signature instead", self.name, type(e).__name__,
                        str(e).splitlines()[0][:300] if str(e) else "")
            entry = _Dynamic(None, None, None)
        else:
            log.info("dbo: Inductor compiled %s with symbolic sizes (%.2f s; guards: %s)",
                     self.name, time.perf_counter() - t0, guards)
            entry = _Dynamic(env, guards, fn)
        self.compile_s += time.perf_counter() - t0
        return entry

    def _check_not_capturing(self, args: tuple[Any, ...]) -> None:
        if _capturing(args):
            shapes = [tuple(a.shape) for a in pytree.tree_leaves(args) if isinstance(a, torch.Tensor)]
            raise UBatchExecutionError(
                f"dbo: {self.name} meets input shapes {shapes} for the first time during CUDA-graph "
                "capture; Inductor cannot compile inside a capture. Run the step once eagerly at "
                "this bucket before capturing it (CudaGraphRunner.warmup does).")

    def _compile(self, key: tuple, args: tuple[Any, ...]) -> Callable:
        self._check_not_capturing(args)
        with self._lock:
            fn = self.compiled.get(key)
            if fn is not None:
                return fn
            self._static += 1
            shared_key = (self._program, key, _layout(args))
            found, fn = self.cache.get(shared_key)
            if found:
                log.debug("dbo: %s runs the code Inductor compiled for the same program and "
                          "signature", self.name)
                fn = self.gm if fn is None else fn
                self.compiled[key] = fn
                self.kinds[key] = "aten" if fn is self.gm else "static"
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
                         self._static, time.perf_counter() - t0)
                self.cache.put(shared_key, fn)
            self.compile_s += time.perf_counter() - t0
            self.compiled[key] = fn
            self.kinds[key] = "aten" if fn is self.gm else "static"
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
