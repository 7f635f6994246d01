"""dbo_compile.viz: text lanes, Chrome trace, PNG, profile matching and the CLI (CPU, fast)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dbo_compile.schedule import COMM, COMPUTE, Schedule, Unit
from dbo_compile.viz import (VizInputError, load_schedule, load_trace, match_profile, range_name,
                             render_text, schedule_from_dict, to_chrome_trace)
from dbo_compile.viz.common import short_label
from dbo_compile.viz.text import layer_blocks


@pytest.fixture(scope="module")
def schedule() -> Schedule:
    from dbo_compile.viz.example import example_schedule

    return example_schedule(num_layers=2)


def _hand_schedule() -> Schedule:
    """A small hand-made schedule with a zero-length prologue and a comm NOT fully hidden."""
    def u(i, kind, ub, label, layer, s, e):
        return Unit(i, kind, kind, ub, label, layer, [f"n{i}"], e - s, s, e)
    units = [u(0, COMPUTE, None, "P", None, 0, 0), u(1, COMPUTE, 0, "A", 0, 0, 10),
             u(2, COMM, 0, "D", 0, 10, 30), u(3, COMPUTE, 1, "A", 0, 10, 20),
             u(4, COMM, 1, "D", 0, 30, 35), u(5, COMPUTE, 0, "MLP", 0, 30, 50),
             u(6, COMPUTE, 1, "MLP", 0, 50, 60)]
    deps = [(0, 1), (0, 3), (1, 2), (2, 5), (3, 4), (4, 6)]
    return Schedule(units, deps, [], [(1, 2), (2, 5), (3, 4), (4, 6)], 2, "list", "x",
                    predicted_step_us=60.0, serial_us=sum(x.cost_us for x in units))


# ------------------------------------------------------------------------------------------
# text
# ------------------------------------------------------------------------------------------

def _parse_blocks(text: str) -> dict[str, dict[str, list[str]]]:
    blocks: dict[str, dict[str, list[str]]] = {}
    cur = None
    for line in text.splitlines():
        m = re.match(r"^(Layer \d+|Layers \(none\))\s", line)
        if m:
            cur = blocks.setdefault(m.group(1), {})
        elif cur is not None and line.startswith(("Comp: ", "Comm: ")):
            toks = [t.strip("-· ") for t in line[6:].split("|")]
            cur[line[:4]] = [t for t in toks if t]
    return blocks


def _check_text(sched: Schedule, text: str) -> None:
    blocks = _parse_blocks(text)
    expect = layer_blocks(sched)
    assert sorted(blocks) == sorted(f"Layer {layer}" for layer, _ in expect)
    seen = []
    for layer, units in expect:
        for stream, lane in ((COMPUTE, "Comp"), (COMM, "Comm")):
            mine = [u for u in units if u.stream == stream]  # host order
            assert blocks[f"Layer {layer}"].get(lane, []) == [short_label(u) for u in mine]
            seen += [u.id for u in mine]
    assert sorted(seen) == list(range(len(sched.units)))  # every unit exactly once


def test_text_lanes_follow_schedule_order(schedule):
    text = render_text(schedule, width=100)
    _check_text(schedule, text)
    assert f"{len(schedule.units)} units" in text
    assert f"{len(schedule.event_edges)} event edges" in text
    assert f"predicted step {schedule.predicted_step_us:.1f} µs" in text
    assert "A = attention part" in text and "subscripts = ubatch" in text
    assert "MLP₀" in text and "D₁" in text
    assert text.count("overlap ") == len(layer_blocks(schedule))


def test_text_positions_are_proportional_and_show_overlap():
    sched = _hand_schedule()
    text = render_text(sched, width=80)
    _check_text(sched, text)
    comp = next(l for l in text.splitlines() if l.startswith("Comp:"))
    comm = next(l for l in text.splitlines() if l.startswith("Comm:"))
    # D₀ (10-30 µs) is in flight while A₁ runs (10-20): it starts under A₁'s left bar
    assert comm.index("|") == comp.rindex("|", 0, comp.index("A₁"))
    # D₀ ends after A₁ ends, MLP₀ starts where D₀ ends
    d0_end = comm.index("|", comm.index("D₀"))
    assert comp.index("|", comp.index("A₁")) < d0_end
    # D₀: 10 of 20 µs hidden (A₁ 10-20); D₁ 30-35 under MLP₀ -> 15 of 25 µs = 60 %
    assert "60.0%" in text and "15.0 of 25.0 µs comm hidden" in text


def _send_schedule() -> Schedule:
    """Sends (issues whose receive is a unit, their transfer in flight on the link): D₀'s
    transfer 11-31 µs under A₁ (10-20), D₁'s waits for the link: 31-36, under MLP₀."""
    def u(i, kind, ub, label, s, e, phase="issue", latency=0.0):
        return Unit(i, kind, kind, ub, label, 0, [f"n{i}"], e - s, s, e, phase=phase,
                    latency_us=latency)
    units = [u(0, COMPUTE, 0, "A", 0, 10), u(1, COMM, 0, "D", 10, 11, latency=20.0),
             u(2, COMPUTE, 1, "A", 10, 20), u(3, COMM, 1, "D", 20, 21, latency=5.0),
             u(4, COMM, 0, "D", 31, 32, "receive"), u(5, COMPUTE, 0, "MLP", 32, 52),
             u(6, COMM, 1, "D", 36, 37, "receive"), u(7, COMPUTE, 1, "MLP", 52, 62)]
    deps = [(0, 1), (2, 3), (1, 4), (4, 5), (3, 6), (6, 7)]
    return Schedule(units, deps, [], [(0, 1), (2, 3), (4, 5), (6, 7)], 2, "list", "x",
                    predicted_step_us=62.0, serial_us=89.0)


