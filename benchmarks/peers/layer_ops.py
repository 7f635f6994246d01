"""What both peers run: the example model's own ops, cut into the steps a schedule orders.

The peers (:mod:`vllm_dbo`, :mod:`sglang_tbo`) differ from our compiled program only in the
schedule and the host work: they call the same modules and custom ops the compiled program
was traced from (``dbo_compile/models/deepseek.py``): the attention block (RMSNorm, q/k/v,
RoPE, ``dbo.attention`` over the paged KV cache, o_proj), the router (``MoE.route``), the
dispatch and combine (``dbo.moe_dispatch`` / ``dbo.moe_combine`` of the emulated EP-W
backend the compiled program is bound to, issued with ``defer_receive`` and received with
``comm_receive``, as the split program does), the routed experts (``MoE.experts``:
``dbo.grouped_experts``) and the shared experts. Per ubatch ``u`` of a MoE layer (the op
names the peers place their yields and stage points between)::

    attn      x -> h = x + attn(norm(x)), hn = post_norm(h), route(hn)      compute
    dispatch  dbo.moe_dispatch(hn, ids, w, defer_receive=True)            comm (send)
    d_recv    comm_receive(dispatch)                                      comm (receive)
    experts   grouped_experts(recv rows)                                  compute
    combine   dbo.moe_combine(y, ..., defer_receive=True)                 comm (send)
    shared    shared_experts(hn)                                          compute
    c_recv    comm_receive(combine)                                       comm (receive)
    post      x = h + (combine * scale + shared)                          compute

(the sums in the model's order, so each ubatch's rows equal the unsplit model's up to the
GEMMs' row count). An op waits for the other stream only where it reads what that stream made
(:attr:`Op.waits`: the sends wait for compute, ``experts`` and ``post`` for comm; the receives
and the shared experts wait for nothing), so no false edge holds a stream back. A dense layer
is one compute op. Every tensor a step makes is held by its :class:`UBatch` until the step's
end (:meth:`Streams.join`), so that nothing made on one stream and read on the other is freed
early (the allocator's cross-stream rule, DESIGN.md invariant 4), in eager runs and in a CUDA
graph's private pool alike.

The check every peer's output passes (:func:`check_numerics`) and the fault the smoke run
can plant in a schedule (:data:`FAULTS`) live here too.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable

import torch
import torch.nn.functional as F

from dbo_compile.metadata import AttentionMetadata
from dbo_compile.models.deepseek import MoE
from dbo_compile.ops.comm import comm_receive
from dbo_compile.runtime.ubatch import make_ubatch_slices_at, split_attn_metadata

__all__ = ["COMM_OPS", "FAULTS", "REL_TOL", "Op", "Streams", "UBatch", "check_numerics",
           "layer_ops", "split_step"]

#: the ops of a MoE layer that run on the comm stream (the rest run on the compute stream)
COMM_OPS = frozenset({"dispatch", "d_recv", "combine", "c_recv"})

#: schedule faults a smoke run may plant (``--fault``), each one the numerics must catch:
#: ``skip-combine``: ubatch 1 of the first MoE layer never issues its combine (its routed
#: experts' output is lost; its shared experts' stays)
FAULTS = ("skip-combine",)

#: numerics tolerance: max |peer - reference| over max |reference| (the logits), per dtype
#: of the model; bf16 / fp16: 5 % (the bound of the emulated benchmark's smoke test; the
#: split program's own error against the one-device reference is 1.6-3.4 % on one H200,
#: benchmarks/results/emulated_v2lite_w8_h200_2026-12-01.json)
REL_TOL = {torch.bfloat16: 0.05, torch.float16: 0.05, torch.float32: 1e-4}


@dataclasses.dataclass
class UBatch:
    """One ubatch's inputs and its state through the layers.

    Attributes:
        index: the ubatch id (0 first).
        input_ids: ``[T_u]`` int64 (``T_u`` = the ubatch's token rows).
        positions: ``[T_u]`` int64.
        md: its attention metadata (:func:`split_step`).
        x: ``[T_u, H]`` hidden state between layers (model dtype).
        state: the current layer's intermediate values by name (``h``, ``hn``, ``topk``,
            ``dispatch``, ``y``, ``combine``, ``shared``).
        keep: every tensor of the step, held until it ends.
        out: ``[T_u, vocab]`` fp32 logits once the head ran.
    """

    index: int
    input_ids: torch.Tensor
    positions: torch.Tensor
    md: AttentionMetadata
    x: torch.Tensor | None = None
    state: dict = dataclasses.field(default_factory=dict)
    keep: list = dataclasses.field(default_factory=list)
    out: torch.Tensor | None = None

    def put(self, **values: Any) -> None:
        self.state.update(values)
        self.keep.extend(values.values())

    def release(self) -> None:
        self.state.clear()
        self.keep.clear()


def split_step(input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata,
               num_scheduled_tokens: list[int], split_token: int) -> list[UBatch]:
    """The step cut at token ``split_token`` into two ubatches (the package's slicing rules,
    docs/references.md §Slicing: a request cut in two is in both, its metadata trimmed):
    ``input_ids`` / ``positions`` ``[T]`` int64, ``md`` the step's metadata,
    ``num_scheduled_tokens`` the tokens of each request (sum ``T``).

    Raises:
        MetadataError: the metadata does not match the counts, or the split point is outside
            ``[0, T]``.
    """
    t = int(input_ids.shape[0])
    slices, _ = make_ubatch_slices_at(num_scheduled_tokens, [split_token], t)
    mds = split_attn_metadata(slices, md)
    return [UBatch(i, input_ids[s.token_slice], positions[s.token_slice], m)
            for i, (s, m) in enumerate(zip(slices, mds))]


class Streams:
    """The peers' two CUDA streams: compute (the caller's current stream at :meth:`begin`,
    so that CUDA-event timing and graph capture see the whole step) and comm (one stream of
    its own, made once). On CPU both are ``None`` and every method does nothing."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device
        self.comm = torch.cuda.Stream(device) if self.cuda else None
        self.compute = None
        #: per ubatch: "compute done" and "comm done" events (reused every layer: each is
        #: waited on before its next record, by the schedules' construction)
        self.events = ([[torch.cuda.Event(), torch.cuda.Event()] for _ in range(2)]
                       if self.cuda else None)

    def begin(self) -> None:
        """The step starts: compute = the current stream; comm waits for it."""
        if self.cuda:
            self.compute = torch.cuda.current_stream(self.device)
            self.comm.wait_stream(self.compute)

    def use(self, which: str):
        """A context that makes ``which`` (``"compute"`` / ``"comm"``) the current stream
        of the calling thread."""
        if not self.cuda:
            return contextlib.nullcontext()
        return torch.cuda.stream(self._stream(which))

    def set_current(self, which: str) -> None:
        """Make ``which`` the calling thread's current stream (a thread's own setting)."""
        if self.cuda:
            torch.cuda.set_stream(self._stream(which))

    def _stream(self, which: str):
        return self.comm if which == "comm" else self.compute

    def record(self, ubatch: int, src: str) -> None:
        """Record ubatch ``ubatch``'s "``src`` done" event on stream ``src``."""
        if self.cuda:
            self.events[ubatch][0 if src == "compute" else 1].record(self._stream(src))

    def wait(self, ubatch: int, src: str, dst: str) -> None:
        """Stream ``dst`` waits for ubatch ``ubatch``'s last "``src`` done" event (an event
        edge; :meth:`record` first)."""
        if self.cuda and src != dst:
            self._stream(dst).wait_event(self.events[ubatch][0 if src == "compute" else 1])

    def join(self) -> None:
        """The step ends: compute waits for everything queued on comm."""
        if self.cuda:
            self.compute.wait_stream(self.comm)


