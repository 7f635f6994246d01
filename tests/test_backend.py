"""Backend entry: options, the entry point, and graphs that must compile unsplit."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import dbo_compile.ops  # noqa: F401 - registers torch.ops.dbo.*
from conftest import last_artifact
from dbo_compile import DboConfig, DboConfigError, UnsplittableGraphError
from dbo_compile.runtime.program import UnsplitArtifact


def test_unknown_option_names_the_valid_ones():
    with pytest.raises(DboConfigError, match="valid options are: .*decode_token_threshold"):
        DboConfig.from_options({"num_ubatch": 2})
    m = torch.compile(nn.Linear(4, 4), backend="dbo", options={"bogus": 1})
    with pytest.raises(Exception, match="unknown dbo option"):
        m(torch.randn(3, 4))


def test_unknown_option_in_the_constructor_is_a_config_error():
    """``DboConfig(**options)`` checks the keys as ``from_options`` does (it raised the
    dataclass's bare TypeError); the error is still a TypeError for existing callers."""
    with pytest.raises(DboConfigError, match="did you mean 'num_ubatches'.*valid options are"):
        DboConfig(**{"num_ubatch": 2})
    with pytest.raises(TypeError):
        DboConfig(num_ubatch=2)


def test_backend_config_error_is_found_by_dbo_error_of():
    """Dynamo raises BackendCompilerFailed ``from None`` (pinned here: the README says where
    the DboConfigError is): ``inner_exception`` holds it, and ``dbo_error_of`` finds it."""
    from dbo_compile import dbo_error_of

    m = torch.compile(nn.Linear(4, 4), backend="dbo", options={"num_ubatch": 2})
    with pytest.raises(Exception) as info:
        m(torch.randn(3, 4))
    e = info.value
    assert e.__cause__ is None and isinstance(e.inner_exception, DboConfigError)
    assert isinstance(dbo_error_of(e), DboConfigError)
    assert dbo_error_of(ValueError("x")) is None


def test_thresholds_not_set_follow_num_ubatches_and_are_unused_by_always():
    """Defaults resolve to max(vLLM's default, num_ubatches): ``split="always"`` with 64
    ubatches is accepted (it was refused because of decode_token_threshold=32, an option the
    user never set and "always" does not read); an explicit threshold below num_ubatches is
    still refused under "auto" (vLLM's rule)."""
    cfg = DboConfig(split="always", num_ubatches=64)
    assert (cfg.decode_token_threshold, cfg.prefill_token_threshold) == (64, 512)
    assert DboConfig(num_ubatches=64).decode_token_threshold == 64
    assert DboConfig().fingerprint() == DboConfig(decode_token_threshold=32).fingerprint()
    assert DboConfig().replace(num_ubatches=40).decode_token_threshold == 40
    assert DboConfig(decode_token_threshold=8).replace(num_ubatches=4).decode_token_threshold == 8
    with pytest.raises(DboConfigError, match="decode_token_threshold=8"):
        DboConfig(num_ubatches=16, decode_token_threshold=8)


def test_unwritable_dump_dir_warns_and_compiles(tmp_path, caplog):
    """Diagnostics never fail a compile: a dump_dir below a regular file is a WARNING."""
    from dbo_compile.models.batch import make_step
    from dbo_compile.models.deepseek import DeepseekMoEModel, get_config

    (tmp_path / "a_file").write_text("")
    bad = str(tmp_path / "a_file" / "dumps")
    cfg = get_config("tiny", num_layers=1)
    model = DeepseekMoEModel(cfg, seed=0)
    step = make_step(cfg, decode_context_lens=[], prefills=[(0, 16)], block_size=16)
    model.allocate_kv_cache(step.num_blocks, step.block_size)
    compiled = torch.compile(model, backend="dbo", options={"dump_dir": bad, "split": "always",
                                                            "schedule_candidates": False})
    with caplog.at_level(logging.WARNING, logger="dbo_compile"), torch.no_grad():
        compiled(step.input_ids, step.positions, step.attn_metadata)
    assert last_artifact().is_split
    assert "cannot be written" in caplog.text and bad in caplog.text


def test_unknown_dp_group_name_is_a_config_error_at_compile_time():
    """``dp_group_name`` is resolved when the backend builds its config (it failed at the first
    step with torch's RuntimeError); the message lists the registered groups. Run in a
    subprocess: it initialises a one-rank Gloo group."""
    code = textwrap.dedent("""
        import datetime, socket, torch, torch.distributed as dist
        from torch import nn
        from dbo_compile import DboConfigError, dbo_error_of
        s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
        try:
            torch.compile(nn.Linear(4, 4), backend="dbo", options={"dp_group_name": "nope"})(
                torch.randn(3, 4))
        except Exception as e:
            assert isinstance(dbo_error_of(e), DboConfigError), e
            assert "not initialised" in str(dbo_error_of(e))
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                                world_size=1, timeout=datetime.timedelta(seconds=60))
        torch._dynamo.reset()
        try:
            torch.compile(nn.Linear(4, 4), backend="dbo", options={"dp_group_name": "nope"})(
                torch.randn(3, 4))
            raise SystemExit("accepted")
        except Exception as e:
            err = dbo_error_of(e)
            assert isinstance(err, DboConfigError), e
            print(err)
            assert "names no process group" in str(err) and "registered" in str(err)
        dist.destroy_process_group()
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    print(p.stdout)
    assert p.returncode == 0, p.stderr[-2000:]


@pytest.mark.parametrize("bad", [dict(num_ubatches=1), dict(decode_token_threshold=1),
                                 dict(prefill_token_threshold=0), dict(split="sometimes"),
                                 dict(comm_sms=0), dict(link_gbps=0), dict(comm_sms=True),
                                 dict(peak_tflops="fast"), dict(link_gbps=float("inf")),
                                 dict(dump_dir=5)])
def test_invalid_values_raise(bad):
    with pytest.raises(DboConfigError):
        DboConfig(**bad)


class NoComm(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return torch.relu(self.lin(x))


class SumsOverTokens(nn.Module):
    """Has a comm op, but normalises by a statistic over all tokens (mixes the split)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        ids = torch.zeros(x.shape[0], 1, dtype=torch.int64)
        w = torch.ones(x.shape[0], 1)
        recv, rid, rw = torch.ops.dbo.dispatch(self.lin(x), ids, w, 1, "")
        y = torch.ops.dbo.combine(recv * rw.sum(-1, keepdim=True), "")
        return y - y.sum(dim=0, keepdim=True)


@pytest.mark.parametrize("cls,why", [(NoComm, "no comm op"),
                                     (SumsOverTokens, "mixes tokens across the split")])
def test_unsplittable_models_compile_unsplit_and_say_why(cls, why, caplog):
    import dbo_compile.ops  # noqa: F401

    torch.manual_seed(0)
    model = cls()
    x = torch.randn(64, 8)
    torch._dynamo.mark_dynamic(x, 0)  # else the routing built from x.shape[0] is the reason
    with caplog.at_level(logging.WARNING, logger="dbo_compile"):
        out = torch.compile(model, backend="dbo", options={"split": "always"})(x)
    torch.testing.assert_close(out, model(x))
    art = last_artifact()
    assert isinstance(art, UnsplitArtifact)
    assert why in art.reason and why in caplog.text
    if cls is SumsOverTokens:
        assert "sum" in art.reason  # names the node


def test_the_artifacts_names_before_issue_30_still_import_with_a_deprecation_warning():
    """``DboCompiledModule`` / ``UnsplitProgram`` (renamed ``SplitArtifact`` /
    ``UnsplitArtifact``) are the same classes, and importing them says the new name."""
    from dbo_compile.runtime import program

    with pytest.warns(DeprecationWarning, match="DboCompiledModule is now SplitArtifact"):
        from dbo_compile.runtime.program import DboCompiledModule
    with pytest.warns(DeprecationWarning, match="UnsplitProgram is now UnsplitArtifact"):
        old_unsplit = program.UnsplitProgram
    assert DboCompiledModule is program.SplitArtifact and old_unsplit is UnsplitArtifact
    with pytest.raises(AttributeError, match="no attribute 'DboCompiledModul'"):
        program.DboCompiledModul


def test_on_unsplittable_raise():
    with pytest.raises(Exception, match="no comm op") as info:
        torch.compile(NoComm(), backend="dbo", options={"on_unsplittable": "raise"})(torch.randn(4, 8))
    assert isinstance(info.value, UnsplittableGraphError) or "UnsplittableGraphError" in str(info.value)
    # the reason names every comm op the graph could have used, and what to do
    assert "dbo.moe_dispatch" in str(info.value) and "Route the MoE all-to-all" in str(info.value)


def test_backend_works_in_a_fresh_process_without_importing_the_package():
    code = textwrap.dedent("""
        import sys, torch
        m = torch.nn.Linear(4, 4)
        out = torch.compile(m, backend="dbo")(torch.randn(2, 4))
        assert out.shape == (2, 4)
        assert "dbo_compile" in sys.modules   # loaded through the entry point
        print("ok")
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip().endswith("ok")


class RoutesByShape(nn.Module):
    """Routing metadata built from the token count (``torch.zeros(x.shape[0], 1)``)."""

    def forward(self, x):
        ids = torch.zeros(x.shape[0], 1, dtype=torch.int64)
        recv, _, rw = torch.ops.dbo.dispatch(x, ids, torch.ones(x.shape[0], 1), 1, "")
        return torch.ops.dbo.combine(recv * rw.sum(-1, keepdim=True), "")


def test_static_token_count_in_a_dbo_op_input_falls_back_with_the_reason(caplog):
    """In a static graph ``zeros(8, 1)`` no longer depends on the tokens: each ubatch would pair
    its 4 rows with all 8. It must compile unsplit, say why and how to fix it."""
    x = torch.randn(8, 4)
    with caplog.at_level("WARNING", logger="dbo_compile"):
        out = torch.compile(RoutesByShape(), backend="dbo", options={"split": "always"})(x)
    torch.testing.assert_close(out, RoutesByShape()(x))
    assert last_artifact().split_program is None
    assert "fixed first dim" in caplog.text and "mark_dynamic" in caplog.text


def test_dynamic_token_count_in_a_dbo_op_input_splits():
    x = torch.randn(8, 4)
    torch._dynamo.mark_dynamic(x, 0)
    out = torch.compile(RoutesByShape(), backend="dbo", options={"split": "always"})(x)
    torch.testing.assert_close(out, RoutesByShape()(x))
    assert last_artifact().stats.split_steps == 1


def test_one_token_step_runs_unsplit_and_the_next_size_splits():
    """Dynamo never makes a size-1 dim dynamic: the 1-token graph runs unsplit and says so
    (not "mark it dynamic", which Dynamo refuses for size 1); a 6-token step gets its own
    graph, which splits."""
    fn = torch.compile(RoutesByShape(), backend="dbo", options={"split": "always"})
    one = torch.randn(1, 4)
    torch.testing.assert_close(fn(one), RoutesByShape()(one))
    art = last_artifact()
    assert art.split_program is None and "never makes sizes 0 and 1 dynamic" in art.reason
    six = torch.randn(6, 4)
    torch.testing.assert_close(fn(six), RoutesByShape()(six))
    assert last_artifact() is not art and last_artifact().stats.split_steps == 1


class TakesATable(nn.Module):
    """A second tensor input that is not token-indexed (a [V, H] table passed per call)."""

    def forward(self, x, table):
        ids = torch.zeros(x.shape[0], 1, dtype=torch.int64)
        recv, _, rw = torch.ops.dbo.dispatch(x @ table.t(), ids, torch.ones(x.shape[0], 1), 1, "")
        return torch.ops.dbo.combine(recv * rw.sum(-1, keepdim=True), "")


class NormalisesOverTokens(SumsOverTokens):
    def forward(self, x):
        ids = torch.zeros(x.shape[0], 1, dtype=torch.int64)
        recv, _, rw = torch.ops.dbo.dispatch(self.lin(x), ids, torch.ones(x.shape[0], 1), 1, "")
        return torch.nn.functional.normalize(torch.ops.dbo.combine(recv, ""), dim=0)


@pytest.mark.parametrize("cls,args,why", [
    (TakesATable, lambda: (torch.randn(16, 8), torch.randn(5, 8)), "has dim 0 = 5"),
    (NormalisesOverTokens, lambda: (torch.randn(16, 8),), "linalg_vector_norm reduces"),
])
def test_unsplittable_inputs_and_ops_fall_back_with_a_reason(cls, args, why):
    import dbo_compile.ops  # noqa: F401

    model = cls() if cls is TakesATable else cls()
    inputs = args()
    torch._dynamo.mark_dynamic(inputs[0], 0)  # else the routing built from x.shape[0] is the reason
    out = torch.compile(model, backend="dbo", options={"split": "always"})(*inputs)
    torch.testing.assert_close(out, model(*inputs))
    art = last_artifact()
    assert isinstance(art, UnsplitArtifact) and why in art.reason, art.reason


class ViewsByIntArg(nn.Module):
    """``x.view(n * scale, -1)`` with ``n`` an int argument: the row count comes from outside the
    tokens, so each ubatch would regroup its rows with the whole step's count."""

    def __init__(self, scale: int):
        super().__init__()
        self.scale = scale
        self.lin = nn.Linear(8 // scale, 8 // scale)

    def forward(self, x, n: int):
        h = self.lin(x.view(n * self.scale, -1))
        ids = torch.zeros_like(h[:, :1], dtype=torch.int64)
        recv, rid, rw = torch.ops.dbo.dispatch(h, ids, torch.ones_like(h[:, :1]), 1, "")
        return torch.ops.dbo.combine(recv * rw, "")


@pytest.mark.parametrize("scale, why", [
    (1, "equals the token count"),          # n == T: Dynamo gives n the token dim's symbol
    (2, "only dim 0 may be the token dim"),  # view to 2n rows: n gets its own symbol
])
def test_int_argument_sizing_a_token_view_compiles_unsplit_and_says_why(scale, why, caplog):
    m = ViewsByIntArg(scale)
    compiled = torch.compile(m, backend="dbo", options={"split": "always"})
    with caplog.at_level(logging.WARNING, logger="dbo_compile"), torch.no_grad():
        for t in (16, 16, 24, 32):
            x = torch.randn(t, 8)
            torch.testing.assert_close(compiled(x, t), m(x, t))
    art = last_artifact()
    assert isinstance(art, UnsplitArtifact) and why in art.reason, art.reason


def test_record_calls_and_last_called_are_per_thread():
    """A server may step models from several threads: one thread's recording (the CUDA-graph
    runner's warm-up) must not collect another thread's calls."""
    import threading

    from dbo_compile.runtime.program import last_called, record_calls

    m = torch.compile(nn.Linear(4, 4), backend="dbo")
    xa, xb = torch.randn(3, 4), torch.randn(5, 4)
    m(xa), m(xb)  # compile both shapes first
    recording, other_done = threading.Event(), threading.Event()
    seen = {}

    def other():
        recording.wait(timeout=30)
        m(xb)
        seen["other"] = last_called()
        other_done.set()

    t = threading.Thread(target=other)
    t.start()
    with record_calls() as calls:
        recording.set()
        assert other_done.wait(timeout=30)
        m(xa)
    t.join(timeout=30)
    assert len(calls) == 1 and any(a is xa for a in calls[0][1])  # this thread's call only
    assert seen["other"] is not None and last_called() is not None


def _tiny_step(layers=2):
    from dbo_compile.models.batch import fill_kv_cache, make_step
    from dbo_compile.models.deepseek import DeepseekMoEModel, get_config

    cfg = get_config("tiny", num_layers=layers)
    model = DeepseekMoEModel(cfg, seed=0)
    step = make_step(cfg, decode_context_lens=[30] * 8, prefills=[(0, 24)], block_size=16)
    model.allocate_kv_cache(step.num_blocks, step.block_size)
    fill_kv_cache(model, step, seed=1)
    return model, step


def _eager(model, step, *inputs):
    saved = [c.clone() for c in model.kv_caches()]
    with torch.no_grad():
        ref = model(*inputs) if inputs else model(step.input_ids, step.positions,
                                                  step.attn_metadata)
    for c, s in zip(model.kv_caches(), saved):
        c.copy_(s)
    return ref


@pytest.mark.parametrize("layout", ["strided", "offset"])
@pytest.mark.parametrize("entry", ["run_step", "direct"])
def test_strided_and_offset_token_inputs_split(layout, entry):
    """x[::2] or a view at storage offset 8 gave Dynamo stride / offset symbols, which made
    the graph unsplittable ("SymInt input s2 ... is not the size of a graph input"): DBO was
    off, the answer right. run_step passes dense rows; unused layout symbols are passed
    through."""
    from dbo_compile.runtime.engine import run_step

    model, step = _tiny_step()
    ids, pos = step.input_ids, step.positions
    if layout == "strided":
        ids, pos = (torch.stack([t, torch.zeros_like(t)], 1).flatten()[::2] for t in (ids, pos))
    else:
        ids, pos = (torch.cat([torch.zeros(8, dtype=t.dtype), t])[8:] for t in (ids, pos))
    ref = _eager(model, step)
    compiled = torch.compile(model, backend="dbo", options={"split": "always",
                                                            "schedule_candidates": False})
    with torch.no_grad():
        if entry == "run_step":
            out = run_step(compiled, ids, pos, step.attn_metadata, step.num_scheduled_tokens)
        else:  # a dynamic graph, as a server's: Dynamo then adds the layout symbols
            md = step.attn_metadata
            for t in (ids, pos, md.slot_mapping, md.query_start_loc, md.seq_lens,
                      md.num_computed_tokens, md.block_table):
                torch._dynamo.mark_dynamic(t, 0)
            out = compiled(ids, pos, md)
    art = last_artifact()
    assert art.is_split and art.stats.split_steps == 1, art.reason
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)


def test_dynamic_true_splits_and_guards_the_folded_floats(caplog):
    """torch.compile(dynamic=True) passes float attributes (the attention scale, the norms'
    eps) as 0-dim tensors read by .item(); re-traced they were SymFloats that dbo.attention
    refused, so the package's own model ran unsplit. They are folded, and checked per call:
    an artifact called with another value runs Dynamo's graph unsplit (right answer, a
    WARNING)."""
    from dbo_compile.runtime.context import record_calls

    model, step = _tiny_step()
    ref = _eager(model, step)
    compiled = torch.compile(model, backend="dbo", dynamic=True,
                             options={"split": "always", "schedule_candidates": False})
    with torch.no_grad(), record_calls() as calls:
        out = compiled(step.input_ids, step.positions, step.attn_metadata)
    art, args = calls[0]
    assert art.is_split and art.stats.split_steps == 1, art.reason
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    scale = next(i for i, v in art.float_guards if v == model.layers[0].self_attn.scale)
    args = list(args)
    args[scale] = torch.tensor(0.5, dtype=torch.float64)
    model.layers[0].self_attn.scale = 0.5
    ref = _eager(model, step)
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="dbo_compile"):
        out = art(*args)[0]
    assert art.stats.unsplit_steps == 1 and "float" in art.stats.last_decision
    assert "changed from the value" in caplog.text
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)


def test_unsplit_graph_with_collectives_says_so_at_its_first_step(caplog):
    from dbo_compile.runtime.engine import run_step

    torch.manual_seed(0)
    model = SumsOverTokens()
    x = torch.randn(16, 8)
    torch._dynamo.mark_dynamic(x, 0)
    compiled = torch.compile(model, backend="dbo", options={"split": "always"})
    with caplog.at_level(logging.WARNING, logger="dbo_compile"):
        compiled(x)
        compiled(x)
    assert caplog.text.count("DBO is off for this graph") == 1


def test_the_reason_a_graph_is_not_split_is_logged_once(caplog):
    """The backend decides to compile a token-mixing graph unsplit and logs why (naming the
    node); the first step's note that DBO is off points there instead of repeating it."""
    torch.manual_seed(0)
    x = torch.randn(16, 8)
    torch._dynamo.mark_dynamic(x, 0)
    compiled = torch.compile(SumsOverTokens(), backend="dbo", options={"split": "always"})
    with caplog.at_level(logging.DEBUG, logger="dbo_compile"):
        compiled(x)
        compiled(x)
    reasons = [r for r in caplog.records if "mixes tokens across the split" in r.getMessage()]
    assert [r.name for r in reasons] == ["dbo_compile.backend"], caplog.text
    assert reasons[0].levelname == "WARNING" and "sum" in reasons[0].getMessage()
    assert caplog.text.count("DBO is off for this graph") == 1


def test_import_dbo_compile_registers_the_backend_without_the_entry_point():
    """``PYTHONPATH=$PWD`` (the GPU host): no entry point is installed, and ``import
    dbo_compile`` alone must make ``backend="dbo"`` resolve (it raised InvalidBackend there)."""
    code = (
        "import importlib.metadata as md\n"
        "md.entry_points = lambda **kw: md.EntryPoints(())\n"  # as if not installed
        "import torch, dbo_compile\n"
        "f = torch.compile(lambda x: torch.relu(x) + 1, backend='dbo')\n"
        "print(f(torch.arange(-2.0, 2.0)).tolist())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[1.0, 1.0, 1.0, 2.0]"
