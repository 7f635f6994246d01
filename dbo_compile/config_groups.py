"""The option groups of :class:`~dbo_compile.config.DboConfig` that need nothing of the
schedule candidates (:class:`SplitPolicy`, :class:`CostFigures`, :class:`BackendsConfig`,
:class:`DebugConfig`), what every group shares (:class:`OptionGroup`: errors, ``replace``,
fingerprint), and the calibration file's loader. ``ScheduleConfig``, which checks names
against the candidate table (:mod:`dbo_compile.candidates`), lives in :mod:`dbo_compile.config`.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import hashlib
import json
import math
import os
import sys
import warnings
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping

from dbo_compile.errors import DboConfigError, UnknownOptionError

_SPLIT_MODES = ("auto", "always", "never")
_COMPUTE_BACKENDS = ("auto", "aten", "inductor")
_ON_UNSPLITTABLE = ("fallback", "raise")
#: the token thresholds' defaults (vLLM's); ``None`` in a field resolves to
#: ``max(default, num_ubatches)``
_THRESHOLD_DEFAULTS = {"decode_token_threshold": 32, "prefill_token_threshold": 512}
#: the deprecated fields of the emulated backend's options (``comm_backend_options`` without
#: the prefix)
_EMULATE_FIELDS = ("emulate_world_size", "emulate_link_gbps", "emulate_latency_us",
                  "emulate_copy_gbps", "emulate_capacity_factor", "emulate_comm_sms")


#: where a warning of this package is not blamed: its own modules, the dataclass machinery
#: (``dataclasses.py`` and the ``__init__`` it generates, ``<string>``) and torch (whose
#: ``torch.compile(options=...)`` path builds the config)
_LIBRARY_FILES = (os.path.dirname(os.path.abspath(__file__)) + os.sep,
                  os.path.abspath(dataclasses.__file__), "<string>")


def caller_stacklevel() -> int:
    """``warnings.warn``'s ``stacklevel`` that blames the first frame outside this package,
    torch and the dataclass machinery (the user's ``DboConfig(...)``, ``from_options`` or
    ``torch.compile`` call), however many of our frames lie between."""
    torch = sys.modules.get("torch")
    skip = _LIBRARY_FILES + ((os.path.dirname(os.path.abspath(torch.__file__)) + os.sep,)
                             if torch is not None else ())
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(skip):
        frame, level = frame.f_back, level + 1
    return level


def canonical_options(value: Any, bad: Any) -> tuple[tuple[str, Any], ...]:
    """A backend's options as sorted ``(key, value)`` pairs (hashable, and the same on every
    rank however the dict was built: they enter the fingerprint)."""
    if value is None:
        return ()
    items = value.items() if isinstance(value, Mapping) else value
    try:
        pairs = [(k, v) for k, v in items]
    except (TypeError, ValueError):
        raise bad("must be a dict of option name -> value") from None
    for k, v in pairs:
        if not isinstance(k, str) or not k or any(c in k for c in ":,="):
            raise bad(f"option name {k!r} must be a non-empty str without ':', ',' or '='")
        if not isinstance(v, (bool, int, float, str)) or (isinstance(v, str) and
                                                          any(c in v for c in ":,=")):
            raise bad(f"option {k}={v!r} must be a bool, int, float or str (without ':', ',', "
                      "'=')")
    if len({k for k, _ in pairs}) != len(pairs):
        raise bad("an option is given twice")
    return tuple(sorted(pairs))


def digest(data: Mapping[str, Any]) -> str:
    """16 hex digits of the SHA-256 of ``data`` as sorted-key JSON (tuples as lists)."""
    return hashlib.sha256(json.dumps(dict(data), sort_keys=True).encode()).hexdigest()[:16]


def load_calibration(path: str) -> dict[str, Any]:
    """Read a calibration file (``benchmarks/calibrate.py`` writes one, with the machine it
    was measured on): a JSON object whose ``figures`` object holds the cost model's figures
    per op class (:mod:`dbo_compile.passes.cost_model`).

    Raises:
        DboConfigError: the file cannot be read as JSON, or has no ``figures`` object.
    """
    try:
        with open(path) as f:
            cal = json.load(f)
    except (OSError, ValueError) as e:
        raise DboConfigError(f"DboConfig.calibration={path!r}: cannot be read as JSON ({e}); "
                             "write one with benchmarks/calibrate.py") from None
    if not isinstance(cal, dict) or not isinstance(cal.get("figures"), dict):
        raise DboConfigError(f"DboConfig.calibration={path!r}: has no 'figures' object (not a "
                             "calibration file written by benchmarks/calibrate.py)")
    return cal


def check_keys(options: Mapping[str, Any], valid: list[str], what: str,
               groups: tuple[str, ...] = ()) -> None:
    """Raise :class:`UnknownOptionError` for keys of ``options`` not in ``valid``, naming
    close matches, the valid options and where they are described."""
    unknown = sorted(k for k in options if k not in valid and k not in groups)
    if unknown:
        close = {k: difflib.get_close_matches(str(k), valid, n=1) for k in unknown}
        hint = "; ".join(f"{k!r}: did you mean {m[0]!r}?" for k, m in close.items() if m)
        also = f", or a whole group: {', '.join(groups)}" if groups else ""
        raise UnknownOptionError(
            f"unknown {what}(s) {unknown}{' (' + hint + ')' if hint else ''}; valid options "
            f"are: {', '.join(sorted(valid))}{also} (docs/config.md lists them by group)")


def option_group(cls: type) -> type:
    """Make ``cls`` a frozen dataclass whose constructor names an unknown key as
    ``DboConfig``'s does (the generated ``__init__`` raises a bare ``TypeError``)."""
    cls = dataclass(frozen=True)(cls)
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        check_keys(kwargs, cls.field_names(), f"{cls.__name__} option")
        init(self, *args, **kwargs)

    cls.__init__ = __init__
    return cls


