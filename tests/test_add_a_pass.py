"""Add a pass (``docs/architecture.md``, "Add a pass"): a pass defined in this one file and
one registration call (:func:`~dbo_compile.passes.manager.register_pass`); no other file is
touched. It runs in the pipeline on the tiny model's FX graph, and the compiled model still
computes what the eager (unsplit) model does."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx

from conftest import last_artifact
from dbo_compile.passes.manager import CompileState, GraphPass, register_pass, user_pass_keys
from dbo_compile.passes.pipeline import pass_names
from moe_cases import MIXED_CUT, build, eager_and_compiled

aten = torch.ops.aten

#: per run of the pass: the number of ``silu`` nodes it rewrote
REWRITTEN: list[int] = []


def decompose_silu(gm: fx.GraphModule, state: CompileState) -> None:
    """``silu(x)`` -> ``x * sigmoid(x)`` in the lowered graph, in place. The new nodes take
    the silu's meta (its fake value, the same shape and dtype, and its decoder layer), so
    the passes after it (``token_dim``, ``split_ubatch``, ...) see them as any other node."""
    graph = gm.graph
    count = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not aten.silu.default:
            continue
        with graph.inserting_after(node):
            sig = graph.call_function(aten.sigmoid.default, (node.args[0],))
        with graph.inserting_after(sig):
            mul = graph.call_function(aten.mul.Tensor, (node.args[0], sig))
        sig.meta.update(node.meta)
        mul.meta.update(node.meta)
        node.replace_all_uses_with(mul)
        graph.erase_node(node)
        count += 1
    REWRITTEN.append(count)


#: the pass: a name of its own, its function, the CompileState facts it reads and writes
#: (none), and optional (the program is correct without it: ``disable_passes`` may name it)
DECOMPOSE_SILU = GraphPass("decompose_silu", decompose_silu, optional=True)


@pytest.fixture
def registered():
    handle = register_pass(DECOMPOSE_SILU, after="dead_code")  # the one registration
    yield
    handle.remove()


def test_a_pass_in_one_file_runs_and_the_numbers_match(registered):
    names = pass_names()
    assert names.index("decompose_silu") == names.index("dead_code") + 1
    torch._dynamo.reset()
    REWRITTEN.clear()
    model, step = build(MIXED_CUT, layers=1)
    eager, out, eager_caches, caches = eager_and_compiled(model, step, {"split": "always"})
    art = last_artifact()
    # it ran once, on the lowered graph, and rewrote the graph's silu
    assert len(REWRITTEN) == 1 and REWRITTEN[0] >= 1, REWRITTEN
    assert "decompose_silu" in art.compile_times
    for gm in (art.lowered_gm, art.split_gm):
        targets = {n.target for n in gm.graph.nodes}
        assert aten.silu.default not in targets and aten.sigmoid.default in targets
    # the step ran split, and computes what the unsplit (eager) model does
    assert art.stats.split_steps == 1
    torch.testing.assert_close(out, eager)
    for got, want in zip(caches, eager_caches):
        torch.testing.assert_close(got, want)


def test_the_compile_cache_does_not_serve_an_entry_across_a_user_pass(tmp_path):
    """An entry compiled with a user pass is not read back without it: the compile cache's
    key holds each registered user pass's identity (name, place, source)."""
    model, step = build(MIXED_CUT, layers=1)
    options = {"split": "always", "cache_dir": str(tmp_path)}
    handle = register_pass(DECOMPOSE_SILU, after="dead_code")
    try:
        torch._dynamo.reset()
        eager_and_compiled(model, step, options)
        assert "lower" in last_artifact().compile_times  # compiled (and written)
        assert any("decompose_silu" in k and "after dead_code" in k for k in user_pass_keys())
    finally:
        handle.remove()
    torch._dynamo.reset()
    eager, out, _, _ = eager_and_compiled(model, step, options)
    art = last_artifact()
    assert "lower" in art.compile_times, art.compile_times  # compiled again, not read back
    assert aten.silu.default in {n.target for n in art.lowered_gm.graph.nodes}
    torch.testing.assert_close(out, eager)
