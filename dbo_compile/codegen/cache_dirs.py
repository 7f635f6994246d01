"""One cache directory for a warm restart (``DboConfig.cache_dir``, issue 26): our compile cache
and the caches of the compilers under us, so that a second process on the same host compiles
nothing.

Layout of ``cache_dir`` (``~`` expanded)::

    cache_dir/
        <key>.pkl        our compile cache (:mod:`dbo_compile.codegen.cache`; where it always was,
                         so entries written before stay valid)
        inductor/        TORCHINDUCTOR_CACHE_DIR: Inductor's FX-graph and AOTAutograd caches,
                         its generated code and compiled kernels
        triton/          TRITON_CACHE_DIR: Triton's compiled kernels

Torch reads ``TORCHINDUCTOR_CACHE_DIR`` at each cache lookup
(``torch._inductor.runtime.cache_dir_utils.cache_dir``, the same on torch 2.11 and 2.13), which
then writes its resolved default back into the environment; Triton reads
``TRITON_CACHE_DIR`` when it opens its cache (torch sets it to ``<inductor dir>/triton/<device>``
when unset). :func:`use_cache_dir` sets both for the process at the backend's compile, before
any stage is compiled.

**Who wins**: a variable the user set explicitly wins over ``cache_dir`` (logged once at
INFO): an explicit ``TORCHINDUCTOR_CACHE_DIR`` keeps Inductor's caches (and, unless
``TRITON_CACHE_DIR`` is set too, Triton's, which torch puts under it) where the user said; an
explicit ``TRITON_CACHE_DIR`` keeps Triton's. A value torch wrote itself (its default
``/tmp/torchinductor_<user>``, or Triton's dir under it) or that this module set for an earlier
``cache_dir`` is not the user's and is replaced. Caveat: the variables are process-wide, and
Inductor's compile workers read them when their pool starts; where Inductor compiled something
in this process before the first ``backend="dbo"`` compile with ``cache_dir``, set the variables
yourself before that.
"""

from __future__ import annotations

import logging
import os

from torch._inductor.runtime.cache_dir_utils import default_cache_dir

log = logging.getLogger(__name__)

__all__ = ["INDUCTOR_SUBDIR", "TRITON_SUBDIR", "cache_layout", "use_cache_dir"]

INDUCTOR_SUBDIR = "inductor"
TRITON_SUBDIR = "triton"
_INDUCTOR, _TRITON = "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"
#: the values this module set, per variable (told apart from the user's)
_SET: dict[str, set[str]] = {_INDUCTOR: set(), _TRITON: set()}
_TOLD: set[tuple[str, str]] = set()


def cache_layout(cache_dir: str) -> dict[str, str]:
    """The absolute paths ``cache_dir`` holds (module docstring): ``dbo`` (our entries),
    ``inductor``, ``triton``."""
    root = os.path.abspath(os.path.expanduser(cache_dir))
    return {"dbo": root, "inductor": os.path.join(root, INDUCTOR_SUBDIR),
            "triton": os.path.join(root, TRITON_SUBDIR)}


def _torch_default() -> str:
    return os.path.abspath(default_cache_dir())


def _users(var: str, value: str | None) -> bool:
    """Whether ``value`` of ``var`` is the user's own (not unset, ours, or torch's default)."""
    if not value:
        return False
    value = os.path.abspath(value)
    if value in _SET[var]:
        return False
    default = _torch_default()
    if var == _INDUCTOR:
        return value != default
    inductor_dirs = set(_SET[_INDUCTOR]) | ({default} if default else set())
    inductor_now = os.environ.get(_INDUCTOR)
    if inductor_now:
        inductor_dirs.add(os.path.abspath(inductor_now))
    # torch's own choice: <inductor dir>/triton/<device>
    return not any(value.startswith(os.path.join(d, TRITON_SUBDIR) + os.sep) or
                   value == os.path.join(d, TRITON_SUBDIR) for d in inductor_dirs)


def use_cache_dir(cache_dir: str) -> dict[str, str]:
    """Point Inductor's and Triton's caches under ``cache_dir`` (module docstring), unless the
    user set them; creates the directories.

    Returns:
        Where each cache is now: ``dbo``, ``inductor``, ``triton`` (absolute paths; the
        user's where theirs won).
    """
    layout = cache_layout(cache_dir)
    inductor_users = _users(_INDUCTOR, os.environ.get(_INDUCTOR))
    if inductor_users:
        layout["inductor"] = os.path.abspath(os.environ[_INDUCTOR])
        _tell(_INDUCTOR, layout["inductor"])
    triton_now = os.environ.get(_TRITON)
    if _users(_TRITON, triton_now):  # before the inductor dir moves: torch's is told apart
        layout["triton"] = os.path.abspath(triton_now)
        _tell(_TRITON, layout["triton"])
        set_triton = False
    else:  # an explicit Inductor dir keeps Triton's under it, as torch puts it
        set_triton = not inductor_users
        if inductor_users:
            layout["triton"] = os.path.join(layout["inductor"], TRITON_SUBDIR)
    if not inductor_users:
        os.environ[_INDUCTOR] = layout["inductor"]
        _SET[_INDUCTOR].add(layout["inductor"])
    if set_triton:
        os.environ[_TRITON] = layout["triton"]
        _SET[_TRITON].add(layout["triton"])
    for path in {layout["dbo"], layout["inductor"]} | ({layout["triton"]} if set_triton else set()):
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as e:  # the compile cache logs its own WARNING on write
            log.warning("dbo: cache directory %r cannot be created (%s)", path, e)
    return layout


def _tell(var: str, value: str) -> None:
    if (var, value) not in _TOLD:
        _TOLD.add((var, value))
        log.info("dbo: %s=%s was set explicitly and wins over cache_dir for its cache",
                 var, value)
