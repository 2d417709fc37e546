"""The plain-torch learner backend (``learner.backend: torch``): one process, one device.

The backend part only: the hooks of :class:`~trainer.learner.template.TemplateLearner`
(forward passes: per-token log-probs, entropies and values of a micro-batch; the whole-batch
recompute; the micro-batch backward passes) and its optimizers
(:class:`~trainer.learner.optim.TorchOptimizer`: AdamW or SGD, gradient clipping, linear LR
warm-up, from the one :class:`~trainer.learner.settings.OptimizerSettings`). The step itself, and
everything algorithmic (advantages, mini-batches, global denominators, losses, metric combination), is the
template's and :class:`~trainer.learner.algorithm.ActorCriticAlgorithm`'s, which call :mod:`copc`.

LoRA (``learner.lora`` / ``learner.critic_lora``, :mod:`trainer.learner.lora`): only the adapters (and
the critic's value head) are optimised and checkpointed; :meth:`TorchLearner.export_adapter` is what
weight syncs send, :meth:`TorchLearner.export_policy_weights` the merged model (export, evaluation).

The actor's log-probs never materialise the full-vocabulary logits: hidden states are taken at the
model tokens only and the LM head + log-softmax run in chunks of ``logprob_chunk_tokens``
with recomputation in backward (:func:`response_scores`; shared with the fsdp backend).
``gradient_checkpointing`` adds activation checkpointing of the decoder layers
(:func:`enable_activation_checkpointing`). The backend's own settings are
:class:`~trainer.learner.backend_settings.TorchSettings` (``learner.backend_settings``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import nn

import copc

from ...models.chunked_logprobs import DEFAULT_CHUNK_TOKENS
from ...models.lm_head import check_output_head, token_scores
from ...models.lora import AdapterWeights, merged_state_dict
from ...rollout.batch import RolloutBatch, pad_response
from ..algorithm import ActorCriticAlgorithm, MiniBatchDenominators, StepInputs
from ..backend_settings import TorchSettings
from ..critic import ValueModel, freeze_attention
from ..lora import check_trainable_dtype, load_role_state, prepare_models, role_state, trainable_parameters
from ..optim import TorchOptimizer
from ..settings import LearnerConfig
from ..spec import LearnerSpec
from ..template import TemplateLearner

Tensor = torch.Tensor


def response_scores(model: nn.Module, b: RolloutBatch, temperature: float, *,
                    chunk_tokens: int = DEFAULT_CHUNK_TOKENS, entropy: bool = False,
                    scorer: Callable[..., tuple[Tensor, Tensor | None]] | None = None,
                    shared_prefix_tokens: int = 0, top_k: int = -1, top_p: float = 1.0
                    ) -> tuple[Tensor, Tensor | None]:
    """``(B, T)`` float32 log-probs (and entropies) of the response's model tokens: token ``t`` (column
    ``P + t``) scored by the distribution at column ``P + t − 1``, ``log softmax(logits / temperature)``
    restricted to the sampler's top-k / top-p support when it truncates (:mod:`trainer.logprobs`;
    ``-inf`` for a token outside it); 0 at columns with ``loss_mask`` 0 (observation and padding tokens).

    The hidden states are taken at the model tokens only and the LM head is applied in chunks of
    ``chunk_tokens`` with recomputation in backward (:func:`trainer.models.lm_head.token_scores`): no
    ``(B, P + T, V)`` logits.

    Args:
        model: the actor (a ``transformers`` causal LM, or a ``peft`` model wrapping one).
        b: the (micro-)batch. temperature: > 0. chunk_tokens: rows of logits at a time.
        entropy: also the entropy (nats) of each model token's distribution at ``temperature``.
        scorer: what runs :func:`~trainer.models.lm_head.token_scores` on ``model`` with the remaining
            arguments (default: that function; the fsdp backend passes the actor's FSDP forward method).
        shared_prefix_tokens: a common prefix of the rows of at least this many tokens is run once
            (``learner.backend_settings.shared_prefix_tokens``, :mod:`trainer.models.shared_prefix`; 0:
            off; not passed to a ``scorer``).
        top_k / top_p: the rollout's truncation (``rollout.top_k`` / ``rollout.top_p``; -1 / 1: none).

    Returns:
        ``(logp, entropy)``, ``(B, T)`` float32 each (entropy None when not asked for).
    """
    mask = b.loss_mask.bool()
    score_mask = torch.zeros(b.input_ids.shape, dtype=torch.bool, device=mask.device)
    score_mask[:, b.prompt_len:] = mask
    fn = scorer or (lambda *a, **k: token_scores(model, *a, shared_prefix_tokens=shared_prefix_tokens, **k))
    lp, ent = fn(b.input_ids, b.attention_mask, b.position_ids, score_mask, temperature=temperature,
                 chunk_tokens=chunk_tokens, entropy=entropy, top_k=top_k, top_p=top_p)
    lp = lp.new_zeros(mask.shape).masked_scatter(mask, lp)
    return lp, None if ent is None else ent.new_zeros(mask.shape).masked_scatter(mask, ent)


def response_logprobs(model: nn.Module, b: RolloutBatch, temperature: float, *,
                      chunk_tokens: int = DEFAULT_CHUNK_TOKENS, top_k: int = -1,
                      top_p: float = 1.0) -> Tensor:
    """``(B, T)`` float32 log-probs of the response's model tokens (:func:`response_scores`)."""
    return response_scores(model, b, temperature, chunk_tokens=chunk_tokens, top_k=top_k, top_p=top_p)[0]


def enable_activation_checkpointing(*models: nn.Module | None) -> None:
    """Activation checkpointing of every decoder layer of each model (``gradient_checkpointing`` of
    ``learner.backend_settings``):
    ``transformers``' own (non-reentrant :func:`torch.utils.checkpoint.checkpoint`), so a layer's
    activations are recomputed in backward instead of kept. A :class:`ValueModel` gets it on its
    backbone; None is skipped."""
    for m in models:
        if m is None:
            continue
        target = m.backbone if isinstance(m, ValueModel) else m
        if hasattr(target, "activation_checkpointing_enable"):  # transformers >= 5
            target.activation_checkpointing_enable()
        else:
            target.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def mb_values(critic: ValueModel, b: RolloutBatch, shared_prefix_tokens: int = 0) -> Tensor:
    """``(B, T)`` float32 critic values of the states before each response token (a common prefix
    of at least ``shared_prefix_tokens`` run once, :meth:`ValueModel.forward`; 0: off)."""
    return critic.response_values(b.input_ids, b.attention_mask, b.position_ids, b.prompt_len,
                                  shared_prefix_tokens)


class TransformersForward:
    """The forward hooks of :class:`~trainer.learner.template.TemplateLearner` over a
    ``transformers`` causal LM ``actor`` and a :class:`ValueModel` ``critic`` (torch and FSDP)."""

    actor: nn.Module
    critic: ValueModel | None
    cfg: LearnerConfig
    #: :func:`response_scores`'s ``scorer`` (None: :func:`~trainer.models.lm_head.token_scores`).
    scorer: Callable[..., tuple[Tensor, Tensor | None]] | None = None

    def forward_context(self) -> contextlib.AbstractContextManager:
        """Where the forward passes run: :func:`torch.autocast` in ``cfg.autocast_dtype`` on the
        actor's device type (``learner.backend_settings.autocast_dtype``), else a null context (float32)."""
        if self.cfg.autocast_dtype is None:
            return contextlib.nullcontext()
        device = next(self.actor.parameters()).device.type
        return torch.autocast(device_type=device, dtype=getattr(torch, self.cfg.autocast_dtype))

    def scores(self, mb: RolloutBatch, entropy: bool) -> tuple[Tensor, Tensor | None]:
        """The actor's response log-probs (and entropies) of ``mb`` (:func:`response_scores`, chunks of
        ``cfg.logprob_chunk_tokens``, the rollouts' ``cfg.top_k`` / ``cfg.top_p`` support), float32,
        under :meth:`forward_context`."""
        width, mb = mb.loss_mask.shape[1], mb.trimmed()
        with self.forward_context():
            lp, ent = response_scores(self.actor, mb, self.cfg.temperature, entropy=entropy,
                                      scorer=self.scorer, chunk_tokens=self.cfg.logprob_chunk_tokens,
                                      shared_prefix_tokens=self.cfg.shared_prefix_tokens,
                                      top_k=self.cfg.top_k, top_p=self.cfg.top_p)
        return pad_response(lp, width), None if ent is None else pad_response(ent, width)

    def logprobs(self, mb: RolloutBatch) -> Tensor:
        """The actor's response log-probs of ``mb`` (:meth:`scores`)."""
        return self.scores(mb, False)[0]

    def logprobs_and_entropy(self, mb: RolloutBatch) -> tuple[Tensor, Tensor | None]:
        """The actor's response log-probs and per-token entropies of ``mb`` (:meth:`scores`)."""
        return self.scores(mb, True)

    def values(self, mb: RolloutBatch) -> Tensor:
        """The critic's values of ``mb`` (:func:`mb_values`, ``shared_prefix_tokens``),
        float32, under :meth:`forward_context`."""
        width, mb = mb.loss_mask.shape[1], mb.trimmed()
        with self.forward_context():
            return pad_response(mb_values(self.critic, mb, self.cfg.shared_prefix_tokens).float(), width)

    @torch.no_grad()
    def next_token_logprobs(self, prompt_ids: Tensor, temperature: float) -> Tensor:
        """The actor's next-token distribution after each prompt, ``log softmax(logits / T)``, in
        float32 whatever ``autocast_dtype`` (an exact reference of the weights).

        Args:
            prompt_ids: ``(K, P)`` int64 unpadded prompts.
            temperature: > 0.

        Returns:
            ``(K, V)`` float32 on the CPU (the weight-sync attestation's reference,
            :mod:`trainer.orchestration.attestation`).
        """
        was_training = self.actor.training
        self.actor.eval()
        device = next(self.actor.parameters()).device
        logits = self.actor(input_ids=prompt_ids.to(device)).logits[:, -1].float()
        self.actor.train(was_training)
        return torch.log_softmax(logits / temperature, dim=-1).cpu()


class TorchLearner(TransformersForward, TemplateLearner):
    """Actor (causal LM) + optional critic (:class:`ValueModel`) on one device (a :class:`Learner`).

    Args:
        actor: the policy (trained in place).
        algo: the algorithm (preset).
        cfg: :class:`LearnerConfig`.
        critic: the value model (used iff ``algo.use_critic``); default built from the actor.

    With ``cfg.lora`` / ``cfg.critic_lora`` the adapters are injected into ``actor`` / ``critic`` in
    place (:func:`~trainer.learner.lora.prepare_models`) and only their parameters are optimised.

    Raises:
        ConfigError: a LoRA target module the model does not have (naming the key); a trained
            parameter that is not float32 (``model.dtype: bfloat16`` without LoRA, whose AdamW
            updates would round away: :func:`~trainer.learner.lora.check_trainable_dtype`).
    """

    def __init__(self, actor: nn.Module, algo: copc.AlgorithmConfig, cfg: LearnerConfig,
                 critic: ValueModel | None = None) -> None:
        check_output_head(actor)  # the chunked log-prob path scores this model exactly
        self.algo, self.cfg = algo, cfg
        self.algorithm = ActorCriticAlgorithm.from_config(algo, cfg)
        self.actor, self.critic = prepare_models(actor, cfg, algo.use_critic, critic)
        if cfg.critic_freeze_attention and self.critic is not None:
            freeze_attention(self.critic)
        for role, model in (("actor", self.actor), ("critic", self.critic)):
            if model is not None:
                check_trainable_dtype(model, role)
        self.actor_opt = TorchOptimizer(trainable_parameters(self.actor), cfg.optim, "actor")
        self.critic_opt = None if self.critic is None else TorchOptimizer(
            trainable_parameters(self.critic), cfg.optim, "critic")
        self.steps_done = 0

    @classmethod
    def from_spec(cls, spec: LearnerSpec, model_dir: str | Path) -> TorchLearner:
        """The torch backend of a :class:`~trainer.learner.spec.LearnerSpec`, actor from ``model_dir``;
        its own settings are the backend's :class:`~trainer.learner.backend_settings.TorchSettings`
        (``spec.settings_as``: defaults for a backend registered without settings).

        Raises:
            ConfigError: the backend's settings are not a ``TorchSettings``; as :meth:`__init__`.
        """
        from ...models.loading import load_model_and_tokenizer

        own = spec.settings_as(TorchSettings)
        actor, _ = load_model_and_tokenizer(model_dir, dtype=getattr(torch, spec.dtype),
                                            attn_implementation=spec.attn_implementation)
        learner = cls(actor, spec.algorithm, spec.step_with(own))
        if own.gradient_checkpointing:
            enable_activation_checkpointing(learner.actor, learner.critic)
        return learner

    # -- the Learner protocol (step and policy_version: TemplateLearner) ----------------------
    def export_policy_weights(self) -> Iterator[tuple[str, Tensor]]:
        """The actor's ``state_dict`` items (``transformers`` names = Hugging Face names); a LoRA
        actor's merged (:func:`~trainer.models.lora.merged_state_dict`, base weights untouched)."""
        if self.cfg.lora is None:
            yield from self.actor.state_dict().items()
        else:
            yield from merged_state_dict(self.actor).items()

    def export_adapter(self) -> AdapterWeights | None:
        """The actor's LoRA adapter (views of the live tensors; None without ``learner.lora``): what
        a weight sync sends instead of :meth:`export_policy_weights`."""
        return None if self.cfg.lora is None else AdapterWeights.of(self.actor, self.cfg.lora)

    def merged_weights(self, adapter: AdapterWeights) -> dict[str, Tensor]:
        """The full weights of the actor's base with another version's ``adapter`` merged (a kept
        fixed-lag version for an engine that takes full weights only)."""
        return merged_state_dict(self.actor, adapter.tensors, adapter.settings)

    def state_dict(self) -> dict:
        """Everything needed to resume: models (a LoRA model's adapter, value head, settings only:
        :func:`~trainer.learner.lora.role_state`), optimizers, schedulers, step counter, and the
        diagnostics' state (``diagnostics``: the value-bias EMA,
        :class:`~trainer.learner.step_metrics.ValueBiasTracker`)."""
        out = {**role_state("actor", self.actor, self.cfg.lora),
               "actor_opt": self.actor_opt.optimizer.state_dict(),
               "actor_sched": self.actor_opt.scheduler.state_dict(), "steps_done": self.steps_done,
               "diagnostics": self.algorithm.diagnostics_state_dict()}
        if self.critic is not None:
            out.update(role_state("critic", self.critic, self.cfg.critic_lora),
                       critic_opt=self.critic_opt.optimizer.state_dict(),
                       critic_sched=self.critic_opt.scheduler.state_dict())
        return out

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` output (a checkpoint from before ``diagnostics`` existed
        loads too: the value-bias EMA then restarts, drift 0 at the next step).

        Raises:
            ConfigError: the checkpoint's LoRA settings are not this learner's (naming the key).
        """
        load_role_state("actor", self.actor, self.cfg.lora, state)
        self.actor_opt.optimizer.load_state_dict(state["actor_opt"])
        self.actor_opt.scheduler.load_state_dict(state["actor_sched"])
        self.steps_done = int(state["steps_done"])
        self.algorithm.load_diagnostics_state_dict(state.get("diagnostics", {"value_bias_ema": None}))
        if self.critic is not None:
            load_role_state("critic", self.critic, self.cfg.critic_lora, state)
            self.critic_opt.optimizer.load_state_dict(state["critic_opt"])
            self.critic_opt.scheduler.load_state_dict(state["critic_sched"])

    # -- the template step's hooks (forward passes: TransformersForward) ----------------------
    @torch.no_grad()
    def recompute(self, batch: RolloutBatch) -> tuple[Tensor, Tensor | None]:
        """Whole-batch ``logp_old`` / ``values_old`` over micro-batches of rows of similar length
        (eval mode): the rows sorted by real tokens, so each micro-batch's :meth:`RolloutBatch.trimmed`
        padding is small; a row's outputs do not depend on the rows beside it, and are returned in
        batch order."""
        self.actor.eval()
        order = torch.argsort(batch.attention_mask.sum(dim=1), stable=True).tolist()
        lps, vals = [], []
        for sl in self.algorithm.micro_slices(len(batch)):
            mb = batch.select(order[sl])
            lps.append(self.logprobs(mb))
            if self.critic is not None:
                self.critic.eval()
                vals.append(self.values(mb))
        back = torch.argsort(torch.tensor(order))
        return torch.cat(lps)[back], (torch.cat(vals)[back] if vals else None)

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
