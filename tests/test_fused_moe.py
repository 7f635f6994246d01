"""The fused experts path (``dbo_compile/ops/fused_moe.py`` and the gather-sum of
``ops/experts.py``): its Triton kernels under Triton's CPU interpreter against the reference
loop, the align kernel's layout, and the choice between the fused and the sorted path."""

import pytest
import torch

from dbo_compile.errors import ExpertsOpError
from dbo_compile.ops import experts, fused_moe

_FUSED_CHECK = """
import torch
from test_experts import _case
from dbo_compile.ops.experts import experts_loop
from dbo_compile.ops.experts import grouped_fused as fused_experts
from dbo_compile.ops.fused_moe import FusedConfig
cases = (  # seed, dtype, rows, H, I, experts, K, tile shape
    (0, torch.float32, 40, 32, 16, 4, 3, FusedConfig(16, 16, 16)),
    (1, torch.bfloat16, 70, 40, 24, 5, 3, FusedConfig(16, 16, 32)),  # H, I not tile multiples
    (2, torch.float32, 1, 32, 16, 4, 3, FusedConfig(32, 32, 16)),    # one row
    (3, torch.float32, 90, 32, 16, 2, 4, FusedConfig(16, 16, 16)),   # experts over many tiles
    (5, torch.float32, 700, 32, 16, 5, 3, FusedConfig(16, 16, 16)),  # ids over several blocks
)
for seed, dtype, n, h, inter, e, k, cfg in cases:
    x, ids, w, w13, w2 = _case(n=max(n, 5), h=h, inter=inter, e=e, k=k, seed=seed, dtype=dtype)
    x, ids, w = x[:n], ids[:n], w[:n]
    w = w + 1.0  # slots on another rank carry a weight too: the kernels must mask by id
    got = fused_experts(x, ids, w, w13, w2, cfg).float()
    ref = experts_loop(x.float(), ids, w, w13.float(), w2.float())
    err = float((got - ref).abs().max() / ref.abs().max().clamp(min=1e-6))
    assert err < (1e-5 if dtype == torch.float32 else 2e-2), (seed, dtype, err)
    assert bool(((ids >= 0).any(1) | (got.abs().sum(1) == 0)).all())  # no-slot rows: zeros
# strided weights (a transposed view) and column-major rows read through their strides
x, ids, w, w13, w2 = _case(n=30, seed=4)
w13t = w13.transpose(1, 2).contiguous().transpose(1, 2)
xs = x.t().contiguous().t()
torch.testing.assert_close(fused_experts(xs, ids, w, w13t, w2, FusedConfig(16, 16, 16)),
                           fused_experts(x, ids, w, w13, w2, FusedConfig(16, 16, 16)))
# an expert with no slot, every slot elsewhere
ids2 = ids.clone(); ids2[ids2 == 1] = 2
ref = experts_loop(x, ids2, w, w13, w2)
torch.testing.assert_close(fused_experts(x, ids2, w, w13, w2, FusedConfig(16, 16, 16)), ref,
                           rtol=1e-5, atol=1e-5)
none = torch.full_like(ids, -1)
assert fused_experts(x, none, w, w13, w2, FusedConfig(16, 16, 16)).abs().max() == 0
print("ok")
"""

_ALIGN_CHECK = """
import torch
from dbo_compile.ops.fused_moe import align
g = torch.Generator().manual_seed(0)
# small; several blocks of ids; many tiles past one store block; 200 experts
for n, k, e, bm in ((37, 3, 5, 16), (200, 6, 8, 32), (3, 2, 4, 16), (2000, 4, 3, 16), (50, 8, 200, 16)):
    ids = torch.randint(-1, e, (n, k), generator=g)
    sorted_slots, pos, tile_expert = align(ids, e, bm)
    flat = ids.reshape(-1)
    counts = torch.bincount(flat[flat >= 0], minlength=e)
    padded = (counts + bm - 1) // bm * bm
    start = torch.cumsum(padded, 0) - padded
    tiles = int(padded.sum()) // bm
    assert sorted_slots.numel() % bm == 0 and tile_expert.numel() == sorted_slots.numel() // bm
    assert sorted_slots.numel() >= flat.numel() + e * (bm - 1) - bm + 1
    for x in range(e):
        rows = sorted_slots[int(start[x]):int(start[x]) + int(padded[x])]
        mine = torch.nonzero(flat == x).reshape(-1).to(torch.int32)
        assert torch.equal(rows[:int(counts[x])], mine), x        # stable: slot order kept
        assert bool((rows[int(counts[x]):] == flat.numel()).all())  # padding: the sentinel
        assert bool((tile_expert[int(start[x]) // bm:(int(start[x]) + int(padded[x])) // bm] == x).all())
        assert torch.equal(pos[mine.long()], torch.arange(int(start[x]), int(start[x]) + int(counts[x]), dtype=torch.int32))
    assert bool((tile_expert[tiles:] == -1).all())
print("ok")
"""


