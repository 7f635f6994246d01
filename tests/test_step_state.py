"""Step-state ops (vLLM's attention reads its metadata from the engine's forward context by
layer name): a functionalised call of a registered op is seen through
``auto_functionalized_v2``, the split program switches the engine's per-ubatch state before
each such unit, and same-key calls keep ubatch order."""

from __future__ import annotations

import pytest
import torch

import dbo_compile.ops  # noqa: F401  (torch.ops.dbo.*)
from dbo_compile.backend import compiled_artifacts, reset_artifacts
from dbo_compile.ops.registry import register_step_state_op
from dbo_compile.runtime.context import ubatch_scope
from dbo_compile.runtime.padding import WriteBack, pad_args
from dbo_compile.signature import InputSpec

#: the engine's per-step state: the scale the op applies (what vLLM keeps in its forward context)
STATE = {"scale": 1.0}


@torch.library.custom_op("dbo_test::keyed_scale", mutates_args=("out",))
def keyed_scale(out: torch.Tensor, x: torch.Tensor, key: str) -> None:
    """``out [T, H] = x * state`` (row-local given the step state, like vLLM's attention)."""
    out.copy_(x * STATE["scale"])


register_step_state_op(torch.ops.dbo_test.keyed_scale.default, (2, "key"),
                       token_args=((0, "out"), (1, "x")))


class _Model(torch.nn.Module):
    def __init__(self, hidden: int = 8, experts: int = 2, inter: int = 4):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w13 = torch.nn.Parameter(torch.randn(experts, 2 * inter, hidden, generator=g))
        self.w2 = torch.nn.Parameter(torch.randn(experts, hidden, inter, generator=g))
        self.experts = experts

    def forward(self, x, ids, w):
        y = torch.empty_like(x)
        torch.ops.dbo_test.keyed_scale(y, x, "layer0")
        rx, rids, rw, h = torch.ops.dbo.moe_dispatch(y, ids, w, self.experts, "")
        e = torch.ops.dbo.grouped_experts(rx, rids, rw, self.w13, self.w2)
        return torch.ops.dbo.moe_combine(e, ids, w, rids, rw, h, "")


def _compiled(t: int, seed: int):
    """A fresh model, its ``split="always"`` compile and ``t`` rows of inputs (token dim
    dynamic)."""
    torch._dynamo.reset()
    reset_artifacts()
    model = _Model().eval()
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, 8, generator=g)
    ids = torch.randint(0, 2, (t, 1), generator=g)
    w = torch.ones(t, 1)
    for a in (x, ids, w):
        torch._dynamo.mark_dynamic(a, 0)
    return model, torch.compile(model, backend="dbo", options={"split": "always"}), (x, ids, w)


def test_step_state_op_splits_and_runs_under_its_ubatch_state():
    model, compiled, (x, ids, w) = _compiled(8, seed=1)
    scales = {0: 2.0, 1: 3.0}
    entered: list[int] = []

    def enter(u: int) -> None:
        entered.append(u)
        STATE["scale"] = scales[u]

    with torch.no_grad(), ubatch_scope(enter):
        out = compiled(x, ids, w)
    STATE["scale"] = 1.0
    (art,) = compiled_artifacts()
    # before: "auto_functionalized_v2 ... is not known to be row-local" and an unsplit program
    assert art.is_split, art.reason
    assert art.stats.split_steps == 1
    assert "enter_ubatch(0)" in art.code and "enter_ubatch(1)" in art.code
    assert sorted(set(entered)) == [0, 1]
    # each ubatch's rows saw its own state: rows [0, 4) scaled by 2, rows [4, 8) by 3
    with torch.no_grad():
        STATE["scale"] = 2.0
        first = model(x, ids, w)[:4]
        STATE["scale"] = 3.0
        second = model(x, ids, w)[4:]
        STATE["scale"] = 1.0
    torch.testing.assert_close(out[:4], first)
    torch.testing.assert_close(out[4:], second)


def test_padded_split_step_under_inference_mode():
    """vLLM runs its model under ``torch.inference_mode``: a split step whose token count is
    padded (7 rows -> 8) copies its inputs into inference tensors, which have no version
    counter (before: ``RuntimeError: Inference tensors do not track version counter`` in the
    write-back, the step aborted)."""
    model, compiled, (x, ids, w) = _compiled(7, seed=2)
    with torch.inference_mode(), ubatch_scope(lambda u: None):  # one state for both ubatches
        out = compiled(x, ids, w)
        expected = model(x, ids, w)
    (art,) = compiled_artifacts()
    assert art.is_split and art.stats.split_steps == 1, (art.reason, art.stats)
    assert art.last_vote.num_tokens_padded == 8
    torch.testing.assert_close(out, expected)


def test_step_state_split_needs_the_engines_ubatch_switch():
    """A split program whose ops read engine state outside the graph does not split where no
    engine switches that state per ubatch (before: it split, and each ubatch's rows read the
    whole step's state: a silent wrong answer, e.g. ``backend="dbo"`` under vLLM)."""
    model, compiled, (x, ids, w) = _compiled(8, seed=3)
    with torch.no_grad():
        out = compiled(x, ids, w)
        expected = model(x, ids, w)
    (art,) = compiled_artifacts()
    assert art.is_split, art.reason
    assert art.stats.split_steps == 0 and art.stats.unsplit_steps == 1, art.stats
    (reason,) = art.stats.reasons
    assert "step-state ops" in reason and "ubatch_scope" in reason, reason
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("inference", [False, True])
def test_write_back_leaves_cut_rows_to_the_caller(inference):
    """A program that must not see ``run_step``'s padding rows runs on the first rows only
    (``pad_args`` to fewer rows: views of the caller's tensors); the write-back copies back
    only padded copies. Under ``torch.inference_mode`` a view has no ``_base``: the cut view
    was taken for a copy and written back at the wrong size (RuntimeError)."""
    specs = [InputSpec(0, "x", "L['x']", "token"), InputSpec(1, "kv", "L['kv']", "token")]
    with torch.inference_mode(inference):
        x, kv = torch.arange(8.0).reshape(4, 2), torch.zeros(4, 2)
        cut = pad_args(specs, [x, kv], 4, 3)
        assert cut[1].shape[0] == 3 and cut[1].untyped_storage().data_ptr() == kv.data_ptr()
        back = WriteBack([x, kv], cut, 4)
        cut[1].add_(1.0)  # the program writes its rows in place: the caller's rows
        back()
        assert back.pairs == [] and kv[:3].eq(1).all() and kv[3].eq(0).all()
        grown = pad_args(specs, [x, kv], 4, 6)  # padding: copies, written back
        assert [o for o, _, _ in WriteBack([x, kv], grown, 4).pairs] == [x, kv]
