"""Logging: ``TORCH_LOGS`` naming ``dbo_compile`` prints each record once, and the name stays
registered with ``torch._logging`` (``set_logs``)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A fresh interpreter (TORCH_LOGS is read once, at ``import torch``). A root handler
# (logging.basicConfig, as applications set one) would print a second copy of every record of
# a logger that propagates beside torch's own handler. Markers: a WARNING before any compile, a
# compile of a two-op MoE step (its INFO "dbo: split into" and DEBUG "dbo pass 00" lines), a
# WARNING after it, torch re-reading its settings, and a last WARNING.
_SCRIPT = textwrap.dedent("""
    import logging, sys
    import torch
    import dbo_compile
    import dbo_compile.ops  # registers torch.ops.dbo.*
    from torch._logging import _internal

    logging.basicConfig(stream=sys.stderr, format="ROOT %(name)s %(message)s")
    probe = logging.getLogger("dbo_compile.probe")
    assert _internal.log_registry.is_log("dbo_compile")
    probe.warning("probe-before-compile")

    class M(torch.nn.Module):
        def forward(self, x):
            ids = torch.zeros(x.shape[0], 1, dtype=torch.int64)
            recv, _, rw = torch.ops.dbo.dispatch(x, ids, torch.ones(x.shape[0], 1), 1, "")
            return torch.ops.dbo.combine(recv * rw.sum(-1, keepdim=True), "")

    x = torch.randn(8, 4)
    torch._dynamo.mark_dynamic(x, 0)
    torch.compile(M(), backend="dbo", options={"split": "always",
                                               "schedule_candidates": False})(x)
    probe.warning("probe-after-compile")
    _internal._init_logs()  # torch re-reads its settings (set_logs does the same)
    probe.warning("probe-after-reinit")
""")


def _run(code: str, torch_logs: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TORCH_LOGS"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    if torch_logs is not None:
        env["TORCH_LOGS"] = torch_logs
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env=env, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stderr


@pytest.mark.parametrize("torch_logs,debug", [("+dbo_compile", True), ("dbo_compile", False)])
def test_torch_logs_prints_each_record_once(torch_logs, debug):
    """torch imports the package while it parses ``TORCH_LOGS`` (to find the name); the
    package's own registration then must not leave a second handler on ``dbo_compile``, nor a
    logger that also hands its records to the root handlers: each record prints once, before
    the first compile, during it and after torch re-reads its settings."""
    err = _run(_SCRIPT, torch_logs)
    for marker in ("probe-before-compile", "probe-after-compile", "probe-after-reinit",
                   "dbo: split into"):
        assert err.count(marker) == 1, f"{marker!r} printed {err.count(marker)} times:\n{err[-3000:]}"
    assert "ROOT dbo_compile" not in err  # torch's handler prints them, not the root's
    assert err.count("dbo pass 00 inline_regions") == (1 if debug else 0), err[-3000:]


def test_without_torch_logs_records_reach_the_root_once():
    """No ``TORCH_LOGS``: our records go to the application's handlers, once; the name is
    registered with ``torch._logging``."""
    code = textwrap.dedent("""
        import logging, sys
        import torch, dbo_compile
        from torch._logging import _internal
        assert _internal.log_registry.is_log("dbo_compile")
        logging.basicConfig(stream=sys.stderr, format="ROOT %(name)s %(message)s")
        logging.getLogger("dbo_compile.probe").warning("probe-plain")
    """)
    err = _run(code, None)
    assert err.count("probe-plain") == 1 and "ROOT dbo_compile.probe probe-plain" in err, err


@pytest.mark.parametrize("imported_first", [True, False])
def test_set_logs_names_the_package_and_prints_each_record_once(imported_first):
    """``torch._logging.set_logs(modules={"dbo_compile": DEBUG})`` turns torch's handler on
    for our records, each printed once, whether the package was imported before or torch
    imports it to resolve the name (then it registers the name itself: the package must not
    have registered it too, or torch also takes it for a child log of itself and lets it
    propagate to the root handler)."""
    code = textwrap.dedent(f"""
        import logging, sys
        import torch
        if {imported_first}:
            import dbo_compile
        logging.basicConfig(stream=sys.stderr, format="ROOT %(name)s %(message)s")
        torch._logging.set_logs(modules={{"dbo_compile": logging.DEBUG}})
        import dbo_compile
        from torch._logging import _internal
        assert _internal.log_registry.is_log("dbo_compile")
        logging.getLogger("dbo_compile.probe").debug("probe-set-logs")
    """)
    err = _run(code, None)
    assert err.count("probe-set-logs") == 1 and "ROOT dbo_compile" not in err, err