@dataclasses.dataclass(frozen=True)
class Op:
    """One step of a ubatch's schedule: ``fn(ubatch)`` on ``stream`` (``"compute"`` /
    ``"comm"``), after the ubatch's work queued so far on ``waits`` (the other stream, whose
    results it reads: an event edge), ``None``: it reads only what its own stream made."""

    name: str
    layer: int | None
    stream: str
    fn: Callable[[UBatch], None]
    waits: str | None = None


def layer_ops(model, spec: str, fault: str | None = None,
              trace: list[str] | None = None) -> list[Op]:
    """The whole forward of one ubatch as a list of :class:`Op` (the module docstring's
    ops per MoE layer, an ``embed`` op first and a ``head`` op last), calling ``model``'s
    modules and the comm backend instance ``spec`` (the emulated world the compiled program
    is bound to). ``fault``: one of :data:`FAULTS`, planted in ubatch 1. ``trace``: each op
    appends ``"UBATCH:NAME:LAYER"`` to it when the host issues it (a separate op list: the
    timed ones carry no wrapper)."""
    ops = _ops(model, spec, fault)
    if trace is None:
        return ops
    return [dataclasses.replace(op, fn=_traced(op, trace)) for op in ops]


def _traced(op: Op, trace: list[str]) -> Callable[[UBatch], None]:
    def fn(u: UBatch) -> None:
        trace.append(f"{u.index}:{op.name}:{'' if op.layer is None else op.layer}")
        op.fn(u)
    return fn