_EDGE_CHECK = """
import torch
from test_experts import _case
_empty = torch.empty


def poisoned(*args, **kwargs):  # every buffer the kernels leave undefined reads as poison
    t = _empty(*args, **kwargs)
    return t.fill_(float("nan") if t.dtype.is_floating_point else 2**30)


torch.empty = poisoned
from dbo_compile.ops.experts import experts_loop
from dbo_compile.ops.experts import grouped_fused as fused_experts
from dbo_compile.ops.fused_moe import FusedConfig, align
C = FusedConfig(16, 16, 16)


def check(name, x, ids, w, w13, w2, cfg=C):
    got = fused_experts(x, ids, w, w13, w2, cfg).float()
    ref = experts_loop(x.float(), ids.long(), w.float(), w13.float(), w2.float()).float()
    assert bool(torch.isfinite(got).all()), name
    err = float((got - ref).abs().max() / ref.abs().max().clamp(min=1e-6))
    assert err < (1e-5 if x.dtype == torch.float32 else 2e-2), (name, err)


x, ids, w, w13, w2 = _case(n=40, seed=0)
check("every slot elsewhere", x, torch.full_like(ids, -1), w, w13, w2)
check("one expert takes every slot", x, torch.full_like(ids, 2), w, w13, w2)
dup = ids.clone(); dup[:, 1:] = dup[:, :1]
check("one expert thrice in a row", x, dup, w, w13, w2)
# inf / NaN weights of slots elsewhere and inf rows without a local slot never reach y
w_bad = torch.where(ids < 0, float("nan"), w); w_bad[::2][ids[::2] < 0] = float("inf")
x_bad = x.clone(); x_bad[(ids < 0).all(1)] = float("inf")
check("inf/NaN where no local slot", x_bad, ids, w_bad, w13, w2)
check("int32 ids", x, ids.int(), w, w13, w2)
check("strided ids and weights", x, ids.t().contiguous().t(), w.t().contiguous().t(), w13, w2)
wide = torch.randint(-1, 4, (40, 6)); wide[:5] = -1
check("every other column", x, wide[:, ::2], torch.rand(40, 6)[:, ::2], w13, w2)
check("block_m above every row", x[:3], ids[5:8], w[:3], w13, w2, FusedConfig(128, 16, 16))
check("H, I below one tile", *_case(n=20, h=8, inter=4, e=3, k=2, seed=3))
check("H, I below a 64 tile", *_case(n=20, h=20, inter=12, e=3, k=2, seed=3),
      FusedConfig(64, 64, 64))
check("300 experts (512 bins)", *_case(n=64, h=16, inter=16, e=300, k=6, seed=5))
check("N*K = 301", *_case(n=43, k=7, seed=7))
check("bf16, one expert", *_case(n=40, seed=9, dtype=torch.bfloat16)[:1],
      torch.full((40, 3), 1), torch.rand(40, 3),
      *_case(n=40, seed=9, dtype=torch.bfloat16)[3:], FusedConfig(32, 16, 16))
# no local expert at all (E_local = 0): every tile unused, y zeros
none = torch.full((6, 2), -1)
_, _, tile_expert = align(none, 0, 16)
assert bool((tile_expert == -1).all()), tile_expert
y = fused_experts(x[:6], none, w[:6, :2], w13[:0], w2[:0], C)
assert y.abs().max() == 0
print("ok")
"""


_OUT_OF_RANGE_CHECK = """
import torch
from test_experts import _case
_empty = torch.empty


def poisoned(*args, **kwargs):  # every buffer the kernels leave undefined reads as poison
    t = _empty(*args, **kwargs)
    return t.fill_(float("nan") if t.dtype.is_floating_point else torch.iinfo(t.dtype).max)


torch.empty = poisoned
from dbo_compile.ops.experts import experts_loop, grouped_reference
from dbo_compile.ops.experts import grouped_fused as _grouped_fused
from dbo_compile.ops.experts import grouped_triton as _grouped_triton
from dbo_compile.ops.fused_moe import FusedConfig

paths = {"loop": experts_loop, "reference": grouped_reference, "sorted": _grouped_triton,
         "fused": lambda *a: _grouped_fused(*a, FusedConfig(16, 16, 16))}
for dtype in (torch.float32, torch.bfloat16):
    x, ids, w, w13, w2 = _case(n=40, e=4, seed=11, dtype=dtype)
    bad = ids.clone()
    bad[5:10, 0] = 4        # E_local: another rank's first expert
    bad[10:15, 1] = 2**20   # past the align kernel's bins and the narrow sort keys
    bad[15:20, 2] = -7      # negative, not the padding -1
    bad[20, :] = 2**40      # every slot of a row
    local = torch.where((bad >= 0) & (bad < 4), bad, -1)
    want = experts_loop(x.float(), local, w, w13.float(), w2.float())
    int32 = bad.clamp(-2**31, 2**31 - 1).int()  # the kernels take int32 ids too
    for name, fn, ids_ in [(n, f, bad) for n, f in paths.items()] + [
            ("sorted int32", _grouped_triton, int32), ("fused int32", paths["fused"], int32)]:
        got = fn(x, ids_, w, w13, w2).float()
        assert bool(torch.isfinite(got).all()), (name, dtype)
        err = float((got - want).abs().max() / want.abs().max())
        assert err < (1e-5 if dtype == torch.float32 else 2e-2), (name, dtype, err)
        assert got[20].abs().max() == 0, name  # no local slot: a zero row
print("ok")
"""


