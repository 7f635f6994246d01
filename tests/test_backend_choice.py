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


# -- backend options under "auto" (issue 29, finding 7) -----------------------------------------


@pytest.mark.parametrize("options, error, says", [
    ({"comm_backend_options": {"mode": "bogus"}}, CommBackendError, "mode='bogus'"),
    ({"comm_backend_options": {"max_tokens": -5}}, CommBackendError, "max_tokens=-5"),
    ({"comm_backend_options": {"nope": 1}}, CommBackendError, "deep_ep: mode, max_tokens"),
    ({"experts_backend_options": {"path": "bogus"}}, ExpertsOpError, "path='bogus'"),
    ({"experts_backend_options": {"expected_m": 0}}, ExpertsOpError, "expected_m=0"),
    ({"experts_backend_options": {"nope": 1}}, ExpertsOpError, "deep_gemm: fp8, expected_m"),
])
def test_auto_checks_the_options_of_every_backend_it_may_choose(options, error, says):
    """Under the default ``"auto"`` backends, options were dropped when ``auto`` chose another
    backend (always on CPU, where DeepEP and DeepGEMM do not import). They are checked by the
    backend they would configure, whichever ``auto`` picks, and without its package."""
    err, artifacts = _compile_error(TinyMoE(), options)
    assert isinstance(err, error), err
    assert artifacts == 0
    kind = "comm" if error is CommBackendError else "experts"
    assert says in str(err) and f"{kind}_backend='auto'" in str(err), err


def test_options_are_checked_on_a_graph_without_comm_ops():
    class Dense(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(8, 8))

        def forward(self, x):
            return torch.relu(x @ self.w)

    for options, error in (({"comm_backend_options": {"mode": "bogus"}}, CommBackendError),
                           ({"comm_backend": "deep_ep", "comm_backend_options": {"mode": "x"}},
                            CommBackendError),
                           ({"experts_backend_options": {"fp8": "yes"}}, ExpertsOpError)):
        torch._dynamo.reset()
        err, _ = _compile_error(Dense(), options)
        assert isinstance(err, error), (options, err)


def test_auto_warns_of_options_the_backend_it_chose_does_not_take(caplog):
    """Valid options of a backend ``auto`` did not choose (DeepEP's ``mode`` where the EP group
    has one rank, DeepGEMM's ``fp8`` for rank-major rows) are not used: a WARNING says so, and
    what to name to require that backend."""
    import logging

    model, x, compiled = _compile({"comm_backend_options": {"mode": "low_latency"},
                                   "experts_backend_options": {"fp8": True}})
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="dbo_compile"):
        torch.testing.assert_close(compiled(x), model(x))
    assert "comm_backend=auto chose local" in caplog.text
    assert "configure deep_ep" in caplog.text and "comm_backend='deep_ep'" in caplog.text
    assert "experts_backend=auto chose torch" in caplog.text
    assert "configure deep_gemm" in caplog.text and "experts_backend='deep_gemm'" in caplog.text


def test_auto_applies_the_options_of_the_backend_it_chose(caplog):
    """``experts_backend_options={"path": "sorted"}`` is the torch backend's: where ``auto``
    chooses torch, it is bound with them (it was dropped: the op ran its own default)."""
    import logging

    model, x, compiled = _compile({"experts_backend_options": {"path": "sorted"}})
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="dbo_compile"):
        torch.testing.assert_close(compiled(x), model(x))
    art = last_artifact()
    assert {bound_backend(n) for n in art.split_gm.graph.nodes
            if n.op == "call_function" and getattr(op_info(n.target), "backend", None) ==
            "experts"} == {"torch:path=sorted"}
    assert "not used" not in caplog.text


def test_emulated_takes_its_options_in_comm_backend_options():
    """Issue 30 reverses issue 29's refusal: the emulated backend is configured through
    ``comm_backend_options`` like every backend; its old ``emulate_*`` fields still work, with
    a FutureWarning, and make the same config (the same fingerprint, the same cache
    entry); a key given both ways, differently, is refused."""
    from dbo_compile import DboConfig, DboConfigError

    new = DboConfig(comm_backend="emulated",
                    comm_backend_options={"world_size": 4, "link_gbps": 25.0})
    with pytest.warns(FutureWarning, match="emulate_world_size.*comm_backend_options"):
        old = DboConfig(comm_backend="emulated", emulate_world_size=4, emulate_link_gbps=25.0)
    assert old == new and old.fingerprint() == new.fingerprint()
    assert dict(new.comm_backend_options) == {"world_size": 4, "link_gbps": 25.0}
    assert new.fingerprint() != DboConfig(comm_backend="emulated",
                                          comm_backend_options={"world_size": 8}).fingerprint()
    with pytest.raises(DboConfigError, match="world_size.*emulate_"):
        DboConfig(comm_backend="emulated", emulate_world_size=4,
                  comm_backend_options={"world_size": 8})


@pytest.mark.parametrize("options, match", [
    ({"world_size": 4, "mode": "low_latency"}, r"\['mode'\].*emulated: world_size, link_gbps"),
    ({"world_size": 0}, "world_size=0 must be an int >= 1"),
    ({"world_size": 4, "link_gbps": 0}, "link_gbps=0 must be > 0"),
    ({"world_size": 4, "capacity_factor": 0.5}, "capacity_factor=0.5 must be >= 1"),
])
def test_emulated_options_are_checked_by_the_emulated_backend(options, match):
    """Unknown keys and bad values of ``comm_backend_options`` are refused by the backend that
    owns them (at compile time, ``CommBackendError``), as for DeepEP's."""
    from dbo_compile import DboConfig
    from dbo_compile.ops.comm import comm_options_for

    config = DboConfig(comm_backend="emulated", comm_backend_options=options)
    with pytest.raises(CommBackendError, match=match):
        comm_options_for((config.comm_backend,), dict(config.comm_backend_options))