class OptionGroup:
    """What every option group has: errors that name the option as ``DboConfig`` does,
    ``replace``, and a fingerprint of the fields that can change the compiled program."""

    #: fields that cannot change the compiled program (outside the fingerprint: ranks may
    #: differ in them)
    _local: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    def error(self, name: str, why: str) -> DboConfigError:
        """The error for option ``name``: ``DboConfig.<name>=<value>: <why>``."""
        return DboConfigError(f"DboConfig.{name}={getattr(self, name)!r}: {why}")

    def _check_choice(self, name: str, choices: tuple[str, ...]) -> None:
        if getattr(self, name) not in choices:
            raise self.error(name, f"must be one of {choices}")

    def _check_optional_str(self, *names: str) -> None:
        for name in names:
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise self.error(name, "must be None or a str")

    def _check_optional_path(self, *names: str, what: str = "a str or path") -> None:
        """Each of ``names``: ``None``, a ``str``, or a path-like object kept as its
        ``os.fspath`` str (the same config and fingerprint as the str)."""
        for name in names:
            value = getattr(self, name)
            if isinstance(value, os.PathLike):
                value = os.fspath(value)
                object.__setattr__(self, name, value)
            if value is not None and not isinstance(value, str):
                raise self.error(name, f"must be None or {what}")

    def replace(self, **changes: Any) -> Any:
        """A copy with ``changes`` (validated again)."""
        return dataclasses.replace(self, **changes)

    def fingerprint_data(self) -> dict[str, Any]:
        """The fields that can change the compiled program, by name."""
        return {n: getattr(self, n) for n in self.field_names() if n not in self._local}

    def fingerprint(self) -> str:
        """A short hash of :meth:`fingerprint_data` (computed once)."""
        cached = self.__dict__.get("_fingerprint")
        if cached is None:
            cached = digest(self.fingerprint_data())
            object.__setattr__(self, "_fingerprint", cached)
        return cached