def test_the_link_lane_shows_the_sends_transfers_and_counts_them_as_comm(tmp_path):
    from dbo_compile.viz.common import predicted_overlap, transfers

    sched = _send_schedule()
    assert transfers(sched) == {1: (11.0, 31.0), 3: (31.0, 36.0)}
    # comm: the four comm units' 1 µs each + the transfers' 20 + 5; hidden: D₀ 1 (under
    # A₁), rD₁ 1 (under MLP₀), D₀'s transfer 9 (11-20), D₁'s 4 (32-36)
    assert predicted_overlap(sched).total() == (15.0, 29.0)
    text = render_text(sched, width=100)
    _check_text(sched, text)
    link = next(line for line in text.splitlines() if line.startswith("Link:"))
    assert [t.strip("-· ") for t in link[6:].split("|") if t.strip("-· ")] == ["D₀", "D₁"]
    assert "15.0 of 29.0 µs comm hidden" in text and "rD" in text
    trace = to_chrome_trace(sched)
    link_slices = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["tid"] == 3]
    assert [(e["ts"], e["dur"]) for e in link_slices] == [(11.0, 20.0), (31.0, 5.0)]
    assert "Link:" not in render_text(_hand_schedule())  # no sends: no link lane
    pytest.importorskip("matplotlib")
    from dbo_compile.viz import to_png

    assert to_png(sched, tmp_path / "s.png").stat().st_size > 0


def test_text_narrow_width_still_lists_every_unit(schedule):
    _check_text(schedule, render_text(schedule, width=30))


def test_text_order_check_can_fail(schedule):
    text = render_text(schedule)
    swapped = text.replace("A₀", "Q").replace("A₁", "A₀").replace("Q", "A₁")
    with pytest.raises(AssertionError):
        _check_text(schedule, swapped)


# ------------------------------------------------------------------------------------------
# chrome
# ------------------------------------------------------------------------------------------

