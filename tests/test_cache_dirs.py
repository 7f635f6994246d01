"""One cache directory for a warm restart (codegen/cache_dirs.py, issue 26): our compile cache,
Inductor's and Triton's caches under ``cache_dir``; a second fresh process reads ours (hit
counted) and Inductor's; a variable the user set explicitly wins."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from dbo_compile.codegen import cache_dirs
from dbo_compile.codegen.cache_dirs import cache_layout, use_cache_dir

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
IND, TRI = "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"


def _child(cache_dir: str, backend: str) -> dict:
    """One process's compile and first step of the tiny model (in a fresh interpreter)."""
    from torch._dynamo.utils import counters

    from dbo_compile.backend import register
    from moe_cases import MIXED_CUT, build, eager_and_compiled

    register()
    model, step = build(MIXED_CUT, layers=1)
    eager, out, _, _ = eager_and_compiled(model, step, {
        "split": "always", "compute_backend": backend, "cache_dir": cache_dir,
        "schedule_candidates": False})
    return {"dbo": dict(counters["dbo_compile"]), "inductor": dict(counters["inductor"]),
            "env": {k: os.environ.get(k) for k in (IND, TRI)},
            "err": (out - eager).abs().max().item(), "listing": sorted(os.listdir(cache_dir))}


def _fresh_process(cache_dir: str, backend: str = "aten", env: dict | None = None) -> dict:
    code = ("import json, test_cache_dirs as t; "
            f"print('RESULT', json.dumps(t._child({cache_dir!r}, {backend!r})))")
    full = {k: v for k, v in os.environ.items() if k not in (IND, TRI)}
    full.update(env or {}, PYTHONPATH=os.pathsep.join([_ROOT, _HERE]))
    out = subprocess.run([sys.executable, "-c", code], cwd=_HERE, env=full, capture_output=True,
                         text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def test_a_second_process_hits_our_cache_and_inductor_points_under_the_dir(tmp_path):
    d = str(tmp_path / "cache")
    cold = _fresh_process(d)
    warm = _fresh_process(d)
    layout = cache_layout(d)
    assert cold["dbo"] == {"cache_miss": 1} and warm["dbo"] == {"cache_hit": 1}
    for r in (cold, warm):
        assert r["env"] == {IND: layout["inductor"], TRI: layout["triton"]}
        assert r["err"] < 1e-5
        assert {"inductor", "triton"} <= set(r["listing"])
        assert any(p.endswith(".pkl") for p in r["listing"])


def test_an_explicit_inductor_dir_wins_over_cache_dir(tmp_path):
    mine = str(tmp_path / "mine")
    r = _fresh_process(str(tmp_path / "cache"), env={IND: mine})
    assert r["env"][IND] == mine and r["env"][TRI] is None  # torch puts Triton's under it
    assert r["dbo"] == {"cache_miss": 1} and "inductor" not in r["listing"]


@pytest.mark.slow
def test_with_inductor_stages_a_second_process_hits_inductors_cache_too(tmp_path):
    """compute_backend="inductor" on CPU (about a minute cold): Inductor's FX-graph cache is
    under the dir and the second process hits it."""
    d = str(tmp_path / "cache")
    cold = _fresh_process(d, "inductor")
    warm = _fresh_process(d, "inductor")
    assert os.path.isdir(os.path.join(cache_layout(d)["inductor"], "fxgraph"))
    assert cold["inductor"].get("fxgraph_cache_miss", 0) > 0
    assert warm["inductor"].get("fxgraph_cache_hit", 0) > 0 and warm["dbo"] == {"cache_hit": 1}
    assert warm["err"] < 1e-5


@pytest.fixture
def clean_env(monkeypatch):
    monkeypatch.delenv(IND, raising=False)
    monkeypatch.delenv(TRI, raising=False)
    monkeypatch.setattr(cache_dirs, "_SET", {IND: set(), TRI: set()})
    return monkeypatch


def test_unset_variables_are_set_under_the_dir(clean_env, tmp_path):
    layout = use_cache_dir(str(tmp_path / "c"))
    assert layout == cache_layout(str(tmp_path / "c"))
    assert os.environ[IND] == layout["inductor"] and os.environ[TRI] == layout["triton"]
    assert os.path.isdir(layout["inductor"]) and os.path.isdir(layout["triton"])
    # another cache_dir later in the process replaces ours
    other = use_cache_dir(str(tmp_path / "d"))
    assert os.environ[IND] == other["inductor"] and os.environ[TRI] == other["triton"]


def test_torchs_own_defaults_are_replaced(clean_env, tmp_path):
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    default = os.path.abspath(default_cache_dir())
    clean_env.setenv(IND, default)  # what torch writes back after its first cache lookup
    clean_env.setenv(TRI, os.path.join(default, "triton", "0"))
    layout = use_cache_dir(str(tmp_path / "c"))
    assert os.environ[IND] == layout["inductor"] and os.environ[TRI] == layout["triton"]


def test_explicit_variables_win(clean_env, tmp_path):
    clean_env.setenv(TRI, str(tmp_path / "my_triton"))
    layout = use_cache_dir(str(tmp_path / "c"))
    assert os.environ[TRI] == str(tmp_path / "my_triton") == layout["triton"]
    assert os.environ[IND] == layout["inductor"] == str(tmp_path / "c" / "inductor")
    clean_env.setenv(IND, str(tmp_path / "my_inductor"))
    layout = use_cache_dir(str(tmp_path / "e"))
    assert os.environ[IND] == layout["inductor"] == str(tmp_path / "my_inductor")
    assert os.environ[TRI] == layout["triton"] == str(tmp_path / "my_triton")
