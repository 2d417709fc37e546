"""The learner step, written once: :class:`TemplateLearner` is the step every backend runs
(recompute → advantages → mini-batch updates → schedules → version + 1 → metrics) over a few hooks
a backend implements: forward passes (per-token log-probs and values of a micro-batch), the
whole-batch recompute, the micro-batch backward passes, and its optimizers
(:mod:`trainer.learner.optim`). The algorithm it runs (advantages, mini-batches, denominators,
losses) is :class:`~trainer.learner.algorithm.ActorCriticAlgorithm`'s.
"""

from __future__ import annotations

import abc
import math
import time
from typing import Any

import torch

from ..rollout.batch import RolloutBatch
from .algorithm import ActorCriticAlgorithm, MiniBatchDenominators, StepInputs
from .settings import LearnerConfig
from .step_metrics import MetricAccumulator

Tensor = torch.Tensor


class TemplateLearner(abc.ABC):
    """The learner step, written once over a few backend hooks (every backend subclasses it).

    :meth:`step` = :meth:`place` the batch → :meth:`recompute` the proximal log-probs / values
    (no grad, whole batch) → advantages and diagnostics (:meth:`ActorCriticAlgorithm.advantages`)
    → per PPO mini-batch :meth:`update` the actor (not during critic warm-up) then the critic →
    :meth:`schedule` (learning rates) → version + 1 → metrics. :meth:`update` is
    ``zero_grad`` → :meth:`backward` (the backend's micro-batch passes, metrics of every rank) →
    the optimizer's ``step`` (clip + update); micro-batch losses come from :meth:`micro_loss`
    over the forward hooks :meth:`logprobs` (through :meth:`logprobs_and_entropy`) / :meth:`values`.

    A subclass sets ``algorithm`` (:class:`ActorCriticAlgorithm`), ``cfg``
    (:class:`~trainer.learner.settings.LearnerConfig`), ``actor`` / ``critic`` (None without a
    critic), ``actor_opt`` / ``critic_opt``
    (:class:`~trainer.learner.optim.ModelOptimizer`) and ``steps_done = 0``, and implements
    :meth:`recompute`, :meth:`backward`, :meth:`logprobs` and :meth:`values`.
    """

    algorithm: ActorCriticAlgorithm
    cfg: LearnerConfig
    actor: Any
    critic: Any
    actor_opt: Any
    critic_opt: Any
    steps_done: int
    #: the last :meth:`step`'s :class:`StepInputs` (``logp_old``, ``advantages``: ``(B, T)``, rows
    #: in batch order, before the update); read by ``copc train``'s per-step samples.
    last_step_inputs: StepInputs | None = None

    @property
    def policy_version(self) -> int:
        """Updates done (resumes included): the version of the current actor weights."""
        return self.steps_done

    def step(self, batch: RolloutBatch, version: int | None = None) -> dict[str, float]:
        """Train on ``batch``; return metrics (``actor/…``, ``critic/…``, ``advantage/…``,
        ``staleness/…``, ``diag/…``, ``perf/…``; a distributed backend's are the whole batch's,
        identical on every rank).

        Args:
            batch: the rollout batch (a distributed backend: the full batch, same on every rank).
            version: staleness reference (default :attr:`policy_version`, the version being
                updated; kept for callers that track it themselves).
        """
        t0 = time.perf_counter()
        batch = self.place(batch)
        logp_old, values_old = self.recompute(batch)
        x, metrics = self.algorithm.advantages(batch, logp_old, values_old,
                                               self.policy_version if version is None else version,
                                               steps_done=self.steps_done)
        self.last_step_inputs = x  # the step's per-token tensors, for the run's training samples
        updates, update_actor = self.algorithm.mini_batch_updates(
            batch, x, self.steps_done, has_critic=self.critic is not None, update=self.update)
        lr = self.schedule(update_actor)
        self.steps_done += 1
        metrics.update(updates)
        metrics["actor/lr"] = lr
        metrics["actor/updated"] = float(update_actor)
        metrics["perf/learner_step_s"] = time.perf_counter() - t0
        metrics["perf/tokens"] = float(batch.attention_mask.sum())
        return metrics

    # -- hooks ------------------------------------------------------------------------------
    def place(self, batch: RolloutBatch) -> RolloutBatch:
        """The batch where the step computes its advantages (default: where it is)."""
        return batch

    @abc.abstractmethod
    def recompute(self, batch: RolloutBatch) -> tuple[Tensor, Tensor | None]:
        """Whole-batch ``(logp_old, values_old)``, ``(B, T)`` float32 each (values None without a
        critic), under the current weights, no grad."""

    @abc.abstractmethod
    def backward(self, role: str, mini: RolloutBatch, x: StepInputs, den: MiniBatchDenominators
                 ) -> list[tuple[dict[str, float], float]]:
        """Forward + backward of ``role``'s :meth:`micro_loss` over this process's micro-batches of
        ``mini``; ``(metrics, action tokens)`` of every micro-batch of every rank, in order."""

    @abc.abstractmethod
    def logprobs(self, mb: RolloutBatch) -> Tensor:
        """``(b, T)`` float32 actor log-probs of a micro-batch's response tokens (with grad)."""

    @abc.abstractmethod
    def values(self, mb: RolloutBatch) -> Tensor:
        """``(b, T)`` float32 critic values of a micro-batch (with grad)."""

    def logprobs_and_entropy(self, mb: RolloutBatch) -> tuple[Tensor, Tensor | None]:
        """:meth:`logprobs` and, when the backend computes it, the ``(b, T)`` float32 entropy (nats)
        of the actor's distribution at each response token (for the ``actor/entropy`` metric only;
        the loss does not use it). Default: no entropy."""
        return self.logprobs(mb), None

    def update(self, role: str, mini: RolloutBatch, x: StepInputs, den: MiniBatchDenominators,
               acc: MetricAccumulator) -> None:
        """One optimizer update of ``role`` (``"actor"`` | ``"critic"``) on mini-batch ``mini``:
        ``zero_grad``, :meth:`backward`, clip + step; metrics and the gradient norm into ``acc``
        (``<role>/grad_norm``, NaN when not finite)."""
        model, opt = (self.actor, self.actor_opt) if role == "actor" else (self.critic, self.critic_opt)
        model.train()
        opt.zero_grad()
        for met, tokens in self.backward(role, mini, x, den):
            acc.add_micro(met, tokens)
        norm = opt.step()
        if norm is not None:
            acc.add(f"{role}/grad_norm", norm if math.isfinite(norm) else float("nan"))

    def schedule(self, actor_updated: bool) -> float:
        """Advance the learning-rate schedules (the actor's counts only its updates, none during
        critic warm-up); the actor's learning rate after it."""
        if actor_updated:
            self.actor_opt.schedule_step()
        if self.critic_opt is not None:
            self.critic_opt.schedule_step()
        return self.actor_opt.lr

    # -- shared by the backends ------------------------------------------------------------------
    def micro_loss(self, role: str, mb: RolloutBatch, x: StepInputs, den: MiniBatchDenominators
                   ) -> tuple[Tensor, dict[str, float]]:
        """The loss of one micro-batch (a share of the mini-batch loss) and its metrics: the policy
        loss (+ ``actor/total_loss``, and ``actor/entropy`` when the backend computes the entropy:
        :func:`entropy_metric`) for ``"actor"``, the value loss for ``"critic"``."""
        if role == "actor":
            logp, entropy = self.logprobs_and_entropy(mb)
            loss, met = self.algorithm.policy_loss(logp, mb, x, den)
            met = {**met, "actor/total_loss": float(loss.detach())}
            if entropy is not None:
                met["actor/entropy"] = entropy_metric(entropy, mb.loss_mask)
            return loss, met
        return self.algorithm.value_loss(self.values(mb), mb, x, den)

    def models(self) -> list[tuple[str, Any, Any]]:
        """``(role, model, optimizer)`` of the actor and, when there is one, the critic."""
        out = [("actor", self.actor, self.actor_opt)]
        if self.critic is not None:
            out.append(("critic", self.critic, self.critic_opt))
        return out


def entropy_metric(entropy: Tensor, loss_mask: Tensor) -> float:
    """Mean per-token entropy (nats) over the action tokens of a micro-batch (0 without any); the
    step's ``actor/entropy`` is its action-token-weighted mean over micro-batches
    (:class:`~trainer.learner.step_metrics.MetricAccumulator`)."""
    m = loss_mask.bool()
    return float(entropy.detach()[m].mean()) if m.any() else 0.0
