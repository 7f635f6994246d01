"""``DboConfig``: the one frozen object that carries every option of the backend.

``torch.compile(model, backend="dbo", options={...})`` maps each key of ``options`` onto the field
of the same name; an unknown key raises :class:`~dbo_compile.errors.DboConfigError` naming the
valid ones.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import hashlib
import json
import math
import warnings
from dataclasses import dataclass
from typing import Any, Mapping

from dbo_compile.candidates import DEFAULT_CANDIDATES, SCHEDULE_CANDIDATES, split_carveout
from dbo_compile.errors import DboConfigError, UnknownOptionError

_SPLIT_MODES = ("auto", "always", "never")
_COMPUTE_BACKENDS = ("auto", "aten", "inductor")
_SCHEDULERS = ("list", "naive")
_ON_UNSPLITTABLE = ("fallback", "raise")
#: fields that cannot change the compiled schedule (may differ between ranks)
_NOT_FINGERPRINTED = ("dump_dir", "check_host_mirrors", "cache_dir")
#: the token thresholds' defaults (vLLM's); ``None`` in a field resolves to
#: ``max(default, num_ubatches)``
_THRESHOLD_DEFAULTS = {"decode_token_threshold": 32, "prefill_token_threshold": 512}


#: the deprecated fields of the emulated backend's options (``comm_backend_options`` without
#: the prefix)
_EMULATE_FIELDS = ("emulate_world_size", "emulate_link_gbps", "emulate_latency_us",
                   "emulate_copy_gbps", "emulate_capacity_factor", "emulate_comm_sms")


def _canonical_options(value: Any, bad: Any) -> tuple[tuple[str, Any], ...]:
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


@dataclass(frozen=True)
class DboConfig:
    """Options of the ``dbo`` backend.

    Split decision (rules from vLLM ``--enable-dbo``, see ``docs/references.md``):

    Attributes:
        num_ubatches: number of micro-batches the token dim is cut into (>= 2).
        decode_token_threshold: a step whose DP ranks are all uniform decode (one token per
            request) splits only if every rank has ``>=`` this many tokens. ``None`` (default):
            ``max(32, num_ubatches)``. Used by ``split="auto"`` only; an explicit value below
            ``num_ubatches`` is then an error (vLLM's rule).
        prefill_token_threshold: any other step splits only if every rank has ``>=`` this many
            tokens. ``None`` (default): ``max(512, num_ubatches)``; as above.
        split: ``"auto"`` (thresholds; the vote also carries a per-rank cost-model preference,
            which nothing computes yet, so today thresholds alone decide), ``"always"`` /
            ``"never"`` force the decision. ``"always"`` skips the thresholds, but vetoes still
            apply and a step in which any DP rank has fewer than ``num_ubatches`` tokens never
            splits (see :mod:`dbo_compile.runtime.vote`).
        scheduler: ``"list"`` (whole-graph list scheduler over both ubatches) or ``"naive"``
            (per layer: every ubatch's stage in turn, the order of hand-written schedules without
            cross-layer interleaving; kept for benchmarks and visual comparison).
        schedule_candidates: also compile alternative schedules of the split program, which
            :class:`~dbo_compile.runtime.cudagraph_runner.CudaGraphRunner` times per bucket at warm-up,
            keeping the fastest (identical on every rank: timings are maxed over the DP group):
            the list scheduler assuming a 4x and a 16x slower link (``link_gbps / 4``, ``/ 16``:
            comm-heavy networks), the other scheduler and the joined schedules (see
            ``join_experts``). The cost model's figures are rough; measuring the candidates
            makes the order right on the link at hand. ``True``: all of
            :data:`~dbo_compile.candidates.CANDIDATES`, each also with every SM carve-out (12
            split graphs per bucket on CUDA). ``False``: one schedule (and its carve-outs). A
            tuple of names from :data:`~dbo_compile.candidates.SCHEDULE_CANDIDATES`: the
            primary schedule and those, each with every carve-out; a tuple naming carve-outs
            itself (``"list@link/16+sms16"``, the names the runner and the benchmarks report)
            gets the primary and exactly those (see
            :func:`~dbo_compile.candidates.program_variants`; where torch cannot carve SMs
            out, a ``+smsN`` entry is its schedule alone).

            Default :data:`~dbo_compile.candidates.DEFAULT_CANDIDATES`,
            ``("list@link/16+sms16", "list+join",
            "list@link/16+join")``: with the primary, 4 split graphs per bucket to capture and
            time at warm-up instead of 12. The data (``benchmarks/results/latest.json``, 2x
            H200, DeepSeek-V2-Lite shapes, Inductor stages, all 12 candidates timed per
            bucket, ``t_variants_us``): the fastest split graph was ``list+join`` in 11 of 16
            buckets (every NVLink bucket, comm-heavy decode 64-256), ``list@link/16+join`` at
            comm-heavy decode 512 and 1024 and ``list@link/16+sms16`` at comm-heavy prefill
            2048 / 4096 / 8192 (0.79 / 0.70 / 0.67x the unsplit baseline, where the runner
            splits). No other candidate was ever the fastest: the joined schedules with the
            carve-out were 0.6-4.1 % slower than without in every bucket (the join pays in
            decode, bound by weight reads, where fewer SMs for the GEMMs only cost); the
            unjoined ones without it were 7-13 % slower at comm-heavy prefill; ``naive`` and
            ``list@link/4`` (with it) were 2.0-4.2 % slower than ``list@link/16+sms16``
            there (the runner's own warm-up timing preferred them at 3 buckets where the
            benchmark timed them 0.7-3.6 % slower: that is the noise between two timings).
            By the benchmark's timing, the fastest of the default set is the fastest of all 12
            in all 16 buckets; in the five earlier result files (ATen stages, projection-only
            attention, no joined or no carve-out candidates) it is at most 0.73 % slower
            (``shm_carveout16.json``, prefill 2048: ``list@link/4+sms16``).
        sm_carveout_candidates: SM carve-outs (ints) to try as well: each schedule candidate is
            also compiled with each carve-out (``comm_sms`` semantics) and measured by the
            runner, which keeps a carve-out only in buckets where it was faster. ``None``
            (default): ``(16,)`` for graphs on CUDA where torch has
            ``torch._C._set_sm_carveout_experimental``, ``()`` elsewhere. Measured on 2x H200
            with Inductor stages (README): the carve-out made the split step 6.6 / 9.1 / 10.2 %
            faster at comm-heavy prefill 2048 / 4096 / 8192 and lost 2–5 % over NVLink, where
            the runner then keeps the candidate without it. ``()``: none (half the graphs to
            capture at warm-up).
        join_experts: join the ubatch copies of each MoE layer's routed experts
            (``dbo.grouped_experts``) into one call on the rows of both ubatches
            (:mod:`dbo_compile.passes.join_experts`): the expert weights are read once per
            layer instead of once per ubatch, at the price of a join (the experts wait for the
            later ubatch's dispatch). With ``schedule_candidates`` the joined schedules
            (``"list+join"``, ``"list@link/16+join"``) are compiled as candidates whatever this
            says, and the runner keeps them only where they were measured faster.
        compute_backend: ``"inductor"`` compiles each compute stage of the split program and
            the unsplit program with Inductor (fused Triton kernels; seconds of compile time
            per stage and bucket, once); ``"aten"`` runs each stage's ATen ops as traced (one or
            more kernels per op); ``"auto"`` (default): ``"inductor"`` for graphs on CUDA,
            ``"aten"`` elsewhere (CPU is for tests: Inductor's C++ compile is slow there).
            Measured on 2x H200 (README): the unsplit step 13–20 % and the fastest split
            step 15–23 % faster than with ATen stages.
        on_unsplittable: ``"fallback"`` compiles an unsplittable graph unsplit and logs why;
            ``"raise"`` raises :class:`UnsplittableGraphError`.
        comm_sms: SMs kept for communication: the split program runs with that many SMs
            carved out of compute GEMMs (``torch._C._set_sm_carveout_experimental`` where
            torch has it; CUDA only); cap the NCCL side with
            :func:`dbo_compile.runtime.streams.new_ep_group` ``(comm_sms=...)``. ``None``
            leaves both alone. vLLM's default is 20; measured here it did not help on 2x H200
            (README, tuning), so the default is ``None``.
        cost_model_tokens: tokens per rank at which the schedule's cost model is evaluated. The
            schedule is a function of (graph, config) only, never of the first batch seen, so
            every rank compiles the same schedule.
        peak_tflops: compute roofline of the cost model, TFLOP/s (H200 dense bf16 measured: 790).
        hbm_gbps: memory roofline of the cost model, GB/s (H200 measured copy: 4300).
        link_gbps: all-to-all bus bandwidth of the cost model, GB/s per rank.
        comm_latency_us: fixed cost of one collective, µs.
        launch_us: fixed cost of one compute kernel, µs.
        dump_dir: if set, each compiled schedule is written there as JSON, and the generated
            wrapper as ``.py``.
        disable_passes: names of compile passes to skip (a debug switch, e.g.
            ``("join_experts",)``): only passes the program is correct without
            (:class:`~dbo_compile.passes.manager.GraphPass` ``optional``); a compile refuses
            any other name with :class:`~dbo_compile.errors.DboConfigError` naming those.
        cache_dir: the persistent compile cache (:mod:`dbo_compile.codegen.cache`): a
            directory (``~`` expanded) where each compiled graph's lowered graph, split
            signature, schedules, generated wrappers and unit graphs are written, and from
            where a later process with the same Dynamo graph, options, torch and package
            reads them instead of compiling (measured: ``benchmarks/compile_time.py --warm``).
            ``None`` (default): off. Off by default because an entry is pickled code run on
            load (a directory is a trust decision, as for Inductor's cache), because the key
            sees our package's source but not a user's own custom ops (edit one, and an entry
            it was compiled with could be read back), and so that tests and CI compile what
            they test; a serving host sets it, e.g. ``"~/.cache/dbo_compile"``. Not in the
            fingerprint (ranks may use different directories).
        dp_group_name: name of the CPU (Gloo) process group that carries the DP vote; ``None``
            means the default group when torch.distributed is initialised, else no vote.
        comm_backend: the comm backend of the graph's comm ops (``dbo.moe_dispatch`` /
            ``dbo.moe_combine``, ``dbo.dispatch`` / ``dbo.combine``), bound into the graph
            before lowering: ``"auto"`` (default): DeepEP (``"deep_ep"``) where it imports
            and serves every comm op of the graph (the MoE-layer ops, an EP group of 2, 4 or 8
            ranks: its normal mode; see ``dbo_compile.ops.deep_ep``), else each op's own
            (``"local"`` for an EP group of one rank, ``"torch"`` otherwise), logging what it
            chose and why; any other value is the name of a registered comm backend
            (``dbo_compile.ops.available_comm_backends()``). An unknown or unloadable one, or
            one that cannot serve an op of the graph, raises ``CommBackendError`` at compile
            time, naming what is missing and the fallback.
        comm_backend_options: options of the comm backend (a dict; ``deep_ep``:
            ``mode`` ``"auto"`` / ``"low_latency"`` / ``"normal"``, ``max_tokens``, ...), bound
            with its name; an unknown option or a bad value raises ``CommBackendError`` at
            compile time, under ``"auto"`` too (checked by the backend among those ``"auto"``
            may choose that takes it, whether its package imports or not); options of a
            backend ``"auto"`` did not choose are not used, with a WARNING. ``"emulated"``:
            ``world_size`` (required), ``link_gbps``, ``latency_us``, ``copy_gbps``,
            ``capacity_factor``, ``comm_sms`` (the ``emulate_*`` fields below, deprecated).
        experts_backend: the backend of ``dbo.grouped_experts``: ``"auto"`` (default):
            DeepGEMM (``"deep_gemm"``) for the calls it serves best where it imports (the
            expert-major layout of DeepEP low-latency: its masked grouped GEMM), else the op's
            own (``"torch"``), logging what it chose; else a registered experts backend
            (``dbo_compile.ops.experts.available_experts_backends()``).
        experts_backend_options: options of the experts backend (``deep_gemm``: ``fp8``,
            ``expected_m``; ``torch``: ``path``, ``"auto"`` / ``"fused"`` / ``"sorted"``, the
            CUDA path of its rank-major calls, :mod:`dbo_compile.ops.fused_moe`); checked as
            ``comm_backend_options`` (``ExpertsOpError``); under ``"auto"`` each call's
            backend gets the options it takes, the others are not used, with a WARNING.
        check_host_mirrors: compare the host mirrors of the attention metadata
            (``query_start_loc_cpu``, ...; see :mod:`dbo_compile.metadata`) with their
            device tensors every step: a device read per mirrored field, for debugging an
            engine's mirrors. Default ``False``: mirrors are trusted (checked on the host only).
        emulate_world_size: deprecated (a ``DeprecationWarning``): the emulated backend's
            options are ``comm_backend_options`` (``world_size``, ``link_gbps``, ... without
            the ``emulate_`` prefix), into which these fields are moved (then ``None``), so
            that both spellings make the same config and fingerprint. With
            ``comm_backend="emulated"`` (required there, refused elsewhere): this device is rank 0 of an emulated EP world of that many ranks
            (:mod:`dbo_compile.ops.emulated`: identical batches, expert weights repeating every
            ``E / W`` experts, the remote share of every dispatch / combine through pinned host
            memory and back). The model must hold ``E / W`` experts (``DeepseekMoEModel(...,
            emulated_world_size=W)``).
        emulate_link_gbps: the emulated link's bandwidth per direction, GB/s (``None``: 50,
            one 400 Gb/s NIC). Below the hardware's copy rate the copies are throttled to it;
            above, the hardware's rate is what runs.
        emulate_latency_us: added per dispatch / combine, µs (``None``: 0, the copies' own).
        emulate_copy_gbps: the hardware's copy bandwidth per direction with both directions
            busy, GB/s, which throttling divides by (``None``: measured at the first call).
        emulate_capacity_factor: static link capacity over the expected remote rows under
            uniform routing (``None``: 1.1); rows past it stay on the device (exact, counted).
        emulate_comm_sms: SMs carved out of compute while the split program runs, the cost of
            comm kernels that hold SMs (DeepEP reserves 20–24; the copy engines hold none);
            ``None``/0: none. ``comm_sms`` wins where both are given.
        calibration: path of a calibration JSON (``benchmarks/calibrate.py`` writes one, with
            the machine it was measured on): the cost model's figures per op class fitted to
            measured stage and comm times (:mod:`dbo_compile.passes.cost_model`). Its content
            is part of the fingerprint. ``None``: the roofline figures above.
        step_agreement: end every eager step with one all-reduce on the DP vote's group, so
            that a rank whose step failed (an op raised in a ubatch) makes every rank raise the
            same ``UBatchExecutionError`` after issuing its remaining collectives with null
            payloads (:mod:`dbo_compile.runtime.step_txn`). ``False``: for an engine with its
            own failure protocol; a failing rank then raises alone and its peers wait in its
            collectives (a hang). CUDA-graph replays never run it.
    """

    num_ubatches: int = 2
    decode_token_threshold: int | None = None
    prefill_token_threshold: int | None = None
    split: str = "auto"
    scheduler: str = "list"
    schedule_candidates: bool | tuple[str, ...] = DEFAULT_CANDIDATES
    sm_carveout_candidates: tuple | None = None
    join_experts: bool = False
    compute_backend: str = "auto"
    on_unsplittable: str = "fallback"
    comm_sms: int | None = None
    cost_model_tokens: int = 1024
    peak_tflops: float = 790.0
    hbm_gbps: float = 4300.0
    link_gbps: float = 100.0
    comm_latency_us: float = 15.0
    launch_us: float = 4.0
    dump_dir: str | None = None
    disable_passes: tuple[str, ...] = ()
    cache_dir: str | None = None
    dp_group_name: str | None = None
    comm_backend: str = "auto"
    experts_backend: str = "auto"
    comm_backend_options: Any = ()
    experts_backend_options: Any = ()
    check_host_mirrors: bool = False
    emulate_world_size: int | None = None
    emulate_link_gbps: float | None = None
    emulate_latency_us: float | None = None
    emulate_copy_gbps: float | None = None
    emulate_capacity_factor: float | None = None
    emulate_comm_sms: int | None = None
    calibration: str | None = None
    step_agreement: bool = True

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> DboConfigError:
            return DboConfigError(f"DboConfig.{name}={getattr(self, name)!r}: {why}")

        if not isinstance(self.num_ubatches, int) or self.num_ubatches < 2:
            raise bad("num_ubatches", "must be an int >= 2 (use split='never' to disable DBO)")
        explicit = []
        for name, default in _THRESHOLD_DEFAULTS.items():
            value = getattr(self, name)
            if value is None:  # resolved deterministically: the fingerprint sees the int
                object.__setattr__(self, name, max(default, self.num_ubatches))
                continue
            explicit.append(name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise bad(name, "must be None or a positive int (tokens)")
            if self.split == "auto" and value < self.num_ubatches:
                raise bad(
                    name,
                    f"must be an int >= num_ubatches ({self.num_ubatches}) with split='auto': "
                    "every ubatch needs at least one token (vLLM rejects the same configuration)",
                )
        # which thresholds the caller set (``replace`` re-resolves the others)
        object.__setattr__(self, "_explicit_thresholds", tuple(explicit))
        for name, choices in (
            ("split", _SPLIT_MODES),
            ("scheduler", _SCHEDULERS),
            ("compute_backend", _COMPUTE_BACKENDS),
            ("on_unsplittable", _ON_UNSPLITTABLE),
        ):
            if getattr(self, name) not in choices:
                raise bad(name, f"must be one of {choices}")
        if self.comm_sms is not None and (not isinstance(self.comm_sms, int)
                                          or isinstance(self.comm_sms, bool) or self.comm_sms < 1):
            raise bad("comm_sms", "must be None or a positive int (SMs)")
        for name in ("peak_tflops", "hbm_gbps", "link_gbps", "comm_latency_us", "launch_us"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise bad(name, "must be a finite number")
        for name in ("join_experts", "check_host_mirrors", "step_agreement"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "must be a bool")
        if isinstance(self.schedule_candidates, (list, tuple)):
            unknown = [c for c in self.schedule_candidates
                       if not isinstance(c, str) or split_carveout(c)[0] not in SCHEDULE_CANDIDATES]
            if unknown:
                raise bad("schedule_candidates",
                          f"unknown candidate(s) {unknown}; valid: {list(SCHEDULE_CANDIDATES)}, "
                          "each also with an SM carve-out suffix (e.g. 'list@link/16+sms16')")
            # canonical (order and duplicates do not matter, () is False): the fingerprint the
            # DP vote compares must not depend on how a rank built the tuple
            def rank(name: str) -> tuple:
                base, sms = split_carveout(name)
                return SCHEDULE_CANDIDATES.index(base), sms or 0

            picked = tuple(sorted(set(self.schedule_candidates), key=rank))
            object.__setattr__(self, "schedule_candidates", picked or False)
        elif not isinstance(self.schedule_candidates, bool):
            raise bad("schedule_candidates",
                      f"must be a bool or a tuple of names from {list(SCHEDULE_CANDIDATES)}")
        if isinstance(self.sm_carveout_candidates, (list, tuple)):  # duplicates dropped
            object.__setattr__(self, "sm_carveout_candidates",
                               tuple(dict.fromkeys(self.sm_carveout_candidates)))
        if self.sm_carveout_candidates is not None and (
                not isinstance(self.sm_carveout_candidates, tuple) or any(
                isinstance(v, bool) or not isinstance(v, int) or v < 1
                for v in self.sm_carveout_candidates)):
            raise bad("sm_carveout_candidates", "must be None or a tuple of positive ints (SMs)")
        if isinstance(self.disable_passes, (list, tuple)) and all(
                isinstance(n, str) for n in self.disable_passes):  # canonical, as for the vote
            object.__setattr__(self, "disable_passes", tuple(sorted(set(self.disable_passes))))
        else:
            raise bad("disable_passes", "must be a tuple of pass names")
        for name in ("dump_dir", "cache_dir", "dp_group_name"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise bad(name, "must be None or a str")
        for name in ("comm_backend", "experts_backend"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise bad(name, "must be 'auto' or the name of a registered backend")
        for name in ("comm_backend_options", "experts_backend_options"):
            object.__setattr__(self, name, _canonical_options(getattr(self, name),
                                                              lambda why, n=name: bad(n, why)))
        if not isinstance(self.cost_model_tokens, int) or self.cost_model_tokens < self.num_ubatches:
            raise bad("cost_model_tokens", f"must be an int >= num_ubatches ({self.num_ubatches})")
        for name in ("peak_tflops", "hbm_gbps", "link_gbps"):
            if not getattr(self, name) > 0:
                raise bad(name, "must be > 0")
        for name in ("comm_latency_us", "launch_us"):
            if not getattr(self, name) >= 0:
                raise bad(name, "must be >= 0")
        self._check_emulated(bad)
        if self.calibration is not None:
            if not isinstance(self.calibration, str):
                raise bad("calibration", "must be None or the path of a calibration JSON")
            try:
                with open(self.calibration) as f:
                    cal = json.load(f)
            except (OSError, ValueError) as e:
                raise bad("calibration", f"cannot be read as JSON ({e}); write one with "
                          "benchmarks/calibrate.py") from None
            if not isinstance(cal, dict) or not isinstance(cal.get("figures"), dict):
                raise bad("calibration", "has no 'figures' object (not a calibration file "
                          "written by benchmarks/calibrate.py)")
            object.__setattr__(self, "_calibration", cal)

    def _check_emulated(self, bad) -> None:
        """The deprecated ``emulate_*`` fields: only with ``comm_backend="emulated"``, checked
        and moved into ``comm_backend_options`` (the emulated backend's options, checked by
        it: :func:`dbo_compile.ops.emulated.check_options`) with a ``DeprecationWarning``;
        ``"emulated"`` needs the world size, in one spelling or the other."""
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
        warnings.warn(f"DboConfig {', '.join(given)} are deprecated: give the emulated backend's "
                      f"options in comm_backend_options={moved}", DeprecationWarning,
                      stacklevel=4)
        object.__setattr__(self, "comm_backend_options",
                           _canonical_options({**options, **moved}, lambda why: bad(
                               "comm_backend_options", why)))
        for name in given:
            object.__setattr__(self, name, None)

    def calibration_data(self) -> dict[str, Any] | None:
        """The calibration file's content (read once, when the config was made)."""
        return self.__dict__.get("_calibration")

    @classmethod
    def field_names(cls) -> list[str]:
        return sorted(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_options(cls, options: Mapping[str, Any] | DboConfig | None) -> DboConfig:
        """Build a config from ``torch.compile``'s ``options`` dict.

        Raises:
            DboConfigError: a key is not a field of ``DboConfig``, or a value is invalid.
        """
        if options is None:
            return cls()
        if isinstance(options, DboConfig):
            return options
        if not isinstance(options, Mapping):
            raise DboConfigError(
                f"options must be a dict or a DboConfig, got {type(options).__name__}"
            )
        _check_keys(options)
        return cls(**dict(options))

    def replace(self, **changes: Any) -> DboConfig:
        """A copy with ``changes``; thresholds the caller never set stay defaults (resolved
        again against the new ``num_ubatches``)."""
        for name in _THRESHOLD_DEFAULTS:
            if name not in changes and name not in self._explicit_thresholds:
                changes[name] = None
        return dataclasses.replace(self, **changes)

    def fingerprint(self) -> str:
        """A short hash of every field that can change the compiled schedule (computed once:
        the DP vote sends it every step)."""
        cached = self.__dict__.get("_fingerprint")
        if cached is None:
            data = {n: getattr(self, n) for n in self.field_names() if n not in _NOT_FINGERPRINTED}
            if self.calibration is not None:  # what the file says, not where it lies
                data["calibration"] = self.calibration_data()
            cached = hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]
            object.__setattr__(self, "_fingerprint", cached)
        return cached


def _check_keys(options: Mapping[str, Any]) -> None:
    """Raise :class:`UnknownOptionError` for keys that are not fields of ``DboConfig``,
    naming close matches and the valid options."""
    valid = DboConfig.field_names()
    unknown = sorted(k for k in options if k not in valid)
    if unknown:
        close = {k: difflib.get_close_matches(str(k), valid, n=1) for k in unknown}
        hint = "; ".join(f"{k!r}: did you mean {m[0]!r}?" for k, m in close.items() if m)
        raise UnknownOptionError(
            f"unknown dbo option(s) {unknown}{' (' + hint + ')' if hint else ''}; valid options "
            f"are: {', '.join(valid)}")


def _checked_init(init: Any) -> Any:
    """``DboConfig(**options)`` names unknown keys like ``from_options`` (the generated
    ``__init__`` would raise a bare ``TypeError``)."""

    @functools.wraps(init)
    def __init__(self: DboConfig, *args: Any, **kwargs: Any) -> None:
        _check_keys(kwargs)
        init(self, *args, **kwargs)

    return __init__


DboConfig.__init__ = _checked_init(DboConfig.__init__)  # type: ignore[method-assign]