def _check_chrome(trace: dict, sched: Schedule, pid: int = 0) -> None:
    trace = json.loads(json.dumps(trace))  # JSON-serialisable
    evs = trace["traceEvents"]
    meta = {(e["name"], e["pid"], e.get("tid")) for e in evs if e["ph"] == "M"}
    assert ("process_name", pid, 0) in meta
    for tid in {e["tid"] for e in evs if e["ph"] == "X" and e["pid"] == pid}:
        assert ("thread_name", pid, tid) in meta
    xs = [e for e in evs if e["ph"] == "X" and e["pid"] == pid]
    for e in xs:
        assert {"name", "cat", "ts", "dur", "pid", "tid", "args"} <= e.keys()
        assert e["dur"] >= 0
    assert sorted(e["args"]["unit_id"] for e in xs) == list(range(len(sched.units)))
    by_tid: dict[int, list] = {}
    for e in xs:
        by_tid.setdefault(e["tid"], []).append((round(e["ts"] * 1000), round((e["ts"] + e["dur"]) * 1000)))
    for ivs in by_tid.values():
        ivs.sort()
        for (s0, e0), (s1, _) in zip(ivs, ivs[1:]):
            assert s1 >= e0, "two slices overlap on one tid"
    slice_of = {e["args"]["unit_id"]: e for e in xs}
    flows: dict[int, dict[str, dict]] = {}
    for e in evs:
        if e["ph"] in ("s", "f") and e["pid"] == pid:
            flows.setdefault(e["id"], {})[e["ph"]] = e
    drawn = set()
    for fid, f in flows.items():
        assert set(f) == {"s", "f"} and f["f"].get("bp") == "e"
        src = next(x for x in xs if x["tid"] == f["s"]["tid"] and x["ts"] <= f["s"]["ts"] <= x["ts"] + x["dur"]
                   and x["args"]["unit_id"] in {a for a, _ in sched.event_edges})
        dst_cands = [x["args"]["unit_id"] for x in xs if x["tid"] == f["f"]["tid"]
                     and x["ts"] <= f["f"]["ts"] <= x["ts"] + x["dur"]]
        edge = sched.event_edges[fid]
        assert slice_of[edge[0]]["tid"] == f["s"]["tid"] and edge[1] in dst_cands
        assert slice_of[edge[0]]["ts"] <= f["s"]["ts"] <= slice_of[edge[0]]["ts"] + slice_of[edge[0]]["dur"]
        del src
        drawn.add(tuple(edge))
    assert drawn == {tuple(e) for e in sched.event_edges}


def test_chrome_trace(schedule):
    trace = to_chrome_trace(schedule, rank=3)
    _check_chrome(trace, schedule, pid=3)
    x = next(e for e in trace["traceEvents"] if e["ph"] == "X" and e["args"]["unit_id"] == 5)
    u = schedule.units[5]
    assert x["args"]["num_nodes"] == len(u.nodes) and x["args"]["layer"] == u.layer
    assert x["args"]["ubatch"] == u.ubatch and x["name"] == u.name


def test_chrome_check_can_fail(schedule):
    trace = to_chrome_trace(schedule)
    trace["traceEvents"] = [e for e in trace["traceEvents"] if not (e["ph"] in "sf" and e["id"] == 0)]
    with pytest.raises(AssertionError):
        _check_chrome(trace, schedule)
    trace = to_chrome_trace(schedule)
    x = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["tid"] == 1]
    x[2]["ts"] = x[1]["ts"]
    with pytest.raises(AssertionError):
        _check_chrome(trace, schedule)


# ------------------------------------------------------------------------------------------
# png
# ------------------------------------------------------------------------------------------

