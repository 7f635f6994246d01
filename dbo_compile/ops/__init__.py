"""Custom ops of dbo_compile (namespace ``dbo``); importing this package registers them all.

- ``torch.ops.dbo.dispatch`` / ``torch.ops.dbo.combine``: MoE EP all-to-all (:mod:`.comm`).
- ``torch.ops.dbo.grouped_experts``: an EP rank's local routed experts, row-local, grouped GEMM
  on CUDA (:mod:`.experts`).
- ``torch.ops.dbo.attention``: paged causal attention + KV-cache write (:mod:`.attention`;
  the op is not re-exported here so that ``dbo_compile.ops.attention`` stays the module).
"""

from dbo_compile.ops.attention import AttentionOpError
from dbo_compile.ops.experts import ExpertsOpError
from dbo_compile.ops.comm import (
    COMM_KIND,
    COMM_OPS,
    CommBackend,
    CommBackendError,
    CommOpError,
    available_comm_backends,
    backend_for_group,
    combine,
    dispatch,
    ep_group_name,
    ep_world_size,
    get_comm_backend,
    register_comm_backend,
    register_lazy_comm_backend,
)

__all__ = [
    "COMM_KIND",
    "COMM_OPS",
    "AttentionOpError",
    "CommBackend",
    "CommBackendError",
    "CommOpError",
    "ExpertsOpError",
    "available_comm_backends",
    "backend_for_group",
    "combine",
    "dispatch",
    "ep_group_name",
    "ep_world_size",
    "get_comm_backend",
    "register_comm_backend",
    "register_lazy_comm_backend",
]
