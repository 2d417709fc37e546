"""The plain-torch learner backend (``learner.backend: torch``): one process, one device.

The backend part only: the hooks of :class:`~trainer.learner.algorithm.TemplateLearner`
(forward passes: per-token log-probs and values of a micro-batch; the whole-batch recompute;
the micro-batch backward passes) and its optimizers (:class:`~trainer.learner.optim.TorchOptimizer`:
AdamW or SGD, gradient clipping, linear LR warm-up, from the one
:class:`~trainer.learner.settings.OptimizerSettings`). The step itself, and everything
algorithmic (advantages, mini-batches, global denominators, losses, metric combination), is the
template's and :class:`~trainer.learner.algorithm.ActorCriticAlgorithm`'s, which call :mod:`copc`.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

import copc

from ...logprobs import token_logprobs
from ...rollout.batch import RolloutBatch
from ..algorithm import ActorCriticAlgorithm, MiniBatchDenominators, StepInputs, TemplateLearner
from ..critic import ValueModel
from ..optim import TorchOptimizer
from ..settings import LearnerConfig

Tensor = torch.Tensor


def response_logprobs(model: nn.Module, b: RolloutBatch, temperature: float) -> Tensor:
    """``(B, T)`` float32 log-probs of the response tokens: token ``t`` scored by logits at ``P + t − 1``."""
    P = b.prompt_len
    logits = model(input_ids=b.input_ids, attention_mask=b.attention_mask,
                   position_ids=b.position_ids).logits
    return token_logprobs(logits[:, P - 1:-1], b.input_ids[:, P:], temperature)


def mb_values(critic: ValueModel, b: RolloutBatch) -> Tensor:
    """``(B, T)`` float32 critic values of the states before each response token."""
    return critic.response_values(b.input_ids, b.attention_mask, b.position_ids, b.prompt_len)


class TransformersForward:
    """The forward hooks of :class:`~trainer.learner.algorithm.TemplateLearner` over a
    ``transformers`` causal LM ``actor`` and a :class:`ValueModel` ``critic`` (torch and FSDP)."""

    actor: nn.Module
    critic: ValueModel | None
    cfg: LearnerConfig

    def logprobs(self, mb: RolloutBatch) -> Tensor:
        """The actor's response log-probs of ``mb`` (:func:`response_logprobs`)."""
        return response_logprobs(self.actor, mb, self.cfg.temperature)

    def values(self, mb: RolloutBatch) -> Tensor:
        """The critic's values of ``mb`` (:func:`mb_values`)."""
        return mb_values(self.critic, mb)


class TorchLearner(TransformersForward, TemplateLearner):
    """Actor (causal LM) + optional critic (:class:`ValueModel`) on one device (a :class:`Learner`).

    Args:
        actor: the policy (trained in place).
        algo: the algorithm (preset).
        cfg: :class:`LearnerConfig`.
        critic: the value model (used iff ``algo.use_critic``); default built from the actor.
    """

    def __init__(self, actor: nn.Module, algo: copc.AlgorithmConfig, cfg: LearnerConfig,
                 critic: ValueModel | None = None) -> None:
        self.actor, self.algo, self.cfg = actor, algo, cfg
        self.algorithm = ActorCriticAlgorithm.from_config(algo, cfg)
        self.critic = (critic or ValueModel.from_causal_lm(actor)) if algo.use_critic else None
        self.actor_opt = TorchOptimizer(actor.parameters(), cfg.optim, "actor")
        self.critic_opt = None if self.critic is None else TorchOptimizer(self.critic.parameters(), cfg.optim,
                                                                          "critic")
        self.steps_done = 0

    @classmethod
    def from_config(cls, exp: Any, model_dir: str | Path) -> TorchLearner:
        """The torch backend of an :class:`~trainer.config.ExperimentConfig`, actor from ``model_dir``."""
        from ...models.loading import load_model_and_tokenizer

        actor, _ = load_model_and_tokenizer(model_dir, dtype=getattr(torch, exp.model.dtype),
                                            attn_implementation=exp.model.attn_implementation)
        if exp.model.gradient_checkpointing:
            actor.gradient_checkpointing_enable()
        return cls(actor, exp.algorithm_config(), LearnerConfig.from_config(exp))

    # -- the Learner protocol (step and policy_version: TemplateLearner) ----------------------
    def export_policy_weights(self) -> Iterator[tuple[str, Tensor]]:
        """The actor's ``state_dict`` items (``transformers`` names = Hugging Face names)."""
        yield from self.actor.state_dict().items()

    def state_dict(self) -> dict:
        """Everything needed to resume: models, optimizers, schedulers, step counter, and the
        diagnostics' state (``diagnostics``: the value-bias EMA,
        :class:`~trainer.learner.step_metrics.ValueBiasTracker`)."""
        out = {"actor": self.actor.state_dict(), "actor_opt": self.actor_opt.optimizer.state_dict(),
               "actor_sched": self.actor_opt.scheduler.state_dict(), "steps_done": self.steps_done,
               "diagnostics": self.algorithm.value_bias.state_dict()}
        if self.critic is not None:
            out.update(critic=self.critic.state_dict(), critic_opt=self.critic_opt.optimizer.state_dict(),
                       critic_sched=self.critic_opt.scheduler.state_dict())
        return out

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` output (a checkpoint from before ``diagnostics`` existed
        loads too: the value-bias EMA then restarts, drift 0 at the next step)."""
        self.actor.load_state_dict(state["actor"])
        self.actor_opt.optimizer.load_state_dict(state["actor_opt"])
        self.actor_opt.scheduler.load_state_dict(state["actor_sched"])
        self.steps_done = int(state["steps_done"])
        self.algorithm.value_bias.load_state_dict(state.get("diagnostics", {"value_bias_ema": None}))
        if self.critic is not None:
            self.critic.load_state_dict(state["critic"])
            self.critic_opt.optimizer.load_state_dict(state["critic_opt"])
            self.critic_opt.scheduler.load_state_dict(state["critic_sched"])

    # -- the template step's hooks (forward passes: TransformersForward) ----------------------
    @torch.no_grad()
    def recompute(self, batch: RolloutBatch) -> tuple[Tensor, Tensor | None]:
        """Whole-batch ``logp_old`` / ``values_old`` over the micro-batches (eval mode)."""
        self.actor.eval()
        lps, vals = [], []
        for sl in self.algorithm.micro_slices(len(batch)):
            mb = batch.select(sl)
            lps.append(self.logprobs(mb))
            if self.critic is not None:
                self.critic.eval()
                vals.append(self.values(mb))
        return torch.cat(lps), (torch.cat(vals) if vals else None)

    def backward(self, role: str, mini: RolloutBatch, x: StepInputs, den: MiniBatchDenominators
                 ) -> list[tuple[dict[str, float], float]]:
        """Backward of ``role``'s loss over the micro-batches of ``mini`` (gradients accumulate)."""
        out = []
        for sl in self.algorithm.micro_slices(len(mini)):
            mb = mini.select(sl)
            loss, met = self.micro_loss(role, mb, x.rows_slice(sl), den)
            loss.backward()
            out.append((met, float(mb.loss_mask.sum())))
        return out
