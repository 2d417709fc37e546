"""The algorithm configuration and the paper's named presets (spec, "Baselines").

:class:`AlgorithmConfig` is a frozen dataclass validated at construction: a bad field raises
``ValueError`` naming the field and the value. It holds the fields every estimator and loss
share; a built-in's own knobs (η_A of ``copc``, η_P of ``dis``, the PPO clip, V-trace's ρ̄ / c̄,
...) are its registered settings dataclass (:mod:`copc.component_settings`), held in
``estimator_settings`` / ``policy_loss_settings`` exactly as a user's plug-in's are.
``advantage_estimator`` and ``policy_loss`` are checked against the open registries
:data:`copc.ADVANTAGE_ESTIMATORS` / :data:`copc.POLICY_LOSSES` (and their metadata) when the
config is built, so register a custom one first.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ._scalars import LOSS_AGG_MODES, OBS_DISCOUNT_MODES, check_number
from .margins import EPS_HIGH, EPS_LOW
from .registries import ADVANTAGE_ESTIMATORS, POLICY_LOSSES

OBS_REWARD_MODES = ("fold", "error")


def _unit(name: str, v: object) -> None:
    if not 0.0 <= check_number(name, v) <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {v!r}")


def _positive(name: str, v: object, *, allow_none: bool = False) -> None:
    if v is None and allow_none:
        return
    if v is None or not check_number(name, v) > 0.0:
        raise ValueError(f"{name} must be > 0{' or None' if allow_none else ''}, got {v!r}")

#: Fields that moved from :class:`AlgorithmConfig` into a built-in's own settings: old field →
#: ``(settings field, which built-ins)``; a preset override or ``replace`` naming one is refused
#: with one line naming the new spelling (:func:`moved_field_hint`).
MOVED_FIELDS: dict[str, tuple[str, str]] = {
    "eta_a": ("estimator_settings.eta_a", "advantage_estimator: copc"),
    "rho_clip": ("estimator_settings.rho_clip", "advantage_estimator: vtrace | brace"),
    "c_clip": ("estimator_settings.c_clip", "advantage_estimator: vtrace | brace"),
    "std_normalize": ("estimator_settings.std_normalize", "advantage_estimator: grpo"),
    "eta_p": ("policy_loss_settings.eta_p", "policy_loss: dis"),
    "dis_ppo_clip_eps": ("policy_loss_settings.ppo_clip_eps", "policy_loss: dis"),
    **{k: (f"policy_loss_settings.{k}", "policy_loss: ppo | decoupled_ppo | tis | icepop")
       for k in ("clip_low", "clip_high", "dual_clip_c")},
    **{k: (f"policy_loss_settings.{k}", "policy_loss: decoupled_ppo")
       for k in ("behav_weight_cap", "behav_cap_mode")},
    "tis_cap": ("policy_loss_settings.tis_cap", "policy_loss: tis"),
    **{k: (f"policy_loss_settings.{k}", "policy_loss: icepop") for k in ("icepop_low", "icepop_high")},
}


#: Fields removed from :class:`AlgorithmConfig`: old field → why (refused naming the replacement).
REMOVED_FIELDS: dict[str, str] = {
    "max_staleness": "left the algorithm: the staleness is the trainer's (train.staleness; the "
                     "'ppo' preset is synchronous through the trainer's preset table)",
}


def moved_field_hint(name: str) -> str | None:
    """The one-line refusal of a field that left :class:`AlgorithmConfig`, else None.

    Example: ``"eta_a: moved to estimator_settings.eta_a (with advantage_estimator: copc)"``
    (:data:`MOVED_FIELDS`); ``"max_staleness: left the algorithm: ..."`` (:data:`REMOVED_FIELDS`).
    """
    if name in REMOVED_FIELDS:
        return f"{name}: {REMOVED_FIELDS[name]}"
    if name not in MOVED_FIELDS:
        return None
    new, where = MOVED_FIELDS[name]
    return f"{name}: moved to {new} (with {where})"


def _settings_of(registry: Any, name: str, raw: Any, key: str) -> Any:
    """``registry.build_settings(name, raw, key)``; a built-in's knob given to another component
    is refused with the one line plus which components it belongs to (:data:`MOVED_FIELDS`):
    ``policy_loss_settings.clip_high=0.28: unknown setting of DisSettings; ... (clip_high is a
    setting of policy_loss: ppo | decoupled_ppo | tis | icepop)``.

    Raises:
        ValueError: as :meth:`seams.registry.Registry.build_settings`.
    """
    try:
        return registry.build_settings(name, raw, key)
    except ValueError as e:
        field = str(e).partition("=")[0].rpartition(".")[2]
        old = {"ppo_clip_eps": "dis_ppo_clip_eps"}.get(field, field)  # its old central spelling
        owner = MOVED_FIELDS.get(old)
        if "unknown setting" not in str(e) or owner is None or not owner[0].startswith(key):
            raise
        raise ValueError(f"{e} ({field} is a setting of {owner[1]})") from None


def _check_field_names(names: Any) -> None:
    """Raise ``ValueError`` for a name that is not an :class:`AlgorithmConfig` field (a moved one
    with its new spelling)."""
    known = {f.name for f in dataclasses.fields(AlgorithmConfig)}
    unknown = sorted(set(names) - known)
    for name in unknown:
        hint = moved_field_hint(name)
        if hint:
            raise ValueError(hint)
    if unknown:
        raise ValueError(f"unknown AlgorithmConfig field(s) {unknown}; known: {sorted(known)}")


@dataclass(frozen=True)
class AlgorithmConfig:
    """Everything that defines an actor(-critic) update; one instance per preset.

    Attributes (spec sections in brackets):
        name: preset name (free text for custom configs).
        advantage_estimator: a name registered in :data:`copc.ADVANTAGE_ESTIMATORS` (built-in:
            ``copc`` | ``gae`` | ``vtrace`` | ``brace`` | ``grpo`` | ``batch_norm``).
        policy_loss: a name registered in :data:`copc.POLICY_LOSSES` (built-in: ``dis`` |
            ``ppo`` | ``decoupled_ppo`` | ``tis`` | ``icepop``).
        use_critic: train a value model; must equal the estimator's ``needs_critic``
            metadata (True for ``copc``/``gae``/``vtrace``).
        gamma, lam: γ, λ ∈ [0, 1] per action token ["Setting"; paper γ = λ = 1].
        eps_low, eps_high: shared base margins ε_ℓ ∈ [0, 1], ε_h ≥ 0 of both channels
            ["Margins"]; the channel strengths η_A / η_P are the settings of ``copc`` / ``dis``.
        normalize_advantages: whiten advantages over the batch's action tokens
            ["Policy channel", (choice), default off].
        loss_agg_mode: actor loss aggregation ["Policy channel", (choice)].
        value_clip_eps: ε_V of the clipped value loss, None = unclipped ["Critic loss"].
        value_loss_agg_mode: critic aggregation ["Critic loss": mean over action tokens].
        obs_reward: reward on observation tokens: ``fold`` onto the preceding action token
            or ``error`` ["Setting", (choice)].
        obs_discount: ``skip`` observation tokens in the recursion (default) or discount
            ``per_token`` ["Setting", (choice)]; ``vtrace`` supports ``skip`` only.
        n_samples_per_prompt: the rollouts per prompt the algorithm is defined for (``sao`` = 1,
            a single rollout per prompt), None = any; a run whose rollout count differs is
            rejected (by the trainer's config), not silently changed. Must be >= 2 when the
            estimator ``needs_groups``.

    VAPO options (Yue et al. 2025, "VAPO", arXiv 2504.05118, §3; ``docs/vapo.md``), all off by
    default so that the spec's estimator and losses are unchanged, bit for bit:
        critic_lam: λ of the critic targets (returns) only, "decoupled GAE" (VAPO §3.1:
            λ_critic = 1); None = ``lam`` for both. The actor advantages keep ``lam`` (or the
            length-adaptive λ). Needs a critic estimator.
        length_adaptive_alpha: α > 0 of the "length-adaptive GAE" (VAPO §3.2, paper α = 0.05):
            the actor advantages of row ``b`` use ``λ_b = clip(1 − 1/(α l_b), 0, 1)`` with
            ``l_b`` its number of action tokens (:func:`copc.advantages.length_adaptive_lambda`), instead
            of ``lam``; None = off. Needs a critic estimator.
        pos_lm_coef: μ ≥ 0 of the "positive-example LM loss" (VAPO §3.3, paper μ = 0.1): the
            actor loss gets ``+ μ · NLL`` of the action tokens of episodes whose reward
            (``scores``) is ``> pos_lm_reward_threshold``
            (:func:`copc.policy_losses.positive_lm_loss`); 0 = off.
        pos_lm_reward_threshold: the episode reward above which an episode is positive (a
            correct answer for 0/1 rewards; default 0.5).
        critic_warmup_mc_returns: during the critic warm-up steps (the trainer's
            ``train.critic_warmup_steps``, VAPO's "value pretraining", §3.1), train the critic on
            Monte-Carlo returns (plain GAE returns with λ = 1, no advantage-channel weighting)
            instead of the estimator's returns. Needs a critic estimator.

    Plug-in settings (the registered estimator's / loss's own knobs, built-ins included:
    :mod:`copc.component_settings`):
        estimator_settings: an instance of the settings dataclass ``advantage_estimator`` was
            registered with (``ADVANTAGE_ESTIMATORS.register(name, settings=Cls)``), given as
            a mapping of its fields (or None: its defaults); None when it takes no settings.
            The estimator reads ``cfg.estimator_settings`` (``copc``: :class:`CopcSettings`
            ``eta_a``; ``vtrace``: ``rho_clip``, ``c_clip``; ``brace``: those, ``horizon`` and ``tail``;
            ``grpo``: ``std_normalize``).
        policy_loss_settings: the same for ``policy_loss`` (``cfg.policy_loss_settings``;
            ``dis``: ``eta_p``, ``ppo_clip_eps``; ``ppo``: :class:`PPOClip` ``clip_low``,
            ``clip_high``, ``dual_clip_c``; ``decoupled_ppo`` / ``tis`` / ``icepop``: those and
            their own).

    Raises:
        ValueError: at construction, naming the first invalid field and its value; an
            unregistered ``advantage_estimator``/``policy_loss`` (listing the registered ones);
            ``use_critic`` differing from the estimator's ``needs_critic``; or
            ``n_samples_per_prompt = 1`` with an estimator that ``needs_groups``.
    """

    name: str = "copc"
    advantage_estimator: str = "copc"
    policy_loss: str = "dis"
    use_critic: bool = True
    gamma: float = 1.0
    lam: float = 1.0
    eps_low: float = EPS_LOW
    eps_high: float = EPS_HIGH
    normalize_advantages: bool = False
    loss_agg_mode: str = "seq-mean-token-mean"
    value_clip_eps: float | None = 0.5
    value_loss_agg_mode: str = "token-mean"
    obs_reward: str = "fold"
    obs_discount: str = "skip"
    n_samples_per_prompt: int | None = None
    critic_lam: float | None = None
    length_adaptive_alpha: float | None = None
    pos_lm_coef: float = 0.0
    pos_lm_reward_threshold: float = 0.5
    critic_warmup_mc_returns: bool = False
    estimator_settings: Any = None
    policy_loss_settings: Any = None

    def __post_init__(self) -> None:
        """Validate every field (see class docstring)."""
        for n in ("use_critic", "normalize_advantages", "critic_warmup_mc_returns"):
            if not isinstance(getattr(self, n), bool):
                raise ValueError(f"{n} must be a bool, got {getattr(self, n)!r}")
        for n in ("name", "advantage_estimator", "policy_loss", "loss_agg_mode", "value_loss_agg_mode",
                  "obs_reward", "obs_discount"):
            if not isinstance(getattr(self, n), str):
                raise ValueError(f"{n} must be a string, got {getattr(self, n)!r}")
        # read the registries now (not at import): a user's registration before this counts
        if self.advantage_estimator not in ADVANTAGE_ESTIMATORS:
            raise ValueError(f"advantage_estimator must be one of the registered advantage estimators "
                             f"{ADVANTAGE_ESTIMATORS.names()}, got {self.advantage_estimator!r} "
                             "(register a custom one with copc.ADVANTAGE_ESTIMATORS.register first)")
        if self.policy_loss not in POLICY_LOSSES:
            raise ValueError(f"policy_loss must be one of the registered policy losses "
                             f"{POLICY_LOSSES.names()}, got {self.policy_loss!r} "
                             "(register a custom one with copc.POLICY_LOSSES.register first)")
        meta = ADVANTAGE_ESTIMATORS.metadata(self.advantage_estimator)
        # the plug-ins' own settings: a mapping (or None) becomes their settings dataclass
        for registry, which, key in ((ADVANTAGE_ESTIMATORS, "advantage_estimator", "estimator_settings"),
                                     (POLICY_LOSSES, "policy_loss", "policy_loss_settings")):
            built = _settings_of(registry, getattr(self, which), getattr(self, key), key)
            object.__setattr__(self, key, built)
        if self.use_critic and not meta["needs_critic"]:
            raise ValueError(f"use_critic=True with advantage_estimator={self.advantage_estimator!r}: "
                             "that estimator never reads values, the critic would train for nothing")
        if meta["needs_critic"] and not self.use_critic:
            raise ValueError(
                f"use_critic=False is incompatible with advantage_estimator={self.advantage_estimator!r}"
                " (it needs values)")
        n = self.n_samples_per_prompt
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ValueError(f"n_samples_per_prompt must be an int >= 1 or None, got {n!r}")
        if meta["needs_groups"] and n is not None and n < 2:
            raise ValueError(f"n_samples_per_prompt={n!r} is incompatible with advantage_estimator="
                             f"{self.advantage_estimator!r} (group-relative: needs >= 2)")
        for n in ("gamma", "lam", "eps_low"):
            _unit(n, getattr(self, n))
        if not check_number("eps_high", self.eps_high) >= 0.0:
            raise ValueError(f"eps_high must be >= 0, got {self.eps_high!r}")
        _positive("value_clip_eps", self.value_clip_eps, allow_none=True)
        for n in ("loss_agg_mode", "value_loss_agg_mode"):
            if getattr(self, n) not in LOSS_AGG_MODES:
                raise ValueError(f"{n} must be one of {LOSS_AGG_MODES}, got {getattr(self, n)!r}")
        if self.obs_reward not in OBS_REWARD_MODES:
            raise ValueError(f"obs_reward must be one of {OBS_REWARD_MODES}, got {self.obs_reward!r}")
        if self.obs_discount not in OBS_DISCOUNT_MODES:
            raise ValueError(f"obs_discount must be one of {OBS_DISCOUNT_MODES}, got {self.obs_discount!r}")
        if self.obs_discount != "skip" and not meta["per_token_obs_discount"]:
            raise ValueError(f"obs_discount={self.obs_discount!r} is not supported by advantage_estimator="
                             f"{self.advantage_estimator!r} (its per_token_obs_discount metadata is False)")
        self._check_vapo(meta["needs_critic"])

    def _check_vapo(self, needs_critic: bool) -> None:
        """Validate the VAPO options (see the class docstring)."""
        if self.critic_lam is not None:
            _unit("critic_lam", self.critic_lam)
        _positive("length_adaptive_alpha", self.length_adaptive_alpha, allow_none=True)
        if not math.isfinite(check_number("pos_lm_coef", self.pos_lm_coef)) or self.pos_lm_coef < 0.0:
            raise ValueError(f"pos_lm_coef must be a finite number >= 0, got {self.pos_lm_coef!r}")
        if not math.isfinite(check_number("pos_lm_reward_threshold", self.pos_lm_reward_threshold)):
            raise ValueError(f"pos_lm_reward_threshold must be finite, got {self.pos_lm_reward_threshold!r}")
        if not needs_critic:
            for n, off in (("critic_lam", None), ("length_adaptive_alpha", None),
                           ("critic_warmup_mc_returns", False)):
                if getattr(self, n) != off:
                    raise ValueError(f"{n}={getattr(self, n)!r} needs a critic, but advantage_estimator="
                                     f"{self.advantage_estimator!r} has none (it reads no λ or returns)")

    def replace(self, **overrides: Any) -> AlgorithmConfig:
        """Return a validated copy with ``overrides`` applied.

        A changed ``advantage_estimator`` / ``policy_loss`` without its ``*_settings`` override
        starts from the new one's defaults (the old settings belong to the old one).

        Raises:
            ValueError: for an unknown field name (a field that moved into a built-in's settings:
                one line naming its new spelling, :data:`MOVED_FIELDS`) or an invalid value.
        """
        _check_field_names(overrides)
        for which, key in _SETTINGS_OF:
            if overrides.get(which, getattr(self, which)) != getattr(self, which) and key not in overrides:
                overrides = {**overrides, key: None}
        return dataclasses.replace(self, **overrides)


#: (the name field, its settings field) of the two plug-in kinds an :class:`AlgorithmConfig` names.
_SETTINGS_OF = (("advantage_estimator", "estimator_settings"), ("policy_loss", "policy_loss_settings"))


_PRESETS: dict[str, dict[str, Any]] = {
    # spec table "Baselines the paper compares"
    # (synchronous: max staleness 0, a trainer setting: trainer.config.train_section.PRESET_STALENESS)
    "ppo": dict(advantage_estimator="gae", policy_loss="ppo"),
    "ppo_async": dict(advantage_estimator="gae", policy_loss="ppo"),
    "areal": dict(advantage_estimator="gae", policy_loss="decoupled_ppo"),
    "sao": dict(advantage_estimator="batch_norm", policy_loss="dis", use_critic=False,
                n_samples_per_prompt=1),
    # the SAO recipe with its critic (arXiv 2607.07508): one rollout per prompt, DIS actor, GAE
    # from a critic updated K = 2 times per actor update (train.critic_updates_per_step in
    # configs/*/sao_critic.yaml: a trainer setting, not the algorithm's)
    "sao_critic": dict(advantage_estimator="gae", policy_loss="dis", n_samples_per_prompt=1),
    "vtrace": dict(advantage_estimator="vtrace", policy_loss="ppo",
                   estimator_settings={"rho_clip": 1.0, "c_clip": 1.0}),
    "dapo": dict(advantage_estimator="grpo", policy_loss="ppo", use_critic=False,
                 policy_loss_settings={"clip_low": 0.2, "clip_high": 0.28}, loss_agg_mode="token-mean"),
    # BRACE (arXiv 2609.09783; docs/algorithm.md "BRACE"): capped V-trace critic targets, plain
    # PPO clip actor, the reported k = 100, ρ̄ = 1.2, c̄ = 1.1, value clip 0.5
    "brace": dict(advantage_estimator="brace", policy_loss="ppo", value_clip_eps=0.5,
                  estimator_settings={"horizon": 100, "rho_clip": 1.2, "c_clip": 1.1}),
    "copc_wo_rc": dict(advantage_estimator="copc", policy_loss="dis", estimator_settings={"eta_a": 0.0}),
    "copc": dict(advantage_estimator="copc", policy_loss="dis", estimator_settings={"eta_a": 0.5},
                 policy_loss_settings={"eta_p": 0.5}),
}

PRESET_NAMES = tuple(_PRESETS)

#: Fields that define a preset (not tunables): an override to another value is an error,
#: with a hint at the preset to use instead.
_PINNED: dict[str, dict[str, str]] = {
    "sao": {"n_samples_per_prompt": "preset 'sao' is single-rollout (n_samples_per_prompt=1); for "
                                    "groups of samples per prompt use 'dapo'"},
    "sao_critic": {"n_samples_per_prompt": "preset 'sao_critic' is single-rollout (n_samples_per_prompt=1)"},
}


def get_preset(name: str, /, **overrides: Any) -> AlgorithmConfig:
    """Build the named preset, optionally with field overrides (spec, "Baselines" table).

    Args:
        name: one of :data:`PRESET_NAMES` (``ppo``, ``ppo_async``, ``areal``, ``sao``, ``sao_critic``,
            ``vtrace``, ``dapo``, ``brace``, ``copc_wo_rc``, ``copc``).
        **overrides: :class:`AlgorithmConfig` fields to change (e.g. ``gamma=0.99``, or
            ``estimator_settings={"eta_a": 0.25}``). A ``*_settings`` mapping is merged over the
            preset's own settings of the same estimator / loss (``brace`` with
            ``estimator_settings={"horizon": 50}`` keeps ρ̄ = 1.2, c̄ = 1.1; None or ``{}`` keeps
            them all); naming another estimator / loss drops the preset's settings for it.
            ``name`` relabels the config (default: the preset's name).

    Returns:
        A frozen, validated :class:`AlgorithmConfig`.

    Raises:
        ValueError: for an unknown preset, unknown field (a moved one: naming its new spelling)
            or invalid value, or an override of a field the preset is defined by:
            ``n_samples_per_prompt`` other than 1 for the single-rollout ``sao``.
    """
    if name not in _PRESETS:
        raise ValueError(f"unknown preset {name!r}; available: {list(PRESET_NAMES)}")
    _check_field_names(overrides)
    preset = _PRESETS[name]
    for key, why in _PINNED.get(name, {}).items():
        if key in overrides and overrides[key] != preset[key]:
            raise ValueError(f"{why} (got {key}={overrides[key]!r})")
    fields = {"name": name, **preset, **overrides}  # ``name`` may be overridden (a run's label)
    for which, key in _SETTINGS_OF:
        own, given = preset.get(key), overrides.get(key)
        if fields[which] != preset[which]:
            fields[key] = given  # the preset's settings are for its own estimator / loss
        elif isinstance(own, Mapping) and isinstance(given, Mapping | None):
            fields[key] = {**own, **(given or {})}  # null / {}: the preset's own settings, unchanged
    return AlgorithmConfig(**fields)