def test_png(schedule, tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib.image as mpimg

    from dbo_compile.viz import to_png

    path = to_png(schedule, tmp_path / "s.png")
    assert path.stat().st_size > 10_000
    img = mpimg.imread(path)
    assert img.shape[0] > 100 and img.shape[1] > 500
    assert img[..., :3].std() > 0.05  # not blank
    # ubatch colours are there (blue-ish and orange-ish pixels)
    rgb = img[..., :3]
    assert ((rgb[..., 2] > 0.6) & (rgb[..., 0] < 0.3)).sum() > 500
    assert ((rgb[..., 0] > 0.9) & (rgb[..., 2] < 0.2)).sum() > 500


# ------------------------------------------------------------------------------------------
# profile
# ------------------------------------------------------------------------------------------

def synthetic_trace(sched: Schedule, annotate: str | None, slow_comm_ids=(), scale=1.5) -> dict:
    """A torch.profiler-like trace (``annotate``: "device_ranges" = gpu_user_annotation,
    "host_ranges" = user_annotation + launch correlation, None = kernels only): per unit kernels on stream 7 (compute) / 20 (comm) at
    ``scale`` × the predicted times (+ a 1000 µs offset); comm units in ``slow_comm_ids`` are
    moved after the end of all compute (so they are measurably not overlapped)."""
    evs, corr = [], 0
    end_all = max(u.end_us for u in sched.units) * scale + 1000
    t_slow = end_all + 10
    for u in sched.units:
        s, e = u.start_us * scale + 1000, u.end_us * scale + 1000
        if u.id in slow_comm_ids:
            s, e = t_slow, t_slow + (e - s)
            t_slow = e
        sid = 20 if u.stream == COMM else 7
        n = 1 if u.stream == COMM else 3
        if e <= s:
            continue
        if annotate == "host_ranges":
            evs.append({"ph": "X", "cat": "user_annotation", "name": range_name(u), "pid": 1,
                        "tid": 1, "ts": 10 + u.id * 5, "dur": 4})
        for k in range(n):
            ks = s + (e - s) * k / n
            corr += 1
            name = "ncclDevKernel_SendRecv" if u.stream == COMM else f"gemm_{k}"
            evs.append({"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": sid,
                        "ts": ks, "dur": (e - s) / n * 0.95,
                        "args": {"stream": sid, "device": 0, "correlation": corr}})
            evs.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1,
                        "tid": 1, "ts": 10 + u.id * 5 + 1 + k * 0.1, "dur": 0.05,
                        "args": {"correlation": corr}})
        if annotate == "device_ranges":
            evs.append({"ph": "X", "cat": "gpu_user_annotation", "name": range_name(u),
                        "pid": 0, "tid": sid, "ts": s, "dur": e - s,
                        "args": {"stream": sid}})
    return {"traceEvents": evs, "schemaVersion": 1}


@pytest.mark.parametrize("annotate", ["device_ranges", "host_ranges"])
def test_profile_annotations(schedule, annotate, tmp_path):
    comm = [u for u in schedule.units if u.stream == COMM]
    slow = comm[-1]
    p = tmp_path / "trace.json"
    p.write_text(json.dumps(synthetic_trace(schedule, annotate, slow_comm_ids=[slow.id])))
    m = match_profile(schedule, load_trace(p))
    assert m.method == "annotations"
    timed = [u for u in schedule.units if u.end_us > u.start_us]
    assert set(m.units) == {u.id for u in timed}
    for u in timed:
        if u.id == slow.id:
            continue
        s, e = m.units[u.id]
        assert s == pytest.approx(u.start_us * 1.5, abs=1e-6)
        assert e - s == pytest.approx((u.end_us - u.start_us) * 1.5, rel=0.1)
    assert m.overlap.hidden_us[slow.id] == 0.0
    assert m.overlap.hidden_us[comm[0].id] > 0
    text = render_text(schedule, measured=m)
    row = next(l for l in text.splitlines() if re.match(rf"\s+{slow.id} {re.escape(slow.name)}\s", l))
    assert "NOT overlapped" in row
    trace = to_chrome_trace(schedule, measured=m)
    _check_chrome(trace, schedule, pid=0)
    mx = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] == 1000]
    assert {e["args"]["unit_id"] for e in mx} == set(m.units)