def test_ids_outside_the_local_experts_contribute_nothing_in_interpreter():
    """Issue 29, finding 8: a slot whose id is outside ``[0, E_local)`` (another rank's expert,
    a huge id, a negative id other than -1) contributes nothing on every path, and no kernel
    reads out of bounds (the undefined buffers are poisoned). Before: the fused and the sorted
    kernels read ``o`` at the undefined position of such a slot (a segfault under the
    interpreter), the torch-ops reference summed garbage rows."""
    from triton_interp import run_interpreted

    assert run_interpreted(_OUT_OF_RANGE_CHECK).strip().endswith("ok")


def test_fused_kernels_match_loop_in_interpreter():
    """Gate/up + SiLU and down GEMMs over the aligned slots, then the weighted gather-sum,
    against the reference loop: fp32 and bf16, H and I not multiples of the tiles, one row,
    experts spanning several tiles, strided weights and rows, an expert with no slot, no slot
    at all."""
    from triton_interp import run_interpreted

    assert run_interpreted(_FUSED_CHECK).strip().endswith("ok")


def test_fused_kernels_edge_cases_in_interpreter():
    """Every buffer the kernels leave undefined poisoned (NaN, 2**30): no slot here, one
    expert taking every slot, one expert thrice in a row, inf/NaN on slots elsewhere and on
    rows without a local slot, int32 and strided ids, a tile taller than every row, H and I
    below one tile, 300 experts, ``N*K`` not a multiple of anything, no local expert."""
    from triton_interp import run_interpreted

    assert run_interpreted(_EDGE_CHECK).strip().endswith("ok")


def test_align_layout_in_interpreter():
    """The align kernel's layout: each expert's slots in their order at its padded start, the
    padding rows the sentinel ``N*K``, the inverse permutation, the expert of each tile and
    ``-1`` past the last."""
    from triton_interp import run_interpreted

    assert run_interpreted(_ALIGN_CHECK).strip().endswith("ok")


@pytest.mark.parametrize("bad", [dict(block_m=24), dict(block_n=8), dict(block_k=0)])
def test_tile_shape_is_validated(bad):
    with pytest.raises(ExpertsOpError, match="power of two"):
        fused_moe.FusedConfig(**bad)


