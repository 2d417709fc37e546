"""One model's optimizer behind one interface (:class:`ModelOptimizer`), built from
:class:`~trainer.learner.settings.OptimizerSettings`.

The template step (:class:`~trainer.learner.template.TemplateLearner`) drives it:
``zero_grad`` → (the backend's forward/backward passes) → ``step`` (clip, update; returns the
gradient norm) per mini-batch, ``schedule_step`` once per learner step. :class:`TorchOptimizer`
is the torch / FSDP one (and, on CPU, Megatron's over ``main_grad``:
:class:`~trainer.learner.backends.megatron.optim.TorchRankOptimizer`); Megatron's distributed
optimizer on GPU implements the same interface.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol

import torch
from torch import nn

from .settings import OptimizerSettings

Tensor = torch.Tensor

#: ``clip(params, max_norm) -> norm before clipping`` (as :func:`torch.nn.utils.clip_grad_norm_`).
GradClip = Callable[[list[nn.Parameter], float], "Tensor | float"]


class ModelOptimizer(Protocol):
    """One model's optimizer and learning-rate schedule (collective methods on every rank)."""

    def zero_grad(self) -> None:
        """Clear the gradients before a mini-batch."""

    def step(self) -> float | None:
        """Clip and update; the global gradient norm before clipping (None when clipping is off)."""

    def schedule_step(self) -> None:
        """Advance the learning-rate schedule (once per learner step)."""

    @property
    def lr(self) -> float:
        """The current learning rate."""


def make_torch_optimizer(settings: OptimizerSettings, params: Iterable[nn.Parameter],
                         role: str) -> torch.optim.Optimizer:
    """``adamw`` (:class:`torch.optim.AdamW`, ``betas`` / ``eps``) or ``sgd`` (plain
    :class:`torch.optim.SGD`, L2 ``weight_decay``) over ``params`` at ``settings.lr(role)``."""
    lr = settings.lr(role)
    if settings.name == "adamw":
        return torch.optim.AdamW(params, lr=lr, betas=settings.betas, eps=settings.eps,
                                 weight_decay=settings.weight_decay)
    return torch.optim.SGD(params, lr=lr, weight_decay=settings.weight_decay)


def warmup_schedule(settings: OptimizerSettings, optimizer: torch.optim.Optimizer
                    ) -> torch.optim.lr_scheduler.LambdaLR:
    """The linear warm-up of ``settings`` (:meth:`OptimizerSettings.warmup_factor`) on ``optimizer``."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: settings.warmup_factor(i))


class TorchOptimizer:
    """A torch optimizer (:func:`make_torch_optimizer`) with its warm-up schedule and clipping.

    Args:
        params: the model's trainable parameters.
        settings: the optimiser settings. role: ``"actor"`` | ``"critic"`` (picks the rate).
        clip: the clipping function (default :func:`torch.nn.utils.clip_grad_norm_`; FSDP passes
            one over all shards). Clipping is off when ``settings.grad_clip`` is 0.

    Attributes:
        optimizer / scheduler: the torch objects (their ``state_dict`` s go into checkpoints).
    """

    def __init__(self, params: Iterable[nn.Parameter], settings: OptimizerSettings, role: str,
                 clip: GradClip = nn.utils.clip_grad_norm_) -> None:
        self.params = list(params)
        self.grad_clip, self.clip = settings.grad_clip, clip
        self.optimizer = make_torch_optimizer(settings, self.params, role)
        self.scheduler = warmup_schedule(settings, self.optimizer)

    def zero_grad(self) -> None:
        """Drop the gradients (``set_to_none``)."""
        self.optimizer.zero_grad(set_to_none=True)

    def step(self) -> float | None:
        """Clip to ``grad_clip`` (when on), update; the norm before clipping or None."""
        norm = float(self.clip(self.params, self.grad_clip)) if self.grad_clip > 0 else None
        self.optimizer.step()
        return norm

    def schedule_step(self) -> None:
        """One ``LambdaLR`` step (linear warm-up)."""
        self.scheduler.step()

    @property
    def lr(self) -> float:
        """The current learning rate."""
        return self.scheduler.get_last_lr()[0]