def test_profile_kernel_order(schedule):
    comm = [u for u in schedule.units if u.stream == COMM]
    # a stream runs in order: only the last comm can be late without reordering the stream
    m = match_profile(schedule, synthetic_trace(schedule, None, slow_comm_ids=[comm[-1].id]))
    assert m.method == "kernel-order"
    assert set(m.units) == {u.id for u in comm}
    for u in comm[:-1]:
        assert m.units[u.id][0] == pytest.approx(u.start_us * 1.5, abs=1e-6)
    assert m.overlap.hidden_us[comm[-1].id] == 0.0
    assert all(m.overlap.hidden_us[u.id] > 0 for u in comm[:-1])
    assert "kernel-order" in render_text(schedule, measured=m)


def test_profile_kernel_order_deals_emulated_comm_ops_at_their_first_kernel(schedule):
    """A CUDA-graph replay of the emulated backend: its dispatches launch 4 kernels, its
    combines 3, on whichever streams the graph runs its branches (here: two, alternating);
    each op runs from its first named kernel (route / flag) to its last."""
    comm = [u for u in schedule.units if u.stream == COMM]
    tr = synthetic_trace(schedule, None)
    evs = [e for e in tr["traceEvents"] if "nccl" not in e.get("name", "")]
    names = {"D": ["emulated_dispatch_route", "cumsum", "emulated_dispatch_pack",
                   "emulated_dispatch_unpack"],
             "C": ["emulated_combine_flag", "cumsum", "emulated_combine_sum"]}
    for u in comm:
        ks = names[u.label]
        s, e = u.start_us * 1.5 + 1000, u.end_us * 1.5 + 1000
        for i, name in enumerate(ks):
            sid = 20 + (u.id + i) % 2
            evs.append({"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": sid,
                        "ts": s + (e - s) * i / len(ks), "dur": (e - s) / len(ks) * 0.9,
                        "args": {"stream": sid}})
    m = match_profile(schedule, {"traceEvents": evs})
    assert m.method == "kernel-names" and set(m.units) == {u.id for u in comm}
    lo = min(u.start_us for u in schedule.units if u.end_us > u.start_us) * 1.5
    for u in comm:
        assert m.units[u.id][0] == pytest.approx(u.start_us * 1.5 - lo, abs=1e-6)
        assert m.units[u.id][1] - m.units[u.id][0] == pytest.approx(
            (u.end_us - u.start_us) * 1.5 * (1 - 0.1 / len(names[u.label])), rel=1e-6)
    assert m.overlap.hidden_us[comm[0].id] > 0
    swapped = [dict(e, name="emulated_combine_flag") if e.get("name") == "emulated_dispatch_route"
               else e for e in evs]
    with pytest.raises(VizInputError, match="not the schedule's"):
        match_profile(schedule, {"traceEvents": swapped})


def test_profile_errors(schedule):
    with pytest.raises(VizInputError, match="no GPU kernels"):
        match_profile(schedule, {"traceEvents": []})
    tr = synthetic_trace(schedule, None)
    tr["traceEvents"] = [e for e in tr["traceEvents"] if "nccl" not in e.get("name", "")][:-1] + \
        [e for e in tr["traceEvents"] if "nccl" in e.get("name", "")][:-1]
    with pytest.raises(VizInputError, match="evenly"):
        match_profile(schedule, tr)


# ------------------------------------------------------------------------------------------
# loading and CLI
# ------------------------------------------------------------------------------------------

def test_roundtrip_and_malformed(schedule, tmp_path):
    p = tmp_path / "s.json"
    p.write_text(schedule.to_json())
    assert load_schedule(p).to_dict() == schedule.to_dict()
    d = schedule.to_dict()
    d["event_edges"].append([0, 999])
    with pytest.raises(VizInputError, match="does not exist"):
        schedule_from_dict(d)
    with pytest.raises(VizInputError, match="not a dbo schedule"):
        schedule_from_dict([1, 2])


