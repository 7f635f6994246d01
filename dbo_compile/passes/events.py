"""The event edges of a schedule (step 4 of the scheduler).

The transitive reduction of (stream order + cross-stream dependencies) keeps exactly the
cross-stream edges no other path implies: each is one event record on the producer's stream
and one wait on the consumer's.
"""

from __future__ import annotations

import logging

from dbo_compile.schedule import Unit

log = logging.getLogger(__name__)


def minimal_event_edges(units: list[Unit], deps: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Step 4: cross-stream edges of the transitive reduction of stream order + deps.

    ``units`` are in host order, which every dep and every stream-order edge follows (a
    topological order). A cross-stream edge ``a -> b`` is implied by another path exactly when
    another successor ``c`` of ``a`` reaches ``b``; and since each stream is a chain, ``c``
    reaches ``b`` exactly when ``c`` reaches some unit at or before ``b`` on ``b``'s stream.
    So one reverse pass computes, per unit and stream, the earliest position on that stream
    it reaches, and each edge is then tested in constant time per successor: O(units + deps),
    where a general transitive reduction (``networkx``, a search per unit) was quadratic in
    the depth of the model.
    """
    stream = {u.id: u.stream for u in units}
    position: dict[int, int] = {}  # index on its own stream
    succs: dict[int, set[int]] = {u.id: set() for u in units}
    last: dict[str, int] = {}
    count: dict[str, int] = {}
    for u in units:  # host order
        if u.stream in last:
            succs[last[u.stream]].add(u.id)
        last[u.stream] = u.id
        position[u.id] = count.get(u.stream, 0)
        count[u.stream] = position[u.id] + 1
    for a, b in deps:
        succs[a].add(b)
    streams = sorted(set(stream.values()))
    never = len(units) + 1
    earliest: dict[int, dict[str, int]] = {}
    for u in reversed(units):
        reach = {s: never for s in streams}
        reach[u.stream] = position[u.id]
        for c in succs[u.id]:
            for s, p in earliest[c].items():
                if p < reach[s]:
                    reach[s] = p
        earliest[u.id] = reach
    out = set()
    for a, b in deps:
        if stream[a] == stream[b]:
            continue
        sb, pb = stream[b], position[b]
        if not any(c != b and earliest[c][sb] <= pb for c in succs[a]):
            out.add((a, b))
    return sorted(out)
