"""DboConfig.comm_backend / experts_backend: bound into the graph's ops before lowering, so the
chosen backend runs (eagerly and in the split program) and a bad choice fails the compile."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import dbo_compile.ops  # noqa: F401 - registers torch.ops.dbo.*
from conftest import last_artifact
from dbo_compile.errors import CommBackendError, ExpertsOpError
from dbo_compile.ops.comm import CommBackend, get_comm_backend, register_comm_backend
from dbo_compile.ops.experts import ExpertsBackend, get_experts_backend, register_experts_backend
from dbo_compile.ops.registry import bound_backend, op_info


class TinyMoE(nn.Module):
    """One MoE layer over a one-rank EP group: dispatch -> grouped experts -> combine."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.gate = nn.Linear(8, 4)
        self.w13 = nn.Parameter(torch.randn(4, 32, 8) * 0.1)
        self.w2 = nn.Parameter(torch.randn(4, 8, 16) * 0.1)

    def forward(self, x):
        w, ids = torch.topk(torch.softmax(self.gate(x), -1), 2)
        recv, rid, rw = torch.ops.dbo.dispatch(x, ids, w.float(), 4, "")
        y = torch.ops.dbo.grouped_experts(recv, rid, rw, self.w13, self.w2)
        return torch.ops.dbo.combine(y, "") + x


@pytest.fixture
def recording_backends():
    """A comm and an experts backend that count their calls and do what "local"/"torch" do."""
    calls = {"dispatch": 0, "combine": 0, "experts": 0}
    local, torch_experts = get_comm_backend("local"), get_experts_backend("torch")

    def dispatch(*a):
        calls["dispatch"] += 1
        return local.dispatch(*a)

    def combine(*a):
        calls["combine"] += 1
        return local.combine(*a)

    def experts(*a):
        calls["experts"] += 1
        return torch_experts.run(*a)

    register_comm_backend(CommBackend("recording", dispatch, combine, "test"))
    register_experts_backend(ExpertsBackend("recording", experts, "test"))
    return calls


def _compile(options):
    model = TinyMoE()
    x = torch.randn(32, 8)
    torch._dynamo.mark_dynamic(x, 0)
    compiled = torch.compile(model, backend="dbo", options={"split": "always", **options})
    return model, x, compiled


def test_chosen_backends_are_bound_into_the_split_graph_and_run(recording_backends):
    model, x, compiled = _compile({"comm_backend": "recording", "experts_backend": "recording"})
    with torch.no_grad():
        out = compiled(x)
        torch.testing.assert_close(out, model(x))
    art = last_artifact()
    assert art.is_split and art.stats.split_steps == 1
    bound = [bound_backend(n) for n in art.split_gm.graph.nodes if n.op == "call_function"
             and getattr(op_info(n.target), "backend", None)]
    assert bound == ["recording"] * 6, bound  # 2 ubatches x (dispatch, experts, combine)
    # two ubatches: each issues its own dispatch and combine and runs its experts
    assert recording_backends == {"dispatch": 2, "combine": 2, "experts": 2}


def test_auto_leaves_the_ops_choice(recording_backends):
    model, x, compiled = _compile({})
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x))
    art = last_artifact()
    assert all(not bound_backend(n) for n in art.split_gm.graph.nodes
               if n.op == "call_function" and getattr(op_info(n.target), "backend", None))
    assert recording_backends == {"dispatch": 0, "combine": 0, "experts": 0}


@pytest.mark.parametrize("option, error", [("comm_backend", CommBackendError),
                                           ("experts_backend", ExpertsOpError)])
def test_an_unknown_backend_fails_the_compile_and_names_the_registered_ones(option, error):
    _, x, compiled = _compile({option: "no_such_backend"})
    with pytest.raises(Exception, match="no_such_backend.*registered") as info:
        compiled(x)
    cause = info.value
    while cause is not None and not isinstance(cause, error):
        cause = cause.__cause__ or cause.__context__
    assert isinstance(cause, error), info.value
