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
buckets, so a stage compiles once per bucket (Inductor's FX graph cache makes a stage that is
identical to one already compiled — the other ubatch's copy, the next layer — cheap). Comm
units are never handed to Inductor: they stay the one comm op they are, issued on the comm
stream by the generated wrapper.

Compiling inside CUDA-graph capture would launch (autotuning) and allocate outside the graph's
pool, so a signature first seen while the current stream is capturing raises
:class:`~dbo_compile.errors.UBatchExecutionError`: warm the bucket up before capturing it
(:class:`~dbo_compile.runtime.graphs.CudaGraphRunner` does).
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

from dbo_compile.errors import UBatchExecutionError

log = logging.getLogger(__name__)

__all__ = ["MAX_SIGNATURES", "InductorStage", "inductor_unit_compiler"]

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


def _drop_stream_annotations(gm: fx.GraphModule) -> None:
    """The wrapper already runs the whole stage on its stream; Inductor would read our
    ``meta["custom"]["stream"]`` (:mod:`dbo_compile.passes.meta`) as a request to switch
    streams inside the stage. The dict is shared with the split graph's node: replace it."""
    for n in gm.graph.nodes:
        custom = n.meta.get("custom")
        if isinstance(custom, dict) and "stream" in custom:
            rest = {k: v for k, v in custom.items() if k != "stream"}
            if rest:
                n.meta["custom"] = rest
            else:
                del n.meta["custom"]


def _fake_inputs(args: tuple[Any, ...]) -> list[Any]:
    """Static-shape fake copies of ``args`` in a fake mode that has a shape env: Inductor's FX
    graph cache needs one (without it every stage bypasses the cache, and the stage of the next
    layer, identical but for its weights, compiles again)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

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

    Calling it with tensors of a new signature compiles (seconds; inference graph, whatever the
    caller's grad mode: the backend compiles inference steps); later calls with the same
    signature run the compiled code. The traced ATen graph runs instead, with a warning, where
    compiling would not pay or cannot work:

    - the graph takes an int input that is not a tensor size (a step counter, a cache
      position): compiled code bakes ints in, so every new value would compile again;
    - after :data:`MAX_SIGNATURES` signatures (Dynamo's default recompile limit): the eager
      path (no buckets) with ever new token counts must not compile every step;
    - Inductor raised while compiling this signature.

    Raises UBatchExecutionError if the first call with a signature happens during CUDA-graph
    capture.
    """

    def __init__(self, gm: fx.GraphModule, name: str):
        _drop_stream_annotations(gm)
        self.gm = gm
        self.name = name
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
        from torch._inductor import compile as inductor_compile

        with self._lock:
            fn = self.compiled.get(key)
            if fn is not None:
                return fn
            t0 = time.perf_counter()
            # a fresh GraphModule over a copy of the graph (weights shared): Inductor rewrites
            # the graph it is given (e.g. a single output into a tuple), and self.gm must stay
            # the traced program for the next signature and for the ATen fallback
            gm = fx.GraphModule(self.gm, copy.deepcopy(self.gm.graph))
            try:
                with torch.no_grad():  # an inference graph even if the caller records autograd
                    fn = _as_traced(inductor_compile(gm, _fake_inputs(args)), self._tuple_out)
            except Exception as e:  # noqa: BLE001 - a stage Inductor cannot compile still runs
                log.warning("dbo: Inductor could not compile %s (%s: %s); it runs its traced ATen "
                            "ops for these input shapes", self.name, type(e).__name__,
                            str(e).splitlines()[0][:300] if str(e) else "")
                fn = self.gm
            else:
                log.info("dbo: Inductor compiled %s for signature %d (%.2f s)", self.name,
                         len(self.compiled) + 1, time.perf_counter() - t0)
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


def inductor_unit_compiler() -> Callable[[fx.GraphModule, Any], Callable]:
    """A ``compile_unit`` for :class:`~dbo_compile.codegen.wrapper.SplitProgram`: compute units
    become :class:`InductorStage`; a unit with the same nodes and the same code in another
    schedule variant gets the same stage (compiled once for all variants). The code is part of
    the key because variants may schedule different graphs (joined experts): a node of the
    same name can read other inputs there."""
    memo: dict[tuple, InductorStage] = {}

    def compile_unit(gm: fx.GraphModule, unit: Any) -> Callable:
        key = (tuple(unit.nodes), gm.code)
        if key not in memo:
            memo[key] = InductorStage(gm, f"unit {unit.id} ({unit.name})")
        return memo[key]

    return compile_unit