def _cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "dbo_compile.viz", *args], capture_output=True,
                          text=True, timeout=120, cwd=cwd)


def test_cli_example_text():
    r = _cli("--example")
    assert r.returncode == 0, r.stderr
    assert "Comp: |" in r.stdout and "Comm: " in r.stdout and "predicted step" in r.stdout


def test_cli_formats_and_profile(schedule, tmp_path):
    sp = tmp_path / "s.json"
    sp.write_text(schedule.to_json())
    tp = tmp_path / "trace.json"
    tp.write_text(json.dumps(synthetic_trace(schedule, "device_ranges")))
    out = tmp_path / "t.json"
    r = _cli(str(sp), "--format", "chrome", "-o", str(out), "--profile", str(tp))
    assert r.returncode == 0, r.stderr
    _check_chrome(json.loads(out.read_text()), schedule)
    r = _cli(str(sp), "--profile", str(tp))
    assert r.returncode == 0 and "Measured (annotations)" in r.stdout
    r = _cli(str(sp), "--format", "png", "-o", str(tmp_path / "s.png"))
    assert r.returncode == 0 and (tmp_path / "s.png").stat().st_size > 10_000


@pytest.mark.parametrize("content,msg", [
    (None, "cannot read schedule file"),
    ("{not json", "not valid JSON"),
    ('{"units": [{"id": 0}]}', "not a valid dbo schedule"),
    ("[]", "not a dbo schedule"),
])
def test_cli_bad_schedule_file(tmp_path, content, msg):
    p = tmp_path / "bad.json"
    if content is not None:
        p.write_text(content)
    r = _cli(str(p))
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and msg in lines[0]
    assert "Traceback" not in r.stderr


def test_cli_bad_profile(schedule, tmp_path):
    sp = tmp_path / "s.json"
    sp.write_text(schedule.to_json())
    bad = tmp_path / "p.json"
    bad.write_text('{"foo": 1}')
    r = _cli(str(sp), "--profile", str(bad))
    assert r.returncode == 2 and "traceEvents" in r.stderr and "Traceback" not in r.stderr


def test_cli_help():
    r = _cli("--help")
    assert r.returncode == 0
    for word in ("--example", "--format", "--profile", "perfetto", "dbo.u<ID>.<name>"):
        assert word.lower() in r.stdout.lower()


def test_dump_dir_writes_every_compiled_schedule(tmp_path):
    """``dump_dir``: the primary schedule and each candidate the runner may pick, as JSON the
    viz loads (same units as the program's schedule) and the wrapper each one runs."""
    import torch

    from conftest import last_artifact
    from moe_cases import MIXED_CUT, build, eager_and_compiled

    model, step = build(MIXED_CUT, layers=2)
    eager, out, _, _ = eager_and_compiled(model, step, {"split": "always",
                                                        "dump_dir": str(tmp_path)})
    torch.testing.assert_close(out, eager, rtol=0, atol=1e-5)
    art = last_artifact()
    programs = {id(p): (name, p) for name, p in art.candidates.items()}  # +smsN share a program
    assert len(programs) >= 3  # list, naive, joined at least
    files = sorted(p.name for p in tmp_path.glob("*.json"))
    assert len(files) == len(programs), files
    graph = re.match(r"schedule_rank0_(g\d+)_", files[0]).group(1)
    for name, prog in programs.values():
        stem = f"schedule_rank0_{graph}_{art.config.fingerprint()}"
        if prog is not art.split_program:
            stem += "_" + re.sub(r"[^A-Za-z0-9_.]", "-", name)
        loaded = load_schedule(tmp_path / f"{stem}.json")
        assert [u.nodes for u in loaded.units] == [u.nodes for u in prog.schedule.units]
        assert (tmp_path / f"{stem}.py").read_text() == prog.code
