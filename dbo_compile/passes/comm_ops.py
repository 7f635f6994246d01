"""Which FX nodes are communication, and of what kind.

Recognised:

- our custom ops ``torch.ops.dbo.dispatch`` / ``torch.ops.dbo.combine`` (single nodes; the
  yield pass gives them an explicit wait),
- user-written functional collectives ``_c10d_functional.all_to_all_single`` followed by
  ``_c10d_functional.wait_tensor`` (already split into issue and wait).
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx


def _c10d_a2a():
    return torch.ops._c10d_functional.all_to_all_single.default


def _c10d_wait():
    return torch.ops._c10d_functional.wait_tensor.default


def comm_kind(node: fx.Node) -> str | None:
    """``"dispatch"``, ``"combine"`` or ``"all_to_all"`` for an issuing comm node, else ``None``."""
    if node.op != "call_function":
        return None
    target = node.target
    if isinstance(target, torch._ops.OpOverloadPacket):  # Dynamo graphs call the packet
        target = target.default
    if isinstance(target, torch._ops.OpOverload):
        if target.namespace == "dbo" and target._opname in ("dispatch", "combine"):
            return target._opname
        if target == _c10d_a2a():
            return "all_to_all"
    return None


def is_c10d_wait(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target == _c10d_wait()


def is_getitem(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is operator.getitem


def comm_nodes(graph: fx.Graph) -> list[fx.Node]:
    """Issuing comm nodes in graph order."""
    return [n for n in graph.nodes if comm_kind(n) is not None]
