"""The backend-independent part of an actor–critic learner step (any backend reuses it).

A backend supplies forward passes (per-token log-probs ``(B, T)`` and values ``(B, T)`` of a
micro-batch), backward and optimizer steps. This module supplies everything else, all through
:mod:`copc` (no RL maths here):

* advantages and returns from the recomputed ``logp_old`` / ``values_old`` (the preset's
  estimator, :func:`copc.compute_advantages`) and their step metrics;
* the PPO mini-batch split (seeded permutation) and micro-batches;
* global loss denominators per mini-batch (:func:`copc.batch_denominators`), so the losses of
  micro-batches *sum* to the mini-batch loss exactly whatever the micro-batch size;
* the policy loss and the value loss of a micro-batch;
* :class:`MetricAccumulator`: losses summed over micro-batches (the true mini-batch loss),
  fractions and means weighted by the micro-batch's action-token count, maxima/minima taken.

A distributed backend also all-reduces :class:`copc.Denominators` counts across data-parallel
ranks before computing losses (exact global token/sequence counts).
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass

import torch

import copc
from copc.metrics import (
    abs_log_ratio_by_staleness,
    advantage_channel_ess,
    ema_drift,
    policy_channel_diagnostics,
    value_bias_metrics,
)

from ..rollout.batch import RolloutBatch

Tensor = torch.Tensor

#: EMA decay of the value-bias drift probe (:class:`ValueBiasTracker`).
VALUE_BIAS_EMA_DECAY = 0.9


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


class MetricAccumulator:
    """Combines micro-batch metrics into step metrics.

    Rules (by key): ``*_loss`` — summed within a mini-batch (micro-batch losses with global
    denominators add up to the mini-batch loss), then averaged over mini-batches;
    ``*_max`` / ``*_min`` — max / min; ``*grad_norm`` — mean over optimizer updates;
    everything else (fractions, means) — weighted by the micro-batch's action-token count.
    """

    def __init__(self) -> None:
        self._loss_mb: dict[str, float] = defaultdict(float)  # current mini-batch's sums
        self._loss: dict[str, list[float]] = defaultdict(list)
        self._wsum: dict[str, float] = defaultdict(float)
        self._w: dict[str, float] = defaultdict(float)
        self._ext: dict[str, float] = {}
        self._plain: dict[str, list[float]] = defaultdict(list)

    def add_micro(self, metrics: dict[str, float], tokens: float) -> None:
        """Add one micro-batch's metrics; ``tokens`` = its number of action (loss-mask-1) tokens."""
        for k, v in metrics.items():
            v = float(v)
            if k.endswith("_loss"):
                self._loss_mb[k] += v
            elif k.endswith("_max"):
                self._ext[k] = max(self._ext.get(k, v), v)
            elif k.endswith("_min"):
                self._ext[k] = min(self._ext.get(k, v), v)
            else:
                self._wsum[k] += v * tokens
                self._w[k] += tokens

    def end_mini_batch(self) -> None:
        """Close the current mini-batch (its summed losses become one value each)."""
        for k, v in self._loss_mb.items():
            self._loss[k].append(v)
        self._loss_mb.clear()

    def add(self, key: str, value: float) -> None:
        """A once-per-update value (e.g. a gradient norm), averaged over updates."""
        self._plain[key].append(float(value))

    def result(self) -> dict[str, float]:
        """The combined metrics."""
        self.end_mini_batch()
        out = {k: sum(v) / len(v) for k, v in self._loss.items()}
        out.update(self._ext)
        out.update({k: self._wsum[k] / self._w[k] if self._w[k] > 0 else 0.0 for k in self._wsum})
        out.update({k: sum(v) / len(v) for k, v in self._plain.items()})
        return out


