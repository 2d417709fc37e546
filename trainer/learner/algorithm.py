"""The algorithm of the learner step, backend-independent: :class:`ActorCriticAlgorithm`, all
through :mod:`copc` (no RL maths here). The step that runs it over a backend's hooks is
:class:`~trainer.learner.template.TemplateLearner` (:mod:`trainer.learner.template`).

* advantages and returns from the recomputed ``logp_old`` / ``values_old`` (the preset's
  estimator, :func:`copc.compute_advantages`) and their step metrics, with the VAPO options
  (``docs/vapo.md``): decoupled λ for the critic targets, length-adaptive λ for the actor
  advantages, Monte-Carlo critic targets during the critic warm-up;
* the PPO mini-batch split (seeded permutation) and micro-batches;
* global loss denominators per mini-batch (:func:`copc.batch_denominators`), so the losses of
  micro-batches *sum* to the mini-batch loss exactly whatever the micro-batch size (a
  distributed backend's ranks each hold the whole mini-batch, so these are the global counts);
* the policy loss (plus VAPO's positive-example LM term when ``pos_lm_coef > 0``) and the value
  loss of a micro-batch;
* metric combination (:class:`~trainer.learner.step_metrics.MetricAccumulator`): losses summed
  over micro-batches (the true mini-batch loss), fractions and means weighted by the
  micro-batch's action-token count, maxima/minima taken.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

import copc
from copc.advantages import length_adaptive_lambda, per_row_lambda
from copc.component_settings import ValueProbeSettings
from copc.metrics import (
    abs_log_ratio_by_staleness,
    advantage_channel_ess,
    policy_channel_diagnostics,
    value_bias_metrics,
)
from copc.policy_losses import positive_lm_loss
from copc.value_probe_window import ValueProbeWindow
from copc.value_probes import policy_value_by_staleness, probe_terms

from ..rollout.batch import RolloutBatch
from .outside_support import floor_outside_support, is_outside, outside_support_fraction, support_loss_mask
from .settings import LearnerConfig
from .step_metrics import MetricAccumulator, ValueBiasTracker

Tensor = torch.Tensor

@dataclass(frozen=True)
class StepInputs:
    """Per-row tensors of one batch computed once before the updates (all ``(B, T)``).

    Attributes:
        logp_old: float32 log-probs of the proximal policy (the weights before this step).
        values_old: float32 critic values ``V(s_t)`` before this step, or None (no critic).
        advantages / returns: float32, from the preset's estimator.
    """

    logp_old: Tensor
    values_old: Tensor | None
    advantages: Tensor
    returns: Tensor

    def rows(self, idx: list[int]) -> StepInputs:
        """The same tensors restricted to batch rows ``idx``."""
        return StepInputs(self.logp_old[idx], None if self.values_old is None else self.values_old[idx],
                          self.advantages[idx], self.returns[idx])

    def rows_slice(self, sl: slice) -> StepInputs:
        """The same tensors restricted to the contiguous rows ``sl`` (a micro-batch)."""
        return StepInputs(self.logp_old[sl], None if self.values_old is None else self.values_old[sl],
                          self.advantages[sl], self.returns[sl])

    def to(self, device: torch.device) -> StepInputs:
        """The same tensors on ``device`` (``self`` when already there)."""
        if self.logp_old.device == device:
            return self
        return StepInputs(*(None if t is None else t.to(device)
                            for t in (self.logp_old, self.values_old, self.advantages, self.returns)))


@dataclass(frozen=True)
class MiniBatchDenominators(copc.Denominators):
    """:class:`copc.Denominators` of a mini-batch plus those of its positive episodes.

    Attributes:
        positive: token / sequence counts of the action tokens of the mini-batch's positive
            episodes (VAPO's positive-example LM loss), or None when that loss is off.
    """

    positive: copc.Denominators | None = None


class ActorCriticAlgorithm:
    """The algorithm part of a learner step, configured by a :class:`copc.AlgorithmConfig`.

    Args:
        algo: the preset (estimator, losses, clipping).
        num_mini_batches: optimizer updates per step (PPO mini-batches, one epoch).
        micro_batch_size: rows per forward/backward (gradient accumulation).
        critic_warmup_steps: first steps update only the critic (ignored without a critic).
        seed: mini-batch permutation seed (the permutation of step ``n`` uses
            ``seed · 1000003 + n``).
        critic_updates_per_step: ``K`` ≥ 1 critic updates on every mini-batch for its one actor
            update (SAO's critic recipe, arXiv 2607.07508, K = 2); 1: the usual one.
        value_probes: the π-referenced value probes' window and weight cap
            (:class:`~copc.component_settings.ValueProbeSettings`); None: the defaults.

    Raises:
        ValueError: a count < 1.
    """

    def __init__(self, algo: copc.AlgorithmConfig, *, num_mini_batches: int = 1, micro_batch_size: int = 8,
                 critic_warmup_steps: int = 0, seed: int = 0, critic_updates_per_step: int = 1,
                 value_probes: ValueProbeSettings | None = None) -> None:
        if num_mini_batches < 1 or micro_batch_size < 1 or critic_updates_per_step < 1:
            raise ValueError(f"num_mini_batches={num_mini_batches!r}, micro_batch_size="
                             f"{micro_batch_size!r} and critic_updates_per_step="
                             f"{critic_updates_per_step!r} must be >= 1")
        self.critic_updates_per_step = critic_updates_per_step
        self.algo, self.num_mini_batches, self.micro_batch_size = algo, num_mini_batches, micro_batch_size
        self.critic_warmup_steps, self.seed = critic_warmup_steps, seed
        self.value_bias = ValueBiasTracker()
        self.value_probes = value_probes or ValueProbeSettings()
        self.value_probe_window = ValueProbeWindow(self.value_probes)

    @classmethod
    def from_config(cls, algo: copc.AlgorithmConfig, cfg: LearnerConfig) -> ActorCriticAlgorithm:
        """The algorithm of ``algo`` with the step settings of a :class:`LearnerConfig`."""
        return cls(algo, num_mini_batches=cfg.num_mini_batches, micro_batch_size=cfg.micro_batch_size,
                   critic_warmup_steps=cfg.critic_warmup_steps, seed=cfg.seed,
                   critic_updates_per_step=cfg.critic_updates_per_step, value_probes=cfg.value_probes)

    def diagnostics_state_dict(self) -> dict:
        """The diagnostics' learner state for a checkpoint: the value-bias EMA
        (:class:`ValueBiasTracker`) and the pooled value probes' window (:class:`ValueProbeWindow`)."""
        return {**self.value_bias.state_dict(), **self.value_probe_window.state_dict()}

    def load_diagnostics_state_dict(self, state: dict) -> None:
        """Restore :meth:`diagnostics_state_dict` output (one without the window, from an older
        checkpoint, starts an empty window).

        Raises:
            ValueError: as :meth:`ValueBiasTracker.load_state_dict` /
                :meth:`ValueProbeWindow.load_state_dict`.
        """
        self.value_bias.load_state_dict(state)
        self.value_probe_window.load_state_dict(state)

    def advantages(self, batch: RolloutBatch, logp_old: Tensor, values_old: Tensor | None,
                   version: int, *, steps_done: int | None = None) -> tuple[StepInputs, dict[str, float]]:
        """Advantages/returns (spec: the preset's estimator) and the step's off-policy metrics.

        With the VAPO options off this is exactly :func:`copc.compute_advantages` (bit for bit);
        see :meth:`estimate` for what they change.

        Args:
            batch: the rollout batch (rewards, loss mask, behavior log-probs, versions, scores).
            logp_old: ``(B, T)`` proximal-policy log-probs (recomputed, no grad).
            values_old: ``(B, T)`` critic values (no grad) or None.
            version: the learner's policy version before this update (staleness reference).
            steps_done: the learner's completed steps, to tell a critic warm-up step
                (:meth:`in_critic_warmup`); None = not a warm-up step.

        Returns:
            ``(StepInputs, metrics)``; metrics: :meth:`off_policy_diagnostics`,
            ``advantage/mean``, ``advantage/returns_mean``, ``perf/advantage_s``,
            ``diag/outside_support_frac`` and, with the VAPO options, ``advantage/actor_lam_mean`` /
            ``critic/mc_targets``.

        Action tokens outside π_old's top-k / top-p support (``logp_old`` ``-inf``) are floored
        (:func:`~trainer.learner.outside_support.floor_outside_support`: ratio π_old/µ exactly 0 for
        the estimator and the diagnostics), counted in ``diag/outside_support_frac`` and masked
        from the policy loss (:meth:`policy_loss`); ``StepInputs.logp_old`` holds the floored values.

        Call it once per learner step: it advances the value-bias EMA (:class:`ValueBiasTracker`).
        """
        mask = batch.loss_mask
        logp_old, outside = floor_outside_support(logp_old, mask)
        t0 = time.perf_counter()
        warmup = steps_done is not None and self.in_critic_warmup(steps_done, values_old is not None)
        adv, returns, extra = self.estimate(copc.AdvantageInputs(
            rewards=batch.rewards, loss_mask=mask, values=values_old, logp_old=logp_old,
            logp_mu=batch.logp_mu, scores=batch.scores, group_ids=batch.group_ids), critic_warmup=warmup)
        metrics: dict[str, float] = {"perf/advantage_s": time.perf_counter() - t0, **extra}
        metrics.update(self.off_policy_diagnostics(batch, logp_old, values_old, version))
        metrics["diag/outside_support_frac"] = outside_support_fraction(outside, mask)
        m = mask.bool()
        metrics["advantage/mean"] = float(adv[m].mean()) if m.any() else 0.0
        metrics["advantage/returns_mean"] = float(returns[m].mean()) if m.any() else 0.0
        return StepInputs(logp_old, values_old, adv, returns), metrics

    def estimate(self, inputs: copc.AdvantageInputs, *, critic_warmup: bool = False
                 ) -> tuple[Tensor, Tensor, dict[str, float]]:
        """Actor advantages and critic targets, ``(B, T)`` each, with the VAPO options.

        * no option set: one :func:`copc.compute_advantages` call (unchanged, bit for bit);
        * ``critic_lam`` (decoupled GAE, VAPO §3.1): returns from the estimator with
          λ = ``critic_lam``, advantages from the estimator with the actor's λ;
        * ``length_adaptive_alpha`` (VAPO §3.2): the actor's λ of row ``b`` is
          :func:`copc.advantages.length_adaptive_lambda`; the estimator runs once per distinct λ
          on its rows (:func:`copc.advantages.per_row_lambda`; any registered estimator that
          reads ``cfg.lam``; ``vtrace``, whose loop over T would repeat per λ, takes the ``(B,)``
          λ in one call), then ``normalize_advantages`` whitens the whole batch;
        * ``critic_warmup_mc_returns`` and ``critic_warmup``: the returns are Monte-Carlo returns
          (:func:`copc.gae_advantage_return` with λ = 1: the γ-discounted reward-to-go over
          action tokens, no advantage-channel weighting), VAPO's value pretraining targets.

        Args:
            inputs: the estimator's inputs (``values`` None without a critic).
            critic_warmup: this step only trains the critic.

        Returns:
            ``(advantages, returns, metrics)``; metrics ``advantage/actor_lam_mean`` (length-
            adaptive λ) and ``critic/mc_targets`` (1.0 on a Monte-Carlo warm-up step).

        Raises:
            ValueError: as the estimator.
        """
        algo, mask = self.algo, inputs.loss_mask
        critic_lam = algo.lam if algo.critic_lam is None else algo.critic_lam
        mc = critic_warmup and algo.critic_warmup_mc_returns and inputs.values is not None
        if algo.length_adaptive_alpha is None and critic_lam == algo.lam and not mc:
            adv, ret = copc.compute_advantages(inputs, algo)  # the spec's path, unchanged
            return adv, ret, {}
        metrics: dict[str, float] = {}
        plain = algo.replace(normalize_advantages=False)
        if algo.length_adaptive_alpha is None:
            adv, ret = copc.compute_advantages(inputs, algo)
        else:
            lam = length_adaptive_lambda(mask, algo.length_adaptive_alpha)
            rows = copc.ADVANTAGE_ESTIMATORS.metadata(algo.advantage_estimator)["lambda_rows"]
            if rows is not None:  # the estimator takes a (B,) λ in one pass (vtrace), not one run per λ
                adv, ret = rows(inputs, plain, lam)
            else:
                adv, ret = per_row_lambda(lambda v, rows: copc.compute_advantages(
                    _input_rows(inputs, rows), plain.replace(lam=v)), lam, mask.shape[0])
            if algo.normalize_advantages:
                adv = copc.masked_whiten(adv, mask)
            has_action = mask.bool().any(1)
            metrics["advantage/actor_lam_mean"] = float(lam[has_action].mean()) if has_action.any() else 0.0
        if mc:
            ret = copc.gae_advantage_return(inputs.rewards, inputs.values, mask, gamma=algo.gamma, lam=1.0,
                                            bootstrap_values=inputs.bootstrap_values,
                                            obs_reward=algo.obs_reward, obs_discount=algo.obs_discount)[1]
            metrics["critic/mc_targets"] = 1.0
        elif critic_lam != algo.lam or algo.length_adaptive_alpha is not None:
            ret = copc.compute_advantages(inputs, plain.replace(lam=critic_lam))[1]
        return adv, ret, metrics

    def mini_batch_updates(self, batch: RolloutBatch, x: StepInputs, steps_done: int, *, has_critic: bool,
                           update: Callable[[str, RolloutBatch, StepInputs, MiniBatchDenominators,
                                             MetricAccumulator], None]) -> tuple[dict[str, float], bool]:
        """The mini-batch loop of one learner step.

        For each mini-batch (:meth:`mini_batches`): its loss denominators (:meth:`denominators`,
        those of the WHOLE mini-batch, which every rank of a distributed backend holds), then
        ``update("actor", mini, inputs, denominators, acc)`` (skipped during critic warm-up,
        :meth:`update_actor`) and ``critic_updates_per_step`` times ``update("critic", …)`` (the
        same mini-batch and targets; values re-read by each update), each adding its metrics to ``acc``.

        Args:
            batch: the step's batch (``B`` rows). x: its :class:`StepInputs` (from :meth:`advantages`).
            steps_done: updates done before this step. has_critic: whether there is a critic.
            update: the backend's optimizer update of one model on one mini-batch.

        Returns:
            (the combined metrics of every update, whether the actor was updated).
        """
        acc = MetricAccumulator()
        update_actor = self.update_actor(steps_done, has_critic)
        for idx in self.mini_batches(len(batch), steps_done):
            mini, xm = batch.select(idx), x.rows(idx)
            den = self.denominators(mini)
            if update_actor:
                update("actor", mini, xm, den, acc)
                acc.end_mini_batch()
            for _ in range(self.critic_updates_per_step if has_critic else 0):
                update("critic", mini, xm, den, acc)
                acc.end_mini_batch()  # each update's loss is one value: K updates are averaged
        return acc.result(), update_actor

    def update_actor(self, steps_done: int, has_critic: bool) -> bool:
        """Whether step ``steps_done`` updates the actor (critic warm-up needs a critic)."""
        return not has_critic or steps_done >= self.critic_warmup_steps

    def in_critic_warmup(self, steps_done: int, has_critic: bool) -> bool:
        """Whether step ``steps_done`` trains only the critic (VAPO's value pretraining: the actor,
        hence the policy generating the rollouts, stays the initial one)."""
        return not self.update_actor(steps_done, has_critic)

    def mini_batches(self, n_rows: int, steps_done: int) -> list[list[int]]:
        """Row indices of each PPO mini-batch of step ``steps_done`` (seeded permutation)."""
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + steps_done)
        order = torch.randperm(n_rows, generator=gen)
        return [c.tolist() for c in order.chunk(self.num_mini_batches)]

    def micro_slices(self, n_rows: int) -> list[slice]:
        """Contiguous micro-batch row slices of a (mini-)batch of ``n_rows`` rows."""
        step = self.micro_batch_size
        return [slice(i, min(i + step, n_rows)) for i in range(0, n_rows, step)]

    def denominators(self, mini: RolloutBatch) -> MiniBatchDenominators:
        """Global loss denominators of a mini-batch (token and sequence counts; with the
        positive-example LM loss on, also those of its positive episodes)."""
        den = copc.batch_denominators(mini.loss_mask)
        pos = None
        if self.algo.pos_lm_coef > 0.0:
            pos = copc.batch_denominators(mini.loss_mask.bool() & self.positive_episodes(mini).unsqueeze(1))
        return MiniBatchDenominators(den.num_tokens, den.num_sequences, positive=pos)

    def positive_episodes(self, b: RolloutBatch) -> Tensor:
        """``(B,)`` bool: episodes whose reward (``scores``) is above ``pos_lm_reward_threshold``."""
        return b.scores > self.algo.pos_lm_reward_threshold

    def policy_loss(self, logp: Tensor, mb: RolloutBatch, x: StepInputs,
                    den: copc.Denominators) -> tuple[Tensor, dict[str, float]]:
        """The preset's policy loss of one micro-batch (a share of the mini-batch loss).

        With ``pos_lm_coef = μ > 0`` it adds ``μ ·`` :func:`copc.policy_losses.positive_lm_loss`
        (same aggregation mode; its denominators are ``den.positive`` when ``den`` comes from
        :meth:`denominators`, else this micro-batch's own, exact only when it is the whole
        mini-batch); metrics gain ``actor/pos_lm_loss`` (the NLL before μ) and
        ``actor/pos_lm_token_frac``.

        Action tokens outside the top-k / top-p support of π (``logp`` ``-inf``) or of π_old
        (``x.logp_old`` floored by :meth:`advantages`) have ratio 0 and are masked from the loss
        (they contribute 0; ``den`` unchanged: :mod:`trainer.learner.outside_support`); their share
        of the micro-batch's action tokens is ``actor/outside_support_frac``.
        """
        logp, out_now = floor_outside_support(logp, mb.loss_mask)
        mask = support_loss_mask(mb.loss_mask, out_now, is_outside(x.logp_old) & mb.loss_mask.bool())
        loss, metrics = copc.compute_policy_loss(logp, copc.PolicyLossInputs(
            logp_old=x.logp_old, logp_mu=mb.logp_mu, advantages=x.advantages,
            loss_mask=mask, denominators=den), self.algo)
        dropped = mb.loss_mask.bool() & ~mask.bool()
        metrics = {**metrics, "actor/outside_support_frac": outside_support_fraction(dropped, mb.loss_mask)}
        if self.algo.pos_lm_coef > 0.0:
            pos_den = den.positive if isinstance(den, MiniBatchDenominators) else None
            lm, lm_metrics = positive_lm_loss(logp, mask, self.positive_episodes(mb),
                                              loss_agg_mode=self.algo.loss_agg_mode, denominators=pos_den)
            loss = loss + self.algo.pos_lm_coef * lm
            metrics = {**metrics, **lm_metrics}
        return loss, metrics

    def value_loss(self, values: Tensor, mb: RolloutBatch, x: StepInputs,
                   den: copc.Denominators) -> tuple[Tensor, dict[str, float]]:
        """The clipped value loss of one micro-batch (``critic/value_loss`` added to the metrics).

        Raises:
            ValueError: no ``values_old`` (the algorithm has no critic).
        """
        if x.values_old is None:
            raise ValueError("value_loss: values_old is None (this algorithm has no critic)")
        loss, met = copc.value_loss(values, x.values_old, x.returns, mb.loss_mask,
                                    clip_eps=self.algo.value_clip_eps,
                                    loss_agg_mode=self.algo.value_loss_agg_mode, denominators=den)
        return loss, {**met, "critic/value_loss": float(loss.detach())}

    # -- per-step off-policy diagnostics (kept apart from the loss/estimator code) -----------
    def policy_channel_interval(self) -> tuple[float, float] | None:
        """(ℓ_P, u_P) of the policy channel, or None when the loss has none (its ``channel_margins``
        metadata; ``dis`` has one)."""
        fn = copc.POLICY_LOSSES.metadata(self.algo.policy_loss)["channel_margins"]
        return None if fn is None else fn(self.algo)

    def advantage_channel_interval(self) -> tuple[float, float] | None:
        """(ℓ_A, u_A) of the clipped-ratio advantage channel, or None when the estimator has none
        (its ``channel_margins`` metadata; ``copc`` has one, ``copc_wo_rc`` with η_A = 0, i.e. ρ̄ ≡ 1)."""
        fn = copc.ADVANTAGE_ESTIMATORS.metadata(self.algo.advantage_estimator)["channel_margins"]
        return None if fn is None else fn(self.algo)

    def off_policy_diagnostics(self, batch: RolloutBatch, logp_old: Tensor, values_old: Tensor | None,
                               version: int) -> dict[str, float]:
        """The step's staleness / off-policy diagnostics (all from the weights before the update).

        * ``advantage/ratio_*``: statistics of ``π_old/µ`` (every preset); with an advantage
          channel also ``advantage/clipped_{,low_,high_}frac`` and ``diag/advantage_ess_frac``;
        * with a policy channel: ``diag/policy_masked_{,low_,high_}frac``, ``diag/policy_ess_frac``;
        * ``staleness/mean|max|min`` and ``diag/abs_log_ratio_s{k}`` per staleness level k (over
          the tokens inside π_old's support: a floored one's log-ratio is not a distance);
        * with a critic: ``critic/value_bias``, ``critic/value_bias_abs``,
          ``critic/value_bias_drift`` (advances :attr:`value_bias`), all against µ's returns; and
          against π (:mod:`copc.value_probes`): ``value/policy_value_gap``, ``value/b_hat``,
          ``value/seq_weight_{ess,capped}_frac``, ``value/se_gap``, ``value/se_b_hat``, also per
          staleness level (``…_s{k}``); and pooled over the last ``value_probes.window_steps``
          steps (:class:`ValueProbeWindow`, advanced here): ``value/pooled_*``.

        Args:
            batch: the rollout batch (loss mask, behavior log-probs, token versions, rewards).
            logp_old: ``(B, T)`` proximal-policy log-probs. values_old: ``(B, T)`` or None.
            version: the learner's policy version before this update.

        Raises:
            ValueError: a token version newer than ``version``, or bad shapes.
        """
        mask, mu = batch.loss_mask, batch.logp_mu
        adv_iv, pol_iv = self.advantage_channel_interval(), self.policy_channel_interval()
        if adv_iv is not None:
            out = copc.advantage_channel_metrics(logp_old, mu, mask, *adv_iv)
            out.update(advantage_channel_ess(logp_old, mu, mask, *adv_iv))
        else:
            m = mask.bool()
            out = copc.ratio_statistics(torch.where(m, logp_old - mu, 0.0), m, "advantage")
        if pol_iv is not None:
            out.update(policy_channel_diagnostics(logp_old, mu, mask, *pol_iv))
        out.update(copc.staleness_metrics(batch.versions, version, mask))
        in_support = support_loss_mask(mask, is_outside(logp_old) & mask.bool())
        out.update(abs_log_ratio_by_staleness(logp_old, mu, batch.versions, version, in_support))
        if values_old is not None:
            out.update(value_bias_metrics(values_old, batch.rewards, mask, self.algo.gamma))
            out.update(self.value_bias.update(out))
            cap, gamma = self.value_probes.weight_cap, self.algo.gamma
            out.update(policy_value_by_staleness(values_old, batch.rewards, logp_old, mu, batch.versions,
                                                 version, mask, gamma, weight_cap=cap))
            out.update(self.value_probe_window.update(
                probe_terms(values_old, batch.rewards, logp_old, mu, mask, gamma, weight_cap=cap)))
        return out


def _input_rows(x: copc.AdvantageInputs, rows: Tensor) -> copc.AdvantageInputs:
    """The same estimator inputs restricted to batch rows ``rows`` (every ``(B, …)`` tensor)."""
    return dataclasses.replace(x, **{f.name: getattr(x, f.name)[rows] for f in dataclasses.fields(x)
                                     if getattr(x, f.name) is not None})
