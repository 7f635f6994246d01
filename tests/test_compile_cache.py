"""The persistent compile cache (``DboConfig.cache_dir``, issue 17): a second fresh process
reads what the first compiled, gets the same programs and the same numbers; stale and corrupt
entries are ignored with a log line. Timing is printed, never asserted
(``benchmarks/compile_time.py --warm`` measures it)."""

from __future__ import annotations

import json
import logging
import operator
import os
import pickle
import shutil
import subprocess
import sys

import pytest
import torch

from conftest import last_artifact
from dbo_compile import DboConfig, DboConfigError
from dbo_compile.codegen import cache
from moe_cases import MIXED_CUT, build, eager_and_compiled

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
OPTIONS = {"split": "always", "compute_backend": "aten", "link_gbps": 0.5,
           "schedule_candidates": True}


def _child(cache_dir: str, layers: int) -> dict:
    """One process's compile of the tiny model (run in a fresh interpreter)."""
    import time

    from dbo_compile.backend import register

    register()
    model, step = build(MIXED_CUT, layers=layers)
    t0 = time.perf_counter()
    eager, out, eager_caches, caches = eager_and_compiled(model, step,
                                                          dict(OPTIONS, cache_dir=cache_dir))
    art = last_artifact()
    return {"times": art.compile_times, "backend_s": sum(art.compile_times.values()),
            "first_call_s": time.perf_counter() - t0,
            "err": (out - eager).abs().max().item(),
            "kv_err": max((a - b).abs().max().item() for a, b in zip(caches, eager_caches)),
            "codes": {n: p.code for n, p in art.candidates.items()},
            "schedules": {n: p.schedule.to_json() for n, p in art.candidates.items()},
            "split_steps": art.stats.split_steps}