def _ops(model, spec: str, fault: str | None) -> list[Op]:
    moe_seen = 0
    ops = [Op("embed", None, "compute", lambda u: _embed(model, u))]
    for i, layer in enumerate(model.layers):
        if not isinstance(layer.mlp, MoE):
            ops.append(Op("dense", i, "compute", lambda u, layer=layer: _dense(layer, u)))
            continue
        skip = fault == "skip-combine" and moe_seen == 0
        moe_seen += 1
        m = layer.mlp
        ops += [
            Op("attn", i, "compute", lambda u, layer=layer: _attn(layer, u)),
            Op("dispatch", i, "comm", lambda u, m=m: _dispatch(m, spec, u), "compute"),
            Op("d_recv", i, "comm", lambda u: comm_receive(u.state["dispatch"], spec)),
            Op("experts", i, "compute", lambda u, m=m: _experts(m, u), "comm"),
            Op("combine", i, "comm", lambda u, m=m, skip=skip: _combine(m, spec, u, skip),
               "compute"),
            Op("shared", i, "compute", lambda u, m=m: _shared(m, u)),
            Op("c_recv", i, "comm", lambda u, skip=skip: _combine_recv(spec, u, skip)),
            Op("post", i, "compute", lambda u, m=m: _post(m, u), "comm"),
        ]
    ops.append(Op("head", None, "compute", lambda u: _head(model, u)))
    return ops


def _embed(model, u: UBatch) -> None:
    u.x = F.embedding(u.input_ids, model.embed_tokens)
    u.keep.append(u.x)


def _attn(layer, u: UBatch) -> None:
    h = u.x + layer.self_attn(layer.input_layernorm(u.x), u.positions, u.md)
    hn = layer.post_attention_layernorm(h)
    topk_w, topk_ids = layer.mlp.route(hn)
    u.put(h=h, hn=hn, topk_w=topk_w, topk_ids=topk_ids)


def _dense(layer, u: UBatch) -> None:
    h = u.x + layer.self_attn(layer.input_layernorm(u.x), u.positions, u.md)
    u.x = h + layer.mlp(layer.post_attention_layernorm(h))
    u.keep += [h, u.x]


def _backend(spec: str) -> dict:
    return {"backend": spec} if spec else {}


def _dispatch(m: MoE, spec: str, u: UBatch) -> None:
    s = u.state
    u.put(dispatch=torch.ops.dbo.moe_dispatch(s["hn"], s["topk_ids"], s["topk_w"],
                                               m.num_experts, m.group_name, **_backend(spec),
                                               defer_receive=True))


