"""Custom ops of dbo_compile (namespace ``dbo``); importing this package registers them all,
with their records in :mod:`dbo_compile.ops.registry` (every fact the compiler knows of an op).

- ``torch.ops.dbo.moe_dispatch`` / ``torch.ops.dbo.moe_combine``: MoE EP all-to-all in each
  comm backend's own receive layout (torch, local, DeepEP: :mod:`.comm`, :mod:`.deep_ep`);
  ``torch.ops.dbo.dispatch`` / ``torch.ops.dbo.combine``: the rank-major contract.
- ``torch.ops.dbo.grouped_experts``: an EP rank's local routed experts on either layout,
  grouped GEMM on CUDA (:mod:`.experts`; DeepGEMM: :mod:`.deep_gemm`).
- the ``emulated`` comm backend: this device as rank 0 of an EP-W world (:mod:`.emulated`).
- ``torch.ops.dbo.attention``: paged causal attention + KV-cache write (:mod:`.attention`;
  the op is not re-exported here so that ``dbo_compile.ops.attention`` stays the module).
"""

from dbo_compile.errors import AttentionOpError, CommBackendError, CommOpError, ExpertsOpError
from dbo_compile.ops import attention as _attention  # noqa: F401  (registers dbo.attention)
from dbo_compile.ops import emulated as _emulated  # noqa: F401  (registers comm backend "emulated")
from dbo_compile.ops import experts as _experts  # noqa: F401  (registers dbo.grouped_experts)
from dbo_compile.ops.comm import (
    EXPERT_MAJOR,
    RANK_MAJOR,
    CommBackend,
    ResultPool,
    available_comm_backends,
    backend_for_group,
    combine,
    dispatch,
    moe_combine,
    moe_dispatch,
    ep_group_name,
    ep_world_size,
    get_comm_backend,
    register_comm_backend,
    register_lazy_comm_backend,
)
from dbo_compile.ops.registry import (
    OpInfo,
    op_info,
    register_paged_kv_op,
    register_row_local,
    registered_ops,
)

#: our comm ops and their kind (a view of the registry)
COMM_KIND = {i.op: i.comm for i in registered_ops()
             if i.comm is not None and getattr(i.op, "namespace", None) == "dbo"}
COMM_OPS = frozenset(COMM_KIND)

__all__ = [
    "EXPERT_MAJOR",
    "RANK_MAJOR",
    "COMM_KIND",
    "COMM_OPS",
    "AttentionOpError",
    "CommBackend",
    "CommBackendError",
    "CommOpError",
    "ExpertsOpError",
    "OpInfo",
    "ResultPool",
    "available_comm_backends",
    "backend_for_group",
    "combine",
    "dispatch",
    "ep_group_name",
    "ep_world_size",
    "get_comm_backend",
    "moe_combine",
    "moe_dispatch",
    "op_info",
    "register_comm_backend",
    "register_lazy_comm_backend",
    "register_paged_kv_op",
    "register_row_local",
]
