"""Turn functionalised mutations of our ops back into in-place calls on graph inputs.

AOTAutograd functionalises an op that writes an input (``dbo.attention`` writes the KV cache)
into ``auto_functionalized(_v2)``, which at run time clones the whole input first. When the
mutated value is a graph input whose old value nobody reads afterwards, we call the op in place
on the input itself and drop the epilogue ``copy_`` (as Inductor's reinplace pass does)::

    before:  af = auto_functionalized_v2(dbo.attention, q=q, ..., _kv_cache_base_index=0,
                                         _all_bases=[kv_cache])
             out = af[0]; kv_new = af[1]; ...; copy_(kv_cache, kv_new)
    after:   out = dbo.attention(q, ..., kv_cache)        # meta["dbo"]["mutates"] = [kv_cache]

The write is no longer a data edge, so the scheduler orders writers and readers of the same
input explicitly (``docs/design.md``, invariant 3).
"""

from __future__ import annotations

import logging
import operator

import torch
import torch.fx as fx

from dbo_compile.passes.manager import CompileState, GraphPass
from dbo_compile.passes.meta import dbo_meta

log = logging.getLogger(__name__)


def _is_af(node: fx.Node) -> str | None:
    if node.op != "call_function":
        return None
    hop = torch.ops.higher_order
    if node.target is getattr(hop, "auto_functionalized_v2", None):
        return "v2"
    if node.target is getattr(hop, "auto_functionalized", None):
        return "v1"
    return None


def reinplace_graph_input_mutations(graph: fx.Graph) -> int:
    """Re-inplace ``auto_functionalized`` ops that mutate graph inputs. Returns the count.

    Ops mutating an intermediate, or a view of an input, are left functional (correct, but
    they clone).
    """
    order = {n: i for i, n in enumerate(graph.nodes)}
    count = 0
    for node in list(graph.nodes):
        version = _is_af(node)
        if version is None:
            continue
        op = node.args[0]
        schema = op._schema
        kwargs = dict(node.kwargs)
        mutated = [a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
        bases: list[fx.Node] = []
        call_kwargs = {}
        ok = True
        if version == "v2":
            all_bases = kwargs.pop("_all_bases")
            for arg_name in mutated:
                idx = kwargs.pop(f"_{arg_name}_base_index", None)
                if idx is None or any(k.startswith(f"_{arg_name}_") for k in kwargs):
                    ok = False  # a view of a base, or an optional arg left out
                    break
                bases.append(all_bases[idx])
                call_kwargs[arg_name] = all_bases[idx]
            call_kwargs.update({k: v for k, v in kwargs.items() if not k.startswith("_")})
        else:
            for arg_name in mutated:
                bases.append(kwargs[arg_name])
            call_kwargs = kwargs
        if not ok or not all(isinstance(b, fx.Node) and b.op == "placeholder" for b in bases):
            continue
        # the old value of each base must not be read after this node (except by copy_ back)
        if any(order[u] > order[node] and u.target is not torch.ops.aten.copy_.default
               for b in bases for u in b.users if u is not node):
            continue
        num_out = len(schema.returns)
        with graph.inserting_before(node):
            args = tuple(call_kwargs[a.name] for a in schema.arguments if not a.kwarg_only and a.name in call_kwargs)
            kw = {a.name: call_kwargs[a.name] for a in schema.arguments if a.kwarg_only and a.name in call_kwargs}
            new = graph.call_function(op, args, kw)
        val = node.meta.get("val")
        outs = tuple(val[:num_out]) if isinstance(val, (tuple, list)) else ()
        new.meta["val"] = outs[0] if num_out == 1 else outs
        new.meta["stack_trace"] = node.meta.get("stack_trace")
        dbo_meta(new)["mutates"] = sorted(b.name for b in bases)
        for user in list(node.users):
            if user.target is not operator.getitem:
                continue
            idx = user.args[1]
            if idx < num_out:
                if num_out == 1:
                    user.replace_all_uses_with(new)
                    graph.erase_node(user)
                else:
                    user.args = (new, idx)
            else:
                base = bases[idx - num_out]
                for cu in list(user.users):
                    if cu.target is torch.ops.aten.copy_.default and cu.args[0] is base and cu.args[1] is user:
                        graph.erase_node(cu)
                user.replace_all_uses_with(base)
                graph.erase_node(user)
        if not node.users:
            graph.erase_node(node)
            count += 1
        else:
            log.warning("could not fully re-inplace %s; left functional", node.name)
    return count


def _run(gm: fx.GraphModule, st: CompileState) -> None:
    reinplace_graph_input_mutations(gm.graph)


#: needed: the scheduler orders the KV-cache accesses by the ``mutates`` it writes
PASS = GraphPass("reinplace", _run)
