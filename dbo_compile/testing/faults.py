"""Injected failures for tests and the soak: an op that raises where a test says, inside the
compiled program.

``dbo_test::fault(x, site)`` returns ``x`` (a copy) unless this process armed a failure for
``site`` (:func:`arm`): then its ``call``-th run in the process (counting from the arming)
raises ``InjectedFault``. It is declared row-local, so a graph using it still splits: each
ubatch runs its own copy, so ``call`` picks the ubatch (in the schedule's host order).

:class:`FaultyMoEModel` is the reference model with the op at three sites: after the embedding
(``"attention"``: the first stage of every ubatch, before any collective), on the received
rows before the routed experts (``"experts"``: between a dispatch and its combine) and before
the final norm (``"tail"``: after the last combine of the ubatch).

:func:`count_expert_load` gives a model (any :class:`~dbo_compile.models.deepseek.
DeepseekMoEModel`) an EPLB-style expert-load counter, a state buffer its steps update in
place; :func:`routing_margins` says which tokens a reference routed by a hair.
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F

from dbo_compile.models.deepseek import DeepseekMoEModel, MoE
from dbo_compile.ops.registry import register_row_local

__all__ = ["SITES", "FaultyMoEModel", "InjectedFault", "arm", "count_expert_load", "disarm",
           "fault", "routing_margins"]

#: the sites of :class:`FaultyMoEModel`, by the ``site`` argument of the op
SITES = ("attention", "experts", "tail")


class InjectedFault(RuntimeError):
    """The failure :func:`arm` asked for (not a ``DboError``: what a user's op would raise)."""


class _Armed(threading.local):
    site: int | None = None
    call: int = 0
    seen: int = 0


_ARMED = _Armed()


def arm(site: str, call: int = 0) -> None:
    """Make the ``call``-th run (0 = the next) of ``fault(x, site)`` in this process raise."""
    _ARMED.site, _ARMED.call, _ARMED.seen = SITES.index(site), call, 0


def disarm() -> bool:
    """Disarm; whether the armed failure was still pending (it never ran)."""
    pending = _ARMED.site is not None
    _ARMED.site = None
    return pending


@torch.library.custom_op("dbo_test::fault", mutates_args=())
def fault(x: torch.Tensor, site: int) -> torch.Tensor:
    """``x`` (a copy), or :class:`InjectedFault` where :func:`arm` said."""
    if _ARMED.site == site:
        if _ARMED.seen == _ARMED.call:
            _ARMED.site = None
            raise InjectedFault(f"injected failure at site {SITES[site]!r}")
        _ARMED.seen += 1
    return x.clone()


@fault.register_fake
def _fault_fake(x: torch.Tensor, site: int) -> torch.Tensor:
    return torch.empty_like(x)


register_row_local(torch.ops.dbo_test.fault.default)


class _LoadCountingMoE(MoE):
    """:class:`~dbo_compile.models.deepseek.MoE` adding its routing into ``expert_load``
    (when not ``None``), as an EPLB balancer records load."""

    #: keep each call's routing margin in ``last_margin`` (eager reference models only)
    record_margins = False

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        topk_w, topk_ids = super().route(x)
        if self.expert_load is not None:  # EPLB-style: every layer counts into one buffer
            flat = topk_ids.flatten()
            self.expert_load.index_add_(0, flat, torch.ones_like(flat, dtype=torch.float32))
        if self.record_margins:
            logits = F.linear(x, self.gate).to(torch.float32)
            if self.top_k < self.num_experts:
                top = logits.topk(self.top_k + 1, dim=-1).values
                self.last_margin = top[:, -2] - top[:, -1]
            else:
                self.last_margin = torch.full_like(logits[:, 0], float("inf"))
        return topk_w, topk_ids


class _FaultyMoE(_LoadCountingMoE):
    def experts(self, recv_x: torch.Tensor, recv_ids: torch.Tensor,
                recv_w: torch.Tensor) -> torch.Tensor:
        recv_x = torch.ops.dbo_test.fault(recv_x, SITES.index("experts"))
        return super().experts(recv_x, recv_ids, recv_w)


def count_expert_load(model: DeepseekMoEModel, record_margins: bool = False) -> torch.Tensor:
    """Give ``model`` an EPLB-style expert-load counter: every MoE layer adds its routing (one
    per token and top-k slot, global expert ids) into one shared buffer, in place, inside
    the model's forward (a state buffer a compiled and captured step must update exactly as
    eager does, padding rows excluded).

    ``record_margins`` (for an eager reference model): each MoE layer also keeps, per token,
    its routing margin (:func:`routing_margins`).

    Returns:
        The counter ``[num_experts]`` float32 on the model's device, zeros (also
        ``model.expert_load`` and each MoE layer's non-persistent buffer ``expert_load``).
    """
    load = torch.zeros(model.config.num_experts, device=model.embed_tokens.device)
    model.expert_load = load
    for layer in model.layers:
        if isinstance(layer.mlp, MoE):
            if not isinstance(layer.mlp, _LoadCountingMoE):
                layer.mlp.__class__ = _LoadCountingMoE
            layer.mlp.register_buffer("expert_load", load, persistent=False)
            layer.mlp.record_margins = record_margins
    return load


def routing_margins(model: DeepseekMoEModel) -> torch.Tensor:
    """Per token of the model's last call, the smallest routing margin over its MoE layers:
    the gate logit of the ``top_k``-th expert less the next one's (``[T]`` float32, >= 0;
    ``inf`` where every expert is chosen). A margin at the numerical noise of another
    computation of the same step (other row counts, other kernels) is where that computation
    may route the token to another expert. Needs :func:`count_expert_load` with
    ``record_margins``."""
    margins = [layer.mlp.last_margin for layer in model.layers
               if isinstance(layer.mlp, _LoadCountingMoE)]
    return torch.stack(margins).amin(dim=0)


class FaultyMoEModel(DeepseekMoEModel):
    """:class:`~dbo_compile.models.deepseek.DeepseekMoEModel` with ``fault`` at the three
    :data:`SITES` (the same function when nothing is armed).

    Args:
        count_load: every MoE layer adds its routing (one per token and top-k slot) into one
            shared buffer ``expert_load`` ``[num_experts]`` float32, in place, as an EPLB
            balancer records load (:func:`count_expert_load`).
        (the rest as :class:`~dbo_compile.models.deepseek.DeepseekMoEModel`)
    """

    def __init__(self, *args, count_load: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.expert_load = None
        for layer in self.layers:
            if isinstance(layer.mlp, MoE):
                layer.mlp.__class__ = _FaultyMoE
                layer.mlp.register_buffer("expert_load", None, persistent=False)
        if count_load:
            count_expert_load(self)

    def forward(self, input_ids, positions, attn_metadata):
        x = F.embedding(input_ids, self.embed_tokens)
        x = torch.ops.dbo_test.fault(x, SITES.index("attention"))
        for layer in self.layers:
            x = layer(x, positions, attn_metadata)
        x = torch.ops.dbo_test.fault(x, SITES.index("tail"))
        x = self.norm(x)
        return F.linear(x, self.lm_head).to(torch.float32)