class ValueBiasTracker:
    """Drift of the critic's start-of-episode bias: ``critic/value_bias`` minus its EMA.

    ``critic/value_bias_drift = bias − EMA(previous steps' bias)`` (0 at the first step), then the
    EMA (decay :data:`VALUE_BIAS_EMA_DECAY`) takes in this step's bias (:func:`copc.metrics.ema_drift`).
    The EMA is learner state: :meth:`state_dict` goes into the learner's checkpoint.

    Args:
        decay: EMA decay in [0, 1).
    """

    def __init__(self, decay: float = VALUE_BIAS_EMA_DECAY) -> None:
        ema_drift(0.0, None, decay)  # validates decay
        self.decay = decay
        self.ema: float | None = None

    def update(self, metrics: dict[str, float]) -> dict[str, float]:
        """``{"critic/value_bias_drift": d}`` from ``metrics["critic/value_bias"]`` (advancing the EMA);
        ``{}`` (EMA unchanged) when the step has no bias (no critic or no episode)."""
        if "critic/value_bias" not in metrics:
            return {}
        drift, self.ema = ema_drift(metrics["critic/value_bias"], self.ema, self.decay)
        return {"critic/value_bias_drift": drift}

    def state_dict(self) -> dict[str, float | None]:
        """``{"value_bias_ema": float | None}`` (None before the first step with a bias)."""
        return {"value_bias_ema": self.ema}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` output.

        Raises:
            ValueError: ``state`` is not a dict with ``value_bias_ema`` a number or None.
        """
        ema = state.get("value_bias_ema", "missing") if isinstance(state, dict) else "missing"
        if ema is not None and (isinstance(ema, bool) or not isinstance(ema, int | float)):
            raise ValueError("value-bias state must be {'value_bias_ema': float | None}, "
                             f"got {state!r:.100}")
        self.ema = None if ema is None else float(ema)


class ActorCriticAlgorithm:
    """The algorithm part of a learner step, configured by a :class:`copc.AlgorithmConfig`.

    Args:
        algo: the preset (estimator, losses, clipping).
        num_mini_batches: optimizer updates per step (PPO mini-batches, one epoch).
        micro_batch_size: rows per forward/backward (gradient accumulation).
        critic_warmup_steps: first steps update only the critic (ignored without a critic).
        seed: mini-batch permutation seed (the permutation of step ``n`` uses
            ``seed · 1000003 + n``).
    """

    def __init__(self, algo: copc.AlgorithmConfig, *, num_mini_batches: int = 1, micro_batch_size: int = 8,
                 critic_warmup_steps: int = 0, seed: int = 0) -> None:
        if num_mini_batches < 1 or micro_batch_size < 1:
            raise ValueError(f"num_mini_batches={num_mini_batches!r} and micro_batch_size="
                             f"{micro_batch_size!r} must be >= 1")
        self.algo, self.num_mini_batches, self.micro_batch_size = algo, num_mini_batches, micro_batch_size
        self.critic_warmup_steps, self.seed = critic_warmup_steps, seed
        self.value_bias = ValueBiasTracker()

    def advantages(self, batch: RolloutBatch, logp_old: Tensor, values_old: Tensor | None,
                   version: int) -> tuple[StepInputs, dict[str, float]]:
        """Advantages/returns (spec: the preset's estimator) and the step's off-policy metrics.

        Args:
            batch: the rollout batch (rewards, loss mask, behavior log-probs, versions, scores).
            logp_old: ``(B, T)`` proximal-policy log-probs (recomputed, no grad).
            values_old: ``(B, T)`` critic values (no grad) or None.
            version: the learner's policy version before this update (staleness reference).

        Returns:
            ``(StepInputs, metrics)``; metrics: :meth:`off_policy_diagnostics`,
            ``advantage/mean``, ``advantage/returns_mean``, ``perf/advantage_s``.

        Call it once per learner step: it advances the value-bias EMA (:class:`ValueBiasTracker`).
        """
        algo, mask = self.algo, batch.loss_mask
        t0 = time.perf_counter()
        adv, returns = copc.compute_advantages(copc.AdvantageInputs(
            rewards=batch.rewards, loss_mask=mask, values=values_old, logp_old=logp_old,
            logp_mu=batch.logp_mu, scores=batch.scores, group_ids=batch.group_ids), algo)
        metrics: dict[str, float] = {"perf/advantage_s": time.perf_counter() - t0}
        metrics.update(self.off_policy_diagnostics(batch, logp_old, values_old, version))
        m = mask.bool()
        metrics["advantage/mean"] = float(adv[m].mean()) if m.any() else 0.0
        metrics["advantage/returns_mean"] = float(returns[m].mean()) if m.any() else 0.0
        return StepInputs(logp_old, values_old, adv, returns), metrics

    def update_actor(self, steps_done: int, has_critic: bool) -> bool:
        """Whether step ``steps_done`` updates the actor (critic warm-up needs a critic)."""
        return not has_critic or steps_done >= self.critic_warmup_steps

    def mini_batches(self, n_rows: int, steps_done: int) -> list[list[int]]:
        """Row indices of each PPO mini-batch of step ``steps_done`` (seeded permutation)."""
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + steps_done)
        order = torch.randperm(n_rows, generator=gen)
        return [c.tolist() for c in order.chunk(self.num_mini_batches)]

    def micro_slices(self, n_rows: int) -> list[slice]:
        """Contiguous micro-batch row slices of a (mini-)batch of ``n_rows`` rows."""
        step = self.micro_batch_size
        return [slice(i, min(i + step, n_rows)) for i in range(0, n_rows, step)]

    @staticmethod
    def denominators(mini: RolloutBatch) -> copc.Denominators:
        """Global loss denominators of a mini-batch (token and sequence counts)."""
        return copc.batch_denominators(mini.loss_mask)

    def policy_loss(self, logp: Tensor, mb: RolloutBatch, x: StepInputs,
                    den: copc.Denominators) -> tuple[Tensor, dict[str, float]]:
        """The preset's policy loss of one micro-batch (a share of the mini-batch loss)."""
        return copc.compute_policy_loss(logp, copc.PolicyLossInputs(
            logp_old=x.logp_old, logp_mu=mb.logp_mu, advantages=x.advantages,
            loss_mask=mb.loss_mask, denominators=den), self.algo)

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
        """(ℓ_P, u_P) of the DIS policy channel, or None when the preset's loss has none (not ``dis``)."""
        a = self.algo
        return copc.margins(a.eta_p, a.eps_low, a.eps_high) if a.policy_loss == "dis" else None

    def advantage_channel_interval(self) -> tuple[float, float] | None:
        """(ℓ_A, u_A) of the clipped-ratio advantage channel, or None when the preset's estimator
        has none (not ``copc``; ``copc_wo_rc`` has it with η_A = 0, i.e. ρ̄ ≡ 1)."""
        a = self.algo
        return copc.margins(a.eta_a, a.eps_low, a.eps_high) if a.advantage_estimator == "copc" else None

    def off_policy_diagnostics(self, batch: RolloutBatch, logp_old: Tensor, values_old: Tensor | None,
                               version: int) -> dict[str, float]:
        """The step's staleness / off-policy diagnostics (all from the weights before the update).

        * ``advantage/ratio_*``: statistics of ``π_old/µ`` (every preset); with an advantage
          channel also ``advantage/clipped_{,low_,high_}frac`` and ``diag/advantage_ess_frac``;
        * with a policy channel: ``diag/policy_masked_{,low_,high_}frac``, ``diag/policy_ess_frac``;
        * ``staleness/mean|max|min`` and ``diag/abs_log_ratio_s{k}`` per staleness level k;
        * with a critic: ``critic/value_bias``, ``critic/value_bias_abs``,
          ``critic/value_bias_drift`` (advances :attr:`value_bias`).

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
        out.update(abs_log_ratio_by_staleness(logp_old, mu, batch.versions, version, mask))
        if values_old is not None:
            out.update(value_bias_metrics(values_old, batch.rewards, mask, self.algo.gamma))
            out.update(self.value_bias.update(out))
        return out
