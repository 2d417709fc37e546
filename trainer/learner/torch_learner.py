"""The torch actor-critic learner: one training step per batch of trajectories.

Per step (issue "trainer", Learner): recompute ``logp_old`` and values without
grad; advantages and returns with the configured :mod:`copc` estimator; actor and
critic updates over mini-batches with gradient accumulation over micro-batches
(exact loss aggregation via global denominators); gradient clipping; LR warm-up;
critic warm-up steps. All RL maths comes from :mod:`copc`.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from dataclasses import dataclass

import torch
from torch import nn

import copc

from ..logprobs import token_logprobs
from ..rollout.batch import RolloutBatch
from .critic import ValueModel

Tensor = torch.Tensor


@dataclass(frozen=True)
class LearnerConfig:
    """Optimisation settings (see :class:`trainer.config.TrainConfig`)."""

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


def response_logprobs(model: nn.Module, b: RolloutBatch, temperature: float) -> Tensor:
    """``(B, T)`` log-probs of the response tokens: token ``t`` scored by logits at ``P + t − 1``."""
    P = b.prompt_len
    logits = model(input_ids=b.input_ids, attention_mask=b.attention_mask,
                   position_ids=b.position_ids).logits
    return token_logprobs(logits[:, P - 1:-1], b.input_ids[:, P:], temperature)


def _warmup(steps: int):
    return lambda i: 1.0 if steps <= 0 else min(1.0, (i + 1) / steps)


class TorchLearner:
    """Actor (causal LM) + optional critic (:class:`ValueModel`) trained with a :class:`copc.AlgorithmConfig`.

    Args:
        actor: the policy (trained in place).
        algo: the algorithm (preset).
        cfg: :class:`LearnerConfig`.
        critic: the value model (required iff ``algo.use_critic``); default built from the actor.
    """

    def __init__(self, actor: nn.Module, algo: copc.AlgorithmConfig, cfg: LearnerConfig,
                 critic: ValueModel | None = None) -> None:
        self.actor, self.algo, self.cfg = actor, algo, cfg
        self.critic = (critic or ValueModel.from_causal_lm(actor)) if algo.use_critic else None
        self.actor_opt = torch.optim.AdamW(actor.parameters(), lr=cfg.actor_lr, weight_decay=cfg.weight_decay)
        self.actor_sched = torch.optim.lr_scheduler.LambdaLR(self.actor_opt, _warmup(cfg.warmup_steps))
        self.critic_opt = self.critic_sched = None
        if self.critic is not None:
            self.critic_opt = torch.optim.AdamW(self.critic.parameters(), lr=cfg.critic_lr,
                                                weight_decay=cfg.weight_decay)
            self.critic_sched = torch.optim.lr_scheduler.LambdaLR(self.critic_opt, _warmup(cfg.warmup_steps))
        self.steps_done = 0

    # -- state -----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Everything needed to resume: models, optimizers, schedulers, step counter."""
        out = {"actor": self.actor.state_dict(), "actor_opt": self.actor_opt.state_dict(),
               "actor_sched": self.actor_sched.state_dict(), "steps_done": self.steps_done}
        if self.critic is not None:
            out.update(critic=self.critic.state_dict(), critic_opt=self.critic_opt.state_dict(),
                       critic_sched=self.critic_sched.state_dict())
        return out

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` output."""
        self.actor.load_state_dict(state["actor"])
        self.actor_opt.load_state_dict(state["actor_opt"])
        self.actor_sched.load_state_dict(state["actor_sched"])
        self.steps_done = int(state["steps_done"])
        if self.critic is not None:
            self.critic.load_state_dict(state["critic"])
            self.critic_opt.load_state_dict(state["critic_opt"])
            self.critic_sched.load_state_dict(state["critic_sched"])

    # -- one step ------------------------------------------------------------------------------
    def _micro(self, b: RolloutBatch) -> list[RolloutBatch]:
        n = len(b)
        return [b.select(slice(i, min(i + self.cfg.micro_batch_size, n)))
                for i in range(0, n, self.cfg.micro_batch_size)]

    @torch.no_grad()
    def _recompute(self, batch: RolloutBatch) -> tuple[Tensor, Tensor | None]:
        self.actor.eval()
        lps, vals = [], []
        for mb in self._micro(batch):
            lps.append(response_logprobs(self.actor, mb, self.cfg.temperature))
            if self.critic is not None:
                self.critic.eval()
                vals.append(mb_values(self.critic, mb))
        return torch.cat(lps), (torch.cat(vals) if vals else None)

    def step(self, batch: RolloutBatch, version: int) -> dict[str, float]:
        """Train on ``batch`` (produced by policy versions ≤ ``version``); return metrics.

        Metrics are namespaced: ``actor/…``, ``critic/…``, ``advantage/…``, ``staleness/…``,
        ``rollout/…``, ``perf/…``.
        """
        t0 = time.perf_counter()
        algo, mask = self.algo, batch.loss_mask
        logp_old, values_old = self._recompute(batch)
        t_adv = time.perf_counter()
        adv, returns = copc.compute_advantages(copc.AdvantageInputs(
            rewards=batch.rewards, loss_mask=mask, values=values_old, logp_old=logp_old,
            logp_mu=batch.logp_mu, scores=batch.scores, group_ids=batch.group_ids), algo)
        metrics: dict[str, float] = {"perf/advantage_s": time.perf_counter() - t_adv}
        low_a, high_a = copc.margins(algo.eta_a, algo.eps_low, algo.eps_high)
        metrics.update(copc.advantage_channel_metrics(logp_old, batch.logp_mu, mask, low_a, high_a))
        metrics.update(copc.staleness_metrics(batch.versions, version, mask))
        m = mask.bool()
        metrics["advantage/mean"] = float(adv[m].mean()) if m.any() else 0.0
        metrics["advantage/returns_mean"] = float(returns[m].mean()) if m.any() else 0.0
        acc: dict[str, list[float]] = defaultdict(list)
        # critic warm-up only makes sense with a critic (sao / dapo update the actor from step 1)
        update_actor = self.critic is None or self.steps_done >= self.cfg.critic_warmup_steps
        gen = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + self.steps_done)
        order = torch.randperm(len(batch), generator=gen)
        for chunk in order.chunk(self.cfg.num_mini_batches):
            idx = chunk.tolist()
            mini = batch.select(idx)
            den = copc.batch_denominators(mini.loss_mask)
            extra = {"logp_old": logp_old[idx], "adv": adv[idx], "ret": returns[idx],
                     "v_old": values_old[idx] if values_old is not None else None}
            if update_actor:
                self._actor_update(mini, extra, den, acc)
            if self.critic is not None:
                self._critic_update(mini, extra, den, acc)
        if update_actor:  # the actor's schedule counts actor updates (none during critic warm-up)
            self.actor_sched.step()
        if self.critic_sched is not None:
            self.critic_sched.step()
        self.steps_done += 1
        metrics.update({k: float(sum(v) / len(v)) for k, v in acc.items()})
        metrics["actor/lr"] = self.actor_sched.get_last_lr()[0]
        metrics["actor/updated"] = float(update_actor)
        metrics["perf/learner_step_s"] = time.perf_counter() - t0
        metrics["perf/tokens"] = float(batch.attention_mask.sum())
        return metrics

    def _actor_update(self, mini: RolloutBatch, x: dict, den: copc.Denominators, acc: dict) -> None:
        self.actor.train()
        self.actor_opt.zero_grad(set_to_none=True)
        start = 0
        for mb in self._micro(mini):
            sl = slice(start, start + len(mb))
            start += len(mb)
            logp = response_logprobs(self.actor, mb, self.cfg.temperature)
            loss, met = copc.compute_policy_loss(logp, copc.PolicyLossInputs(
                logp_old=x["logp_old"][sl], logp_mu=mb.logp_mu, advantages=x["adv"][sl],
                loss_mask=mb.loss_mask, denominators=den), self.algo)
            loss.backward()
            for k, v in met.items():
                acc[k].append(v)
        if self.cfg.grad_clip > 0:
            norm = nn.utils.clip_grad_norm_(self.actor.parameters(), self.cfg.grad_clip)
            acc["actor/grad_norm"].append(float(norm))
        self.actor_opt.step()

    def _critic_update(self, mini: RolloutBatch, x: dict, den: copc.Denominators, acc: dict) -> None:
        assert self.critic is not None and self.critic_opt is not None
        self.critic.train()
        self.critic_opt.zero_grad(set_to_none=True)
        start, total = 0, 0.0
        for mb in self._micro(mini):
            sl = slice(start, start + len(mb))
            start += len(mb)
            v = mb_values(self.critic, mb)
            loss, met = copc.value_loss(v, x["v_old"][sl], x["ret"][sl], mb.loss_mask,
                                        clip_eps=self.algo.value_clip_eps,
                                        loss_agg_mode=self.algo.value_loss_agg_mode, denominators=den)
            loss.backward()
            total += float(loss.detach())
            for k, val in met.items():
                acc[k].append(val)
        acc["critic/value_loss"].append(total)
        if self.cfg.grad_clip > 0:
            norm = nn.utils.clip_grad_norm_(self.critic.parameters(), self.cfg.grad_clip)
            acc["critic/grad_norm"].append(float(norm) if math.isfinite(float(norm)) else float("nan"))
        self.critic_opt.step()


def mb_values(critic: ValueModel, b: RolloutBatch) -> Tensor:
    """``(B, T)`` critic values of the states before each response token."""
    return critic.response_values(b.input_ids, b.attention_mask, b.position_ids, b.prompt_len)
