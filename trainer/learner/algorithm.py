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

from ..rollout.batch import RolloutBatch

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

    def advantages(self, batch: RolloutBatch, logp_old: Tensor, values_old: Tensor | None,
                   version: int) -> tuple[StepInputs, dict[str, float]]:
        """Advantages/returns (spec: the preset's estimator) and the step's off-policy metrics.

        Args:
            batch: the rollout batch (rewards, loss mask, behavior log-probs, versions, scores).
            logp_old: ``(B, T)`` proximal-policy log-probs (recomputed, no grad).
            values_old: ``(B, T)`` critic values (no grad) or None.
            version: the learner's policy version before this update (staleness reference).

        Returns:
            ``(StepInputs, metrics)``; metrics: advantage-channel clip fractions, staleness,
            ``advantage/mean``, ``advantage/returns_mean``, ``perf/advantage_s``.
        """
        algo, mask = self.algo, batch.loss_mask
        t0 = time.perf_counter()
        adv, returns = copc.compute_advantages(copc.AdvantageInputs(
            rewards=batch.rewards, loss_mask=mask, values=values_old, logp_old=logp_old,
            logp_mu=batch.logp_mu, scores=batch.scores, group_ids=batch.group_ids), algo)
        metrics: dict[str, float] = {"perf/advantage_s": time.perf_counter() - t0}
        low_a, high_a = copc.margins(algo.eta_a, algo.eps_low, algo.eps_high)
        metrics.update(copc.advantage_channel_metrics(logp_old, batch.logp_mu, mask, low_a, high_a))
        metrics.update(copc.staleness_metrics(batch.versions, version, mask))
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
