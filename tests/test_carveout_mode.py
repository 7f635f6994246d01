"""``DboConfig.sm_carveout_mode`` (issue 28 item 3, "every kernel limited"): how an SM carve-out
keeps its SMs free of compute. ``"cublas"`` (the default) limits cuBLAS GEMMs alone;
``"green_context"`` runs the split program's compute stream in a CUDA green context of the
device's SMs less the carve-out, so Triton and grouped-GEMM kernels leave them too. On CPU: the
option's checks and fingerprint, the partition arithmetic, the refusal where torch has no green
contexts, the no-op on CPU and the mode's way to the programs; on CUDA (``gpu``): the block runs
on the green context's stream, eagerly and under CUDA-graph capture, with the same result."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dbo_compile.candidates import candidate_programs
from dbo_compile.config import DboConfig
from dbo_compile.errors import DboConfigError
from dbo_compile.runtime import streams


def test_the_mode_is_checked_and_enters_the_fingerprint_only_when_not_the_default():
    assert DboConfig().sm_carveout_mode == "cublas"
    with pytest.raises(DboConfigError, match=r"sm_carveout_mode='sms'.*'cublas', 'green_context'"):
        DboConfig(sm_carveout_mode="sms")
    assert DboConfig(sm_carveout_mode="cublas").fingerprint() == DboConfig().fingerprint()
    assert DboConfig(sm_carveout_mode="green_context").fingerprint() != DboConfig().fingerprint()


@pytest.mark.parametrize("total, carveout, want", [(132, 24, 104), (132, 16, 112), (132, 20, 112),
                                                   (78, 8, 64), (16, 8, 8)])
def test_green_context_sms_rounds_the_compute_partition_down(total, carveout, want):
    """Down, not up: a partition rounded up would take SMs the comm kernels were promised."""
    assert streams.green_context_sms(total, carveout) == want


def test_a_carveout_leaving_less_than_one_partition_is_refused():
    with pytest.raises(DboConfigError, match="leaves 6 for compute.*carve out fewer"):
        streams.green_context_sms(16, 10)


def test_green_context_mode_without_green_contexts_names_the_fallback(monkeypatch):
    gc = getattr(torch.cuda, "green_contexts", None)
    if gc is not None:
        monkeypatch.setattr(gc, "SUPPORTED", False)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda index: SimpleNamespace(multi_processor_count=132))
    monkeypatch.setattr(streams, "_green", {})
    with pytest.raises(DboConfigError, match="needs torch.cuda.green_contexts.*'cublas'"):
        streams._green_stream(0, 24)


@pytest.mark.parametrize("mode", ["cublas", "green_context"])
@pytest.mark.parametrize("device", [None, torch.device("cpu")])
def test_the_carveout_is_a_no_op_off_cuda(mode, device):
    ran = []
    with streams.sm_carveout(24, device, mode):
        ran.append(True)
    assert ran == [True]


def test_every_program_of_an_artifact_carries_the_configs_mode():
    """The variants with a carve-out (copies) and the programs without one alike."""
    class Prog:
        carveout_sms = None
        carveout_mode = "cublas"

    config = DboConfig(schedule_candidates=("list", "list+sms16"), sm_carveout_candidates=(16,),
                       sm_carveout_mode="green_context")
    base = Prog()
    out = candidate_programs({"list": base}, {"list": "list"}, config)
    assert set(out) == {"list", "list+sms16"}
    assert out["list+sms16"] is not base and out["list+sms16"].carveout_sms == 16
    assert {p.carveout_mode for p in out.values()} == {"green_context"}


def _green_or_skip():
    gc = getattr(torch.cuda, "green_contexts", None)
    if gc is None or not gc.SUPPORTED or not hasattr(gc.GreenContext, "Stream"):
        pytest.skip("this torch has no green contexts with a Stream()")


@pytest.mark.gpu
def test_the_block_runs_on_the_green_contexts_stream_with_the_same_result():
    _green_or_skip()
    dev = torch.device("cuda")
    a = torch.randn(1024, 1024, device=dev, dtype=torch.bfloat16)
    want = a @ a
    outer = torch.cuda.current_stream()
    with streams.sm_carveout(24, dev, "green_context"):
        inner = torch.cuda.current_stream()
        got = a @ a
    assert inner != outer and torch.cuda.current_stream() == outer
    torch.testing.assert_close(got, want)


@pytest.mark.gpu
def test_the_green_context_block_is_captured_in_a_cuda_graph():
    _green_or_skip()
    dev = torch.device("cuda")
    a = torch.randn(1024, 1024, device=dev, dtype=torch.bfloat16)
    want = (a @ a).relu()
    with streams.sm_carveout(24, dev, "green_context"):  # warm-up (cuBLAS handles, the stream)
        (a @ a).relu()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        with streams.sm_carveout(24, dev, "green_context"):
            out = (a @ a).relu()
    out.zero_()
    g.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, want)
