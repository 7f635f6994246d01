"""The README's quick start is runnable as written (issue 16): its first Python block builds
its own inputs, and the step it compiles splits; the README says when a SCHEDULE.json exists."""

from __future__ import annotations

import os
import re

import torch

README = os.path.join(os.path.dirname(__file__), "..", "README.md")


def _text() -> str:
    with open(README) as f:
        return f.read()


def test_first_snippet_runs_and_splits():
    from dbo_compile.backend import compiled_artifacts

    block = re.findall(r"```python\n(.*?)```", _text(), re.S)[0]
    for name in ("make_step", "allocate_kv_cache", "fill_kv_cache"):
        assert name in block
    scope: dict = {}
    with torch.no_grad():
        exec(compile(block, "README.md", "exec"), scope)  # noqa: S102 - our own README
    art = compiled_artifacts()[-1]
    print(art.stats, tuple(scope["logits"].shape))
    assert art.is_split and art.stats.split_steps == 1
    step, model = scope["step"], scope["model"]
    assert scope["logits"].shape == (step.num_tokens, scope["cfg"].vocab_size)


def test_readme_says_schedule_json_needs_dump_dir():
    text = _text()
    assert re.search(r"`SCHEDULE\.json` exists only when[^.]*dump_dir", text)
