"""The Megatron backend's optimizers behind the one optimizer interface
(:class:`~trainer.learner.optim.ModelOptimizer`), built from the one
:class:`~trainer.learner.settings.OptimizerSettings`.

* CPU (gloo): :class:`TorchRankOptimizer` — the torch backend's optimizer
  (:class:`~trainer.learner.optim.TorchOptimizer`: AdamW or SGD) over the gradients that
  Megatron DDP accumulates in ``param.main_grad``, with the same clipping rule as
  :func:`torch.nn.utils.clip_grad_norm_` on the global norm (tensor-parallel shards counted
  once, replicated parameters once). Megatron's own optimizers and gradient clipping allocate on
  ``device="cuda"``.
* GPU: :class:`MegatronRankOptimizer` — Megatron's ``get_megatron_optimizer`` (distributed
  optimizer: Adam/SGD state sharded over the data-parallel ranks, fp32 master weights for
  bf16/fp16 models, its own clipping).

Both: ``zero_grad`` → (forward/backward of the micro-batches) → ``step`` (data-parallel SUM of
the gradients by ``finalize_model_grads`` — with global loss denominators that is the
single-process gradient — then clip and update) → ``schedule_step`` once per learner step
(linear warm-up, as the torch backend's ``LambdaLR``).
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from torch import nn

from ...optim import TorchOptimizer
from ...settings import OptimizerSettings

Tensor = torch.Tensor


def global_grad_norm(params: list[nn.Parameter], group: Any) -> float:
    """L2 norm of all gradients of a tensor-parallel model, as if it were one unsharded model.

    Tensor-parallel shards are counted on every rank, replicated parameters (norms, biases of
    row-parallel layers, the value head) only on tensor-parallel rank 0
    (``param_is_not_tensor_parallel_duplicate``); the squares are summed over ``group`` (the
    model-parallel group). Collective.
    """
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

    grads = [p.grad for p in params if p.grad is not None and param_is_not_tensor_parallel_duplicate(p)]
    local = torch.nn.utils.get_total_norm(grads, 2.0) if grads else torch.zeros(())
    sq = (local.double() ** 2).reshape(1)
    torch.distributed.all_reduce(sq, group=group)
    return float(sq.sqrt())


class TorchRankOptimizer(TorchOptimizer):
    """torch AdamW/SGD over Megatron DDP's ``main_grad`` (the CPU path), a
    :class:`~trainer.learner.optim.TorchOptimizer` whose clipping norm counts tensor-parallel
    shards once (:func:`global_grad_norm`).

    Args:
        ddp: the model wrapped in Megatron ``DistributedDataParallel`` (no distributed optimizer).
        settings: the optimiser settings (as every backend). role: ``"actor"`` | ``"critic"``.
        model_parallel_group: the group over which the gradient norm is summed.
    """

    def __init__(self, ddp: nn.Module, settings: OptimizerSettings, role: str,
                 model_parallel_group: Any) -> None:
        self.ddp, self.group = ddp, model_parallel_group
        super().__init__([p for p in ddp.parameters() if p.requires_grad], settings, role, clip=self._clip)

    def _clip(self, params: list[nn.Parameter], max_norm: float) -> float:
        norm = global_grad_norm(params, self.group)
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, torch.tensor(norm))
        return norm

    def zero_grad(self) -> None:
        """Zero DDP's grad buffers (``main_grad``) and drop ``.grad``."""
        self.ddp.zero_grad_buffer()
        super().zero_grad()

    def step(self) -> float | None:
        """DP all-reduce (SUM), ``grad ← main_grad``, clip to ``grad_clip`` (global norm), update."""
        from megatron.core.distributed import finalize_model_grads

        finalize_model_grads([self.ddp])
        for p in self.params:
            p.grad = p.main_grad.to(p.dtype)
        return super().step()

    def _init_state(self) -> None:
        """Materialise the optimizer state (zeros) so a checkpoint can be loaded into it."""
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if self.optimizer.state[p] or not isinstance(self.optimizer, torch.optim.AdamW):
                    continue
                self.optimizer.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                                           "exp_avg_sq": torch.zeros_like(p)}

    def sharded_state_dict(self, model_sharded_state_dict: dict, is_loading: bool = False) -> dict:
        """``{"optimizer": torch state with ShardedTensors, "common_step", "scheduler"}``.

        Per-parameter tensors (``exp_avg``, ``exp_avg_sq``) get the sharding of their parameter
        (megatron ``optim_state_to_sharding_state``); Adam's per-parameter ``step`` (the same
        count for every parameter) is saved once.
        """
        from megatron.core.dist_checkpointing.optimizer import (
            get_param_id_to_sharded_param_map,
            optim_state_to_sharding_state,
        )

        del is_loading  # the state is materialised either way (zeros before the first step)
        self._init_state()
        state = self.optimizer.state_dict()
        steps = {float(s["step"]) for s in state["state"].values() if "step" in s}
        params = itertools.chain.from_iterable(g["params"] for g in self.optimizer.param_groups)
        id_map = get_param_id_to_sharded_param_map(model_sharded_state_dict, params)
        optim_state_to_sharding_state(state, id_map, exclude_keys=("step",))
        return {"optimizer": state, "common_step": max(steps) if steps else None,
                "scheduler": self.scheduler.state_dict()}

    def load_sharded_state_dict(self, state: dict) -> None:
        """Restore :meth:`sharded_state_dict` output (after ``dist_checkpointing.load``)."""
        opt = state["optimizer"]
        if state.get("common_step") is not None:
            for s in opt["state"].values():
                s["step"] = torch.tensor(float(state["common_step"]))
        self.optimizer.load_state_dict(opt)
        self.scheduler.load_state_dict(state["scheduler"])


