"""Outputs and inputs off the plain-tensor path (issue 16, finding 4): every entry (the direct
call, ``run_step``, ``CudaGraphRunner``) returns the model's own structure at the caller's
real token count, whatever the program ran at (``run_step``'s 2 rows for 1 token, the DP
vote's padding, a bucket)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree

from dbo_compile.models.batch import fill_kv_cache, make_step
from dbo_compile.models.deepseek import DeepseekMoEModel, get_config
from dbo_compile.runtime.engine import run_step
from dbo_compile.runtime.cudagraph_runner import CudaGraphRunner
from dbo_compile.testing import run_multirank
from moe_cases import capture_then_serve

OPTS = {"split": "always", "schedule_candidates": False}


class StructuredModel(DeepseekMoEModel):
    """Returns ``mode``'s structure; takes ``inputs_embeds`` instead of ids."""

    mode = "tensor"

    def forward(self, input_ids, positions, attn_metadata, inputs_embeds=None):
        x = F.embedding(input_ids, self.embed_tokens) if inputs_embeds is None else inputs_embeds
        for layer in self.layers:
            x = layer(x, positions, attn_metadata)
        x = self.norm(x)
        logits = F.linear(x, self.lm_head).to(torch.float32)
        aux = x * 2
        n = (input_ids if input_ids is not None else inputs_embeds).shape[0]
        return {
            "tuple": lambda: (logits, aux),
            "list": lambda: [logits, aux],
            "dict": lambda: {"logits": logits, "hidden": aux},
            "dict_n": lambda: {"logits": logits, "n": n},
            "nested": lambda: (logits, [aux, {"n": n}]),
            "tensor": lambda: logits,
        }[self.mode]()


def _build(mode, tokens, group=None, seed=0):
    cfg = get_config("tiny", num_layers=2)
    model = StructuredModel(cfg, ep_group=group, seed=0)
    model.mode = mode
    dec = [40] * (tokens - 8 if tokens > 8 else tokens)
    step = make_step(cfg, decode_context_lens=dec, prefills=[(0, 8)] if tokens > 8 else [],
                     block_size=16, seed=seed)
    model.allocate_kv_cache(step.num_blocks, step.block_size)
    fill_kv_cache(model, step, seed=1)
    return model, step


def _assert_same(out, ref):
    lo, so = pytree.tree_flatten(out)
    lr, sr = pytree.tree_flatten(ref)
    assert so == sr, (so, sr)
    for a, b in zip(lo, lr):
        if isinstance(b, torch.Tensor):
            assert isinstance(a, torch.Tensor) and a.shape == b.shape, (getattr(a, "shape", a), b.shape)
            torch.testing.assert_close(a, b, rtol=0, atol=1e-4)
        else:
            assert a == b, (a, b)


def _eager_then(model, step, fn, **kw):
    saved = [c.clone() for c in model.kv_caches()]
    with torch.no_grad():
        ref = model(step.input_ids, step.positions, step.attn_metadata, **kw)
        for c, s in zip(model.kv_caches(), saved):
            c.copy_(s)
        return ref, fn()


@pytest.mark.parametrize("mode", ["tuple", "list", "dict", "dict_n"])
def test_run_step_of_one_token_returns_one_row_in_any_structure(mode):
    """run_step pads a 1-token step to 2 rows; the padding row came back for every output
    that was not a bare tensor, and ``n = input_ids.shape[0]`` came back as 2."""
    model, step = _build(mode, 1)
    compiled = torch.compile(model, backend="dbo", options=OPTS)
    ref, out = _eager_then(model, step, lambda: run_step(
        compiled, step.input_ids, step.positions, step.attn_metadata, step.num_scheduled_tokens))
    print(mode, pytree.tree_map(lambda t: tuple(t.shape) if isinstance(t, torch.Tensor) else t, out))
    _assert_same(out, ref)


def test_int_output_of_a_split_step():
    """A size output of a split graph was returned once per ubatch and joined with torch.cat
    (``TypeError: expected Tensor as element 0``); it is evaluated once, at the step's count."""
    from dbo_compile.runtime.program import last_called

    model, step = _build("dict_n", 16)
    compiled = torch.compile(model, backend="dbo", options=OPTS)
    ref, out = _eager_then(model, step, lambda: run_step(
        compiled, step.input_ids, step.positions, step.attn_metadata, step.num_scheduled_tokens))
    assert last_called().stats.split_steps == 1
    _assert_same(out, ref)


@pytest.mark.parametrize("mode", ["dict_n", "nested"])
def test_runner_returns_the_eager_structure(mode):
    """The runner returned the flat graph outputs ((logits, [aux]) came back as (logits, aux))
    and crashed capturing a graph with an int output."""
    model, step = _build(mode, 16)
    compiled = torch.compile(model, backend="dbo", options=OPTS)
    runner = CudaGraphRunner(compiled, buckets=[16], timing_iters=1, device="cpu",
                             max_blocks_per_req=step.attn_metadata.block_table.shape[1])

    saved = [c.clone() for c in model.kv_caches()]
    ref, out = _eager_then(model, step, lambda: capture_then_serve(runner, model, step, saved))
    assert runner.last_choice == (16, "split")
    _assert_same(out, ref)


def test_run_step_takes_inputs_embeds_without_input_ids():
    """``run_step(compiled, None, positions, md, inputs_embeds=...)`` read ``input_ids.shape``
    (AttributeError, before the vote: a hang on several ranks); the token count now comes from
    the first token input given, and every token input is padded and marked dynamic."""
    from dbo_compile.runtime.program import last_called

    model, step = _build("tensor", 16)
    compiled = torch.compile(model, backend="dbo", options=OPTS)
    emb = F.embedding(step.input_ids, model.embed_tokens).detach()
    ref, out = _eager_then(model, step, lambda: run_step(
        compiled, None, step.positions, step.attn_metadata, step.num_scheduled_tokens,
        inputs_embeds=emb), inputs_embeds=emb)
    assert last_called().stats.split_steps == 1
    _assert_same(out, ref)
    with pytest.raises(Exception, match="must share their dim 0"):
        run_step(compiled, None, step.positions[:3], step.attn_metadata,
                 step.num_scheduled_tokens, inputs_embeds=emb)


def _uneven_dp_body(rank, world_size):
    import torch.distributed as dist

    from dbo_compile.backend import register

    register()
    model, step = _build("dict_n", [5, 12][rank], group=dist.group.WORLD, seed=rank)
    compiled = torch.compile(model, backend="dbo", options={"schedule_candidates": False})
    with torch.no_grad():
        out = run_step(compiled, step.input_ids, step.positions, step.attn_metadata,
                       step.num_scheduled_tokens)
    return out["n"], tuple(out["logits"].shape)


@pytest.mark.multirank
def test_int_output_is_each_ranks_own_count_under_dp_padding():
    """The DP vote pads both ranks to 12 rows; ``n`` came back as 12 on the 5-token rank."""
    results = run_multirank(_uneven_dp_body, 2, timeout_s=300)
    print(results)
    assert results == [(5, (5, 128)), (12, (12, 128))]
