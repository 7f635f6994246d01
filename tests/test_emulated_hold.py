"""The emulated backend's option ``hold_sms`` (dbo_compile/ops/emulated/hold.py, issue 28 item
3): each transfer of the link holds that many SMs for its emulated duration, as DeepEP's
normal-mode kernels do. On CPU: the option's checks, its way from ``comm_backend_options`` to
the bound world (its spec, the fingerprint) and to the link's send, and that a CPU transfer
holds nothing; the kernel itself on CUDA (``gpu``), eagerly and in a CUDA graph."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from conftest import last_artifact
from dbo_compile.config import DboConfig
from dbo_compile.errors import CommBackendError, DboError
from dbo_compile.ops import emulated as E
from dbo_compile.ops.comm import comm_options_for, get_comm_backend
from dbo_compile.ops.emulated import hold, link
from dbo_compile.ops.registry import bound_backend, comm_kind
from dbo_compile.runtime.engine import run_step
from test_emulated import _world_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("value", [-1, True, 2.5, "24"])
def test_hold_sms_must_be_an_int_of_sms(value):
    with pytest.raises(CommBackendError, match=f"hold_sms={value!r} must be an int >= 0"):
        E.check_options(world_size=8, hold_sms=value)
    with pytest.raises(CommBackendError, match="hold_sms"):
        E.EmulatedWorld(8, 64, 6, hold_sms=value)


def test_hold_sms_and_comm_sms_together_are_refused():
    with pytest.raises(CommBackendError, match="comm_sms=16 and hold_sms=24 .* give one"):
        E.check_options(world_size=8, comm_sms=16, hold_sms=24)
    E.check_options(world_size=8, comm_sms=16, hold_sms=0)  # 0: none held


def test_the_world_carries_hold_sms_in_its_spec():
    """The instance's spec names ``hold_sms`` where it is not 0 (so a graph bound to a world
    that holds SMs is another instance, and the spec of a world without it is as before),
    and the registry configures the same world back from the spec."""
    plain = E.world_of_options({"world_size": 8}, 64, 6)
    held = E.world_of_options({"world_size": 8, "hold_sms": 24}, 64, 6)
    assert plain.hold_sms == 0 and "hold_sms" not in plain.name
    assert held.hold_sms == 24 and "hold_sms=24" in held.name and held.name != plain.name
    backend = get_comm_backend(E.register_emulated(held))
    assert backend.world == held


def test_hold_sms_is_in_the_fingerprint():
    a = DboConfig(comm_backend="emulated", comm_backend_options={"world_size": 8})
    b = DboConfig(comm_backend="emulated", comm_backend_options={"world_size": 8, "hold_sms": 24})
    assert a.fingerprint() != b.fingerprint()


def test_comm_backend_options_deal_hold_sms_to_the_emulated_backend():
    """The compiler deals ``comm_backend_options`` to the backends by their ``check_options``:
    ``hold_sms`` is the emulated backend's, checked there."""
    dealt = comm_options_for(["emulated"], {"world_size": 8, "hold_sms": 24})
    assert dealt == {"emulated": {"world_size": 8, "hold_sms": 24}}
    with pytest.raises(DboError, match="hold_sms=-3"):
        comm_options_for(["emulated"], {"world_size": 8, "hold_sms": -3})


def test_compiled_world_with_hold_sms_binds_it_and_answers_the_same():
    """``comm_backend_options={"hold_sms": 2}`` reaches the world both programs are bound
    to; on CPU nothing is held (no SMs: the CPU link copies synchronously) and the answer is
    the reference's."""
    model, ref, step = _world_model()
    cm = torch.compile(model, backend="dbo", options={
        "split": "always", "comm_backend": "emulated",
        "comm_backend_options": {"world_size": 4, "hold_sms": 2}})
    with torch.no_grad():
        out = run_step(cm, step.input_ids, step.positions, step.attn_metadata,
                       step.num_scheduled_tokens)
        want = ref(step.input_ids, step.positions, step.attn_metadata)
    art = last_artifact()
    assert art.is_split
    torch.testing.assert_close(out, want)
    for gm in (art.split_gm, art.lowered_gm):
        bound = {bound_backend(n) for n in gm.graph.nodes if comm_kind(n) is not None}
        assert bound == {E.EmulatedWorld(4, 8, 3, hold_sms=2).name}


def test_a_cpu_transfer_holds_nothing(monkeypatch):
    calls = []
    monkeypatch.setattr(link, "hold_sms", lambda *a: calls.append(a))
    world = E.EmulatedWorld(4, 8, 3, hold_sms=24)
    src = torch.randn(10, 16)
    torch.testing.assert_close(link.LINK.round_trip(src, world), src)
    assert calls == []
    hold.hold_sms(torch.device("cpu"), 24, 100.0)  # a no-op, no CUDA touched


def test_hold_lasts_the_transfer_at_the_link_rate():
    """µs = latency + bytes / (GB/s * 1e3): 1 MB at 50 GB/s is 20 µs."""
    assert hold.hold_us(1_000_000, 50.0) == pytest.approx(20.0)
    assert hold.hold_us(1_000_000, 25.0, latency_us=5.0) == pytest.approx(45.0)


@pytest.mark.parametrize("argv, refused", [
    (["--hold-sms", "24"], "--hold-sms: not read without --emulate-ep"),
    (["--emulate-ep", "8", "--hold-sms", "24"], "--hold-sms: not read without CUDA"),
])
def test_bench_flag_is_refused_where_not_read(argv, refused):
    if torch.cuda.is_available() and "--emulate-ep" in argv:
        pytest.skip("CUDA reads it")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_moe.py"),
                           *argv], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.returncode == 2 and refused in proc.stderr, proc.stderr[-2000:]


@pytest.mark.gpu
def test_hold_kernel_runs_eagerly_and_in_a_cuda_graph():
    dev = torch.device("cuda")
    count = torch.cuda.get_device_properties(dev).multi_processor_count
    hold.hold_sms(dev, 24, 50.0)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        hold.hold_sms(dev, 24, 50.0)
    g.replay()
    torch.cuda.synchronize()
    with pytest.raises(CommBackendError, match=f"has {count} SMs"):
        hold.hold_sms(dev, count + 1, 50.0)


@pytest.mark.gpu
def test_a_kernel_needing_shared_memory_waits_for_the_held_sms():
    """With every SM held, a matmul (shared memory) on another stream cannot start until the
    hold ends: it finishes after the holding kernel (event order, no time measured)."""
    dev = torch.device("cuda")
    count = torch.cuda.get_device_properties(dev).multi_processor_count
    a = torch.randn(2048, 2048, device=dev, dtype=torch.bfloat16)
    a @ a  # cuBLAS initialised before the race
    other = torch.cuda.Stream()
    held, done = torch.cuda.Event(), torch.cuda.Event()
    torch.cuda.synchronize()
    hold.hold_sms(dev, count, 200_000.0)  # 200 ms on the current stream
    held.record()
    time.sleep(0.02)  # the holding CTAs are resident before the matmul is launched
    with torch.cuda.stream(other):
        a @ a
        done.record(other)
    done.synchronize()
    assert held.query(), "the matmul finished while every SM was held"
    torch.cuda.synchronize()
