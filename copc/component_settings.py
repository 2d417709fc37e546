"""The built-in estimators' and policy losses' own settings (spec, "Margins" and "Baselines").

Each built-in advantage estimator and policy loss is registered with the dataclass of its own
knobs (``ADVANTAGE_ESTIMATORS.register("copc", settings=CopcSettings)``), exactly as a user's
plug-in is; the config holds them as ``algorithm.estimator_settings`` /
``algorithm.policy_loss_settings`` (a mapping, built into the dataclass by
:func:`seams.settings.build_settings`), and :class:`copc.AlgorithmConfig` keeps only the fields every
estimator and loss share (names, γ, λ, the shared base margins ε_ℓ / ε_h, aggregation, value
clip, observation handling, samples per prompt).

The PPO-clip family (``ppo``, ``decoupled_ppo``, ``tis``, ``icepop``) shares :class:`PPOClip`;
``brace`` extends :class:`VTraceSettings` (its ρ̄, c̄) with its horizon
(:class:`BraceSettings`). Every class validates its ranges at construction and
raises ``ValueError`` naming the field and the value. The π-referenced value probes' knobs
(:class:`ValueProbeSettings`, ``train.value_probes``) live here too: a learner diagnostic, not a
registered plug-in, but torch-free like the rest.
"""

from __future__ import annotations

from dataclasses import dataclass

from .margins import ETA


def _setting(ok: bool, name: str, v: object, why: str) -> None:
    """Raise ``ValueError("<name>=<v!r>: <why>")`` unless ``ok`` (:func:`seams.settings.build_settings`
    prefixes the config key: ``algorithm.estimator_settings.eta_a=2.0: must be in [0, 1]``)."""
    if not ok:
        raise ValueError(f"{name}={v!r}: {why}")


