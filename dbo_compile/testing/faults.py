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
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F

from dbo_compile.models.deepseek import DeepseekMoEModel, MoE
from dbo_compile.ops.registry import register_row_local

__all__ = ["SITES", "FaultyMoEModel", "InjectedFault", "arm", "disarm", "fault"]

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


class _FaultyMoE(MoE):
    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        topk_w, topk_ids = super().route(x)
        if self.expert_load is not None:  # EPLB-style: every layer counts into one buffer
            flat = topk_ids.flatten()
            self.expert_load.index_add_(0, flat, torch.ones_like(flat, dtype=torch.float32))
        return topk_w, topk_ids

    def experts(self, recv_x: torch.Tensor, recv_ids: torch.Tensor,
                recv_w: torch.Tensor) -> torch.Tensor:
        recv_x = torch.ops.dbo_test.fault(recv_x, SITES.index("experts"))
        return super().experts(recv_x, recv_ids, recv_w)


class FaultyMoEModel(DeepseekMoEModel):
    """:class:`~dbo_compile.models.deepseek.DeepseekMoEModel` with ``fault`` at the three
    :data:`SITES` (the same function when nothing is armed).

    Args:
        count_load: every MoE layer adds its routing (one per token and top-k slot) into one
            shared buffer ``expert_load`` ``[num_experts]`` float32, in place, as an EPLB
            balancer records load.
        (the rest as :class:`~dbo_compile.models.deepseek.DeepseekMoEModel`)
    """

    def __init__(self, *args, count_load: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        load = torch.zeros(self.config.num_experts, device=self.embed_tokens.device) \
            if count_load else None
        self.expert_load = load
        for layer in self.layers:
            if isinstance(layer.mlp, MoE):
                layer.mlp.__class__ = _FaultyMoE
                layer.mlp.register_buffer("expert_load", load, persistent=False)

    def forward(self, input_ids, positions, attn_metadata):
        x = F.embedding(input_ids, self.embed_tokens)
        x = torch.ops.dbo_test.fault(x, SITES.index("attention"))
        for layer in self.layers:
            x = layer(x, positions, attn_metadata)
        x = torch.ops.dbo_test.fault(x, SITES.index("tail"))
        x = self.norm(x)
        return F.linear(x, self.lm_head).to(torch.float32)
