"""Token-dim rules added for the [batch, seq, hidden] layout (issue 6): what is row-local along
dim 0 passes, what mixes rows (or uses the row count as a value) is rejected."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dbo_compile.errors import UnsplittableGraphError
from dbo_compile.lowering import classify_inputs, lower_to_aten
from dbo_compile.models.deepseek import DeepseekMoEModel
from dbo_compile.passes.token_dim import annotate_token_dims


class _Shared(torch.nn.Module):
    """``fn(x, *params)`` with the params as module parameters (shared by the ubatches)."""

    def __init__(self, fn, *params):
        super().__init__()
        self.fn = fn
        self.params = torch.nn.ParameterList(params)

    def forward(self, x):
        return self.fn(x, *self.params)


def _annotate(fn, x, *params):
    """Compile ``fn(x, *params)`` with Dynamo (dim 0 of ``x`` dynamic), lower it with a
    symbolic token dim and run the token-dim check; re-raise what the check raised."""
    raised = []

    def recorder(gm, example_inputs):
        try:
            specs = classify_inputs(gm, example_inputs)
            lowered = lower_to_aten(gm, example_inputs, specs)
            annotate_token_dims(lowered.gm.graph, lowered.token_symbols)
        except UnsplittableGraphError as e:
            raised.append(e)
        return gm.forward

    torch._dynamo.reset()
    x = x.clone()
    torch._dynamo.mark_dynamic(x, 0)
    with torch.no_grad():
        torch.compile(_Shared(fn, *params), backend=recorder, fullgraph=True)(x)
    if raised:
        raise raised[0]


X = torch.randn(4, 6, 8)  # [batch, seq, hidden]: batch is the token dim


def _row_iota_index(x):
    # transformers' mask pattern: padding_mask[batch_arange[:, None, None, None], kv_idx]
    b = torch.arange(x.shape[0])
    kv = torch.arange(x.shape[1])
    return (x[b[:, None, None], kv[None, :, None], torch.arange(2)[None, None, :]],)


def test_row_iota_indexing_own_rows_is_row_local():
    _annotate(_row_iota_index, X)


def test_row_iota_used_as_a_value_is_rejected():
    def f(x):
        return (x + torch.arange(x.shape[0])[:, None, None],)

    with pytest.raises(UnsplittableGraphError, match="arange"):
        _annotate(f, X)


def test_row_iota_indexing_a_shared_table_is_rejected():
    def f(x, table):
        return (x + table[torch.arange(x.shape[0])][:, None, :],)

    with pytest.raises(UnsplittableGraphError):
        _annotate(f, X, torch.nn.Parameter(torch.randn(16, 8)))


def test_batched_sdpa_over_the_batch_dim_is_row_local():
    def f(x, w):
        q = (x @ w).view(x.shape[0], x.shape[1], 2, 4).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, q, q, is_causal=True)
        return (o.transpose(1, 2).reshape(x.shape[0], x.shape[1], -1),)

    _annotate(f, X, torch.nn.Parameter(torch.randn(8, 8)))


def test_size_arithmetic_is_allowed_only_as_a_size():
    def as_size(x):
        return (x.reshape(x.shape[0] * x.shape[1], -1) * 2,)

    def as_value(x):
        return (x * (x.shape[0] * 2),)

    _annotate(as_size, X)
    with pytest.raises(UnsplittableGraphError, match="as a value"):
        _annotate(as_value, X)


def test_slice_scatter_off_the_token_dim_is_row_local_on_it_is_not():
    def off(x):
        y = x.clone()
        y[..., :4] = 0.0
        return (y,)

    def on(x):
        y = x.clone()
        y[:2] = 0.0
        return (y,)

    _annotate(off, X)
    with pytest.raises(UnsplittableGraphError):
        _annotate(on, X)


class _LastTokenModel(DeepseekMoEModel):
    def forward(self, input_ids, positions, attn_metadata):
        logits = super().forward(input_ids, positions, attn_metadata)
        return logits[(attn_metadata.query_start_loc[1:] - 1).long()]


class _MirrorModel(DeepseekMoEModel):
    def forward(self, input_ids, positions, attn_metadata):
        logits = super().forward(input_ids, positions, attn_metadata)
        return logits * (attn_metadata.seq_lens_cpu.max().to(logits.device) > 0)


@pytest.mark.parametrize("cls, says, not_says", [
    (_LastTokenModel, ["query_start_loc", "request dim", "through dbo ops"], ["token dim"]),
    (_MirrorModel, ["host mirror seq_lens_cpu", "read the device field seq_lens"], ["buffer"]),
])
def test_reasons_name_the_request_dim_and_host_mirrors(cls, says, not_says):
    """A slice of a request-indexed field was reported as "slice along the token dim", and a
    host mirror read was told to "register it on the module (a buffer)"."""
    from conftest import last_artifact
    from dbo_compile.models.batch import make_step
    from dbo_compile.models.deepseek import get_config

    cfg = get_config("tiny", num_layers=1)
    model = cls(cfg, seed=0)
    step = make_step(cfg, decode_context_lens=[30] * 8, prefills=[(0, 8)], block_size=16,
                     host_mirrors=True)
    model.allocate_kv_cache(step.num_blocks, step.block_size)
    compiled = torch.compile(model, backend="dbo", options={"split": "always"})
    with torch.no_grad():
        compiled(step.input_ids, step.positions, step.attn_metadata)
    reason = last_artifact().reason
    print(reason)
    assert reason and all(s in reason for s in says) and not any(s in reason for s in not_says)
