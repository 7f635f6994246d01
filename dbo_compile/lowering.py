"""Lower a Dynamo FX graph to a functional ATen inference graph with a symbolic token dim.

Dynamo hands the backend a torch-level graph whose shapes may be static (the first compile
specialises every size). We re-trace it through AOTAutograd (functionalised, inference,
input mutations kept in the graph) on fake inputs whose token dim — and the request dim of the
attention metadata — are fresh symbols, so one graph serves every ubatch size and
``node.meta["val"]`` tells which values are token-indexed.

Graph inputs are classified from Dynamo's sources (``node.meta["grapharg"].source``):

- ``shared``: module parameters and buffers (weights, KV caches) and 0-dim tensors: one tensor
  for all ubatches;
- ``token``: any other tensor input; dim 0 is the token dim and is sliced per ubatch;
- ``request``: a field of :class:`~dbo_compile.metadata.AttentionMetadata` indexed by
  request (``query_start_loc``, ``seq_lens``, ...): rebuilt per ubatch by the runtime;
- ``size``: a SymInt input that is the size of another input's dim (dynamic Dynamo graphs);
- ``scalar``: any other non-tensor input (passed through unchanged); a SymInt that is not a
  size (a dynamic int argument) is traced as its own symbol, shared by the ubatches;
- ``host_mirror``: a host copy of a metadata field (``seq_lens_cpu``, ...): the runtime's
  host decisions read it; a graph reading one is compiled unsplit (it is not cut per ubatch).

Duck shaping is off (``ShapeEnv(duck_shape=False)``): in a pure-decode step the request count
equals the token count, and the two must stay distinct symbols (``docs/design.md``).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any, Sequence

import sympy
import torch
import torch.fx as fx
from torch._dynamo.source import ConstantSource
from torch._functorch.aot_autograd import aot_module_simplified
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

from dbo_compile.errors import UnsplittableGraphError
from dbo_compile.metadata import FIELD_LAYOUT
from dbo_compile.signature import InputSpec

log = logging.getLogger(__name__)

_SHARED_SOURCE = re.compile(r"(_parameters\[|_buffers\[|_modules\[|^G\[|^L\['self'\]|\['self'\]\.)")
_SIZE_SOURCE = re.compile(r"^(?P<base>.*)\.size\(\)\[(?P<dim>\d+)\]$")
_SHAPE_LIKE = re.compile(r"\.(size|stride|numel|storage_offset|dim)\(\)")


def _source_name(node: fx.Node) -> str:
    ga = node.meta.get("grapharg")
    if ga is None or getattr(ga, "source", None) is None:
        return ""
    name = ga.source.name
    return name() if callable(name) else str(name)


def classify_inputs(gm: fx.GraphModule, example_inputs: Sequence[Any],
                    kinds: Sequence[str] | None = None) -> list[InputSpec]:
    """Classify the placeholders of ``gm`` (see the module docstring).

    Args:
        gm: the Dynamo graph (or any FX graph when ``kinds`` is given).
        example_inputs: one value per placeholder.
        kinds: explicit kinds per placeholder for graphs that did not come from Dynamo
            (``"shared"``, ``"token"``, ``"request"``, ``"scalar"``); metadata fields are
            recognised by placeholder name then.

    Raises:
        UnsplittableGraphError: a SymInt input whose source we cannot map.
    """
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(example_inputs):
        raise UnsplittableGraphError(
            f"graph has {len(placeholders)} inputs but {len(example_inputs)} example inputs"
        )
    sources = [_source_name(n) for n in placeholders]
    by_source = {s: i for i, s in enumerate(sources) if s}
    specs = []
    for i, (node, value, source) in enumerate(zip(placeholders, example_inputs, sources)):
        field = None
        mirror = None
        for f in FIELD_LAYOUT:
            if source.endswith(f".{f}") or (not source and node.name.endswith(f)):
                field = f
            if source.endswith(f".{f}_cpu"):
                mirror = f
        if mirror is not None and kinds is None:
            # the runtime's host copy of a field: never cut per ubatch (_lower refuses it)
            specs.append(InputSpec(i, node.name, source, "host_mirror", mirror))
            continue
        if kinds is not None:
            kind = kinds[i]
            if kind == "token" and field is None:
                field = None
        elif isinstance(value, torch.Tensor):
            if _SHARED_SOURCE.search(source) or value.dim() == 0:
                kind = "shared"  # a 0-dim tensor has no token dim (e.g. a cache's step counter)
            elif field is not None:
                kind = FIELD_LAYOUT[field]
            else:
                kind = "token"
        elif isinstance(value, torch.SymInt):
            m = _SIZE_SOURCE.match(source)
            if m is None and source and not _SHAPE_LIKE.search(source):
                # a dynamic int argument (a cache's Python step counter, logits_to_keep):
                # the same for every ubatch, kept symbolic so the graph serves every value
                specs.append(InputSpec(i, node.name, source, "scalar"))
                continue
            if m is None and not node.users:
                # an unused layout symbol (input_ids.stride()[0] of a strided view, a
                # storage offset): Dynamo adds it, nothing reads it
                specs.append(InputSpec(i, node.name, source, "scalar"))
                continue
            if m is None or m.group("base") not in by_source:
                raise UnsplittableGraphError(
                    f"SymInt input {node.name} (source {source!r}) is not the size of a graph "
                    "input; cannot tell whether it is per-ubatch"
                )
            specs.append(InputSpec(i, node.name, source, "size", None,
                                   (by_source[m.group("base")], int(m.group("dim")))))
            continue
        else:
            kind = "scalar"
        if kind in ("token", "request") and not (isinstance(value, torch.Tensor) and value.dim() >= 1):
            raise UnsplittableGraphError(
                f"input {node.name} (source {source!r}) is classified {kind}-indexed but is not a "
                "tensor with a dim 0"
            )
        specs.append(InputSpec(i, node.name, source, kind, field if kind != "shared" else None))
    if kinds is None:
        _check_scalars_are_not_token_counts(specs, placeholders)
    return specs


def _check_scalars_are_not_token_counts(specs: list[InputSpec], placeholders: list[fx.Node]) -> None:
    """An int argument equal to the token count at trace time gets the token dim's symbol
    (Dynamo's duck sizing, e.g. ``forward(x, n)`` with ``x.view(n, -1)``). As a scalar it would
    reach every ubatch unchanged, the full count where the ubatch has half the rows."""
    def example(node: fx.Node) -> Any:
        return node.meta.get("example_value", node.meta.get("val"))

    def symbols(v: Any) -> set:
        return set(v.node.expr.free_symbols) if isinstance(v, torch.SymInt) else set()

    token_symbols: set = set()
    for spec, node in zip(specs, placeholders):
        v = example(node)
        if spec.kind == "token" and isinstance(v, torch.Tensor) and v.dim():
            token_symbols |= symbols(v.shape[0])
    for spec, node in zip(specs, placeholders):
        if spec.kind == "scalar" and symbols(example(node)) & token_symbols:
            raise UnsplittableGraphError(
                f"int input {node.name} (source {spec.source!r}) equals the token count (Dynamo "
                "gave it the token dim's symbol), but as an argument it would reach every ubatch "
                "as the whole step's count. Derive it from the tokens (x.shape[0]) or use -1 in "
                "views")


def fold_tensorified_floats(gm: fx.GraphModule, example_inputs: Sequence[Any]
                            ) -> tuple[fx.GraphModule, tuple[tuple[int, float], ...]]:
    """``gm``, or a copy of it with each float Dynamo passed as a 0-dim float64 tensor and
    read only by ``.item()`` (``torch.compile(dynamic=True)`` does that to module attributes
    such as an attention scale or a norm's eps) replaced by its value, and the
    ``(input index, value)`` pairs folded.

    Re-traced, ``.item()`` would give a data-dependent ``SymFloat`` that ops taking a
    ``float`` (``dbo.attention``'s ``scale``) refuse. Dynamo did not guard on the value, so
    the artifact must check it every call (a host read of a CPU tensor) and run the original
    graph when it changed (``DboCompiledModule.float_guards``).
    """
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    folds = []
    for i, (node, value) in enumerate(zip(placeholders, example_inputs)):
        grapharg = node.meta.get("grapharg")
        if (isinstance(value, torch.Tensor) and not isinstance(value, torch._subclasses.FakeTensor)
                and value.dim() == 0 and value.dtype == torch.float64 and value.device.type == "cpu"
                and getattr(grapharg, "pass_arg_as_tensor", False) and node.users
                and all(u.op == "call_method" and u.target == "item" for u in node.users)):
            folds.append((i, float(value)))
    if not folds:
        return gm, ()
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    copied = [n for n in graph.nodes if n.op == "placeholder"]
    for i, value in folds:
        for user in list(copied[i].users):
            user.replace_all_uses_with(value)
            graph.erase_node(user)
    folded = fx.GraphModule(gm, graph)
    return folded, tuple(folds)


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
    captured: dict[str, fx.GraphModule] = {}

    def fw_compiler(aten_gm: fx.GraphModule, _inputs: Any) -> Any:
        captured["gm"] = aten_gm
        return aten_gm.forward

    # Outside Dynamo's TracingContext: AOT would otherwise trace in Dynamo's fake mode and
    # ShapeEnv (detect_fake_mode prefers the ambient context), re-fakeify our inputs there and
    # silently drop the symbolic token dim of a static Dynamo graph instead of specialising it
    # in ``shape_env``, where the check below sees it.
    try:
        with torch.no_grad(), torch._guards.tracing(None):
            aot_module_simplified(gm, fakes, fw_compiler=fw_compiler,
                                  keep_inference_input_mutations=True)
    except Exception as e:  # noqa: BLE001 - any failure here means: compile unsplit
        first = (str(e).strip().splitlines() or [""])[0]
        raise UnsplittableGraphError(
            f"re-tracing the graph with a symbolic token dim failed ({type(e).__name__}: "
            f"{first}); if the graph was captured with dynamic=True, mark only the token dim "
            "dynamic instead (torch._dynamo.mark_dynamic(input_ids, 0))"
        ) from e
    aten_gm = captured["gm"]
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


