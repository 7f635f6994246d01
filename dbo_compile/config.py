"""``DboConfig``: the one frozen object that carries every option of the backend, in five
groups (:class:`SplitPolicy`, :class:`ScheduleConfig`, :class:`CostFigures`,
:class:`BackendsConfig`, :class:`DebugConfig`); ``docs/config.md`` lists every option with its
default, and why the defaults are what they are.

``torch.compile(model, backend="dbo", options={...})`` maps each key of ``options`` onto the
option of the same name, whichever group holds it; an unknown key raises
:class:`~dbo_compile.errors.UnknownOptionError` naming the valid ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from dbo_compile.candidates import (
    DEFAULT_CANDIDATES,
    SCHEDULE_CANDIDATES,
    bad_carveout,
    split_carveout,
)
from dbo_compile.config_groups import (
    BackendsConfig,
    CostFigures,
    DebugConfig,
    OptionGroup,
    SplitPolicy,
    check_keys,
    digest,
    load_calibration,
    option_group,
)
from dbo_compile.errors import DboConfigError

__all__ = ["GROUPS", "BackendsConfig", "CostFigures", "DboConfig", "DebugConfig", "ScheduleConfig",
           "SplitPolicy", "load_calibration"]

_SCHEDULERS = ("list", "naive", "staged", "staged-d2")
#: how an SM carve-out keeps its SMs free (``ScheduleConfig.sm_carveout_mode``)
CARVEOUT_MODES = ("cublas", "green_context")


@option_group
class ScheduleConfig(OptionGroup):
    """Which schedules of the split program are compiled: the primary one and the candidates
    the CUDA-graph runner times per bucket at warm-up, keeping the fastest (the same on every
    rank: timings are maxed over the DP group).

    Attributes:
        scheduler: ``"list"`` (the whole-graph list scheduler over both ubatches) or
            ``"naive"`` (per layer, every ubatch's stage in turn: the order of hand-written
            schedules, kept for comparison) or ``"staged"`` / ``"staged-d2"`` (SGLang's
            two-batch overlap: stages cut after each comm issue, taken in turn, ubatch 0
            ahead by 0 / 2 stages; :func:`~dbo_compile.passes.ordering.staged_order`).
        schedule_candidates: the candidates compiled besides the primary. ``True``: all of
            :data:`~dbo_compile.candidates.CANDIDATES`, each also with every SM carve-out;
            ``False``: none; a tuple of names from
            :data:`~dbo_compile.candidates.SCHEDULE_CANDIDATES`: those, each with every
            carve-out, or, where a name carries a carve-out itself (``"list@link/16+sms16"``),
            exactly the entries named (:func:`~dbo_compile.candidates.program_variants`). Order
            and duplicates do not count; ``()`` is ``False``. A candidate whose host order
            equals one compiled before it is kept once, under the earlier name (the
            artifact's ``candidates``). Default
            :data:`~dbo_compile.candidates.DEFAULT_CANDIDATES` (the data: ``docs/config.md``).
        sm_carveout_candidates: SM carve-outs (positive ints, ``comm_sms`` semantics) each
            candidate is also compiled with; the runner keeps one only in buckets where it was
            faster. ``None``: ``(16,)`` on CUDA where torch has
            ``torch._C._set_sm_carveout_experimental``, else ``()``.
        join_experts: join the ubatch copies of each MoE layer's routed experts into one call
            on the rows of both ubatches (:mod:`dbo_compile.passes.join_experts`): the weights
            are read once per layer, at the price of waiting for the later ubatch's dispatch.
        comm_sms: SMs carved out of the compute GEMMs while the split program runs (CUDA,
            where torch has ``torch._C._set_sm_carveout_experimental``; cap the NCCL side with
            :func:`dbo_compile.runtime.streams.new_ep_group`). ``None``: none (vLLM's default
            is 20; it did not help on 2x H200: ``docs/config.md``).
        sm_carveout_mode: how a carve-out (``+smsN``, ``sm_carveout_candidates``,
            ``comm_sms``) keeps its SMs free of compute. ``"cublas"`` (default): cuBLAS GEMMs
            leave them (``torch._C._set_sm_carveout_experimental``); Triton and
            ``torch._grouped_mm`` kernels still take every SM. ``"green_context"``: the split
            program's compute stream runs in a CUDA green context of the device's SMs less the
            carve-out (rounded down to the partition granularity, 8 SMs on sm_90), so every
            compute kernel leaves them, as SGLang's DeepGEMM ``set_num_sms`` beside DeepEP's
            normal kernels does (:func:`dbo_compile.runtime.streams.sm_carveout`; needs
            ``torch.cuda.green_contexts``, a ``DboConfigError`` at the first CUDA step
            otherwise). Outside the fingerprint while ``"cublas"``.
        unsplit_overlap: also compile the unsplit program on the two streams (one ubatch,
            :mod:`dbo_compile.passes.unsplit_overlap`): each comm op on the comm stream, the
            compute that does not depend on it (the shared experts beside the dispatch) on
            the compute stream at the same time; the CUDA-graph runner times it beside the
            serial unsplit graph at every bucket and runs the faster where a step is not
            split (``min_gain`` as for the split). The eager path runs the serial one. Off by
            default until measured on a GPU; while off, it is outside the fingerprint (the
            programs and their dumps are those of before).

    Raises:
        DboConfigError: an unknown scheduler or candidate name, a value of the wrong type.
    """

    scheduler: str = "list"
    schedule_candidates: bool | tuple[str, ...] = DEFAULT_CANDIDATES
    sm_carveout_candidates: tuple | None = None
    join_experts: bool = False
    comm_sms: int | None = None
    sm_carveout_mode: str = "cublas"
    unsplit_overlap: bool = False

    def fingerprint_data(self) -> dict[str, Any]:
        """The fields that can change the compiled program; ``unsplit_overlap`` only when on
        (off, the programs are those of a config without the option: the same fingerprint,
        the same compile-cache entries and dump names)."""
        data = super().fingerprint_data()
        if not self.unsplit_overlap:
            del data["unsplit_overlap"]
        if self.sm_carveout_mode == "cublas":
            del data["sm_carveout_mode"]
        return data

    def __post_init__(self) -> None:
        self._check_choice("scheduler", _SCHEDULERS)
        self._check_choice("sm_carveout_mode", CARVEOUT_MODES)
        if not isinstance(self.unsplit_overlap, bool):
            raise self.error("unsplit_overlap", "must be a bool")
        if self.comm_sms is not None and (not isinstance(self.comm_sms, int)
                                          or isinstance(self.comm_sms, bool) or self.comm_sms < 1):
            raise self.error("comm_sms", "must be None or a positive int (SMs)")
        if not isinstance(self.join_experts, bool):
            raise self.error("join_experts", "must be a bool")
        if isinstance(self.schedule_candidates, (list, tuple)):
            bad_sms = [c for c in self.schedule_candidates if bad_carveout(c)]
            if bad_sms:
                raise self.error("schedule_candidates",
                                f"{', '.join(map(repr, bad_sms))}: the SM carve-out after "
                                "'+sms' must be an int >= 1 (SMs, e.g. 'list@link/16+sms16'); "
                                "drop the suffix for no carve-out")
            unknown = [c for c in self.schedule_candidates
                       if not isinstance(c, str) or split_carveout(c)[0] not in SCHEDULE_CANDIDATES]
            if unknown:
                raise self.error("schedule_candidates",
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
            raise self.error("schedule_candidates",
                            f"must be a bool or a tuple of names from {list(SCHEDULE_CANDIDATES)}")
        if isinstance(self.sm_carveout_candidates, (list, tuple)):  # duplicates dropped
            object.__setattr__(self, "sm_carveout_candidates",
                               tuple(dict.fromkeys(self.sm_carveout_candidates)))
        if self.sm_carveout_candidates is not None and (
                not isinstance(self.sm_carveout_candidates, tuple) or any(
                isinstance(v, bool) or not isinstance(v, int) or v < 1
                for v in self.sm_carveout_candidates)):
            raise self.error("sm_carveout_candidates",
                            "must be None or a tuple of positive ints (SMs)")


#: the option groups of :class:`DboConfig`: its attribute -> the group's class
GROUPS: dict[str, type] = {"split_policy": SplitPolicy, "schedule": ScheduleConfig,
                           "cost": CostFigures, "backends": BackendsConfig, "debug": DebugConfig}
#: every flat option -> the attribute of the group that holds it
_FLAT: dict[str, str] = {n: g for g, cls in GROUPS.items() for n in cls.field_names()}


@dataclass(frozen=True, init=False)
class DboConfig:
    """Options of the ``dbo`` backend, in five groups: :attr:`split_policy`
    (:class:`SplitPolicy`), :attr:`schedule` (:class:`ScheduleConfig`), :attr:`cost`
    (:class:`CostFigures`), :attr:`backends` (:class:`BackendsConfig`) and :attr:`debug`
    (:class:`DebugConfig`); ``docs/config.md`` lists every option with its default.

    Built from flat options (``DboConfig(num_ubatches=3)``, as ``torch.compile(...,
    options={"num_ubatches": 3})``), from groups (``DboConfig(schedule=ScheduleConfig(
    scheduler="naive"))``) or both (a flat option overrides its group's field). Every flat
    option reads as before, read-only: ``config.num_ubatches`` is
    ``config.split_policy.num_ubatches`` (set from the group when the config is made; both
    are frozen).

    Raises:
        UnknownOptionError: a key that is no option (also a ``TypeError``), naming close
            matches and the valid options.
        DboConfigError: an invalid value, as ``DboConfig.<option>=<value>: <why>``.
    """

    split_policy: SplitPolicy
    schedule: ScheduleConfig
    cost: CostFigures
    backends: BackendsConfig
    debug: DebugConfig

    def __init__(self, **options: Any) -> None:
        check_keys(options, list(_FLAT), "dbo option", tuple(GROUPS))
        for name, cls in GROUPS.items():
            group = options.get(name)
            changes = {k: v for k, v in options.items() if _FLAT.get(k) == name}
            if group is None:
                group = cls(**changes)
            elif not isinstance(group, cls):
                raise DboConfigError(
                    f"DboConfig.{name}={group!r}: must be a "
                    f"{cls.__module__}.{cls.__name__}(...), or give its options flat "
                    f"({', '.join(f'{k}=...' for k in cls.field_names()[:3])}, ...)")
            elif changes:
                group = group.replace(**changes)
            object.__setattr__(self, name, group)
            for option in cls.field_names():  # flat reads, as fast as a field's; frozen: read-only
                object.__setattr__(self, option, getattr(group, option))
        if self.cost_model_tokens < self.num_ubatches:
            raise self.cost.error("cost_model_tokens",
                                 f"must be an int >= num_ubatches ({self.num_ubatches})")

    def calibration_data(self) -> dict[str, Any] | None:
        """The calibration file's content (:meth:`CostFigures.calibration_data`: read at
        the first call, once)."""
        return self.cost.calibration_data()

    @classmethod
    def field_names(cls) -> list[str]:
        """Every flat option's name, sorted."""
        return sorted(_FLAT)

    @classmethod
    def from_options(cls, options: Mapping[str, Any] | DboConfig | None) -> DboConfig:
        """Build a config from ``torch.compile``'s ``options`` dict (or take a config), and
        read its calibration file: the entry's one check of every option.

        Raises:
            DboConfigError: a key is not an option of ``DboConfig``, a value is invalid, or
                the calibration file cannot be read (:func:`load_calibration`).
        """
        if options is None:
            return cls()
        if isinstance(options, DboConfig):
            config = options
        elif not isinstance(options, Mapping):
            raise DboConfigError(
                f"options must be a dict or a DboConfig, got {type(options).__name__}"
            )
        else:
            bad = [k for k in options if not isinstance(k, str)]
            if bad:
                raise DboConfigError(f"option names must be str, got {bad} in options: name "
                                     "each option by its str key (docs/config.md)")
            config = cls(**dict(options))
        config.calibration_data()  # read once, here: a bad file fails with the other options
        return config

    def replace(self, **changes: Any) -> DboConfig:
        """A copy with ``changes`` (flat options or whole groups); only the groups changed are
        built again; thresholds the caller never set stay defaults (resolved again against the
        new ``num_ubatches``)."""
        return DboConfig(**{**{name: getattr(self, name) for name in GROUPS}, **changes})

    def fingerprint(self) -> str:
        """A short hash of every option that can change the compiled program (computed once:
        the DP vote sends it every step): the SHA-256 of the groups' :meth:`fingerprint_data`
        taken together, so its value is that of the flat config before the groups (compile
        cache entries written before stay valid)."""
        cached = self.__dict__.get("_fingerprint")
        if cached is None:
            data: dict[str, Any] = {}
            for name in GROUPS:
                data.update(getattr(self, name).fingerprint_data())
            cached = digest(data)
            object.__setattr__(self, "_fingerprint", cached)
        return cached
