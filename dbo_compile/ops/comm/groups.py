"""The EP process group a comm op names: its name, its world size, the process group behind
it, and the backend an op runs with when none is bound."""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from dbo_compile.errors import CommBackendError

__all__ = ["NO_GROUP_FIX", "backend_for_group", "ep_group_name", "ep_world_size",
           "process_group_names", "resolve_group"]


def ep_group_name(group: dist.ProcessGroup | None) -> str:
    """Name under which the ops find the EP process group.

    Args:
        group: the EP process group, or ``None``.

    Returns:
        ``group.group_name``; ``""`` (local, no collective) for ``None`` or a group of world
        size 1.
    """
    if group is None or group.size() == 1:
        return ""
    return group.group_name


def process_group_names() -> list[str]:
    """The names of the process groups registered in this process (for messages)."""
    try:
        return sorted(str(n) for n in dist.distributed_c10d._world.pg_names.values())
    except Exception:  # noqa: BLE001 - a private table; only a message depends on it
        return []


#: what a model without the EP group its comm ops name can do (CommBackendError messages)
NO_GROUP_FIX = ("build the model with an EP process group of this process "
                "(DeepseekMoEModel(..., ep_group=group) after torch.distributed."
                "init_process_group), or without one (ep_group=None: one EP rank, "
                "comm_backend='local' or 'auto')")


def resolve_group(group_name: str) -> dist.ProcessGroup:
    """The process group named ``group_name``.

    Raises:
        CommBackendError: no process group of this process has that name (``""`` included:
            the name of no group), naming the registered ones and what to build instead.
    """
    try:
        return _resolve_process_group(group_name)
    except Exception as e:  # noqa: BLE001 - torch raises RuntimeError / KeyError / ValueError
        raise CommBackendError(
            f"the comm op's EP group {group_name!r} is no process group of this process "
            f"({type(e).__name__}; registered: {process_group_names()}): {NO_GROUP_FIX}"
        ) from None


def ep_world_size(group_name: str) -> int:
    """World size ``W`` of the EP group named ``group_name`` (1 for ``""``).

    Raises:
        CommBackendError: ``group_name`` names no process group of this process.
    """
    if group_name == "":
        return 1
    return resolve_group(group_name).size()


def backend_for_group(group_name: str, backend: str = "") -> str:
    """The comm backend the ops use: ``backend`` when given (the op's ``backend`` argument, bound
    by the compiler from ``DboConfig.comm_backend``), else ``"local"`` for the group ``""`` and
    ``"torch"`` for any other."""
    if backend:
        return backend
    return "local" if group_name == "" else "torch"
