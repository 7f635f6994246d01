"""The numbers a compiled graph takes as inputs, read from the model without Dynamo.

Dynamo passes some Python numbers to the graph as inputs: under ``torch.compile(dynamic=True)``
a float attribute of the model (a norm's eps, an attention or rope scale) becomes a 0-dim
float64 CPU tensor that Dynamo makes from the attribute at every call, without a guard on its
value; an int it did not specialise arrives as a Python int. A captured CUDA graph bakes such a
value in (a CPU scalar reaches the kernels as an argument), and so do the backend's programs,
which fold the floats (:attr:`~dbo_compile.runtime.artifact.CompiledArtifact.float_guards`).
The CUDA-graph runner replays without going through Dynamo, so it reads these numbers again at
every step from their Dynamo sources (``L['self']._modules['norm'].eps``, the expressions
Dynamo's own guards evaluate, in a scope of the traced frame's arguments and globals) and runs
a step whose numbers changed eagerly.

Numbers Dynamo specialised (traced as constants, with a guard on their value: a float without
``dynamic=True``, an int attribute of a module) are no graph inputs and are not seen here.

The tensors a graph reads from the model that are no parameters (a KV cache, an expert-load
counter: buffers and plain attributes) are followed too, by identity: a captured graph reads the
captured tensor's memory, so a model that replaced one (``allocate_kv_cache`` again after
``capture()``) would be served stale memory. Parameters are not followed (one eval per weight per
step): load new weights in place (``load_state_dict``, ``copy_``), or capture again.
"""

from __future__ import annotations

import builtins
import inspect
import logging
from typing import Any, Callable, Mapping, Sequence

import torch

from dbo_compile.errors import GraphRunnerError
from dbo_compile.signature import InputSpec

log = logging.getLogger(__name__)

__all__ = ["InputNumbers", "changed_numbers", "changed_reason"]


class InputNumbers:
    """The number inputs of one compiled graph and the values one capture baked in.

    Args:
        compiled: what ``torch.compile`` returned: an ``OptimizedModule`` (the frame Dynamo
            traced is the module's ``forward``) or a compiled function.
        specs: the graph inputs' classification (their Dynamo sources).
        args: the graph inputs of the captured call.
        call_args / call_kwargs: arguments of a call of ``compiled`` (any step: they give the
            scope the sources are read in).

    Attributes:
        entries: ``(graph input index, source, captured value)`` per number input, in input
            order (empty: the graph takes none; nothing is read per step).
        tensors: ``(graph input index, source, captured tensor)`` per tensor the graph reads
            from the model that is no parameter (followed by identity).

    Raises:
        GraphRunnerError: a graph input that may be such a number (a 0-dim float64 CPU
            tensor, a Python number) whose source cannot be read here: the runner could not
            see it change.
    """

    def __init__(self, compiled: Callable[..., Any], specs: Sequence[InputSpec],
                 args: Sequence[Any], call_args: Sequence[Any], call_kwargs: dict[str, Any]):
        candidates = [s for s in specs if _may_be_number(s, args[s.index])]
        shared = [s for s in specs if s.kind == "shared" and s.source and s.field is None
                  and isinstance(args[s.index], torch.Tensor)
                  and not isinstance(args[s.index], torch.nn.Parameter)
                  and s not in candidates]
        self.entries: list[tuple[int, str, Any]] = []
        self.tensors: list[tuple[int, str, torch.Tensor]] = []
        self._code = None
        if not candidates and not shared:
            return
        self._fn, self._self = _traced_frame(compiled)
        self._signature: inspect.Signature | None = None  # read once: _scope runs every step
        fn = inspect.unwrap(getattr(self._fn, "__func__", self._fn))
        self._globals = getattr(fn, "__globals__", {})
        scope = self._scope(call_args, call_kwargs)
        for spec in candidates:
            try:
                value = eval(spec.source, scope)  # noqa: S307 - Dynamo's own source expression
            except Exception as e:  # noqa: BLE001 - any failure: the value cannot be followed
                raise GraphRunnerError(
                    f"graph input {spec.name} is a number Dynamo read from {spec.source!r} "
                    f"({args[spec.index]!r}), baked into every captured graph, but its source "
                    f"cannot be read outside Dynamo ({type(e).__name__}: {e}), so a change "
                    "could not be seen: make it a constant of the model (compile without "
                    "dynamic=True), or serve with run_step") from None
            if _is_number(value):  # else a tensor of the model (a 0-dim buffer): not baked
                self.entries.append((spec.index, spec.source, _number(args[spec.index])))
        for spec in shared:
            try:
                value = eval(spec.source, scope)  # noqa: S307 - Dynamo's own source expression
            except Exception as e:  # noqa: BLE001 - any failure: the tensor cannot be followed
                log.warning("dbo: graph input %s (%s) is read from the model by every captured "
                            "graph, but its source cannot be read outside Dynamo (%s: %s): a "
                            "replaced tensor there would not be seen; capture() again after "
                            "replacing it", spec.name, spec.source, type(e).__name__, e)
                continue
            if value is args[spec.index]:
                self.tensors.append((spec.index, spec.source, value))
        # one expression, read at every step: the numbers, then the tensors
        sources = [src for _, src, _ in self.entries + self.tensors]
        if sources:
            self._code = compile("(" + "".join(f"{src}, " for src in sources) + ")",
                                 "<dbo graph inputs read from the model>", "eval")

    def changed(self, call_args: Sequence[Any], call_kwargs: dict[str, Any]
                ) -> list[tuple[int, str, Any, Any]]:
        """``(graph input index, source, captured value, value now)`` of each number input
        that holds another value than at capture for a call with these arguments (a value
        that is no number any more counts as changed), and of each followed tensor the model
        replaced (``"the captured tensor"``, ``"another tensor"``)."""
        if self._code is None:
            return []
        scope = self._scope(call_args, call_kwargs)  # a call the frame does not take raises
        try:
            now = eval(self._code, scope)  # noqa: S307
        except Exception as e:  # noqa: BLE001 - the model changed shape: not the graphs' model
            followed = self.entries + [(i, src, "the captured tensor")
                                       for i, src, _ in self.tensors]
            return [(i, src, old, f"unreadable ({type(e).__name__})") for i, src, old in followed]
        numbers, tensors = now[:len(self.entries)], now[len(self.entries):]
        return ([(i, src, old, new) for (i, src, old), new in zip(self.entries, numbers)
                 if not _is_number(new) or new != old]
                + [(i, src, "the captured tensor", "another tensor")
                   for (i, src, old), new in zip(self.tensors, tensors) if new is not old])

    def _scope(self, call_args: Sequence[Any], call_kwargs: dict[str, Any]) -> dict[str, Any]:
        """``L`` (the traced frame's arguments, ``self`` first for a module) and ``G`` (its
        globals), as Dynamo's sources name them."""
        try:
            if self._signature is None:
                self._signature = inspect.signature(self._fn)
            bound = self._signature.bind(*call_args, **call_kwargs)
        except (TypeError, ValueError) as e:
            raise GraphRunnerError(
                f"the runner calls the compiled model as {self._fn!r} does not take "
                f"({type(e).__name__}: {e}); it cannot read the numbers the graphs bake in") from None
        bound.apply_defaults()
        local = dict(bound.arguments)
        if self._self is not None:
            local = {"self": self._self, **local}
        return {"L": local, "G": self._globals, "__builtins__": builtins}