def test_path_choice_option_and_static_rule(monkeypatch):
    """The ``path`` option fixes the choice; without a measurement (not CUDA here) the static
    slot rule decides; calls outside :func:`supports` never take the fused path."""
    pytest.importorskip("triton")
    # CPU tensors as under Triton's interpreter (outside it, supports() refuses them)
    monkeypatch.setattr(fused_moe, "_kernels", lambda: (None, None, True))
    x = torch.zeros(4, 16)
    w13, w2 = torch.zeros(2, 32, 16), torch.zeros(2, 16, 16)
    small = torch.zeros(4, 2, dtype=torch.int64)
    big = torch.zeros(experts.STATIC_FUSED_SLOTS // 2 + 1, 2, dtype=torch.int64)
    xb = torch.zeros(big.shape[0], 16)
    w = torch.zeros(4, 2)
    assert experts._prefer_fused(x, small, w, w13, w2)
    assert not experts._prefer_fused(xb, big, w, w13, w2)
    assert not experts._prefer_fused(x.double(), small, w, w13, w2)  # dtype outside supports
    assert not experts._prefer_fused(x.double(), small, w, w13, w2, "fused")
    assert not experts._prefer_fused(x, small, w, w13, w2, "sorted")
    assert experts._prefer_fused(xb, big, w, w13, w2, "fused")


def test_torch_backend_path_option_is_validated():
    """``experts_backend_options={"path": ...}`` reaches the ``torch`` backend through its spec;
    a bad value or an unknown option raises ``ExpertsOpError`` naming what it takes."""
    from dbo_compile.ops.experts import get_experts_backend
    from dbo_compile.ops.registry import backend_spec

    spec = backend_spec("torch", {"path": "sorted"})
    assert spec == "torch:path=sorted"
    assert get_experts_backend(spec).run.keywords == {"path": "sorted"}
    assert get_experts_backend("torch").run.keywords == {"path": "auto"}
    with pytest.raises(ExpertsOpError, match="expected one of auto, fused, sorted"):
        get_experts_backend("torch:path=fast")
    with pytest.raises(ExpertsOpError, match="unknown option.*takes path"):
        get_experts_backend("torch:fp8=true")


def test_fused_kernels_refuse_what_they_cannot_serve():
    pytest.importorskip("triton")
    x = torch.zeros(4, 16, dtype=torch.float64)
    with pytest.raises(ExpertsOpError, match="sorted path"):
        fused_moe.expert_outputs(x, torch.zeros(4, 2, dtype=torch.int64),
                                 torch.zeros(2, 32, 16, dtype=torch.float64),
                                 torch.zeros(2, 16, 16, dtype=torch.float64))


def test_fused_kernels_refuse_cpu_tensors_outside_the_interpreter():
    """``supports`` says CUDA or Triton's interpreter: CPU tensors otherwise get the
    project's error, not Triton's ("0 active drivers")."""
    pytest.importorskip("triton")
    x, ids = torch.zeros(4, 16), torch.zeros(4, 2, dtype=torch.int64)
    w13, w2 = torch.zeros(2, 32, 16), torch.zeros(2, 16, 16)
    assert not fused_moe.supports(x, ids, w13, w2)
    with pytest.raises(ExpertsOpError, match="sorted path"):
        fused_moe.expert_outputs(x, ids, w13, w2)


@pytest.mark.parametrize("bad", ["hidden", "ids_1d", "ids_float", "rows"])
def test_fused_kernels_refuse_disagreeing_shapes(bad):
    """A public entry point: shapes that disagree raise instead of reading out of bounds."""
    x, ids = torch.zeros(4, 16), torch.zeros(4, 2, dtype=torch.int64)
    w13, w2 = torch.zeros(2, 32, 16), torch.zeros(2, 16, 16)
    if bad == "hidden":
        w13, w2 = torch.zeros(2, 32, 24), torch.zeros(2, 24, 16)
    elif bad == "ids_1d":
        ids = ids.view(-1)
    elif bad == "ids_float":
        ids = ids.float()
    else:
        ids = ids[:3]
    with pytest.raises(ExpertsOpError, match=r"expected x \[N, H\]"):
        fused_moe.expert_outputs(x, ids, w13, w2)


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["fused", "sorted"])
def test_gpu_ids_outside_the_local_experts_in_a_captured_graph(path, monkeypatch):
    """bf16 on the GPU, both CUDA paths of ``dbo.grouped_experts`` (the ``path`` option),
    captured in a CUDA graph and replayed: slots with ids outside ``[0, E_local)`` contribute
    nothing. Every buffer the kernels leave undefined is poisoned (in the graph too: the fills
    are captured), so a kernel reading one (an undefined sorted position: far out of bounds)
    fails here, and under ``compute-sanitizer``."""
    from test_experts import _case

    from dbo_compile.ops.experts import get_experts_backend

    empty = torch.empty

    def poisoned(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(float("nan") if t.dtype.is_floating_point else torch.iinfo(t.dtype).max)

    monkeypatch.setattr(torch, "empty", poisoned)
    torch.manual_seed(0)
    x, ids, w, w13, w2 = (t.cuda() for t in _case(n=64, h=128, inter=64, e=4, seed=11,
                                                  dtype=torch.bfloat16))
    bad = ids.clone()
    bad[5:10, 0] = 4
    bad[10:15, 1] = 2**20
    bad[15:20, 2] = -7
    bad[20, :] = 2**40
    local = torch.where((bad >= 0) & (bad < 4), bad, -1)
    want = experts.experts_loop(x.float(), local, w, w13.float(), w2.float())
    run = get_experts_backend(f"torch:path={path}").run
    assert experts._prefer_fused(x, bad, w, w13, w2, path) == (path == "fused")
    static = bad.clone()
    run(x, static, w, w13, w2)  # compiles the kernels outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = run(x, static, w, w13, w2)
    for ids_ in (bad, ids):  # new ids copied in, replayed
        static.copy_(ids_)
        graph.replay()
        torch.cuda.synchronize()
        ref = want if ids_ is bad else experts.experts_loop(x.float(), ids, w, w13.float(),
                                                            w2.float())
        assert torch.isfinite(y).all()
        err = float((y.float() - ref).abs().max() / ref.abs().max())
        assert err < 2e-2, (path, err)
