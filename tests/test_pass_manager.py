"""The pass manager (``passes/manager.py``): the facts a pass reads and writes are checked,
``disable_passes`` skips only optional passes, user passes are placed and named as declared.
Small FX graphs, no compile (``tests/test_add_a_pass.py`` runs a user pass in the pipeline)."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx

from dbo_compile import DboConfig, DboConfigError
from dbo_compile.errors import PipelineError
from dbo_compile.passes import dead_code, pipeline
from dbo_compile.passes.manager import (
    CompileState,
    GraphPass,
    PassManager,
    check_disabled,
    register_pass,
    with_user_passes,
)


def _graph() -> fx.GraphModule:
    def f(x):
        unused = x * 3  # noqa: F841 - what dead_code drops
        return x + 1

    return fx.symbolic_trace(f)


def _state(**config) -> CompileState:
    return CompileState(DboConfig(**config), [torch.randn(2, 4)])


def _count(gm: fx.GraphModule) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function")


def test_a_pass_reading_a_fact_nothing_wrote_is_refused_before_it_runs():
    ran = []
    reader = GraphPass("reader", lambda gm, st: ran.append(st.comms), reads=("comms",))
    with pytest.raises(PipelineError, match=r"'reader' reads \['comms'\].*producers"):
        PassManager().run(_graph(), [reader], _state())
    assert ran == []
    # once a pass declared to write it ran, the reader runs
    writer = GraphPass("writer", lambda gm, st: setattr(st, "comms", []), writes=("comms",),
                       changes_graph=False)
    PassManager().run(_graph(), [writer, reader], _state())
    assert ran == [[]]


def test_a_pass_replacing_a_fact_it_does_not_declare_is_refused():
    sneaky = GraphPass("sneaky", lambda gm, st: setattr(st, "comms", []), changes_graph=False)
    with pytest.raises(PipelineError, match=r"'sneaky' wrote \['comms'\]"):
        PassManager().run(_graph(), [sneaky], _state())


def test_a_pass_naming_no_fact_is_refused_when_declared():
    with pytest.raises(PipelineError, match="'typo' names \\['comm'\\].*no facts"):
        GraphPass("typo", lambda gm, st: None, reads=("comm",))


def test_disable_passes_skips_an_optional_pass_and_refuses_the_others():
    manager = PassManager()
    gm = manager.run(_graph(), [dead_code.PASS], _state())
    assert _count(gm) == 1 and "dead_code" in manager.times
    manager = PassManager()
    gm = manager.run(_graph(), [dead_code.PASS], _state(disable_passes=("dead_code",)))
    assert _count(gm) == 2 and "dead_code" not in manager.times
    with pytest.raises(DboConfigError, match="'lower' \\(needed by the split\\).*dead_code"):
        check_disabled(DboConfig(disable_passes=("lower",)), pipeline.pipeline_passes())
    with pytest.raises(DboConfigError, match="'nope' \\(no pass\\)"):
        check_disabled(DboConfig(disable_passes=("nope",)), pipeline.pipeline_passes())


def test_user_passes_run_after_the_pass_they_name_in_registration_order():
    first = GraphPass("first_user", lambda gm, st: None, changes_graph=False)
    second = GraphPass("second_user", lambda gm, st: None, changes_graph=False)
    nested = GraphPass("after_first", lambda gm, st: None, changes_graph=False)
    handles = [register_pass(first, after="token_dim"), register_pass(second, after="token_dim"),
               register_pass(nested, after="first_user")]
    try:
        names = pipeline.pass_names()
        at = names.index("token_dim")
        assert names[at + 1:at + 5] == ["first_user", "after_first", "second_user",
                                        "state_threads"]
        assert [p.name for p in with_user_passes([dead_code.PASS])] == ["dead_code"]
        with pytest.raises(PipelineError, match="registered already"):
            register_pass(first, after="lower")
    finally:
        for h in handles:
            h.remove()
    assert "first_user" not in pipeline.pass_names()


@pytest.mark.parametrize("name, after, why", [
    ("dead_code", "lower", "has the name of a pipeline pass"),
    ("mine", "no_such_pass", "runs after 'no_such_pass', which is no pass"),
])
def test_a_user_pass_that_cannot_run_fails_the_compile_before_any_pass(name, after, why):
    handle = register_pass(GraphPass(name, lambda gm, st: None), after=after)
    try:
        with pytest.raises(PipelineError, match=why):
            pipeline.compile_split(_graph(), [torch.randn(2, 4)], DboConfig(),
                                   input_kinds=["tokens"])
    finally:
        handle.remove()
