"""The built-in advantage estimators and policy losses as adapters with one uniform signature,
and the two calls that pick one by name from an :class:`AlgorithmConfig`:

* advantage estimators: ``fn(inputs: AdvantageInputs, cfg) -> (advantages, returns)``
* policy losses: ``fn(logp, inputs: PolicyLossInputs, cfg) -> (loss, metrics)``

The registries are open: :class:`AlgorithmConfig` validates ``advantage_estimator`` and
``policy_loss`` against them when it is built, so register before building the config::

    @copc.ADVANTAGE_ESTIMATORS.register("mc", needs_critic=False)
    def mc(inputs, cfg): ...

    cfg = copc.get_preset("copc", advantage_estimator="mc", use_critic=False)

An advantage estimator carries metadata, read by config validation (here and in the trainer):

* ``needs_critic`` (bool, required): it reads ``inputs.values``; ``use_critic`` must equal it.
* ``needs_groups`` (bool, default False): it compares samples of the same prompt (``grpo``),
  so a run needs ``n_samples_per_prompt >= 2``.

The two registries, instances of :class:`seams.registry.Registry`, live in
:mod:`copc.registries`, which registers the adapters below by reference
(:class:`seams.registry.LazyRef`, with their metadata and settings dataclasses): validating a
config reads the names, metadata and settings without importing this module (torch); the first
:meth:`~seams.registry.Registry.get` of a built-in imports it. The import graph stays one-way
(``registry -> presets -> registries``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .advantages import coupled_advantage_return, gae_advantage_return, vtrace_advantage_return
from .aggregation import Denominators
from .brace import brace_advantage_return
from .component_settings import PPOClip
from .outcome import (
    batch_normalized_advantages,
    broadcast_to_tokens,
    group_relative_advantages,
    masked_whiten,
)
from .policy_losses import (
    decoupled_ppo_policy_loss,
    dis_policy_loss,
    icepop_policy_loss,
    ppo_clip_policy_loss,
    tis_policy_loss,
)
from .presets import AlgorithmConfig
from .registries import ADVANTAGE_ESTIMATORS, POLICY_LOSSES

Tensor = torch.Tensor


@dataclass
class AdvantageInputs:
    """Tensors an advantage estimator may read. All ``(B, T)`` unless noted.

    Attributes:
        rewards: per-token reward (float). values: critic values (float) or None without critic.
        logp_old: learner log-probs before the update. logp_mu: behavior log-probs.
        loss_mask: bool/0-1 action-token mask.
        scores: ``(B,)`` outcome reward per sequence (critic-free estimators).
        group_ids: ``(B,)`` int prompt-group id per sequence (GRPO).
        bootstrap_values: ``(B,)`` V after the last action token of truncated rows.
    """

    rewards: Tensor
    loss_mask: Tensor
    values: Tensor | None = None
    logp_old: Tensor | None = None
    logp_mu: Tensor | None = None
    scores: Tensor | None = None
    group_ids: Tensor | None = None
    bootstrap_values: Tensor | None = None

    def require(self, *names: str, who: str) -> None:
        """Raise ``ValueError`` if any of ``names`` is None, naming the estimator."""
        missing = [n for n in names if getattr(self, n) is None]
        if missing:
            raise ValueError(f"{who} needs {missing}, which are None")


@dataclass
class PolicyLossInputs:
    """Tensors a policy loss may read (all ``(B, T)``), plus micro-batch denominators."""

    logp_old: Tensor
    logp_mu: Tensor
    advantages: Tensor
    loss_mask: Tensor
    denominators: Denominators | None = None


def _copc(x: AdvantageInputs, cfg: AlgorithmConfig) -> tuple[Tensor, Tensor]:
    x.require("values", "logp_old", "logp_mu", who="advantage estimator 'copc'")
    return coupled_advantage_return(x.rewards, x.values, x.logp_old, x.logp_mu, x.loss_mask,
                                    gamma=cfg.gamma, lam=cfg.lam, eta_a=cfg.estimator_settings.eta_a,
                                    eps_low=cfg.eps_low, eps_high=cfg.eps_high,
                                    bootstrap_values=x.bootstrap_values, obs_reward=cfg.obs_reward,
                                    obs_discount=cfg.obs_discount)


def _gae(x: AdvantageInputs, cfg: AlgorithmConfig) -> tuple[Tensor, Tensor]:
    x.require("values", who="advantage estimator 'gae'")
    return gae_advantage_return(x.rewards, x.values, x.loss_mask, gamma=cfg.gamma, lam=cfg.lam,
                                bootstrap_values=x.bootstrap_values, obs_reward=cfg.obs_reward,
                                obs_discount=cfg.obs_discount)


def _vtrace_rows(x: AdvantageInputs, cfg: AlgorithmConfig, lam: float | Tensor) -> tuple[Tensor, Tensor]:
    """V-trace with ``lam`` a float or a per-row ``(B,)`` tensor (its loop over T takes either)."""
    x.require("values", "logp_old", "logp_mu", who="advantage estimator 'vtrace'")
    s = cfg.estimator_settings
    return vtrace_advantage_return(x.rewards, x.values, x.logp_old, x.logp_mu, x.loss_mask,
                                   gamma=cfg.gamma, lam=lam, rho_clip=s.rho_clip,
                                   c_clip=s.c_clip, bootstrap_values=x.bootstrap_values,
                                   obs_reward=cfg.obs_reward)


def _vtrace(x: AdvantageInputs, cfg: AlgorithmConfig) -> tuple[Tensor, Tensor]:
    return _vtrace_rows(x, cfg, cfg.lam)


def _brace_rows(x: AdvantageInputs, cfg: AlgorithmConfig, lam: float | Tensor) -> tuple[Tensor, Tensor]:
    """BRACE with ``lam`` a float or a per-row ``(B,)`` tensor; ρ̄, c̄, ``k`` and the tail's
    reading from its settings."""
    x.require("values", "logp_old", "logp_mu", who="advantage estimator 'brace'")
    s = cfg.estimator_settings
    return brace_advantage_return(x.rewards, x.values, x.logp_old, x.logp_mu, x.loss_mask,
                                  gamma=cfg.gamma, lam=lam, rho_clip=s.rho_clip, c_clip=s.c_clip,
                                  horizon=s.horizon, bootstrap_values=x.bootstrap_values,
                                  obs_reward=cfg.obs_reward, tail=s.tail)


def _brace(x: AdvantageInputs, cfg: AlgorithmConfig) -> tuple[Tensor, Tensor]:
    return _brace_rows(x, cfg, cfg.lam)


def _grpo(x: AdvantageInputs, cfg: AlgorithmConfig) -> tuple[Tensor, Tensor]:
    x.require("scores", "group_ids", who="advantage estimator 'grpo'")
    std_normalize = cfg.estimator_settings.std_normalize
    adv = broadcast_to_tokens(group_relative_advantages(x.scores, x.group_ids,
                                                        std_normalize=std_normalize), x.loss_mask)
    return adv, adv.clone()


def _batch_norm(x: AdvantageInputs, cfg: AlgorithmConfig) -> tuple[Tensor, Tensor]:
    x.require("scores", who="advantage estimator 'batch_norm'")
    adv = broadcast_to_tokens(batch_normalized_advantages(x.scores), x.loss_mask)
    return adv, adv.clone()


def compute_advantages(inputs: AdvantageInputs, cfg: AlgorithmConfig) -> tuple[Tensor, Tensor]:
    """Run ``cfg.advantage_estimator`` (then optional whitening) on ``inputs``.

    Returns:
        ``(advantages, returns)``, each ``(B, T)``; for critic-free estimators ``returns`` is a
        copy of the (un-whitened) advantages and is not used.

    Raises:
        ValueError: for an unknown estimator or missing inputs (named), or as the estimator.
    """
    adv, ret = ADVANTAGE_ESTIMATORS.get(cfg.advantage_estimator)(inputs, cfg)
    if cfg.normalize_advantages:
        adv = masked_whiten(adv, inputs.loss_mask)
    return adv, ret


def _dis(logp: Tensor, x: PolicyLossInputs, cfg: AlgorithmConfig) -> tuple[Tensor, dict]:
    s = cfg.policy_loss_settings
    return dis_policy_loss(logp, x.logp_mu, x.advantages, x.loss_mask, eta_p=s.eta_p,
                           eps_low=cfg.eps_low, eps_high=cfg.eps_high,
                           loss_agg_mode=cfg.loss_agg_mode, logp_old=x.logp_old,
                           ppo_clip_eps=s.ppo_clip_eps, denominators=x.denominators)


def _clip(s: PPOClip) -> dict:
    """The :class:`PPOClip` keywords of a PPO-family loss's settings."""
    return dict(clip_low=s.clip_low, clip_high=s.clip_high, dual_clip_c=s.dual_clip_c)


