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
import operator
import re
from dataclasses import dataclass
from typing import Any, Sequence

import sympy
import torch
import torch.fx as fx
from torch._dynamo.source import ConstantSource
from torch._functorch.aot_autograd import aot_module_simplified
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx._lazy_graph_module import _LazyGraphModule
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

from dbo_compile.errors import UnsplittableGraphError
from dbo_compile.metadata import FIELD_LAYOUT
from dbo_compile.signature import InputSpec

log = logging.getLogger(__name__)

_SHARED_SOURCE = re.compile(r"(_parameters\[|_buffers\[|_modules\[|^G\[|^L\['self'\]|\['self'\]\.)")
_SIZE_SOURCE = re.compile(r"^(?P<base>.*)\.size\(\)\[(?P<dim>\d+)\]$")
_SHAPE_LIKE = re.compile(r"\.(size|stride|numel|storage_offset|dim)\(\)")


def source_name(node: fx.Node) -> str:
    """The Dynamo source of a placeholder (``L['input_ids']``), ``""`` without one."""
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
    sources = [source_name(n) for n in placeholders]
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
    folds = folded_floats(gm, example_inputs)
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


def folded_floats(gm: fx.GraphModule, example_inputs: Sequence[Any]
                  ) -> tuple[tuple[int, float], ...]:
    """The ``(input index, value)`` pairs :func:`fold_tensorified_floats` folds into ``gm``
    (a Dynamo graph and its example inputs): the floats Dynamo passed as 0-dim float64 CPU
    tensors that only ``.item()`` reads."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    folds = []
    for i, (node, value) in enumerate(zip(placeholders, example_inputs)):
        grapharg = node.meta.get("grapharg")
        if (isinstance(value, torch.Tensor) and not isinstance(value, torch._subclasses.FakeTensor)
                and value.dim() == 0 and value.dtype == torch.float64 and value.device.type == "cpu"
                and getattr(grapharg, "pass_arg_as_tensor", False) and node.users
                and all(u.op == "call_method" and u.target == "item" for u in node.users)):
            folds.append((i, float(value)))
    return tuple(folds)


def baked_inputs(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> tuple[tuple[int, Any], ...]:
    """The inputs of ``gm`` whose *values*, not only their types and shapes, the lowered graph
    (and every program made from it) is a function of, as ``(input index, value)`` in input
    order: the floats :func:`fold_tensorified_floats` folds (:func:`folded_floats`) and the
    scalar inputs that are not symbolic (a Python int, float, bool, ... traced as a constant,
    :func:`_fakeify`). A tensor input's values and a SymInt's are read at run time. Another
    value of one of these needs another lowered graph: the compile cache keys by them."""
    baked = dict(folded_floats(gm, example_inputs))
    for i, value in enumerate(example_inputs):
        if not isinstance(value, (torch.Tensor, torch.SymInt, torch.SymFloat, torch.SymBool)):
            baked[i] = value
    return tuple(sorted(baked.items()))


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
    # Outside Dynamo's TracingContext (see _aot_trace), once per distinct decoder layer
    try:
        aten_gm = _trace_by_layers(gm, fakes, fake_mode) or _aot_trace(gm, fakes)
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


def graph_module(root: torch.nn.Module | fx.GraphModule, graph: fx.Graph,
                 class_name: str = "GraphModule") -> fx.GraphModule:
    """A GraphModule that generates its Python code only when it is first called or its
    ``code`` read (torch's ``_LazyGraphModule``, as Inductor uses it): the pipeline's big
    graphs (lowered, split, joined) are rewritten by several passes, and the split graphs are
    never called (their units are), but an eager ``recompile`` of a 61-layer graph costs half
    a second each time."""
    return _LazyGraphModule(root, graph, class_name=class_name)


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


# -- one trace per distinct decoder layer ------------------------------------------------------


def _aot_trace(gm: fx.GraphModule, fakes: Sequence[Any]) -> fx.GraphModule:
    """AOTAutograd's functional inference graph of ``gm`` on ``fakes`` (two traces: metadata
    collection, then the functionalised graph).

    Outside Dynamo's TracingContext: AOT would otherwise trace in Dynamo's fake mode and
    ShapeEnv (detect_fake_mode prefers the ambient context), re-fakeify our inputs there and
    silently drop the symbolic token dim of a static Dynamo graph instead of specialising it
    in our ``shape_env``, where :func:`lower_to_aten`'s checks see it.
    """
    captured: dict[str, fx.GraphModule] = {}

    def fw_compiler(aten_gm: fx.GraphModule, _inputs: Any) -> Any:
        captured["gm"] = aten_gm
        return aten_gm.forward

    with torch.no_grad(), torch._guards.tracing(None):
        aot_module_simplified(gm, list(fakes), fw_compiler=fw_compiler,
                              keep_inference_input_mutations=True)
    return captured["gm"]


def inline_regions(gm: fx.GraphModule) -> int:
    """Inline every ``invoke_subgraph`` call of Dynamo's graph in place; returns how many.

    A decoder layer marked with :func:`torch.compiler.nested_compile_region` is traced by
    Dynamo once and called as ``invoke_subgraph(subgraph, identifier, *operands)`` at every
    layer that reuses the trace (Dynamo's subgraph reuse: a 61-layer graph traces one layer,
    not 61). Every pass here works on one flat graph, so the calls are replaced by copies of
    their subgraph's nodes (the ``getitem`` users by the copied outputs), as Dynamo's own
    ``inline_invoke_subgraph`` option does, and each copy's ``nn_module_stack`` is rewritten
    from the call site that traced the subgraph to its own call site (``layers.0`` ->
    ``layers.7``), so that :func:`_trace_by_layers` still sees one run per decoder layer and
    lowers the repeated ones once. Nested regions are inlined first.
    """
    hop = getattr(torch.ops.higher_order, "invoke_subgraph", None)
    if hop is None:
        return 0
    calls = list(gm.graph.find_nodes(op="call_function", target=hop))
    if not calls:
        return 0
    traced_at: dict[str, str | None] = {}  # subgraph -> the innermost module path of its trace
    count = 0
    for node in calls:
        target = str(node.args[0].target)
        sub = getattr(gm, target)
        if target not in traced_at:
            count += inline_regions(sub)
            traced_at[target] = _innermost_path(node)
        _inline_call(gm, node, sub, traced_at[target])
        count += 1
    for target in traced_at:
        gm.delete_submodule(target)
    return count


def _innermost_path(node: fx.Node) -> str | None:
    stack = node.meta.get("nn_module_stack") or {}
    return next(reversed(stack.values()))[0] if stack else None


def _moved_stack(inner: dict, outer: dict, traced_at: str | None, here: str | None) -> dict:
    """``inner`` (a subgraph node's module stack, traced at ``traced_at``) as seen from a call
    at ``here`` under ``outer``: paths under ``traced_at`` move under ``here``."""

    def move(s: Any) -> Any:
        if isinstance(s, str) and traced_at and here and s.startswith(traced_at):
            return here + s[len(traced_at):]
        return s

    stack = dict(outer)
    for key, (path, *rest) in inner.items():
        stack.setdefault(move(key), (move(path), *rest))
    return stack


def _inline_call(gm: fx.GraphModule, node: fx.Node, sub: fx.GraphModule,
                 traced_at: str | None) -> None:
    here, outer = _innermost_path(node), node.meta.get("nn_module_stack") or {}
    env: dict[fx.Node, Any] = dict(zip(sub.graph.find_nodes(op="placeholder"), node.args[2:]))
    with gm.graph.inserting_before(node):
        for n in sub.graph.nodes:
            if n.op in ("placeholder", "output"):
                continue
            if _float_for_tensor(n, env):  # Dynamo's stamp-out passed the float itself
                env[n] = env[n.args[0]]
                continue
            if n.op == "get_attr":  # a constant of the subgraph: hoisted onto gm
                name = f"_region_{str(node.args[0].target)}_{n.target.replace('.', '_')}"
                if not hasattr(gm, name):
                    setattr(gm, name, getattr(sub, n.target))
                env[n] = gm.graph.get_attr(name)
                env[n].meta = dict(n.meta)
                continue
            env[n] = gm.graph.node_copy(n, lambda a: env[a])
            if "nn_module_stack" in n.meta:
                env[n].meta["nn_module_stack"] = _moved_stack(
                    n.meta["nn_module_stack"], outer, traced_at, here)
    outputs = sub.graph.output_node().args[0]
    for user in list(node.users):
        if user.op == "call_function" and user.target is operator.getitem:
            user.replace_all_uses_with(env.get(outputs[user.args[1]], outputs[user.args[1]]))
            gm.graph.erase_node(user)
    if node.users:
        raise UnsplittableGraphError(
            f"a nested compile region's result is used other than by index at {node.name}; "
            "return a tuple of tensors from the region")
    get_attr = node.args[0]
    gm.graph.erase_node(node)
    if not get_attr.users:
        gm.graph.erase_node(get_attr)


def _float_for_tensor(n: fx.Node, env: dict[fx.Node, Any]) -> bool:
    """``n`` is ``ph.item()`` of a subgraph placeholder traced as a 0-dim tensor (a float
    attribute Dynamo passed as a tensor: ``dynamic=True``, or a float that changed between
    calls) whose operand at this call is the float itself: torch 2.13's stamp-out of a reused
    region resolves a captured float attribute to its value, not to the tensor. The value is
    what ``.item()`` would read."""
    if n.op != "call_method" or n.target != "item" or not n.args:
        return False
    ph = n.args[0]
    if not isinstance(ph, fx.Node) or ph.op != "placeholder":
        return False
    operand = env.get(ph)
    value = operand.meta.get("example_value") if isinstance(operand, fx.Node) else operand
    return isinstance(value, (float, torch.SymFloat))


#: a module path that is an element of a ModuleList (``L['self'].layers.3``, ``...layers[3]``)
_LAYER_PATH = re.compile(r"(\.\d+|\[\d+\])$")


@dataclass
class _Segment:
    """A run of consecutive Dynamo nodes of one decoder layer (or of no layer).

    ``inputs``: the nodes outside it that it reads, in first-use order (placeholders and
    earlier segments' nodes); ``outputs``: its nodes read after it, in graph order."""

    nodes: list[fx.Node]
    inputs: list[fx.Node]
    outputs: list[fx.Node]


def layer_of(node: fx.Node) -> str | None:
    """The module path of the decoder layer (ModuleList element) a Dynamo node belongs to."""
    for path, *_ in (node.meta.get("nn_module_stack") or {}).values():
        if isinstance(path, str) and _LAYER_PATH.search(path):
            return path  # the outermost ModuleList element
    return None


def _segments(gm: fx.GraphModule) -> list[_Segment]:
    body = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    runs: list[list[fx.Node]] = []
    last: Any = object()
    for n in body:
        layer = layer_of(n)
        if layer != last or not runs:
            runs.append([])
            last = layer
        runs[-1].append(n)
    segments = []
    for run in runs:
        members = set(run)
        inputs: dict[fx.Node, None] = {}
        for n in run:
            for a in n.all_input_nodes:
                if a not in members:
                    inputs.setdefault(a)
        outputs = [n for n in run if any(u not in members for u in n.users)]
        segments.append(_Segment(run, list(inputs), outputs))
    return segments


def _structure(seg: _Segment) -> tuple:
    """What makes two segments the same program, up to their inputs: the ops, their targets,
    the constants and the wiring (a node by its position in the segment or among its inputs)."""
    index = {n: ("n", i) for i, n in enumerate(seg.nodes)}
    index.update({n: ("in", i) for i, n in enumerate(seg.inputs)})

    def norm(a: Any) -> Any:
        if isinstance(a, fx.Node):
            return index[a]
        if isinstance(a, (list, tuple)):
            return (type(a).__name__, tuple(norm(x) for x in a))
        if isinstance(a, dict):
            return ("dict", tuple((k, norm(v)) for k, v in a.items()))
        if isinstance(a, slice):
            return ("slice", norm(a.start), norm(a.stop), norm(a.step))
        if isinstance(a, torch.Tensor):
            return ("tensor", id(a))  # never equal to another segment's constant
        return (type(a).__name__, a)

    ops = tuple((n.op, n.target, norm(n.args), norm(n.kwargs)) for n in seg.nodes)
    outs = tuple(index[o] for o in seg.outputs)
    return ops, outs, tuple(n.op == "placeholder" for n in seg.inputs)


def _describe(value: Any) -> Any:
    """The properties of an input value a trace depends on (symbolic sizes as expressions);
    ``None`` for a value that is neither a tensor nor a SymInt."""
    if isinstance(value, torch.Tensor):
        return ("T", value.dtype, value.device.type, tuple(str(s) for s in value.shape),
                tuple(str(s) for s in value.stride()), str(value.storage_offset()))
    if isinstance(value, torch.SymInt):
        return ("S", str(value.node.expr))
    return None


def _fresh(value: Any, fake_mode: FakeTensorMode) -> Any:
    """A new fake tensor like ``value`` that aliases nothing (AOT would otherwise see two
    inputs share a storage and rewrite them)."""
    if not isinstance(value, torch.Tensor):
        return value
    with fake_mode:
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype,
                                   device=value.device)


def _trace_by_layers(gm: fx.GraphModule, fakes: Sequence[Any],
                     fake_mode: FakeTensorMode) -> fx.GraphModule | None:
    """The lowered graph, AOT-traced once per *distinct* decoder layer (``None``: lower the
    whole graph, nothing repeats or a layer cannot be lowered alone).

    AOTAutograd costs time per node (two functional traces with symbolic shapes); a
    DeepSeek-V3-deep graph repeats one decoder layer 61 times. The Dynamo graph is cut into
    runs of consecutive nodes of one ModuleList element (``nn_module_stack``: ``layers.3``)
    and the runs between them; a run whose ops, constants and wiring equal an earlier one's
    and whose inputs have the same dtypes and symbolic sizes and strides is not traced again:
    the ATen nodes of the earlier run are copied with its inputs substituted (``meta["val"]``
    shared, as the ubatch copies of :mod:`dbo_compile.passes.split_ubatch` share theirs).

    Equivalent to one whole-graph trace where a run's functionalisation is local to it: a
    run may mutate only graph inputs that no other run reads (the KV cache of its own layer;
    the ``copy_`` back then sits at the run's end instead of the graph's, and
    :mod:`~dbo_compile.passes.reinplace` turns it back into the in-place write either way).
    Anything else makes this return ``None`` (logged at INFO, the whole graph is then traced
    once): a run that mutates another input, takes a value that is neither a tensor nor a
    SymInt from another run, makes a new symbol (a data-dependent size, which a copy must not
    share), whose traced graph does not have one placeholder per input and one output per
    value it hands on, or whose trace fails (the whole graph's trace then reports it).
    """
    if any(n.op in ("get_attr", "call_module") for n in gm.graph.nodes):
        return None
    segments = _segments(gm)
    structures = [_structure(s) for s in segments]
    if len(structures) == len(set(map(_hashable, structures))):
        return None  # nothing repeats: one trace of the whole graph is cheaper
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    segment_of = {n: i for i, seg in enumerate(segments) for n in seg.nodes}
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for i, (ph, fake) in enumerate(zip(placeholders, fakes)):
        env[ph] = graph.placeholder(f"arg{i}_1")
        env[ph].meta["val"] = fake
    root = torch.nn.Module()
    traced: list[tuple[tuple, tuple, fx.GraphModule]] = []  # (structure, inputs, aten graph)
    for k, (seg, structure) in enumerate(zip(segments, structures)):
        values = [env[a].meta.get("val") for a in seg.inputs]
        described = tuple(_describe(v) for v in values)
        aten = next((g for s, d, g in traced if d == described and s == structure), None)
        why = None
        if None in described:
            why = f"a value that is no tensor or SymInt enters the run at {seg.nodes[0].name}"
        elif aten is None:
            aten, why = _trace_segment(gm, seg, values, fake_mode)
            traced.append((structure, described, aten))
        why = why or _check_mutations(aten, seg, segment_of, k) or _stamp(
            graph, root, aten, [env[a] for a in seg.inputs], seg, env, k)
        if why:
            log.info("dbo: lowering the whole graph at once: %s", why)
            return None
    out = next(n for n in gm.graph.nodes if n.op == "output")
    graph.output(torch.fx.map_arg(out.args[0], lambda n: env[n]))
    log.debug("dbo: lowered %d runs of the graph with %d traces", len(segments), len(traced))
    return graph_module(root, graph)


def _hashable(structure: tuple) -> int:
    return hash(repr(structure))


def _trace_segment(gm: fx.GraphModule, seg: _Segment, values: list[Any],
                   fake_mode: FakeTensorMode) -> tuple[fx.GraphModule | None, str | None]:
    """The ATen graph of one run, or ``(None, why)`` where it cannot stand for its copies."""
    sub = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for a in seg.inputs:
        env[a] = sub.placeholder(a.name)
        env[a].meta = dict(a.meta)
    for n in seg.nodes:
        env[n] = sub.node_copy(n, lambda x: env[x])
    sub.output(tuple(env[o] for o in seg.outputs))
    inputs = [v if a.op == "placeholder" else _fresh(v, fake_mode)
              for a, v in zip(seg.inputs, values)]
    where = f"the run at {seg.nodes[0].name}"
    try:
        aten = _aot_trace(fx.GraphModule(gm, sub), inputs)
    except Exception as e:  # noqa: BLE001 - the whole graph's trace reports a real failure
        return None, f"tracing {where} alone failed ({type(e).__name__}: {e})"
    phs = [n for n in aten.graph.nodes if n.op == "placeholder"]
    outs = next(n for n in aten.graph.nodes if n.op == "output").args[0]
    if len(phs) != len(seg.inputs) or len(outs) != len(seg.outputs):
        return None, (f"the trace of {where} has {len(phs)} inputs and {len(outs)} outputs, "
                      f"not {len(seg.inputs)} and {len(seg.outputs)}")
    known = set()
    for v in inputs:
        known |= _symbols(v)
    if any(not _symbols(n.meta.get("val")) <= known for n in aten.graph.nodes):
        return None, f"{where} makes a new symbol (a data-dependent size)"
    return aten, None


def _symbols(value: Any) -> set:
    """The free symbols of a value's sizes and strides (a SymInt's own)."""
    if isinstance(value, (list, tuple)):
        return set().union(*(_symbols(v) for v in value)) if value else set()
    if isinstance(value, torch.SymInt):
        return set(value.node.expr.free_symbols)
    if isinstance(value, torch.Tensor):
        return set().union(*(_symbols(s) for s in (*value.shape, *value.stride())))
    return set()


def _mutated_inputs(aten: fx.GraphModule) -> list[int]:
    """Positions of the placeholders an op of ``aten`` writes (the ``copy_`` back of an input
    mutation, or any other op whose schema writes its first argument)."""
    phs = {n: i for i, n in enumerate(n for n in aten.graph.nodes if n.op == "placeholder")}
    out = []
    for n in aten.graph.nodes:
        schema = getattr(n.target, "_schema", None)
        if n.op != "call_function" or schema is None or not n.args or n.args[0] not in phs:
            continue
        first = schema.arguments[0] if schema.arguments else None
        if first is not None and first.alias_info is not None and first.alias_info.is_write:
            out.append(phs[n.args[0]])
    return out


def _check_mutations(aten: fx.GraphModule, seg: _Segment, segment_of: dict[fx.Node, int],
                     k: int) -> str | None:
    """Why the run's input mutations are not local to it, or ``None``."""
    for i in _mutated_inputs(aten):
        a = seg.inputs[i]
        if a.op != "placeholder" or any(segment_of.get(u, -1) != k for u in a.users):
            return f"the run at {seg.nodes[0].name} mutates {a.name}, which another run reads too"
    return None


def _stamp(graph: fx.Graph, root: torch.nn.Module, aten: fx.GraphModule, inputs: list[fx.Node],
           seg: _Segment, env: dict[fx.Node, fx.Node], k: int) -> str | None:
    """Copy ``aten``'s nodes into ``graph`` over ``inputs``; map ``seg``'s outputs in ``env``.
    Returns why not, or ``None``."""
    local: dict[fx.Node, fx.Node] = {}
    phs = [n for n in aten.graph.nodes if n.op == "placeholder"]
    local.update(zip(phs, inputs))
    for n in aten.graph.nodes:
        if n.op == "placeholder":
            continue
        if n.op == "output":
            for o, v in zip(seg.outputs, n.args[0]):
                if not isinstance(v, fx.Node):
                    return f"the run at {seg.nodes[0].name} hands on a constant"
                env[o] = local[v]
            continue
        if n.op == "get_attr":  # a constant AOT lifted out of the run
            name = f"_run{k}_{n.target.replace('.', '_')}"
            setattr(root, name, getattr(aten, n.target))
            local[n] = graph.get_attr(name)
            local[n].meta = dict(n.meta)
            continue
        local[n] = graph.node_copy(n, lambda x: local[x])
    return None