def _number(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and v == v  # not NaN


def _in_unit(name: str, v: object) -> None:
    _setting(_number(v) and 0.0 <= v <= 1.0, name, v, "must be a number in [0, 1]")


def _above_zero(name: str, v: object, *, allow_none: bool = False) -> None:
    _setting((v is None and allow_none) or (_number(v) and v > 0.0), name, v,
             f"must be a number > 0{' or None' if allow_none else ''}")


@dataclass(frozen=True)
class CopcSettings:
    """The ``copc`` estimator's knob: the advantage channel's strength (spec "Margins").

    Attributes:
        eta_a: η_A ∈ [0, 1]; the channel's interval is ``(1 − η_A ε_ℓ, 1 + η_A ε_h)``
            (:func:`copc.margins`), η_A = 0 gives ρ̄ ≡ 1 (``copc_wo_rc``); paper 0.5.

    Raises:
        ValueError: ``eta_a`` not a number in [0, 1].
    """

    eta_a: float = ETA

    def __post_init__(self) -> None:
        _in_unit("eta_a", self.eta_a)


@dataclass(frozen=True)
class VTraceSettings:
    """V-trace's truncation levels (Espeholt et al. 2018, "IMPALA", eq. 1; spec "Baselines").

    Attributes:
        rho_clip: ρ̄ > 0, the truncation of the TD-residual weight.
        c_clip: c̄ > 0, the truncation of the traces.

    Raises:
        ValueError: either not a number > 0.
    """

    rho_clip: float = 1.0
    c_clip: float = 1.0

    def __post_init__(self) -> None:
        for n in ("rho_clip", "c_clip"):
            _above_zero(n, getattr(self, n))


#: The paper's reported correction horizon (policy tokens).
DEFAULT_HORIZON = 100

#: The two readings of BRACE's tail beyond the ``k``-token prefix (:class:`BraceSettings`);
#: the first is the default.
BRACE_TAILS = ("product_kept", "literal")


@dataclass(frozen=True)
class BraceSettings(VTraceSettings):
    """The BRACE estimator's own knobs (``algorithm.estimator_settings`` of ``brace``): V-trace's
    ρ̄ and c̄ (:class:`VTraceSettings`; the ``brace`` preset writes the
    paper's 1.2 and 1.1), the horizon and the reading of the tail.

    Attributes:
        horizon: ``k`` ≥ 1, the number of policy tokens after ``t`` whose V-trace weights and
            traces enter the target of ``t`` (paper: 100).
        tail: how a residual ``δ_j`` beyond the prefix (``j ≥ t + k``) is weighted in the target
            of ``t`` (``docs/algorithm.md``, "BRACE"): ``"product_kept"`` (default):
            ``γ^{j−t} Π_{i=t}^{t+k−1} c_i``, every per-token factor beyond the prefix is 1 and the
            product of the ``k`` traces is kept; ``"literal"``: ``γ^{j−t}``, weight 1 and no
            product. Source of the default: the spec's description, "V-trace-style residual
            weights and traces whose product is capped at the first k policy tokens after t;
            beyond the cap the weights are 1" (a capped product keeps its k factors) and the
            seed's "BRACE forms a per-residual product of importance ratios, caps it at k = 100
            tokens"; the literal reading is the seed's "and gives the tail a constant weight of 1".

    Raises:
        ValueError: ``horizon`` not an int ≥ 1; ``rho_clip`` / ``c_clip`` not > 0; ``tail`` not
            one of :data:`BRACE_TAILS`.
    """

    horizon: int = DEFAULT_HORIZON
    tail: str = BRACE_TAILS[0]

    def __post_init__(self) -> None:
        super().__post_init__()
        check_horizon(self.horizon)
        check_brace_tail(self.tail)


def check_horizon(k: object) -> int:
    """``k`` if it is an int ≥ 1 (not a bool); else ``ValueError`` naming ``horizon``."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"horizon must be an int >= 1 (policy tokens), got {k!r}")
    return k


def check_brace_tail(tail: object) -> str:
    """``tail`` if it is one of :data:`BRACE_TAILS`; else ``ValueError("tail=<v!r>: ...")``."""
    _setting(isinstance(tail, str) and tail in BRACE_TAILS, "tail", tail,
             f"must be one of {', '.join(repr(t) for t in BRACE_TAILS)}")
    return tail  # type: ignore[return-value]


@dataclass(frozen=True)
class GrpoSettings:
    """The ``grpo`` estimator's knob (Shao et al. 2024, "DeepSeekMath", §4.1.2).

    Attributes:
        std_normalize: divide each group's centred rewards by the group's std (Dr. GRPO: False).

    Raises:
        ValueError: ``std_normalize`` not a bool.
    """

    std_normalize: bool = True

    def __post_init__(self) -> None:
        _setting(isinstance(self.std_normalize, bool), "std_normalize", self.std_normalize, "must be a bool")


@dataclass(frozen=True)
class DisSettings:
    """The ``dis`` policy loss's knobs: COPC's policy channel (spec "Policy channel").

    Attributes:
        eta_p: η_P ∈ [0, 1], the token ratio mask's interval ``(1 − η_P ε_ℓ, 1 + η_P ε_h)``;
            paper 0.5.
        ppo_clip_eps: optional extra PPO clip vs π_old on the DIS loss, None = off ((choice)).

    Raises:
        ValueError: ``eta_p`` outside [0, 1]; ``ppo_clip_eps`` not > 0 or None.
    """

    eta_p: float = ETA
    ppo_clip_eps: float | None = None

    def __post_init__(self) -> None:
        _in_unit("eta_p", self.eta_p)
        _above_zero("ppo_clip_eps", self.ppo_clip_eps, allow_none=True)


@dataclass(frozen=True)
class PPOClip:
    """The PPO clipped surrogate's knobs (Schulman et al. 2017, eq. 7), shared by the PPO family.

    Attributes:
        clip_low, clip_high: ε of the clip ``[1 − clip_low, 1 + clip_high]``; clip-higher
            (DAPO) when ``clip_high > clip_low``. ``clip_low`` ∈ (0, 1), ``clip_high`` > 0.
        dual_clip_c: dual-clip constant > 1 (Ye et al. 2020), or None.

    Raises:
        ValueError: a value outside its range, naming the field.
    """

    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip_c: float | None = None

    def __post_init__(self) -> None:
        _above_zero("clip_high", self.clip_high)
        _setting(_number(self.clip_low) and 0.0 < self.clip_low < 1.0, "clip_low", self.clip_low,
                 "must be a number in (0, 1)")
        d = self.dual_clip_c
        _setting(d is None or (_number(d) and d > 1.0), "dual_clip_c", d, "must be a number > 1 or None")


@dataclass(frozen=True)
class DecoupledPpoSettings(PPOClip):
    """``decoupled_ppo`` (AReaL, Fu et al. 2025, eq. 5): PPO clip vs the proximal policy plus the
    behavior-weight cap.

    Attributes:
        behav_weight_cap: cap > 0 on the behavior weight π_prox/µ, or None (no cap).
        behav_cap_mode: ``mask`` (drop tokens over the cap) or ``truncate`` (clamp the weight).

    Raises:
        ValueError: as :class:`PPOClip`; a bad cap or mode.
    """

    behav_weight_cap: float | None = 5.0
    behav_cap_mode: str = "mask"

    def __post_init__(self) -> None:
        super().__post_init__()
        _above_zero("behav_weight_cap", self.behav_weight_cap, allow_none=True)
        _setting(self.behav_cap_mode in ("mask", "truncate"), "behav_cap_mode", self.behav_cap_mode,
                 "must be 'mask' or 'truncate'")


@dataclass(frozen=True)
class TisSettings(PPOClip):
    """``tis``: PPO clip times the truncated importance weight (Yao et al. 2025, "TIS").

    Attributes:
        tis_cap: the truncation C > 0 of ``π_old/µ``.

    Raises:
        ValueError: as :class:`PPOClip`; ``tis_cap`` not > 0.
    """

    tis_cap: float = 2.0

    def __post_init__(self) -> None:
        super().__post_init__()
        _above_zero("tis_cap", self.tis_cap)


@dataclass(frozen=True)
class IcePopSettings(PPOClip):
    """``icepop``: PPO clip with tokens whose ``π_old/µ`` leaves ``[α, β]`` masked (Ring-1T, §IcePop).

    Attributes:
        icepop_low, icepop_high: α < β, both > 0.

    Raises:
        ValueError: as :class:`PPOClip`; a bound not > 0, or ``icepop_low >= icepop_high``.
    """

    icepop_low: float = 0.5
    icepop_high: float = 5.0

    def __post_init__(self) -> None:
        super().__post_init__()
        for n in ("icepop_low", "icepop_high"):
            _above_zero(n, getattr(self, n))
        _setting(self.icepop_low < self.icepop_high, "icepop_low", self.icepop_low,
                 f"must be < icepop_high={self.icepop_high!r}")


#: Default cap C of the value probes' episode weights π/µ (:mod:`copc.value_probes`).
DEFAULT_SEQ_WEIGHT_CAP = 10.0
#: Default window of the pooled value probes, in learner steps (:class:`ValueProbeSettings`).
DEFAULT_PROBE_WINDOW = 32


@dataclass(frozen=True)
class ValueProbeSettings:
    """The π-referenced value probes' knobs (``train.value_probes``; :mod:`copc.value_probes`,
    :mod:`copc.value_probe_window`).

    Attributes:
        window_steps: W ≥ 1, the learner steps whose episodes the pooled probes
            (``value/pooled_*``) rest on: the W·B episodes of the last W steps. Default 32: with
            B = 16 episodes a step (the CPU jobs) that is 512 episodes, the size at which a V^µ
            critic is told from a V^π one in ≥ 80 % of windows on the exact toy of
            ``docs/research.md`` ("How much a probe can see"); 1 = no pooling.
        weight_cap: the cap C > 0 of the episode weights min(π/µ, C) (Ionides 2008's truncated IS).

    Raises:
        ValueError: ``window_steps`` not an int ≥ 1; ``weight_cap`` not a number > 0.
    """

    window_steps: int = DEFAULT_PROBE_WINDOW
    weight_cap: float = DEFAULT_SEQ_WEIGHT_CAP

    def __post_init__(self) -> None:
        w = self.window_steps
        _setting(isinstance(w, int) and not isinstance(w, bool) and w >= 1, "window_steps", w,
                 "must be an int >= 1 (learner steps)")
        _above_zero("weight_cap", self.weight_cap)
