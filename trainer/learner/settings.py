"""The learner's settings, built once from the config (:func:`trainer.config.specs.learner_config`,
part of the :class:`~trainer.learner.spec.LearnerSpec`) and passed to every backend.

* :class:`OptimizerSettings` — the optimiser of the actor and of the critic: algorithm
  (``learner.optimizer``), learning rates, Adam betas / eps, weight decay, gradient clipping and
  the linear warm-up (``train.*``). Every backend builds its optimizers and schedules from it
  (:mod:`trainer.learner.optim`; Megatron's own optimizer on GPU); none reads the config itself.
* :class:`LearnerConfig` — the step settings (mini-batches, micro-batch size, critic warm-up,
  sampling temperature, seed, log-prob chunk size) plus the :class:`OptimizerSettings` and the LoRA
  adapters of the actor and the critic (:class:`~trainer.models.lora.LoraSettings`, None: full
  fine-tuning).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from typing import Any

from copc.component_settings import ValueProbeSettings

from ..models.settings import DEFAULT_CHUNK_TOKENS, LoraSettings

#: ``learner.optimizer`` values.
OPTIMIZERS = ("adamw", "sgd")
#: ``autocast_dtype`` values (:class:`~trainer.learner.backend_settings.TorchSettings`): None (float32
#: throughout) or a :func:`torch.autocast` dtype.
AUTOCAST_DTYPES = (None, "bfloat16")
#: Fields of a backend's own settings (``learner.backend_settings``) that :class:`LearnerConfig`
#: carries to the shared step code when the backend's settings dataclass has them
#: (:func:`step_fields`); a backend without one keeps :class:`LearnerConfig`'s default.
STEP_FIELDS = ("logprob_chunk_tokens", "critic_freeze_attention", "autocast_dtype", "shared_prefix_tokens")


@dataclass(frozen=True)
class OptimizerSettings:
    """The optimiser of both models (one object; every backend gets the same).

    Attributes:
        name: ``adamw`` (:class:`torch.optim.AdamW`; Megatron ``adam`` with decoupled decay on GPU)
            | ``sgd`` (plain SGD, no momentum, L2 ``weight_decay``) — ``learner.optimizer``.
        actor_lr / critic_lr: peak learning rates of the actor / critic (``train.actor_lr`` /
            ``train.critic_lr``).
        betas / eps: Adam's moment decays and denominator term (torch's defaults; ignored by SGD).
        weight_decay: decoupled (AdamW) or L2 (SGD) decay, every parameter (``train.weight_decay``).
        grad_clip: max global L2 gradient norm per update, 0 = off (``train.grad_clip``).
        warmup_steps: linear warm-up of both learning rates over this many schedule steps (one per
            learner step that updates the model; ``train.warmup_steps``); factor
            :meth:`warmup_factor`.

    Raises:
        ValueError: an unknown ``name`` (naming ``learner.optimizer``), a negative rate, decay,
            clip or warm-up, betas outside ``[0, 1)`` or ``eps <= 0`` (naming the field).
    """

    name: str = "adamw"
    actor_lr: float = 1e-6
    critic_lr: float = 1e-5
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    warmup_steps: int = 0

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZERS:
            raise ValueError(f"learner.optimizer={self.name!r}: must be 'adamw' or 'sgd'")
        for key in ("actor_lr", "critic_lr", "weight_decay", "grad_clip", "warmup_steps"):
            v = getattr(self, key)
            if not math.isfinite(v) or v < 0:
                raise ValueError(f"optimizer {key}={v!r}: must be a finite number >= 0")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"optimizer betas={self.betas!r}: must be two numbers in [0, 1)")
        if not self.eps > 0:
            raise ValueError(f"optimizer eps={self.eps!r}: must be > 0")

    def lr(self, role: str) -> float:
        """The peak learning rate of ``role`` (``"actor"`` | ``"critic"``).

        Raises:
            ValueError: another role.
        """
        if role not in ("actor", "critic"):
            raise ValueError(f"role={role!r}: must be 'actor' or 'critic'")
        return self.actor_lr if role == "actor" else self.critic_lr

    def warmup_factor(self, i: int) -> float:
        """Learning-rate factor after ``i`` schedule steps: ``min(1, (i + 1) / warmup_steps)``
        (1 without warm-up)."""
        return 1.0 if self.warmup_steps <= 0 else min(1.0, (i + 1) / self.warmup_steps)


@dataclass(frozen=True)
class LearnerConfig:
    """Settings of a learner step (see :class:`trainer.config.TrainConfig`).

    Attributes:
        optim: :class:`OptimizerSettings` of the actor and the critic.
        critic_warmup_steps: first steps update only the critic.
        num_mini_batches: updates per step. micro_batch_size: rows per forward/backward.
        temperature: sampling temperature of the rollouts (log-probs are of ``logits / T``).
        top_k / top_p: the rollouts' truncation (``rollout.top_k`` / ``rollout.top_p``): with
            ``top_k > 1`` or ``top_p < 1`` the actor's log-probs are taken over the sampler's
            renormalised support (:mod:`trainer.logprobs`); -1 / 1: untruncated.
        seed: mini-batch permutation seed.
        lora / critic_lora: the actor's / critic's LoRA adapter (``learner.lora`` /
            ``learner.critic_lora``), None: the model is fully fine-tuned.
        logprob_chunk_tokens: tokens whose logits the LM head computes at a time in the actor's
            log-probs (``learner.backend_settings.logprob_chunk_tokens``;
            :mod:`trainer.models.chunked_logprobs`).
        critic_updates_per_step: critic updates per mini-batch (``train.critic_updates_per_step``).
        critic_freeze_attention: the critic's attention parameters stay as loaded
            (``learner.backend_settings.critic_freeze_attention``;
            :func:`~trainer.learner.critic.freeze_attention`).
        autocast_dtype: ``"bfloat16"``: forward passes under :func:`torch.autocast`
            (``learner.backend_settings.autocast_dtype``); None: float32.
        shared_prefix_tokens: shortest common prefix of a micro-batch's rows run once
            (``learner.backend_settings.shared_prefix_tokens``, :mod:`trainer.models.shared_prefix`);
            0: off.
        value_probes: the π-referenced value probes' pooling window and weight cap
            (``train.value_probes``, :class:`~copc.component_settings.ValueProbeSettings`).

    Raises:
        ValueError: ``logprob_chunk_tokens`` or ``critic_updates_per_step`` not an int >= 1, or an
            ``autocast_dtype`` not in :data:`AUTOCAST_DTYPES` (naming the key).
    """

    optim: OptimizerSettings = field(default_factory=OptimizerSettings)
    critic_warmup_steps: int = 0
    num_mini_batches: int = 1
    micro_batch_size: int = 8
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    seed: int = 0
    lora: LoraSettings | None = None
    critic_lora: LoraSettings | None = None
    logprob_chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    critic_updates_per_step: int = 1
    critic_freeze_attention: bool = False
    autocast_dtype: str | None = None
    shared_prefix_tokens: int = 0
    value_probes: ValueProbeSettings = field(default_factory=ValueProbeSettings)

    def __post_init__(self) -> None:
        for key, n in (("learner.backend_settings.logprob_chunk_tokens", self.logprob_chunk_tokens),
                       ("train.critic_updates_per_step", self.critic_updates_per_step)):
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"{key}={n!r}: must be an int >= 1")
        if self.autocast_dtype not in AUTOCAST_DTYPES:
            raise ValueError(f"learner.backend_settings.autocast_dtype={self.autocast_dtype!r}: must be None "
                             "(float32) or 'bfloat16'")

    def with_backend(self, backend: Any) -> LearnerConfig:
        """This config with the :data:`STEP_FIELDS` of another backend's settings ``backend``
        (:func:`step_fields`; the fields it lacks get :class:`LearnerConfig`'s defaults)."""
        defaults = {f.name: f.default for f in fields(LearnerConfig) if f.name in STEP_FIELDS}
        return replace(self, **{**defaults, **step_fields(backend)})


def step_fields(backend: Any) -> dict[str, Any]:
    """The fields of a backend's settings (``learner.backend_settings`` as its dataclass, or None)
    that :class:`LearnerConfig` carries to the shared step code: those named in :data:`STEP_FIELDS`
    that it has."""
    return {k: getattr(backend, k) for k in STEP_FIELDS if hasattr(backend, k)}
