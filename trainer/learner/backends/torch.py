"""The plain-torch learner backend (``learner.backend: torch``): one process, one device.

The backend part only: forward passes (per-token log-probs and values of a micro-batch),
backward, AdamW, gradient clipping, linear LR warm-up. Everything algorithmic (advantages,
mini-batches, global denominators, losses, metric combination) comes from
:class:`~trainer.learner.algorithm.ActorCriticAlgorithm`, which calls :mod:`copc`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

import copc

from ...logprobs import token_logprobs
from ...rollout.batch import RolloutBatch
from ..algorithm import ActorCriticAlgorithm, MetricAccumulator, StepInputs
from ..critic import ValueModel

Tensor = torch.Tensor


@dataclass(frozen=True)
class LearnerConfig:
    """Optimisation settings (see :class:`trainer.config.TrainConfig`).

    Attributes:
        actor_lr / critic_lr: AdamW learning rates. weight_decay: AdamW decay.
        warmup_steps: linear LR warm-up (optimizer updates). grad_clip: max global norm (0 = off).
        critic_warmup_steps: first steps update only the critic.
        num_mini_batches: updates per step. micro_batch_size: rows per forward/backward.
        temperature: sampling temperature of the rollouts (log-probs are of ``logits / T``).
        seed: mini-batch permutation seed.
        optimizer: ``adamw`` | ``sgd`` (``learner.optimizer``; :func:`make_optimizer`).
    """

    actor_lr: float = 1e-6
    critic_lr: float = 1e-5
    weight_decay: float = 0.0
    warmup_steps: int = 0
    grad_clip: float = 1.0
    critic_warmup_steps: int = 0
    num_mini_batches: int = 1
    micro_batch_size: int = 8
    temperature: float = 1.0
    seed: int = 0
    optimizer: str = "adamw"

    @classmethod
    def from_config(cls, exp: Any) -> LearnerConfig:
        """From an :class:`~trainer.config.ExperimentConfig` (``train`` + ``rollout.temperature``)."""
        t = exp.train
        return cls(actor_lr=t.actor_lr, critic_lr=t.critic_lr, weight_decay=t.weight_decay,
                   warmup_steps=t.warmup_steps, grad_clip=t.grad_clip,
                   critic_warmup_steps=t.critic_warmup_steps, num_mini_batches=t.num_mini_batches,
                   micro_batch_size=t.micro_batch_size, temperature=exp.rollout.temperature, seed=t.seed,
                   optimizer=exp.learner.optimizer)


def make_optimizer(name: str, params: Any, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """``adamw`` (:class:`torch.optim.AdamW`) or ``sgd`` (plain :class:`torch.optim.SGD`, decoupled-free
    L2 ``weight_decay``) over ``params``.

    Raises:
        ValueError: another name (naming ``learner.optimizer``).
    """
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, weight_decay=weight_decay)
    raise ValueError(f"learner.optimizer={name!r}: must be 'adamw' or 'sgd'")


def response_logprobs(model: nn.Module, b: RolloutBatch, temperature: float) -> Tensor:
    """``(B, T)`` float32 log-probs of the response tokens: token ``t`` scored by logits at ``P + t − 1``."""
    P = b.prompt_len
    logits = model(input_ids=b.input_ids, attention_mask=b.attention_mask,
                   position_ids=b.position_ids).logits
    return token_logprobs(logits[:, P - 1:-1], b.input_ids[:, P:], temperature)


def mb_values(critic: ValueModel, b: RolloutBatch) -> Tensor:
    """``(B, T)`` float32 critic values of the states before each response token."""
    return critic.response_values(b.input_ids, b.attention_mask, b.position_ids, b.prompt_len)


def _warmup(steps: int):
    return lambda i: 1.0 if steps <= 0 else min(1.0, (i + 1) / steps)


class TorchLearner:
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
        self.algorithm = ActorCriticAlgorithm(algo, num_mini_batches=cfg.num_mini_batches,
                                              micro_batch_size=cfg.micro_batch_size,
                                              critic_warmup_steps=cfg.critic_warmup_steps, seed=cfg.seed)
        self.critic = (critic or ValueModel.from_causal_lm(actor)) if algo.use_critic else None
        self.actor_opt = make_optimizer(cfg.optimizer, actor.parameters(), cfg.actor_lr, cfg.weight_decay)
        self.actor_sched = torch.optim.lr_scheduler.LambdaLR(self.actor_opt, _warmup(cfg.warmup_steps))
        self.critic_opt = self.critic_sched = None
        if self.critic is not None:
            self.critic_opt = make_optimizer(cfg.optimizer, self.critic.parameters(), cfg.critic_lr,
                                             cfg.weight_decay)
            self.critic_sched = torch.optim.lr_scheduler.LambdaLR(self.critic_opt, _warmup(cfg.warmup_steps))
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

    # -- the Learner protocol -------------------------------------------------------------
    @property
    def policy_version(self) -> int:
        """Updates done (resumes included): the version of the current actor weights."""
        return self.steps_done

    def export_policy_weights(self) -> Iterator[tuple[str, Tensor]]:
        """The actor's ``state_dict`` items (``transformers`` names = Hugging Face names)."""
        yield from self.actor.state_dict().items()

    def state_dict(self) -> dict:
        """Everything needed to resume: models, optimizers, schedulers, step counter, and the
        diagnostics' state (``diagnostics``: the value-bias EMA, :class:`~.algorithm.ValueBiasTracker`)."""
        out = {"actor": self.actor.state_dict(), "actor_opt": self.actor_opt.state_dict(),
               "actor_sched": self.actor_sched.state_dict(), "steps_done": self.steps_done,
               "diagnostics": self.algorithm.value_bias.state_dict()}
        if self.critic is not None:
            out.update(critic=self.critic.state_dict(), critic_opt=self.critic_opt.state_dict(),
                       critic_sched=self.critic_sched.state_dict())
        return out

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` output (a checkpoint from before ``diagnostics`` existed
        loads too: the value-bias EMA then restarts, drift 0 at the next step)."""
        self.actor.load_state_dict(state["actor"])
        self.actor_opt.load_state_dict(state["actor_opt"])
        self.actor_sched.load_state_dict(state["actor_sched"])
        self.steps_done = int(state["steps_done"])
        self.algorithm.value_bias.load_state_dict(state.get("diagnostics", {"value_bias_ema": None}))
        if self.critic is not None:
            self.critic.load_state_dict(state["critic"])
            self.critic_opt.load_state_dict(state["critic_opt"])
            self.critic_sched.load_state_dict(state["critic_sched"])

    def step(self, batch: RolloutBatch, version: int | None = None) -> dict[str, float]:
        """Train on ``batch``; return metrics (``actor/…``, ``critic/…``, ``advantage/…``,
        ``staleness/…``, ``perf/…``).

        Args:
            batch: the rollout batch.
            version: staleness reference (default :attr:`policy_version`, the version being
                updated; the argument is kept for callers that track it themselves).
        """
        t0 = time.perf_counter()
        alg = self.algorithm
        logp_old, values_old = self._recompute(batch)
        x, metrics = alg.advantages(batch, logp_old, values_old,
                                    self.policy_version if version is None else version,
                                    steps_done=self.steps_done)
        updates, update_actor = alg.mini_batch_updates(
            batch, x, self.steps_done, has_critic=self.critic is not None,
            actor_update=self._actor_update, critic_update=self._critic_update)
        if update_actor:  # the actor's schedule counts actor updates (none during critic warm-up)
            self.actor_sched.step()
        if self.critic_sched is not None:
            self.critic_sched.step()
        self.steps_done += 1
        metrics.update(updates)
        metrics["actor/lr"] = self.actor_sched.get_last_lr()[0]
        metrics["actor/updated"] = float(update_actor)
        metrics["perf/learner_step_s"] = time.perf_counter() - t0
        metrics["perf/tokens"] = float(batch.attention_mask.sum())
        return metrics

    # -- backend part ---------------------------------------------------------------------
    def _micro(self, b: RolloutBatch) -> list[tuple[slice, RolloutBatch]]:
        return [(sl, b.select(sl)) for sl in self.algorithm.micro_slices(len(b))]

    @torch.no_grad()
    def _recompute(self, batch: RolloutBatch) -> tuple[Tensor, Tensor | None]:
        self.actor.eval()
        lps, vals = [], []
        for _, mb in self._micro(batch):
            lps.append(response_logprobs(self.actor, mb, self.cfg.temperature))
            if self.critic is not None:
                self.critic.eval()
                vals.append(mb_values(self.critic, mb))
        return torch.cat(lps), (torch.cat(vals) if vals else None)

    def _actor_update(self, mini: RolloutBatch, x: StepInputs, den: copc.Denominators,
                      acc: MetricAccumulator) -> None:
        self.actor.train()
        self.actor_opt.zero_grad(set_to_none=True)
        for sl, mb in self._micro(mini):
            logp = response_logprobs(self.actor, mb, self.cfg.temperature)
            loss, met = self.algorithm.policy_loss(logp, mb, x.rows_slice(sl), den)
            loss.backward()
            acc.add_micro({**met, "actor/total_loss": float(loss.detach())}, float(mb.loss_mask.sum()))
        if self.cfg.grad_clip > 0:
            norm = nn.utils.clip_grad_norm_(self.actor.parameters(), self.cfg.grad_clip)
            acc.add("actor/grad_norm", float(norm))
        self.actor_opt.step()

    def _critic_update(self, mini: RolloutBatch, x: StepInputs, den: copc.Denominators,
                       acc: MetricAccumulator) -> None:
        assert self.critic is not None and self.critic_opt is not None
        self.critic.train()
        self.critic_opt.zero_grad(set_to_none=True)
        for sl, mb in self._micro(mini):
            loss, met = self.algorithm.value_loss(mb_values(self.critic, mb), mb, x.rows_slice(sl), den)
            loss.backward()
            acc.add_micro(met, float(mb.loss_mask.sum()))
        if self.cfg.grad_clip > 0:
            norm = float(nn.utils.clip_grad_norm_(self.critic.parameters(), self.cfg.grad_clip))
            acc.add("critic/grad_norm", norm if math.isfinite(norm) else float("nan"))
        self.critic_opt.step()