class MegatronRankOptimizer:
    """Megatron's distributed optimizer (the GPU path; ``get_megatron_optimizer``), set up as the
    torch backend's optimizer: ``sgd`` without momentum (Megatron's default ``sgd_momentum`` is
    0.9), weight decay on every parameter (Megatron's default exempts biases and 1-D parameters;
    ``config_overrides={}`` turns that off, as ``torch.optim.AdamW`` over all parameters).

    Args:
        ddp: the model in Megatron DDP built with ``use_distributed_optimizer=True``.
        settings: the optimiser settings (``adamw`` → Megatron ``adam``, decoupled weight decay;
            ``sgd`` → plain SGD). role: ``"actor"`` | ``"critic"``.
        dtype: the model's parameter dtype (bf16/fp16 → fp32 master weights).
    """

    def __init__(self, ddp: nn.Module, settings: OptimizerSettings, role: str, dtype: torch.dtype) -> None:
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        lr = settings.lr(role)
        cfg = OptimizerConfig(optimizer="adam" if settings.name == "adamw" else "sgd", lr=lr,
                              weight_decay=settings.weight_decay, clip_grad=settings.grad_clip,
                              adam_beta1=settings.betas[0], adam_beta2=settings.betas[1],
                              adam_eps=settings.eps,
                              bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16, params_dtype=dtype,
                              use_distributed_optimizer=True, sgd_momentum=0.0)
        self.ddp, self.base_lr, self.grad_clip = ddp, lr, settings.grad_clip
        self.optimizer = get_megatron_optimizer(cfg, [ddp], config_overrides={})
        self._warmup, self._n = settings.warmup_factor, 0
        self._set_lr()

    def _set_lr(self) -> None:
        for g in self.optimizer.param_groups:
            g["lr"] = self.base_lr * self._warmup(self._n)

    def zero_grad(self) -> None:
        """Zero the grad buffers (DDP and the optimizer's)."""
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()

    def step(self) -> float | None:
        """``finalize_model_grads`` (reduce-scatter over data parallel), then Megatron's step."""
        from megatron.core.distributed import finalize_model_grads

        finalize_model_grads([self.ddp])
        _ok, norm, _zeros = self.optimizer.step()
        return float(norm) if self.grad_clip > 0 and norm is not None else None

    def schedule_step(self) -> None:
        """Advance the linear warm-up."""
        self._n += 1
        self._set_lr()

    @property
    def lr(self) -> float:
        """The current learning rate."""
        return self.base_lr * self._warmup(self._n)

    def sharded_state_dict(self, model_sharded_state_dict: dict, is_loading: bool = False) -> dict:
        """Megatron's optimizer ``sharded_state_dict`` plus the warm-up counter."""
        state = self.optimizer.sharded_state_dict(model_sharded_state_dict, is_loading=is_loading)
        return {"optimizer": state, "scheduler": self._n}

    def load_sharded_state_dict(self, state: dict) -> None:
        """Restore :meth:`sharded_state_dict` output."""
        self.optimizer.load_state_dict(state["optimizer"])
        self._n = int(state["scheduler"])
        self._set_lr()