def _experts(m: MoE, u: UBatch) -> None:
    u.put(y=m.experts(*u.state["dispatch"][:3]))


def _combine(m: MoE, spec: str, u: UBatch, skip: bool) -> None:
    s = u.state
    if skip and u.index == 1:  # the planted fault: no combine, its output lost
        u.put(combine=torch.zeros_like(s["hn"]))
        return
    _, recv_ids, recv_w, handle = s["dispatch"]
    u.put(combine=torch.ops.dbo.moe_combine(s["y"], s["topk_ids"], s["topk_w"], recv_ids,
                                             recv_w, handle, m.group_name, **_backend(spec),
                                             defer_receive=True))


def _combine_recv(spec: str, u: UBatch, skip: bool) -> None:
    if not (skip and u.index == 1):
        comm_receive(u.state["combine"], spec)


def _shared(m: MoE, u: UBatch) -> None:
    if m.shared_experts is not None:
        u.put(shared=m.shared_experts(u.state["hn"]))


def _post(m: MoE, u: UBatch) -> None:
    s = u.state
    out = s["combine"]
    if m.routed_scaling_factor != 1.0:
        out = out * m.routed_scaling_factor
    if m.shared_experts is not None:
        out = out + s["shared"]
    u.x = s["h"] + out
    u.keep += [out, u.x]
    u.state = {}  # the layer's values stay alive in keep until the step ends


def _head(model, u: UBatch) -> None:
    u.out = F.linear(model.norm(u.x), model.lm_head).to(torch.float32)


#: the check's slack over the noise floor (:func:`check_numerics`): an error up to this many
#: times the floor's max_rel, and rows off up to this many times its share, is a rounding
FLOOR_SLACK = 1.5


def check_numerics(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype,
                   floor: dict | None = None) -> dict:
    """A peer's logits ``out [T, vocab]`` against the unsplit reference ``ref`` (fp32):
    ``max_abs``, ``max_rel`` (max_abs / max |ref|), ``rows_off`` (the share of the rows off by
    more than 5 % of their own max |ref|), the tolerance ``rel_tol`` of the model's ``dtype``
    (:data:`REL_TOL`) and ``ok`` (finite, same shape, and max_rel within the tolerance, or,
    given ``floor`` (:func:`dbo_compile.testing.moe.noise_floor`: the unsplit model's own
    move under a one-ulp change of rounding), max_rel and rows_off within :data:`FLOOR_SLACK`
    times the floor's: ``within_noise_floor`` says the row passed that way). Fine-grained
    routing (DeepSeek-V3) makes a ubatch's different GEMM rounding a different expert for
    tokens on a near tie, so its answer can differ by more than the tolerance and still be
    right: the floor says how much (docs/emulated.md, "Numerics at V3 routing")."""
    out, ref = out.float(), ref.float()
    tol = REL_TOL.get(dtype, 0.05)
    if out.shape != ref.shape:
        return {"ok": False, "why": f"shape {tuple(out.shape)} != {tuple(ref.shape)}",
                "rel_tol": tol}
    finite = bool(torch.isfinite(out).all())
    d = (out - ref).abs()
    diff = float(d.max()) if out.numel() else 0.0
    rel = diff / max(float(ref.abs().max()) if ref.numel() else 0.0, 1e-6)
    rows_off = (float((d.amax(-1) > 0.05 * ref.abs().amax(-1).clamp(min=1e-6)).float().mean())
                if out.numel() else 0.0)
    r = {"ok": finite and rel <= tol, "max_abs": diff, "max_rel": rel, "rows_off": rows_off,
         "rel_tol": tol, "finite": finite}
    if floor is not None and finite and rel > tol:
        within = (rel <= FLOOR_SLACK * floor["max_rel"]
                  and rows_off <= FLOOR_SLACK * floor["rows_off_5pct"])
        r.update(ok=within, within_noise_floor=within)
    return r