@option_group
class SplitPolicy(OptionGroup):
    """When a step is split into ubatches, what a graph that cannot be split does, and how the
    DP ranks agree. The thresholds' rules are vLLM's (``--enable-dbo``, ``docs/references.md``);
    the per-step decision is :mod:`dbo_compile.runtime.vote`'s.

    Attributes:
        num_ubatches: micro-batches the token dim is cut into, an int >= 2 (``split="never"``
            turns DBO off).
        decode_token_threshold: a step of uniform decode (one token per request on every DP
            rank) splits only if every rank has at least this many tokens. ``None``:
            ``max(32, num_ubatches)``. With ``split="auto"``, a value below ``num_ubatches`` is
            refused (vLLM's rule).
        prefill_token_threshold: the same for any other step. ``None``:
            ``max(512, num_ubatches)``.
        split: ``"auto"`` (the thresholds decide), ``"always"`` (thresholds skipped; vetoes
            and a rank with fewer than ``num_ubatches`` tokens still keep a step whole) or
            ``"never"``.
        on_unsplittable: ``"fallback"``: a graph that cannot be split is compiled unsplit,
            the reason logged; ``"raise"``: :class:`~dbo_compile.errors.UnsplittableGraphError`.
        dp_group_name: the CPU (Gloo) process group of the DP vote. ``None``: the default
            group when torch.distributed is initialised, else no vote.
        step_agreement: end every eager step with one all-reduce on the vote's group, so that
            a failed step raises ``UBatchExecutionError`` on every rank
            (:mod:`dbo_compile.runtime.step_txn`). ``False``: for an engine with its own
            failure protocol (a failing rank raises alone; its peers hang in its collectives).

    Raises:
        DboConfigError: a value out of its range (``DboConfig.<name>=<value>: <why>``).
    """

    num_ubatches: int = 2
    decode_token_threshold: int | None = None
    prefill_token_threshold: int | None = None
    split: str = "auto"
    on_unsplittable: str = "fallback"
    dp_group_name: str | None = None
    step_agreement: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.num_ubatches, int) or self.num_ubatches < 2:
            raise self.error("num_ubatches",
                            "must be an int >= 2 (use split='never' to disable DBO)")
        explicit = []
        for name, default in _THRESHOLD_DEFAULTS.items():
            value = getattr(self, name)
            if value is None:  # resolved deterministically: the fingerprint sees the int
                object.__setattr__(self, name, max(default, self.num_ubatches))
                continue
            explicit.append(name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise self.error(name, "must be None or a positive int (tokens)")
            if self.split == "auto" and value < self.num_ubatches:
                raise self.error(
                    name,
                    f"must be an int >= num_ubatches ({self.num_ubatches}) with split='auto': "
                    "every ubatch needs at least one token (vLLM rejects the same configuration)",
                )
        # which thresholds the caller set (``replace`` re-resolves the others)
        object.__setattr__(self, "_explicit_thresholds", tuple(explicit))
        self._check_choice("split", _SPLIT_MODES)
        self._check_choice("on_unsplittable", _ON_UNSPLITTABLE)
        self._check_optional_str("dp_group_name")
        if not isinstance(self.step_agreement, bool):
            raise self.error("step_agreement", "must be a bool")

    def replace(self, **changes: Any) -> SplitPolicy:
        """A copy with ``changes``; thresholds the caller never set stay defaults (resolved
        again against the new ``num_ubatches``)."""
        for name in _THRESHOLD_DEFAULTS:
            if name not in changes and name not in self._explicit_thresholds:
                changes[name] = None
        return dataclasses.replace(self, **changes)


@option_group
class CostFigures(OptionGroup):
    """The figures of the schedule's cost model (:mod:`dbo_compile.passes.cost_model`):
    rooflines and fixed costs, or a calibration file's figures fitted to measured times. The
    schedule is a function of (graph, config) only, never of the first batch seen, so every
    rank compiles the same one.

    Attributes:
        cost_model_tokens: tokens per rank at which the cost model is evaluated, an int >=
            ``num_ubatches``.
        peak_tflops: compute roofline, TFLOP/s, > 0 (H200 dense bf16, measured: 790).
        hbm_gbps: memory roofline, GB/s, > 0 (H200 copy, measured: 4300).
        link_gbps: all-to-all bus bandwidth per rank, GB/s, > 0.
        comm_latency_us: fixed cost of one collective, µs, >= 0.
        launch_us: fixed cost of one compute kernel, µs, >= 0.
        calibration: path of a calibration JSON (``benchmarks/calibrate.py`` writes one): the
            figures per op class that replace the rooflines of the compute classes. Read at
            first use, once (:meth:`calibration_data`, which raises ``DboConfigError`` on a
            bad file); its content, not its path, is in the fingerprint. ``None``: the
            rooflines.
        device_sms: the device's SM count, an int >= 1, for the scheduler's hold model where
            the comm backend's transfers hold SMs (the emulated backend's option
            ``hold_sms``: compute beside a transfer runs on the others,
            :func:`~dbo_compile.passes.cost_model.hold_fraction`). ``None``: the CUDA
            device's ``multi_processor_count`` where the graph's inputs are on CUDA and a
            transfer holds SMs, else 132 (H100 / H200 SXM). In the fingerprint only when set.

    Raises:
        DboConfigError: a figure that is not a finite number in its range.
    """

    cost_model_tokens: int = 1024
    peak_tflops: float = 790.0
    hbm_gbps: float = 4300.0
    link_gbps: float = 100.0
    comm_latency_us: float = 15.0
    launch_us: float = 4.0
    calibration: str | None = None
    device_sms: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.cost_model_tokens, bool) or not isinstance(self.cost_model_tokens, int):
            raise self.error("cost_model_tokens", "must be an int >= num_ubatches")
        if self.device_sms is not None and (isinstance(self.device_sms, bool) or not isinstance(
                self.device_sms, int) or self.device_sms < 1):
            raise self.error("device_sms", "must be None or an int >= 1 (the device's SMs, "
                             "e.g. 132 on H100 / H200 SXM)")
        for name in ("peak_tflops", "hbm_gbps", "link_gbps", "comm_latency_us", "launch_us"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise self.error(name, "must be a finite number")
        for name in ("peak_tflops", "hbm_gbps", "link_gbps"):
            if not getattr(self, name) > 0:
                raise self.error(name, "must be > 0")
        for name in ("comm_latency_us", "launch_us"):
            if not getattr(self, name) >= 0:
                raise self.error(name, "must be >= 0")
        self._check_optional_path("calibration", what="the path of a calibration JSON")

    def calibration_data(self) -> dict[str, Any] | None:
        """The calibration file's content (:func:`load_calibration`), read at the first call
        and kept (also by a ``replace`` that keeps the path); ``None`` without one.

        Raises:
            DboConfigError: the file cannot be read as JSON, or has no ``figures`` object.
        """
        if self.calibration is None:
            return None
        if "_calibration" not in self.__dict__:
            object.__setattr__(self, "_calibration", load_calibration(self.calibration))
        return self.__dict__["_calibration"]

    def replace(self, **changes: Any) -> CostFigures:
        """A copy with ``changes``; the calibration already read goes with an unchanged path."""
        new = dataclasses.replace(self, **changes)
        if new.calibration == self.calibration and "_calibration" in self.__dict__:
            object.__setattr__(new, "_calibration", self.__dict__["_calibration"])
        return new

    def fingerprint_data(self) -> dict[str, Any]:
        """The figures, with the calibration file's content in place of its path (what the
        file says, not where it lies); ``device_sms`` only when set (unset, the fingerprint
        of a config without the option: the same compile-cache entries and dump names)."""
        data = super().fingerprint_data()
        if self.calibration is not None:
            data["calibration"] = self.calibration_data()
        if self.device_sms is None:
            del data["device_sms"]
        return data


@option_group
class BackendsConfig(OptionGroup):
    """The backends of the compute stages, the comm ops and the routed experts, with their
    options; ``"auto"`` chooses at compile time and logs what it chose and why
    (:mod:`dbo_compile.passes.bind`).

    Attributes:
        compute_backend: ``"inductor"`` (each compute stage compiled by Inductor: fused Triton
            kernels, seconds per stage and bucket, once), ``"aten"`` (the traced ATen ops) or
            ``"auto"``: ``"inductor"`` for graphs on CUDA, ``"aten"`` elsewhere.
        comm_backend: the backend bound into the comm ops (``dbo.moe_dispatch`` /
            ``dbo.moe_combine``, ``dbo.dispatch`` / ``dbo.combine``). ``"auto"``: DeepEP
            (``"deep_ep"``) where it imports and serves every comm op of the graph, else each
            op's own (``"local"`` for an EP group of one rank, ``"torch"`` otherwise); any
            other value: a name from ``dbo_compile.ops.available_comm_backends()``. An unknown
            or unloadable one, or one that cannot serve an op, raises ``CommBackendError`` at
            compile time.
        comm_backend_options: the comm backend's options, a dict of str to bool / int / float
            / str (``deep_ep``: ``mode``, ``max_tokens``, ...), checked by the backend at
            compile time (``CommBackendError``; under ``"auto"`` too); options of a backend
            ``"auto"`` did not choose are unused, with a WARNING. ``"emulated"``:
            ``world_size`` (required), ``link_gbps``, ``latency_us``, ``copy_gbps``,
            ``capacity_factor``, ``comm_sms`` (the ``emulate_*`` fields below, deprecated).
        experts_backend: the backend of ``dbo.grouped_experts``. ``"auto"``: DeepGEMM
            (``"deep_gemm"``) for the calls it serves best where it imports, else
            ``"torch"``; or a name from ``available_experts_backends()``.
        experts_backend_options: the experts backend's options (``deep_gemm``: ``fp8``,
            ``expected_m``; ``torch``: ``path``), checked as ``comm_backend_options``
            (``ExpertsOpError``).
        emulate_world_size: deprecated (a ``FutureWarning``: shown under Python's default
            filters, also through ``torch.compile``'s options): the emulated backend's
            options are ``comm_backend_options`` (``world_size``, ``link_gbps``, ... without
            the ``emulate_`` prefix), into which these fields are moved (then ``None``), so
            that both spellings make the same config and fingerprint. With
            ``comm_backend="emulated"`` (refused elsewhere; the world size is required there,
            in one spelling): this device is rank 0 of an emulated EP world of that many
            ranks (:mod:`dbo_compile.ops.emulated`); the model holds ``E / W`` experts.
        emulate_link_gbps: the emulated link's bandwidth per direction, GB/s, > 0
            (``None``: 50, one 400 Gb/s NIC).
        emulate_latency_us: added per dispatch / combine, µs, >= 0 (``None``: 0).
        emulate_copy_gbps: the hardware's copy bandwidth per direction with both directions
            busy, GB/s, > 0 (``None``: measured at the first call).
        emulate_capacity_factor: static link capacity over the expected remote rows under
            uniform routing, >= 1 (``None``: 1.1); rows past it stay on the device.
        emulate_comm_sms: SMs carved out of compute while the split program runs, an int
            >= 0 (``None`` / 0: none; ``comm_sms`` wins where both are given).

    Raises:
        DboConfigError: an empty backend name, malformed options, ``emulate_*`` options
            without ``comm_backend="emulated"`` or out of their range, ``"emulated"`` without
            a world size, or an option given in both spellings with different values.
    """

    compute_backend: str = "auto"
    comm_backend: str = "auto"
    comm_backend_options: Any = ()
    experts_backend: str = "auto"
    experts_backend_options: Any = ()
    emulate_world_size: int | None = None
    emulate_link_gbps: float | None = None
    emulate_latency_us: float | None = None
    emulate_copy_gbps: float | None = None
    emulate_capacity_factor: float | None = None
    emulate_comm_sms: int | None = None

    def __post_init__(self) -> None:
        self._check_choice("compute_backend", _COMPUTE_BACKENDS)
        for name in ("comm_backend", "experts_backend"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise self.error(name, "must be 'auto' or the name of a registered backend")
        for name in ("comm_backend_options", "experts_backend_options"):
            object.__setattr__(self, name, canonical_options(
                getattr(self, name), lambda why, n=name: self.error(n, why)))
        self._check_emulated()

    def _check_emulated(self) -> None:
        """The deprecated ``emulate_*`` fields: only with ``comm_backend="emulated"``, checked
        and moved into ``comm_backend_options`` (the emulated backend's options, checked by
        it: :func:`dbo_compile.ops.emulated.check_options`) with a ``FutureWarning``;
        ``"emulated"`` needs the world size, in one spelling or the other."""
        bad = self.error
        given = [n for n in _EMULATE_FIELDS if getattr(self, n) is not None]
        if self.comm_backend != "emulated":
            if given:
                raise bad(given[0], "applies only with comm_backend='emulated' (the emulated "
                          f"EP world on one device); comm_backend is {self.comm_backend!r}")
            return
        options = dict(self.comm_backend_options)
        if self.emulate_world_size is None and "world_size" not in options:
            raise bad("comm_backend_options", "comm_backend='emulated' needs the emulated EP "
                      "world size: comm_backend_options={'world_size': W} (an int >= 1, e.g. 8)")
        for name in ("emulate_world_size", "emulate_comm_sms"):
            v = getattr(self, name)
            low = 1 if name == "emulate_world_size" else 0
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < low):
                raise bad(name, f"must be an int >= {low}")
        for name, low, strict in (("emulate_link_gbps", 0.0, True),
                                  ("emulate_copy_gbps", 0.0, True),
                                  ("emulate_latency_us", 0.0, False),
                                  ("emulate_capacity_factor", 1.0, False)):
            v = getattr(self, name)
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise bad(name, "must be a finite number")
            if (v <= low) if strict else (v < low):
                raise bad(name, f"must be {'>' if strict else '>='} {low:g}")
        if not given:
            return
        moved = {n[len("emulate_"):]: getattr(self, n) for n in given}
        clash = sorted(k for k in moved if k in options and options[k] != moved[k])
        if clash:
            raise bad("comm_backend_options", f"gives {clash} and so do the deprecated "
                      f"emulate_* fields, differently; give them in comm_backend_options alone")
        warnings.warn(f"DboConfig {', '.join(given)}: deprecated; give the emulated backend's "
                      f"options in comm_backend_options={moved}", FutureWarning,
                      stacklevel=caller_stacklevel())
        object.__setattr__(self, "comm_backend_options",
                           canonical_options({**options, **moved}, lambda why: bad(
                               "comm_backend_options", why)))
        for name in given:
            object.__setattr__(self, name, None)


@option_group
class DebugConfig(OptionGroup):
    """What a process writes and checks for itself: dumps, host-mirror checks, the persistent
    compile cache (none of which changes the compiled program, so none is in the fingerprint:
    ranks may differ in them), and passes switched off.

    Attributes:
        dump_dir: where each compiled schedule (JSON) and generated wrapper (``.py``) is
            written; ``None``: nowhere. One that cannot be written is a WARNING, never a
            failed compile.
        cache_dir: the persistent compile cache (:mod:`dbo_compile.codegen.cache`), a
            directory (``~`` expanded) a later process with the same Dynamo graph, options,
            torch and package reads its compiled graphs back from; Inductor's and Triton's
            caches go under it too (``inductor/``, ``triton/``;
            :mod:`dbo_compile.codegen.cache_dirs`: an explicit ``TORCHINDUCTOR_CACHE_DIR`` /
            ``TRITON_CACHE_DIR`` wins). ``None``: off (an entry is pickled code run on load,
            so a directory is a trust decision: ``docs/config.md``).
        check_host_mirrors: compare the host mirrors of the attention metadata
            (:mod:`dbo_compile.metadata`) with their device tensors every step, a device read
            per mirrored field (debugging an engine's mirrors). ``False``: trusted.
        disable_passes: names of compile passes to skip (e.g. ``("join_experts",)``): only
            passes the program is correct without (``GraphPass.optional``); a compile refuses
            any other name with ``DboConfigError``. It changes the program: in the fingerprint.

    Raises:
        DboConfigError: a value of the wrong type.
    """

    _local: ClassVar[tuple[str, ...]] = ("dump_dir", "cache_dir", "check_host_mirrors")

    dump_dir: str | None = None
    cache_dir: str | None = None
    check_host_mirrors: bool = False
    disable_passes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        self._check_optional_path("dump_dir", "cache_dir")
        if isinstance(self.disable_passes, (list, tuple)) and all(
                isinstance(n, str) for n in self.disable_passes):  # canonical, as for the vote
            object.__setattr__(self, "disable_passes", tuple(sorted(set(self.disable_passes))))
        else:
            raise self.error("disable_passes", "must be a tuple of pass names")
        if not isinstance(self.check_host_mirrors, bool):
            raise self.error("check_host_mirrors", "must be a bool")