def _ppo(logp: Tensor, x: PolicyLossInputs, cfg: AlgorithmConfig) -> tuple[Tensor, dict]:
    return ppo_clip_policy_loss(logp, x.logp_old, x.advantages, x.loss_mask,
                                **_clip(cfg.policy_loss_settings),
                                loss_agg_mode=cfg.loss_agg_mode, denominators=x.denominators)


def _decoupled(logp: Tensor, x: PolicyLossInputs, cfg: AlgorithmConfig) -> tuple[Tensor, dict]:
    s = cfg.policy_loss_settings
    return decoupled_ppo_policy_loss(logp, x.logp_old, x.logp_mu, x.advantages, x.loss_mask,
                                     **_clip(s), behav_weight_cap=s.behav_weight_cap,
                                     behav_cap_mode=s.behav_cap_mode,
                                     loss_agg_mode=cfg.loss_agg_mode, denominators=x.denominators)


def _tis(logp: Tensor, x: PolicyLossInputs, cfg: AlgorithmConfig) -> tuple[Tensor, dict]:
    s = cfg.policy_loss_settings
    return tis_policy_loss(logp, x.logp_old, x.logp_mu, x.advantages, x.loss_mask,
                           **_clip(s), tis_cap=s.tis_cap,
                           loss_agg_mode=cfg.loss_agg_mode, denominators=x.denominators)


def _icepop(logp: Tensor, x: PolicyLossInputs, cfg: AlgorithmConfig) -> tuple[Tensor, dict]:
    s = cfg.policy_loss_settings
    return icepop_policy_loss(logp, x.logp_old, x.logp_mu, x.advantages, x.loss_mask,
                              **_clip(s), icepop_low=s.icepop_low,
                              icepop_high=s.icepop_high, loss_agg_mode=cfg.loss_agg_mode,
                              denominators=x.denominators)


def compute_policy_loss(logp: Tensor, inputs: PolicyLossInputs, cfg: AlgorithmConfig
                        ) -> tuple[Tensor, dict[str, float]]:
    """Run ``cfg.policy_loss`` on the current log-probs ``logp`` ``(B, T)`` (with grad).

    Returns:
        ``(loss, metrics)`` as the chosen loss.

    Raises:
        ValueError: for an unknown loss name, or as the loss.
    """
    return POLICY_LOSSES.get(cfg.policy_loss)(logp, inputs, cfg)