def _fresh_process(cache_dir: str, layers: int = 2) -> dict:
    code = ("import json, sys, test_compile_cache as t; "
            f"print('RESULT', json.dumps(t._child({cache_dir!r}, {layers})))")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([_ROOT, _HERE]))
    out = subprocess.run([sys.executable, "-c", code], cwd=_HERE, env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def test_a_second_process_reads_the_first_ones_compile(tmp_path):
    cold = _fresh_process(str(tmp_path))
    warm = _fresh_process(str(tmp_path))
    # the cold process compiled and wrote; the warm one read it and ran none of the passes
    assert "lower" in cold["times"] and "cache_store" in cold["times"]
    assert "cache_load" in warm["times"]
    assert not {"lower", "split_ubatch", "stream_assign[list]", "codegen[list]"} & set(warm["times"])
    # the same programs, and the same numbers as eager
    assert warm["codes"] == cold["codes"] and warm["schedules"] == cold["schedules"]
    assert len(warm["codes"]) >= 3
    for r in (cold, warm):
        assert r["err"] == 0.0 and r["kv_err"] == 0.0 and r["split_steps"] == 1
    print(f"\nbackend compile: cold {cold['backend_s']:.3f} s, warm {warm['backend_s']:.3f} s "
          f"({warm['backend_s'] / cold['backend_s']:.0%}); first call: cold "
          f"{cold['first_call_s']:.2f} s, warm {warm['first_call_s']:.2f} s")


def _compile(tmp_path, layers=2, **options):
    model, step = build(MIXED_CUT, layers=layers)
    eager, out, _, _ = eager_and_compiled(model, step, dict(OPTIONS, cache_dir=str(tmp_path),
                                                            **options))
    torch.testing.assert_close(out, eager, rtol=0, atol=0)
    return last_artifact()


def _entries(tmp_path):
    return sorted(p for p in os.listdir(tmp_path) if p.endswith(".pkl"))


@pytest.fixture(scope="module")
def hit(tmp_path_factory):
    """One cold compile into a fresh cache dir and one in-process hit after a Dynamo reset:
    ``(dir, first, again)``. The tests only read them; a test that writes entries works in a
    copy of the dir (:func:`_copy_of`)."""
    path = tmp_path_factory.mktemp("hit")
    torch._dynamo.reset()
    first = _compile(path)
    torch._dynamo.reset()
    again = _compile(path)
    torch._dynamo.reset()
    return path, first, again


def _copy_of(hit, tmp_path):
    """``tmp_path`` holding a copy of the entries of the ``hit`` fixture's dir."""
    for name in _entries(hit[0]):
        shutil.copyfile(hit[0] / name, tmp_path / name)
    return tmp_path


def test_in_process_hit_and_a_config_change_misses(hit, tmp_path):
    _, first, again = hit
    tmp_path = _copy_of(hit, tmp_path)
    assert "cache_load" in again.compile_times and "lower" not in again.compile_times
    assert again.code == first.code and again.split_gm is None
    assert len(_entries(tmp_path)) == 1
    torch._dynamo.reset()
    other = _compile(tmp_path, scheduler="naive")  # another fingerprint: another entry
    assert "lower" in other.compile_times and len(_entries(tmp_path)) == 2


def test_an_entry_keeps_what_the_step_guards_need(hit):
    """An artifact read back carries the KV block sizes (the prefix-read veto), the output
    specs (the model's structure at the real token count) and both programs' drain plans
    (the step transaction) as compiled: without them a cached program would split a
    shared-prefix step or hang its peers when a rank fails (issue 16's guards)."""
    _, first, again = hit
    assert "cache_load" in again.compile_times
    assert first.kv_block_sizes and again.kv_block_sizes == first.kv_block_sizes
    assert first.output_specs and again.output_specs == first.output_specs
    for plan in ("split_plan", "unsplit_plan"):
        made, read = getattr(first, plan), getattr(again, plan)
        assert made and read == made, plan


def test_the_key_sees_the_bound_comm_backend(hit, tmp_path, monkeypatch):
    """The key is taken after the bind pass: the same options that bind another backend (what
    ``comm_backend="auto"`` picks depends on the packages present) read no entry of the first."""
    from dbo_compile.ops.comm import CommBackend, get_comm_backend, register_comm_backend
    from dbo_compile.ops.registry import bound_backend, comm_kind
    from dbo_compile.passes import bind

    tmp_path = _copy_of(hit, tmp_path)  # the entry of these options, bound as by default
    local = get_comm_backend("local")
    register_comm_backend(CommBackend("cache_test", local.dispatch, local.combine, "test"))
    monkeypatch.setattr(bind, "_choose_comm", lambda gm, config, nodes: "cache_test")
    torch._dynamo.reset()
    other = _compile(tmp_path)
    assert "lower" in other.compile_times and len(_entries(tmp_path)) == 2
    assert {bound_backend(n) for n in other.split_gm.graph.nodes
            if comm_kind(n) is not None} == {"cache_test"}
    torch._dynamo.reset()
    again = _compile(tmp_path)  # the same binding: the second entry
    assert "cache_load" in again.compile_times and len(_entries(tmp_path)) == 2


def _recompile(tmp_path, caplog):
    """Compile again in this process; the artifact and the cache's WARNING lines."""
    caplog.clear()
    torch._dynamo.reset()
    with caplog.at_level(logging.WARNING, logger="dbo_compile.codegen.cache"):
        art = _compile(tmp_path)
    return art, caplog.text


def test_corrupt_and_stale_entries_are_ignored_with_a_log_line(hit, tmp_path, caplog):
    _, first, _ = hit
    tmp_path = _copy_of(hit, tmp_path)
    (name,) = _entries(tmp_path)
    path = tmp_path / name
    good = path.read_bytes()
    path.write_bytes(good[: len(good) // 2])  # a truncated write
    art, logged = _recompile(tmp_path, caplog)
    assert "ignoring" in logged and "cannot be read" in logged and name in logged
    assert "lower" in art.compile_times and art.code == first.code
    assert path.read_bytes() != good[: len(good) // 2]  # rewritten whole
    # an entry of another package version (an edited checkout) is stale
    entry = pickle.loads(path.read_bytes())
    entry["package"] = "0" * 16
    path.write_bytes(pickle.dumps(entry))
    art, logged = _recompile(tmp_path, caplog)
    assert "stale" in logged and "lower" in art.compile_times
    # an entry that unpickles but does not rebuild (a unit graph naming an op that is gone)
    entry = pickle.loads(path.read_bytes())
    nodes = entry["payload"]["units"][0][0]["nodes"]
    i = next(i for i, n in enumerate(nodes) if n[2][0] == "op")
    nodes[i] = nodes[i][:2] + (("op", "aten", "no_such_op", "default"),) + nodes[i][3:]
    path.write_bytes(pickle.dumps(entry))
    art, logged = _recompile(tmp_path, caplog)
    assert "does not rebuild" in logged and "lower" in art.compile_times
    # and the entry written then is whole again: the next compile reads it
    art, logged = _recompile(tmp_path, caplog)
    assert "cache_load" in art.compile_times and "lower" not in art.compile_times
    assert not logged


def test_an_unsplittable_verdict_is_cached(tmp_path):
    class NoComm(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(8, 8))

        def forward(self, x):
            return torch.relu(x @ self.w)

    model, x = NoComm(), torch.randn(6, 8)
    arts = []
    for _ in range(2):
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="dbo", options={"cache_dir": str(tmp_path)})
        torch._dynamo.mark_dynamic(x, 0)
        with torch.no_grad():
            torch.testing.assert_close(compiled(x), torch.relu(x @ model.w))
        arts.append(last_artifact())
    assert arts[0].split_program is None and "lower" in arts[0].compile_times
    assert arts[1].split_program is None and "lower" not in arts[1].compile_times
    assert "no comm op" in arts[1].reason and "compile cache" in arts[1].reason


def test_graphs_round_trip_with_their_names():
    model, step = build(MIXED_CUT, layers=1)
    eager_and_compiled(model, step, OPTIONS)
    art = last_artifact()
    graphs = list({id(u): u for u in art.split_program.units}.values())
    # and an op passed as an argument (a functionalised in-place op left functional)
    g = torch.fx.Graph()
    x = g.placeholder("x")
    af = g.call_function(torch.ops.higher_order.auto_functionalized,
                         (torch.ops.aten.add_.Tensor,), {"self": x, "other": x})
    g.output((g.call_function(operator.getitem, (af, 1)),))
    graphs.append(torch.fx.GraphModule(torch.nn.Module(), g))
    for gm in graphs:
        back = cache.load_graph(pickle.loads(pickle.dumps(cache.dump_graph(gm))))
        assert back.code == gm.code  # so Inductor's FX-graph cache sees the same program


def test_cache_dir_option():
    assert DboConfig().cache_dir is None
    assert DboConfig(cache_dir="/x").fingerprint() == DboConfig().fingerprint()
    with pytest.raises(DboConfigError, match="cache_dir"):
        DboConfig(cache_dir=3)


# -- what the programs bake in (issue 29, finding 1) --------------------------------------------

#: a mixed step small enough for one CUDA-graph bucket
SMALL = dict(decode_context_lens=[30] * 8, prefills=[(0, 24)])


def _served(eps, cache_dir=None, runner=True):
    """What one process serves for a step of the tiny model with ``rms_eps=eps`` compiled with
    ``dynamic=True`` (Dynamo passes the norms' eps as 0-dim tensors; the backend folds them
    into the programs): ``run_step``'s logits, its artifact and the steps it split, then
    (``runner``) ``CudaGraphRunner``'s logits, from the same KV caches."""
    from dbo_compile.models.batch import fill_kv_cache, make_step
    from dbo_compile.models.deepseek import DeepseekMoEModel, get_config
    from dbo_compile.runtime.engine import run_step
    from dbo_compile.runtime.cudagraph_runner import CudaGraphRunner
    from moe_cases import capture_then_serve

    torch._dynamo.reset()  # a fresh process, as far as Dynamo and the backend can tell
    cfg = get_config("tiny", num_layers=1, rms_eps=eps)
    model = DeepseekMoEModel(cfg, seed=0)
    step = make_step(cfg, block_size=16, seed=0, **SMALL)
    model.allocate_kv_cache(step.num_blocks, step.block_size)
    fill_kv_cache(model, step, seed=0)
    saved = [c.clone() for c in model.kv_caches()]
    options = {"split": "always", "compute_backend": "aten", "schedule_candidates": False}
    if cache_dir is not None:
        options["cache_dir"] = str(cache_dir)
    compiled = torch.compile(model, backend="dbo", dynamic=True, options=options)
    with torch.no_grad():
        out = run_step(compiled, step.input_ids, step.positions, step.attn_metadata,
                       step.num_scheduled_tokens)
        art = last_artifact()
        art.split_by_run_step = art.stats.split_steps
        if not runner:
            return out, art, None
        for c, s in zip(model.kv_caches(), saved):
            c.copy_(s)
        runner = CudaGraphRunner(compiled, [step.num_tokens], block_size=16, timing_iters=1,
                                 max_blocks_per_req=int(step.attn_metadata.block_table.shape[1]))
        served = capture_then_serve(runner, model, step, saved).clone()
    return out, art, served


@pytest.fixture(scope="module")
def served_without_cache():
    """What a process without the cache serves for ``rms_eps=1e-6``: ``(logits, served)``
    (the reference of the tests below; it reads and writes no cache dir)."""
    out, _, served = _served(1e-6)
    torch._dynamo.reset()
    return out.clone(), served


def test_folded_floats_are_part_of_the_key(tmp_path, caplog, served_without_cache):
    """Under ``dynamic=True`` the norms' eps are folded into the lowered and split programs
    (``float_guards``). A process whose model has ``rms_eps=1e-6`` read the entry written for
    ``1e-2``: its CUDA-graph runner served the ``1e-2`` programs (logits off), and ``run_step``
    never split (the guard saw the float "change"). Every value folded in is in the key: the
    second process compiles its own entry and serves what a process without the cache serves."""
    _served(1e-2, tmp_path)
    assert len(_entries(tmp_path)) == 1
    with caplog.at_level(logging.WARNING, logger="dbo_compile"):
        out, art, served = _served(1e-6, tmp_path)
    assert "lower" in art.compile_times, "read the entry of another eps"
    assert len(_entries(tmp_path)) == 2
    assert "changed from the value" not in caplog.text
    assert art.split_by_run_step == 1, art.stats.last_decision
    assert 1e-6 in dict(art.float_guards).values() and 1e-2 not in dict(art.float_guards).values()
    want_out, want_served = served_without_cache
    torch.testing.assert_close(out, want_out, rtol=0, atol=0)
    torch.testing.assert_close(served, want_served, rtol=0, atol=0)
    # and the same eps again reads its own entry
    again, art, served = _served(1e-6, tmp_path)
    assert "cache_load" in art.compile_times and "lower" not in art.compile_times
    torch.testing.assert_close(again, want_out, rtol=0, atol=0)
    torch.testing.assert_close(served, want_served, rtol=0, atol=0)


def test_an_entry_folding_other_floats_is_not_read(tmp_path, caplog, monkeypatch,
                                                   served_without_cache):
    """Checked on read as well: an entry whose programs fold other floats than this graph's
    inputs hold (a key that missed them: here every graph gets one key) is ignored with a
    WARNING, and the graph is compiled (and split) with its own."""
    monkeypatch.setattr(cache, "cache_key", lambda *args: "0" * 64)
    _served(1e-2, tmp_path, runner=False)
    with caplog.at_level(logging.WARNING, logger="dbo_compile"):
        out, art, _ = _served(1e-6, tmp_path, runner=False)
    assert "lower" in art.compile_times and "cache_load" in art.compile_times
    assert "does not rebuild" in caplog.text and "fold the floats" in caplog.text
    assert art.split_by_run_step == 1
    assert 1e-6 in dict(art.float_guards).values() and 1e-2 not in dict(art.float_guards).values()
    want, _ = served_without_cache
    torch.testing.assert_close(out, want, rtol=0, atol=0)


def test_the_key_sees_what_the_programs_bake_in(monkeypatch):
    """Besides the graph, the key holds what a lowered program bakes in that two processes may
    differ in: a scalar input traced as a constant, the world size of the process group a comm
    op names (its fake shapes, ``[W*T, H]``, are static in ``W``), and the placeholder names
    that classify a graph without Dynamo sources."""
    from types import SimpleNamespace

    from dbo_compile.ops import comm

    sizes = {"ep": 2}
    monkeypatch.setattr(comm.groups, "resolve_group", lambda name: SimpleNamespace(
        size=lambda: sizes[name]))

    def key(name="x", scale=0.5):
        g = torch.fx.Graph()
        x, ids, w, s = (g.placeholder(n) for n in (name, "ids", "w", "scale"))
        recv = g.call_function(torch.ops.dbo.dispatch.default, (x, ids, w, 4, "ep"))
        g.output((g.call_function(operator.mul, (g.call_function(operator.getitem, (recv, 0)),
                                                 s)),))
        gm = torch.fx.GraphModule(torch.nn.Module(), g)
        inputs = [torch.randn(6, 8), torch.zeros(6, 2, dtype=torch.int64), torch.ones(6, 2),
                  scale]
        return cache.cache_key(gm, inputs, DboConfig(), ["token", "token", "token", "scalar"])

    first = key()
    assert key() == first
    assert key(scale=0.25) != first
    assert key(name="hidden") != first
    sizes["ep"] = 4
    assert key() != first
