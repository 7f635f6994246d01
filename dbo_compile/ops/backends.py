"""Backend records and their registry: the comm and experts backends of an op, asked for by
spec (``"deep_ep:max_tokens=256,mode=low_latency"``), configured once per spec, their options
dealt and checked, their packages imported when first asked for, and where ``"auto"`` picks
them (:class:`AutoPreference`).

:mod:`dbo_compile.ops.comm` and :mod:`dbo_compile.ops.experts` each keep one
:class:`BackendRegistry` of their records; the compiler binds a backend's spec into the op's
``backend`` argument (:mod:`dbo_compile.passes.bind`).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from typing import Any, Callable, Generic, Protocol, Sequence, TypeVar

__all__ = ["AutoPreference", "BackendRecord", "BackendRegistry", "backend_spec",
           "import_optional", "parse_backend_spec"]


@dataclasses.dataclass(frozen=True)
class AutoPreference:
    """Whether and where ``"auto"`` (``DboConfig.comm_backend`` / ``experts_backend``) picks a
    backend, declared in its record: ``"auto"`` tries the registered backends that declare one
    in ``rank`` order (then by name) and binds the first that loads (its package imports),
    binds and serves every op it is asked for (its ``supports``); a backend without one is
    chosen only by name.

    Attributes:
        rank: the order ``"auto"`` tries it in, lowest first.
        op_default: the backend is what an op runs when nothing is bound (``local`` / ``torch``
            for the comm ops, :func:`~dbo_compile.ops.comm.backend_for_group`; ``torch`` for
            the experts): chosen by ``"auto"``, its spec is bound only with options dealt to
            it, so that the op keeps its own choice.
        only: ``only(facts) -> None`` where ``"auto"`` may pick it for an op with these facts,
            else the words that follow the choice of another backend in the log
            (``"for the rank-major rows (...)"``): a backend that serves an op but is not the
            best there (DeepGEMM's contiguous GEMM on rank-major rows); ``None``: wherever it
            serves.
    """

    rank: int
    op_default: bool = False
    only: Callable[[dict[str, Any]], str | None] | None = None


class BackendRecord(Protocol):
    """What a :class:`BackendRegistry` reads of a backend record (a comm or experts backend:
    :class:`~dbo_compile.ops.comm.CommBackend`, :class:`~dbo_compile.ops.experts.
    ExpertsBackend`).

    Attributes:
        name: the registry key.
        description: one line for logs and errors.
        configure: ``configure(**options) -> record``: the backend with a spec's options (and
            its package checked); ``None``: it takes no options.
        check_options: ``check_options(**options)``: raises for a bad value without importing
            the package the backend wraps; its keyword parameters are the options it takes.
            ``None``: ``configure`` checks them (and takes every option dealt to it).
        auto: where ``"auto"`` picks it (:class:`AutoPreference`); ``None``: only by name.
    """

    name: str
    description: str
    configure: Callable[..., Any] | None
    check_options: Callable[..., None] | None
    auto: AutoPreference | None


B = TypeVar("B", bound=BackendRecord)


def import_optional(module: str, error: type[Exception], what: str, install: str,
                    option: str) -> Any:
    """Import the optional package ``module`` a backend wraps (``deep_ep``, ``deep_gemm``).

    Raises:
        ``error``: it failed to import (any exception: without CUDA these packages raise
            ``OSError`` or ``AssertionError``, not only ``ImportError``), naming the package,
            how to install it (``install``) and the fallback (``option='torch'``).
    """
    try:
        return importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 - an optional package can fail in many ways
        raise error(
            f"{what} needs the package {module}, which failed to import ({type(e).__name__}: "
            f"{e}); install it with {install}, or use {option}='torch' ({option}='auto' falls "
            "back to it)") from e


def parse_backend_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """``"name"`` or ``"name:key=value,key=value"`` -> ``(name, {key: value})``; values that
    read as ints, floats or ``true``/``false`` become those (the form the compiler binds into
    an op's ``backend`` argument: :func:`backend_spec`)."""
    name, _, rest = spec.partition(":")
    options: dict[str, Any] = {}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        options[key.strip()] = _parse_value(value.strip())
    return name, options


def _parse_value(value: str) -> Any:
    if value.lower() in ("true", "false"):
        return value.lower() == "true"
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value


def backend_spec(name: str, options: Any = ()) -> str:
    """The canonical spec of backend ``name`` with ``options`` (a mapping or ``(key, value)``
    pairs): ``"name"`` or ``"name:k1=v1,k2=v2"``, keys sorted, so that every rank binds the same
    string (it enters the fingerprint)."""
    items = sorted(dict(options).items())
    if not items:
        return name
    def text(v: Any) -> str:
        return str(v).lower() if isinstance(v, bool) else str(v)
    return name + ":" + ",".join(f"{k}={text(v)}" for k, v in items)


class BackendRegistry(Generic[B]):
    """Named implementations of an op (its comm or experts backends), some imported lazily.

    Each backend is a record of the :class:`BackendRecord` protocol. A backend may take
    options: it is asked for by its spec (:func:`backend_spec`,
    ``"deep_ep:max_tokens=256,mode=low_latency"``) and, when its record declares
    ``configure`` (``configure(**options) -> backend``: checks the options and the package the
    backend wraps, and returns the configured backend), the configured backend is built once
    per spec and kept. A backend without ``configure`` takes no options. Its
    ``check_options`` checks option values without importing the package (which may be
    absent), and its keyword parameters are the options the backend takes
    (:meth:`options_for`). Its ``auto`` says where ``"auto"`` picks it (:meth:`auto_choices`).

    Args:
        kind: what they are, for errors (``"comm backend"``).
        error: the exception type raised for an unknown or unloadable backend.
        fallback: the backend to name in the error as the one that always works.
    """

    def __init__(self, kind: str, error: type[Exception], fallback: str):
        self.kind, self.error, self.fallback = kind, error, fallback
        self._loaded: dict[str, B] = {}
        #: name -> module path; imported on first use, it must register the backend
        self._lazy: dict[str, str] = {}
        #: spec -> the configured backend
        self._configured: dict[str, B] = {}

    def register(self, name: str, backend: B) -> None:
        """Register (or replace) ``backend`` under ``name``."""
        self._loaded[name] = backend
        self._lazy.pop(name, None)
        self._configured = {k: v for k, v in self._configured.items()
                            if parse_backend_spec(k)[0] != name}

    def register_lazy(self, name: str, module: str) -> None:
        """``name`` is registered by importing ``module``, done when it is first asked for."""
        if name not in self._loaded:
            self._lazy[name] = module

    def names(self) -> list[str]:
        """Every registered name (loaded or lazy), sorted."""
        return sorted(set(self._loaded) | set(self._lazy))

    def instances(self) -> list[B]:
        """Every backend built so far: the loaded ones and the configured ones."""
        return list(self._loaded.values()) + list(self._configured.values())

    def clear_configured(self) -> None:
        """Forget the configured backends (they are rebuilt, and their packages checked again,
        when next asked for); tests that swap a wrapped package use it."""
        self._configured.clear()

    def get(self, spec: str) -> B:
        """The backend of ``spec`` (``"name"`` or ``"name:options"``), importing its module
        first if it is lazy, configured with the spec's options.

        Raises:
            ``self.error``: the name is unknown, importing its module (or the package it
                wraps) failed, or an option is unknown or bad; the message says why and names
                the fallback.
        """
        if spec in self._configured:
            return self._configured[spec]
        name, options = parse_backend_spec(spec)
        backend = self.record(name)
        if backend.configure is None:
            if options:
                raise self.error(f"{self.kind} {name!r} takes no options, got {options}")
            return backend
        configured = backend.configure(**options)
        self._configured[spec] = configured
        return configured

    def options_for(self, names: Sequence[str], options: Any) -> dict[str, dict[str, Any]]:
        """``options`` (a mapping) dealt to the backends ``names``: each gets those it takes
        (the keyword parameters of its ``check_options``; a backend with ``configure`` and no
        ``check_options`` takes them all and checks them when it is configured), their values
        checked by its ``check_options``, which imports nothing: the options of a backend are
        checked whether its package is present or not.

        Raises:
            ``self.error``: a name is unknown, an option none of them takes (saying what each
                takes), or a bad value (the taker's message).
        """
        options = dict(options)
        takes: dict[str, tuple[str, ...] | None] = {}
        for name in names:
            backend = self.record(name)
            if backend.check_options is not None:
                params = inspect.signature(backend.check_options).parameters.values()
                takes[name] = tuple(p.name for p in params
                                    if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
            else:
                takes[name] = None if backend.configure is not None else ()
        dealt = {name: {k: v for k, v in options.items() if t is None or k in t}
                 for name, t in takes.items()}
        unknown = sorted(k for k in options if not any(k in d for d in dealt.values()))
        if unknown:
            said = "; ".join(f"{n}: {', '.join(t) if t else 'no options'}"
                             for n, t in takes.items())
            raise self.error(f"unknown {self.kind} option(s) {unknown} ({said})")
        for name, given in dealt.items():
            check = self.record(name).check_options
            if check is not None and given:
                check(**given)
        return dealt

    def auto_choices(self) -> list[tuple[str, AutoPreference]]:
        """``(name, preference)`` of every registered backend whose record declares an
        :class:`AutoPreference`, in the order ``"auto"`` tries them (rank, then name); lazy
        backends are loaded to read their records.

        Raises:
            ``self.error``: a lazy backend's module cannot be imported.
        """
        found = [(name, self.record(name).auto) for name in self.names()]
        return sorted(((n, a) for n, a in found if a is not None),
                      key=lambda c: (c[1].rank, c[0]))

    def record(self, name: str) -> B:
        """The registered record of ``name`` (not configured), importing its module first if
        it is lazy.

        Raises:
            ``self.error``: the name is unknown, or its module cannot be imported or did not
                register it.
        """
        if name in self._loaded:
            return self._loaded[name]
        if name not in self._lazy:
            raise self.error(f"unknown {self.kind} {name!r}; registered: {self.names()}")
        module = self._lazy[name]
        try:
            importlib.import_module(module)
        except Exception as e:  # noqa: BLE001 - an optional package can fail in many ways
            raise self.error(
                f"{self.kind} {name!r} cannot be loaded: importing {module!r} failed "
                f"({type(e).__name__}: {e}); use {self.fallback!r}") from e
        if name not in self._loaded:
            raise self.error(f"module {module!r} did not register {self.kind} {name!r}")
        return self._loaded[name]
