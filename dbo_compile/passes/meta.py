"""Our facts about FX nodes, kept under ``node.meta["dbo"]`` (one place documents them all).

Keys of ``node.meta["dbo"]`` (a dict):

- ``ubatch``: int ubatch id of a per-ubatch node; ``None`` for shared nodes (weights, their
  views) and for the nodes of a joined call (below).
- ``origin``: on a per-ubatch node, the name of the unsplit node it is a copy of.
- ``join``: on the nodes of a joined call (:mod:`dbo_compile.passes.join_experts`), the
  ``origin`` of the ubatch copies it replaced; the nodes of one join form one stage.
- ``token_dim``: 0 when dim 0 of the node's value is indexed by tokens (or requests), else
  ``None``. Only dim 0 may be a token dim (checked by :mod:`dbo_compile.passes.token_dim`).
- ``comm``: ``"dispatch"`` / ``"combine"`` / ``"all_to_all"`` on communication nodes.
- ``phase``: ``"issue"`` on a comm node, ``"wait"`` on the wait node that ends it.
- ``comm_node``: on a wait node, the name of the issue node it waits for.
- ``thread``: on a node of a state thread (:mod:`dbo_compile.passes.state_threads`) in the
  split graph, ``(placeholder name, segment index)``; each ubatch's copy of a segment is its
  own schedule unit.
- ``state_write``: on the write back of a shared input's new value (``copy_``), the
  placeholder's name; every reader of the old value is ordered before it.
- ``field``: on a placeholder of the lowered graph, the ``AttentionMetadata`` field it is
  (messages name it).
- ``mutates``: names of the placeholders an in-place op writes (after re-inplacing), e.g. the KV
  cache written by ``dbo.attention``.
- ``unit``: id of the schedule unit (stage or comm op) the node belongs to.
- ``stream``: ``"compute"`` or ``"comm"``. ``node.meta["custom"]["stream"]``, the key Dynamo
  and Inductor use for stream annotations, gets its index in their contract
  (:data:`dbo_compile.schedule.STREAM_INDEX`: ``1`` for the comm stream; none for the compute
  stream, the current one).
"""

from __future__ import annotations

from typing import Any

import torch.fx as fx

from dbo_compile.schedule import STREAM_INDEX, annotate_stream


def dbo_meta(node: fx.Node) -> dict[str, Any]:
    """The ``node.meta["dbo"]`` dict of ``node``, created empty on first use."""
    return node.meta.setdefault("dbo", {})


def set_stream(node: fx.Node, stream: str) -> None:
    """Put ``node`` on ``stream`` (``"compute"`` or ``"comm"``): ``meta["dbo"]["stream"]``, and
    ``meta["custom"]["stream"]`` in Inductor's ``int | None`` contract (no key: current stream)."""
    dbo_meta(node)["stream"] = stream
    annotate_stream(node.meta, STREAM_INDEX[stream])
