"""DboConfig.comm_backend / experts_backend: bound into the graph's ops before lowering, so the
chosen backend runs (eagerly and in the split program) and a bad choice fails the compile."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

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


def _compile_error(model, options, x=None):
    """The DboError the first call (the compile) of ``model`` raises, and whether the backend
    returned an artifact before it."""
    from dbo_compile.backend import compiled_artifacts
    from dbo_compile.errors import dbo_error_of

    x = torch.randn(32, 8) if x is None else x
    torch._dynamo.mark_dynamic(x, 0)
    compiled = torch.compile(model, backend="dbo", options={"split": "always", **options})
    with pytest.raises(Exception) as info, torch.no_grad():
        compiled(x)
    return dbo_error_of(info.value) or info.value, len(compiled_artifacts())


# -- a comm backend over a process group the model lacks (issue 29, finding 5) -----------------


class NamedGroupMoE(TinyMoE):
    """TinyMoE whose comm ops name a process group (and, optionally, a backend) themselves."""

    def __init__(self, group, backend=""):
        super().__init__()
        self.group, self.backend = group, backend

    def forward(self, x):
        w, ids = torch.topk(torch.softmax(self.gate(x), -1), 2)
        recv, rid, rw = torch.ops.dbo.dispatch(x, ids, w.float(), 4, self.group, self.backend)
        y = torch.ops.dbo.grouped_experts(recv, rid, rw, self.w13, self.w2)
        return torch.ops.dbo.combine(y, self.group, self.backend) + x


@pytest.mark.parametrize("model, options", [
    (TinyMoE, {"comm_backend": "torch"}),            # the config names it
    (lambda: NamedGroupMoE("", "torch"), {}),        # the model names it
])
def test_torch_comm_backend_on_a_model_without_a_group_fails_the_compile(model, options):
    """``comm_backend="torch"`` on a model built without an EP group was accepted, and then
    every call raised (the op resolving the group named ``''``) while saying the next step
    runs normally. It is a CommBackendError at compile time, naming what the model lacks and
    what to pass instead."""
    err, artifacts = _compile_error(model(), options)
    assert isinstance(err, CommBackendError), err
    assert artifacts == 0  # the compile failed, not a call
    msg = str(err)
    assert "group_name ''" in msg and "ep_group=" in msg and "local backend serves" in msg


@pytest.mark.parametrize("options", [{}, {"comm_backend": "torch"}, {"comm_backend": "local"}])
def test_a_comm_op_naming_no_group_of_this_process_fails_clearly(options):
    """A comm op naming a process group this process does not hold (``"auto"`` too): a
    CommBackendError at compile time naming the group, the registered ones and what to build."""
    err, artifacts = _compile_error(NamedGroupMoE("no_such_group"), options)
    assert isinstance(err, CommBackendError), err
    assert artifacts == 0
    msg = str(err)
    assert "'no_such_group' is no process group" in msg and "registered" in msg
    assert "ep_group=" in msg


def test_local_comm_backend_over_a_group_of_two_ranks_fails_the_compile():
    """``comm_backend="local"`` runs no collective: over an EP group of 2 ranks it would route
    every expert to this rank, whose weights hold only its own. Refused at compile time (a
    subprocess: it starts a fake two-rank process group)."""
    code = textwrap.dedent("""
        import torch, torch.distributed as dist
        from torch.testing._internal.distributed.fake_pg import FakeStore
        from dbo_compile import dbo_error_of
        from dbo_compile.errors import CommBackendError
        from test_backend_choice import NamedGroupMoE
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
        x = torch.randn(32, 8)
        torch._dynamo.mark_dynamic(x, 0)
        model = NamedGroupMoE(dist.group.WORLD.group_name)
        try:
            torch.compile(model, backend="dbo", options={"comm_backend": "local"})(x)
            raise SystemExit("accepted")
        except Exception as e:
            err = dbo_error_of(e)
            assert isinstance(err, CommBackendError), repr(e)
            print(err)
            assert "of 2 ranks" in str(err) and "comm_backend='auto' chooses" in str(err), err
        dist.destroy_process_group()
    """)
    here = os.path.dirname(os.path.abspath(__file__))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       cwd=here, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                           [os.path.dirname(here), here])})
    print(p.stdout)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
