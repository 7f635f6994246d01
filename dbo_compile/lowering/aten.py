"""Trace a Dynamo graph to a functional ATen inference graph with symbolic token/request dims
(:mod:`dbo_compile.lowering` says how)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Sequence

import sympy
import torch
import torch.fx as fx
from torch._dynamo.source import ConstantSource
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

from dbo_compile.errors import UnsplittableGraphError
from dbo_compile.lowering import aot
from dbo_compile.lowering.layers import trace_by_layers
from dbo_compile.lowering.regions import inline_regions
from dbo_compile.signature import InputSpec

log = logging.getLogger(__name__)


@dataclass
class LoweredGraph:
    """The functional ATen inference graph and what the split needs to know about it.

    Attributes:
        gm: ATen graph, one placeholder per Dynamo input (same order), ``meta["val"]`` set.
        specs: per-input classification.
        token_symbols: symbols of the token and request dims.
        token_symbol: the symbol of the token dim (``num_tokens``).
        request_symbols: the symbols of the request dims (``num_reqs``; a subset of
            ``token_symbols``), so that messages can tell the two apart.
        shape_env: the ShapeEnv the symbols live in.
    """

    gm: fx.GraphModule
    specs: list[InputSpec]
    token_symbols: frozenset
    token_symbol: sympy.Symbol | None
    shape_env: ShapeEnv
    request_symbols: frozenset = frozenset()


def _fakeify(specs: list[InputSpec], example_inputs: Sequence[Any],
             fake_mode: FakeTensorMode) -> list[Any]:
    """Fake inputs whose token/request dims (and dims Dynamo made dynamic) are symbols."""
    dynamic_dims: dict[int, set[int]] = {}
    for spec in specs:
        if spec.kind in ("token", "request"):
            dynamic_dims.setdefault(spec.index, set()).add(0)
        if spec.kind == "size":
            dynamic_dims.setdefault(spec.size_of[0], set()).add(spec.size_of[1])
    fakes: list[Any] = [None] * len(specs)
    for spec in specs:
        value = example_inputs[spec.index]
        if isinstance(value, torch.Tensor):
            if isinstance(value, torch._subclasses.FakeTensor) or value.device.type == "meta":
                # Dynamo may hand fakes; their hints give the example sizes
                value = _realish(value)
            dims = dynamic_dims.get(spec.index, set())
            if not dims:  # weights, caches: half the time of a symbolic context of static dims
                fakes[spec.index] = fake_mode.from_tensor(value, static_shapes=True)
                continue
            ctx = StatelessSymbolicContext(
                dynamic_sizes=[DimDynamic.DYNAMIC if d in dims else DimDynamic.STATIC
                               for d in range(value.dim())]
            )
            fakes[spec.index] = fake_mode.from_tensor(value, symbolic_context=ctx)
    for spec in specs:
        if spec.kind == "size":
            src, dim = spec.size_of
            fakes[spec.index] = fakes[src].shape[dim]
        elif spec.kind == "scalar":
            value = example_inputs[spec.index]
            fakes[spec.index] = _hint(value)
            if isinstance(value, torch.SymInt):
                fakes[spec.index] = fake_mode.shape_env.create_unspecified_symint_and_symbol(
                    _hint(value), ConstantSource(spec.source or spec.name), DimDynamic.DYNAMIC)
    return fakes


def _hint(value: Any) -> Any:
    if isinstance(value, torch.SymInt):
        return value.node.hint if value.node.hint is not None else int(value)
    return value


def _realish(t: torch.Tensor) -> torch.Tensor:
    shape = [_hint(s) for s in t.shape]
    return torch.empty(shape, dtype=t.dtype, device="meta" if t.device.type == "meta" else t.device)


def lower_to_aten(gm: fx.GraphModule, example_inputs: Sequence[Any],
                  specs: list[InputSpec]) -> LoweredGraph:
    """Trace ``gm`` to a functional ATen inference graph with symbolic token/request dims.

    Raises:
        UnsplittableGraphError: the token dim was specialised during tracing (a size baked
            into the graph, e.g. ``x.view(64, ...)`` from a static Dynamo trace); compile with
            ``dynamic=True`` or write the view with ``-1``. Also raised, with the cause, when
            the re-trace itself fails (e.g. a data-dependent ``.item()`` of a 0-dim input).
    """
    if inline_regions(gm):  # the backend inlined them already; a direct caller may not have
        gm.recompile()
    shape_env = ShapeEnv(duck_shape=False, specialize_zero_one=False)
    fake_mode = FakeTensorMode(shape_env=shape_env, allow_non_fake_inputs=False)
    fakes = _fakeify(specs, example_inputs, fake_mode)
    token_specs = [s for s in specs if s.kind == "token"]
    request_specs = [s for s in specs if s.kind == "request"]
    if token_specs:
        first = token_specs[0]
        n0 = _hint(example_inputs[first.index].shape[0])
        for s in token_specs[1:]:
            n = _hint(example_inputs[s.index].shape[0])
            if n != n0:
                raise UnsplittableGraphError(
                    f"input {s.name} ({s.source or 'no source'}) has dim 0 = {n} but the token "
                    f"dim of {first.name} is {n0}: every tensor input that is not a module "
                    "parameter or buffer is taken as token-indexed; register it on the module "
                    "(a buffer) to share it between ubatches"
                )
    with fake_mode:
        # one symbol for the token dim, one for the request dim (query_start_loc is [R + 1])
        for group in (token_specs, [s for s in request_specs if s.field != "query_start_loc"]):
            for s in group[1:]:
                torch._check(fakes[s.index].shape[0] == fakes[group[0].index].shape[0])
        qsl = [s for s in request_specs if s.field == "query_start_loc"]
        other_req = [s for s in request_specs if s.field != "query_start_loc"]
        if qsl and other_req:
            torch._check(fakes[qsl[0].index].shape[0] == fakes[other_req[0].index].shape[0] + 1)
    token_symbol = None
    if token_specs:
        token_symbol = fakes[token_specs[0].index].shape[0].node.expr
    # Outside Dynamo's TracingContext (see aot.trace), once per distinct decoder layer
    try:
        aten_gm = trace_by_layers(gm, fakes, fake_mode) or aot.trace(gm, fakes)
    except Exception as e:  # noqa: BLE001 - any failure here means: compile unsplit
        first = (str(e).strip().splitlines() or [""])[0]
        raise UnsplittableGraphError(
            f"re-tracing the graph with a symbolic token dim failed ({type(e).__name__}: "
            f"{first}); if the graph was captured with dynamic=True, mark only the token dim "
            "dynamic instead (torch._dynamo.mark_dynamic(input_ids, 0))"
        ) from e
    syms = set()
    request_syms = set()
    placeholders = [n for n in aten_gm.graph.nodes if n.op == "placeholder"]
    for s in token_specs + request_specs:
        size0 = fakes[s.index].shape[0]
        expr = size0.node.expr if isinstance(size0, torch.SymInt) else sympy.Integer(size0)
        expr = shape_env.replace(expr)
        if not expr.free_symbols and s.kind == "request" and _only_dbo_users(placeholders[s.index]):
            # Dynamo specialised the request count (e.g. 1 request), but only our ops read the
            # tensor and they take any request count: the graph is still generic in it
            continue
        if not expr.free_symbols and expr in (0, 1):
            raise UnsplittableGraphError(
                f"dim 0 of input {s.name} ({s.source or s.kind}) is {expr}: Dynamo never makes "
                "sizes 0 and 1 dynamic, so this graph serves exactly that size and is not split "
                "(a step of >= 2 tokens gets its own, splittable graph)"
            )
        if not expr.free_symbols:
            raise UnsplittableGraphError(
                f"dim 0 of input {s.name} ({s.source or s.kind}) was specialised to {expr} while "
                "tracing: a size is baked into the graph (e.g. x.view(64, ...) from a static "
                "Dynamo trace). Compile with torch.compile(..., dynamic=True), mark the token "
                "dim dynamic, or write views with -1."
            )
        syms |= expr.free_symbols
        if s.kind == "request":
            request_syms |= expr.free_symbols
    for s in specs:
        value = fakes[s.index]
        if s.kind == "scalar" and isinstance(value, torch.SymInt):
            if not shape_env.replace(value.node.expr).free_symbols:
                raise UnsplittableGraphError(
                    f"int input {s.name} ({s.source}) was specialised while tracing; Dynamo "
                    "treats it as dynamic, so the traced graph would be wrong for other values")
    if token_symbol is not None:
        token_symbol = shape_env.replace(token_symbol)
    n_in = sum(1 for n in aten_gm.graph.nodes if n.op == "placeholder")
    if n_in != len(specs):
        raise UnsplittableGraphError(
            f"AOT lowering changed the number of inputs ({len(specs)} -> {n_in}); aliased "
            "inputs are not supported"
        )
    token_free = {token_symbol} if token_symbol is not None else set()
    return LoweredGraph(aten_gm, specs, frozenset(syms), token_symbol, shape_env,
                        frozenset(request_syms - token_free))



def _only_dbo_users(node: fx.Node) -> bool:
    """Every user of ``node`` is one of our ``dbo`` ops (possibly functionalised)."""
    for user in node.users:
        target = user.target
        if user.op != "call_function":
            return False
        if isinstance(target, torch._ops.HigherOrderOperator) and user.args:
            target = user.args[0]
        if not (isinstance(target, torch._ops.OpOverload) and target.namespace == "dbo"):
            return False
    return True
