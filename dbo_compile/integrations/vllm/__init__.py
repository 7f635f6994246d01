"""``backend="dbo"`` inside vLLM (vLLM 0.32): the backend entry, the plug-in, the MoE layer.

Turn it on (``VLLM_USE_AOT_COMPILE=0`` in the environment, see below)::

    llm = LLM(model=..., compilation_config={"mode": 2, "backend": "dbo"},
              additional_config={"dbo": {"decode_token_threshold": 32}})

- ``mode: 2`` (``DYNAMO_TRACE_ONCE``) hands the whole Dynamo graph to the backend;
  ``vllm/compilation/wrapper.py`` calls ``torch.compile`` itself, so our options come from
  ``additional_config["dbo"]`` (the keys of :class:`~dbo_compile.DboConfig`). The plug-in
  resolves the name ``"dbo"`` to :func:`vllm_backend` (vLLM would otherwise hand its graph to
  the plain Dynamo backend, without vLLM's step facts); the qualname
  ``"dbo_compile.integrations.vllm.vllm_backend"`` names it too. Other modes are refused.
- The plug-in (entry point ``vllm.general_plugins``: :func:`register`, loaded by vLLM in
  every process) records vLLM's ops in the op registry (:mod:`.ops`), installs
  :class:`~.moe.DboMoERunner` as vLLM's ``MoERunner`` (dispatch / experts / combine as our
  ops, when the backend is ours) and records how each step's attention metadata was built
  (:func:`.step.record_builds`).
- vLLM's AOT compile (``VLLM_USE_AOT_COMPILE``, on by default with torch >= 2.10) needs a
  backend whose result it can serialise (``SerializableCallable``); ours holds the generated
  programs, process groups and vLLM's forward-context hooks, which are not serialisable:
  :func:`vllm_backend` raises ``DboConfigError`` unless ``VLLM_USE_AOT_COMPILE=0``.

The package imports vLLM: only vLLM loads it (its plug-in entry point and the backend
qualname); ``import dbo_compile`` does not.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import torch.fx as fx
import vllm.envs as envs
from vllm.config import CompilationConfig, CompilationMode, get_current_vllm_config_or_none
from vllm.distributed import get_ep_group
from vllm.model_executor.custom_op import op_registry_oot
from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

from dbo_compile.backend import dbo_backend
from dbo_compile.config import DboConfig
from dbo_compile.errors import DboConfigError
from dbo_compile.integrations.vllm.moe import DboMoERunner, model_vllm_config
from dbo_compile.integrations.vllm.ops import register_vllm_ops
from dbo_compile.integrations.vllm.step import VllmStep, record_builds

log = logging.getLogger(__name__)

__all__ = ["register", "vllm_backend", "vllm_options"]

#: the key of vLLM's ``additional_config`` holding our options
CONFIG_KEY = "dbo"


def vllm_options(vllm_config: Any) -> dict[str, Any]:
    """Our options from vLLM's config: ``additional_config["dbo"]`` (a dict of
    :class:`~dbo_compile.DboConfig` fields), and ``dp_group_name`` defaulting to the CPU
    group of vLLM's EP group when EP spans several ranks (the DP vote must reach every rank
    of the comm ops' group).

    Raises:
        DboConfigError: ``additional_config["dbo"]`` is not a dict, or an option is unknown or
            invalid (named with the valid ones).
    """
    extra = getattr(vllm_config, "additional_config", None) or {}
    options = extra.get(CONFIG_KEY, {})
    if not isinstance(options, dict):
        raise DboConfigError(
            f"vLLM additional_config[{CONFIG_KEY!r}] must be a dict of DboConfig options, got "
            f"{type(options).__name__}")
    options = dict(options)
    DboConfig.from_options(options)  # unknown keys and bad values fail here, with their names
    pc = vllm_config.parallel_config
    if "dp_group_name" not in options and pc.enable_expert_parallel and \
            pc.data_parallel_size * pc.tensor_parallel_size > 1:
        options["dp_group_name"] = get_ep_group().cpu_group.group_name
    return options


def vllm_backend(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
    """The backend vLLM calls in compilation mode 2 (``compilation_config["backend"]`` =
    ``"dbo"``, or this qualname): :func:`~dbo_compile.backend.dbo_backend`
    with the options of :func:`vllm_options`, its artifact wrapped in
    :class:`~.step.VllmStep` (vLLM's step facts, vetoes and per-ubatch metadata).

    Raises:
        DboConfigError: vLLM's compilation mode is not 2, ``VLLM_USE_AOT_COMPILE`` is on, or
            an option is bad.
    """
    # vLLM compiles in the model's first forward, where no current config is set: the one the
    # model's MoE layers were built under
    vllm_config = get_current_vllm_config_or_none() or model_vllm_config()
    mode = getattr(getattr(vllm_config, "compilation_config", None), "mode", None)
    if mode is not None and mode != CompilationMode.DYNAMO_TRACE_ONCE:
        raise DboConfigError(
            f"the dbo backend inside vLLM runs in compilation mode 2 (DYNAMO_TRACE_ONCE: vLLM "
            f"hands it the whole graph), got mode {int(mode)} ({CompilationMode(mode).name}): "
            "pass compilation_config={'mode': 2, 'backend': 'dbo'}")
    if envs.VLLM_USE_AOT_COMPILE:
        raise DboConfigError(
            "vLLM's AOT compile (VLLM_USE_AOT_COMPILE=1, the default on torch >= 2.10) needs a "
            "serialisable backend; the dbo backend's programs are not: set "
            "VLLM_USE_AOT_COMPILE=0 in the environment of the vLLM processes")
    if vllm_config is None:
        raise DboConfigError(
            "dbo_compile.integrations.vllm.vllm_backend found no vLLM config: it is vLLM's "
            "compilation backend (compilation_config backend=...) and needs the dbo plug-in "
            "loaded (pip install dbo_compile in vLLM's environment; VLLM_PLUGINS must allow 'dbo')")
    register_vllm_ops()
    record_builds()
    artifact = dbo_backend(gm, example_inputs, options=vllm_options(vllm_config))
    return VllmStep(artifact, speculative=vllm_config.speculative_config is not None)


def _resolve_dbo_name() -> None:
    """``compilation_config["backend"] = "dbo"`` means :func:`vllm_backend` inside vLLM:
    ``CompilationConfig.init_backend`` (which would hand vLLM's graph to the plain Dynamo
    backend, without vLLM's step facts) returns it for that name. Idempotent."""
    original = CompilationConfig.init_backend
    if getattr(original, "_dbo_resolves", False):
        return

    def init_backend(self: Any, vllm_config: Any, prefix: str = "",
                     is_encoder: bool = False) -> Any:
        if self.backend == "dbo" and self.mode not in (None, CompilationMode.NONE):
            return vllm_backend
        return original(self, vllm_config, prefix, is_encoder)

    init_backend._dbo_resolves = True  # type: ignore[attr-defined]
    CompilationConfig.init_backend = init_backend


def register() -> None:
    """The vLLM plug-in (entry point ``vllm.general_plugins``; vLLM calls it in every
    process, possibly several times): vLLM's op records, :class:`~.moe.DboMoERunner` as the
    out-of-tree ``MoERunner`` (it runs vLLM's own path unless the backend is ours), the
    metadata-build records and the backend name ``"dbo"`` resolved to :func:`vllm_backend`.
    Idempotent."""
    register_vllm_ops()
    record_builds()
    _resolve_dbo_name()
    if op_registry_oot.get("MoERunner") is not DboMoERunner:
        if "MoERunner" in op_registry_oot:
            log.warning("dbo: another plug-in replaced vLLM's MoERunner (%s); the dbo MoE layer "
                        "is not installed", op_registry_oot["MoERunner"])
            return
        MoERunner.register_oot(DboMoERunner, name="MoERunner")
