"""Split every comm op into an issue phase and a wait phase: the ubatch's yield points.

Before::

    r = dbo.dispatch(x, ids, w, E, group)         # blocks until the tokens have arrived
    recv_x = r[0]

After::

    r = dbo.dispatch(x, ids, w, E, group)         # meta["dbo"]: phase="issue" (comm stream)
    r_wait = comm_wait(r)                         # meta["dbo"]: phase="wait", comm_node="r"
    recv_x = r_wait[0]

Between the issue and the wait the other ubatch computes. User-written functional collectives
(``_c10d_functional.all_to_all_single`` + ``wait_tensor``) are already split; they are only
annotated. In generated code the wait is an event wait of the consumer's stream on the event
recorded after the issue; the value itself is passed through unchanged
(:func:`dbo_compile.ops.registry.comm_wait`).

A comm op whose backend has a receive phase (``CommBackend.receive``: DeepEP low-latency's
receive hook) gets ``defer_receive=True`` and, as its wait, the receive itself, a unit of its
own in the schedule::

    r = dbo.moe_dispatch(x, ids, w, E, group, "deep_ep:...", True)   # the send only
    r_wait = comm_receive(r, "deep_ep:...")                           # the receive hook
"""

from __future__ import annotations

import logging

import torch.fx as fx

from dbo_compile.errors import ScheduleError
from dbo_compile.ops.comm import comm_backend_of, comm_receive, comm_spec_of
from dbo_compile.ops.registry import comm_kind, comm_wait, is_c10d_wait, op_has_arg, set_op_arg
from dbo_compile.passes.manager import CompileState, GraphPass
from dbo_compile.passes.meta import dbo_meta

log = logging.getLogger(__name__)


def insert_yields(graph: fx.Graph) -> list[tuple[fx.Node, fx.Node]]:
    """Give each comm node a wait node; return the ``(issue, wait)`` pairs in graph order.

    Idempotent: a comm node that already has its wait is only re-annotated.
    """
    pairs = []
    for node in list(graph.nodes):
        kind = comm_kind(node)
        if kind is None:
            continue
        meta = dbo_meta(node)
        meta["comm"] = kind
        meta["phase"] = "issue"
        if kind == "all_to_all":
            waits = [u for u in node.users if is_c10d_wait(u)]
            if len(waits) != 1:
                raise ScheduleError(f"{node.name}: all_to_all_single must have exactly one "
                                    f"wait_tensor, it has {len(waits)}")
            wait = waits[0]
        else:
            existing = [u for u in node.users if u.target in (comm_wait, comm_receive)]
            backend = comm_backend_of(node)
            receives = (backend is not None and backend.receive is not None
                        and op_has_arg(node, "defer_receive"))
            if existing:
                wait = existing[0]
            else:
                if receives:
                    set_op_arg(node, "defer_receive", True)
                with graph.inserting_after(node):
                    wait = (graph.call_function(comm_receive, (node, comm_spec_of(node)))
                            if receives else graph.call_function(comm_wait, (node,)))
                node.replace_all_uses_with(wait, delete_user_cb=lambda u: u is not wait)
                wait.meta["val"] = node.meta.get("val")
                for k in ("stack_trace", "nn_module_stack"):
                    if k in node.meta:
                        wait.meta[k] = node.meta[k]
        wmeta = dbo_meta(wait)
        wmeta.update(phase="wait", comm=kind, comm_node=node.name,
                     ubatch=meta.get("ubatch"), token_dim=meta.get("token_dim"))
        pairs.append((node, wait))
    return pairs


def _run(gm: fx.GraphModule, st: CompileState) -> None:
    insert_yields(gm.graph)


PASS = GraphPass("insert_yields", _run)
