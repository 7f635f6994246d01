"""The comm backends' registry: register, look up by spec (configured once per spec), deal
``comm_backend_options``, and receive what a failed step left in flight."""

from __future__ import annotations

import logging
from typing import Any

from dbo_compile.errors import CommBackendError
from dbo_compile.ops.backends import BackendRegistry, parse_backend_spec
from dbo_compile.ops.comm.contract import CommBackend

log = logging.getLogger(__name__)

__all__ = ["abort_pending_receives", "auto_comm_choices", "available_comm_backends",
           "clear_configured_comm_backends", "comm_backend_name", "comm_options_for",
           "comm_record", "get_comm_backend", "register_comm_backend",
           "register_lazy_comm_backend"]

_REGISTRY: BackendRegistry[CommBackend] = BackendRegistry("comm backend", CommBackendError,
                                                         fallback="torch")


def register_comm_backend(backend: CommBackend) -> None:
    """Register (or replace) a comm backend under ``backend.name``."""
    _REGISTRY.register(backend.name, backend)


def register_lazy_comm_backend(name: str, module: str) -> None:
    """Register a backend whose module is imported only when :func:`get_comm_backend` asks for it.

    The module must call :func:`register_comm_backend` with a backend named ``name`` on import.
    """
    _REGISTRY.register_lazy(name, module)


def available_comm_backends() -> list[str]:
    """Names of the registered backends (loaded or lazy), sorted."""
    return _REGISTRY.names()


def get_comm_backend(name: str) -> CommBackend:
    """The backend of the spec ``name`` (``"torch"``, ``"deep_ep:mode=low_latency"``),
    importing its module first if it is lazy, configured with the spec's options.

    Raises:
        CommBackendError: ``name`` is unknown, its module (or the package it wraps, e.g.
            ``deep_ep``) cannot be imported, or an option is unknown or bad.
    """
    return _REGISTRY.get(name)


def comm_options_for(names: Any, options: Any) -> dict[str, dict[str, Any]]:
    """``options`` dealt to the comm backends ``names``, each value checked by the backend
    that takes it, whether its package imports or not
    (:meth:`~dbo_compile.ops.backends.BackendRegistry.options_for`).

    Raises:
        CommBackendError: an unknown backend, an option none of them takes, or a bad value.
    """
    return _REGISTRY.options_for(names, options)


def clear_configured_comm_backends() -> None:
    """Forget configured backends (rebuilt when next asked for; tests swapping ``deep_ep``)."""
    _REGISTRY.clear_configured()


def abort_pending_receives() -> None:
    """After a step that failed inside the split program: every backend receives what it
    issued and did not receive (``CommBackend.abort``), so that the next step starts with
    nothing in flight. Called by the step transaction (``runtime/step_txn.py``)."""
    for backend in _REGISTRY.instances():
        if backend.abort is not None:
            try:
                backend.abort()
            except Exception as e:  # noqa: BLE001 - the step's own error is the one to raise
                log.error("dbo: comm backend %r: receiving the aborted step's calls failed: %s",
                          backend.name, e)


def comm_backend_name(spec: str) -> str:
    """The registry name of a backend spec (``"deep_ep:mode=low_latency"`` -> ``"deep_ep"``)."""
    return parse_backend_spec(spec)[0]



def comm_record(name: str) -> CommBackend:
    """The registered record of the backend ``name`` (not configured: its ``auto``,
    ``check_options``), importing its module first if it is lazy.

    Raises:
        CommBackendError: ``name`` is unknown or its module cannot be imported.
    """
    return _REGISTRY.record(name)


def auto_comm_choices() -> list[tuple[str, Any]]:
    """``(name, AutoPreference)`` of the comm backends ``comm_backend="auto"`` may choose, in
    the order it tries them (:meth:`~dbo_compile.ops.backends.BackendRegistry.auto_choices`).

    Raises:
        CommBackendError: a lazy backend's module cannot be imported.
    """
    return _REGISTRY.auto_choices()