def _traced_frame(compiled: Callable[..., Any]) -> tuple[Callable[..., Any], Any]:
    """The function whose frame Dynamo traced (a module's ``forward``, bound) and its
    ``self`` (``None``: a function)."""
    module = getattr(compiled, "_orig_mod", None)  # torch's OptimizedModule
    if isinstance(module, torch.nn.Module):
        return module.forward, module
    return getattr(compiled, "_torchdynamo_orig_callable", compiled), None


def _may_be_number(spec: InputSpec, arg: Any) -> bool:
    """A graph input that may be a number Dynamo read from the model: a 0-dim float64 CPU
    tensor (a float passed as a tensor) or a Python number, with a source, that the runner
    does not refresh per step (not a token-indexed tensor, a size or a metadata field)."""
    if not spec.source or spec.field is not None or spec.kind in ("token", "size"):
        return False
    if isinstance(arg, torch.Tensor):
        return arg.dim() == 0 and arg.dtype == torch.float64 and arg.device.type == "cpu"
    return _is_number(arg)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, torch.Tensor)


def _number(arg: Any) -> Any:
    return arg.item() if isinstance(arg, torch.Tensor) else arg


def changed_numbers(graphs: Mapping[int, Any], step: tuple[Any, ...],
                    model_kwargs: Mapping[str, Any]) -> list[tuple[int, str, Any, Any, Any]]:
    """``(graph input index, source, captured, now, artifact)`` of each number input of the
    captured graphs (``graphs``: a runner's buckets, each with ``numbers`` (an
    :class:`InputNumbers` or ``None``) and ``artifact``) that the model holds another value of
    now; one read per compiled graph, not per bucket."""
    out, seen = [], set()
    for b in graphs.values():
        if b.numbers is None or id(b.artifact) in seen:
            continue
        seen.add(id(b.artifact))
        out += [(*c, b.artifact) for c in b.numbers.changed(step, model_kwargs)]
    return out


def changed_reason(changed: Sequence[tuple[int, str, Any, Any, Any]]) -> str:
    """The CUDA-graph runner's eager-path reason for numbers that changed after capture, and
    what to do: ``changed`` holds ``(graph input index, source, captured, now, artifact)``
    (:meth:`InputNumbers.changed` and the artifact it belongs to)."""
    folded = any(i in dict(art.float_guards) for i, _, _, _, art in changed)
    what = ", ".join(f"{src} {old!s} -> {new!s}" for _, src, old, new, _ in changed)
    fix = ("compile the model again (torch._dynamo.reset(), then torch.compile: the "
           "backend folded it into its programs) and capture() again" if folded
           else "capture() again")
    return (f"the model changed numbers or replaced tensors the captured graphs bake in "
            f"({what}); steps run eagerly until you {fix}")
