"""The Megatron-core rank learner (``learner.backend: megatron``): tensor and data parallel.

One rank of a :class:`~trainer.learner.distributed.runtime.DistributedLearner`. The actor and the
critic are Megatron ``GPTModel`` s built from the Hugging Face checkpoint through mbridge
(:mod:`.bridge`), wrapped in Megatron ``DistributedDataParallel``; ``parallel_state`` lays out
``tp × dp`` ranks (pipeline size 1) in the runtime's order (tensor-parallel ranks adjacent).

The step is the torch backend's (:class:`~trainer.learner.backends.torch.TorchLearner`): every
algorithmic part comes from :class:`~trainer.learner.algorithm.ActorCriticAlgorithm`; per
mini-batch, the rows are split over the data-parallel ranks (contiguous,
:func:`~trainer.learner.distributed.shard.micro_plan`), the losses use the denominators of the
WHOLE mini-batch and Megatron DDP SUMS the rank gradients (``calculate_per_token_loss``: no
division by the data-parallel size), so the update is the single-process one:

* ``logp_old`` / ``values_old`` are recomputed on each data-parallel rank's rows and all-gathered
  over the data-parallel group, so advantages (group statistics, whitening) are whole-batch;
* log-probs are computed vocab-parallel (:mod:`.logprobs`), never gathering the full logits;
* micro-batch metrics are all-gathered over the data-parallel group and combined by the same
  :class:`~trainer.learner.algorithm.MetricAccumulator` rules.

Checkpoints: Megatron ``dist_checkpointing`` (sharded model + optimizer state, one sub-directory
per model) plus a small replicated file (schedules are in the sharded state; step count and
diagnostics here).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import copc

from ....errors import ConfigError
from ....rollout.batch import RolloutBatch
from ...algorithm import ActorCriticAlgorithm, MetricAccumulator, StepInputs
from ...distributed.base import RankContext
from ...distributed.collectives import all_gather_objects
from ...distributed.shard import (
    gather_rows,
    global_denominators,
    micro_plan,
    training_state_bytes,
)
from ..torch import LearnerConfig
from . import shims
from .bridge import build_actor, build_critic, export_actor, export_critic, make_bridge
from .logprobs import response_logprobs, response_values
from .optim import MegatronRankOptimizer, RankOptimizer, TorchRankOptimizer

Tensor = torch.Tensor

#: The replicated small-state file inside a rank learner's save directory.
SMALL_STATE = "learner_state.pt"


def init_parallel_state(ctx: RankContext) -> None:
    """``parallel_state.initialize_model_parallel`` for ``ctx``'s sizes (re-initialised when a
    previous learner in this process used other sizes).

    Raises:
        ConfigError: ``pp_size != 1`` (naming ``learner.pipeline_parallel_size``).
        RuntimeError: Megatron's rank layout differs from ``ctx``'s (a runtime bug).
    """
    from megatron.core import parallel_state as ps

    if ctx.pp_size != 1:
        raise ConfigError(f"learner.pipeline_parallel_size={ctx.pp_size}: the megatron backend runs pipeline "
                          "size 1 only (tensor and data parallel); use tensor_parallel_size")
    if ps.model_parallel_is_initialized():
        if (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()) == \
                (ctx.tp_size, ctx.pp_size):
            return
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=ctx.tp_size,
                                 pipeline_model_parallel_size=ctx.pp_size,
                                 distributed_timeout_minutes=max(1, int(ctx.timeout.total_seconds() // 60)))
    got = (ps.get_tensor_model_parallel_rank(), ps.get_data_parallel_rank(),
           ps.get_data_parallel_world_size())
    if got != (ctx.tp_rank, ctx.dp_rank, ctx.dp_size):
        raise RuntimeError(f"Megatron rank layout (tp_rank, dp_rank, dp_size)={got} differs from the "
                           f"runtime's {(ctx.tp_rank, ctx.dp_rank, ctx.dp_size)}")


def _batch_to(b: RolloutBatch, device: torch.device) -> RolloutBatch:
    if device.type == "cpu":
        return b
    return dataclasses.replace(b, **{f.name: getattr(b, f.name).to(device) for f in dataclasses.fields(b)
                                     if isinstance(getattr(b, f.name), torch.Tensor)})


class MegatronRankLearner:
    """One rank of the ``megatron`` backend (a :class:`~trainer.learner.distributed.base.RankLearner`
    with :meth:`named_gradients`).

    Args:
        model_dir: ``save_pretrained`` directory of the actor (and the critic's backbone).
        algo: the preset. cfg: :class:`LearnerConfig` (the torch backend's settings).
        ctx: this rank's :class:`RankContext` (``torch.distributed`` initialised).
        dtype: parameter dtype (float32 only on CPU).
        recompute: activation recompute (``model.gradient_checkpointing``): Megatron's full,
            uniform recompute of every transformer layer (``recompute_granularity="full"``,
            ``recompute_method="uniform"``, ``recompute_num_layers=1``): each layer keeps only its
            input and is re-run in the backward pass. Same gradients, less activation memory.

    Raises:
        ConfigError: ``model.dtype`` other than float32 on CPU; CPU ranks (gloo) on a CUDA
            machine; pipeline size ≠ 1; tensor-parallel
            size not dividing heads / vocabulary; an architecture mbridge does not know.
        MegatronVersionError: megatron-core / mbridge not at the pinned versions.
    """

    def __init__(self, model_dir: str | Path, algo: copc.AlgorithmConfig, cfg: LearnerConfig,
                 ctx: RankContext, dtype: torch.dtype = torch.float32, recompute: bool = False) -> None:
        shims.check_versions()
        shims.apply_checkpoint_shims()
        on_gpu = ctx.device.type == "cuda"
        if not on_gpu:
            if shims.cuda_available():  # the CPU shims stay off on a CUDA machine
                raise ConfigError("learner.dist_backend=gloo on a machine with CUDA: the megatron backend "
                                  "runs on the GPUs there (learner.dist_backend=auto or nccl)")
            shims.apply_cpu_shims()
            if dtype != torch.float32:
                raise ConfigError(f"model.dtype={str(dtype).removeprefix('torch.')}: the megatron backend "
                                  "on CPU runs float32 only (bfloat16/float16 need the GPU path)")
        init_parallel_state(ctx)
        from megatron.core import parallel_state as ps

        if on_gpu:
            from megatron.core import tensor_parallel

            # Megatron's CUDA RNG tracker needs its "model-parallel-rng" state before any model is
            # built: the GPU weight init (_initialize_affine_weight_gpu) and attention dropout
            # fork() into it, and an empty tracker raises "cuda rng state ... is not added"
            tensor_parallel.model_parallel_cuda_manual_seed(int(cfg.seed))

        self.ctx, self.algo, self.cfg, self.device = ctx, algo, cfg, ctx.device
        self.dp_group = ps.get_data_parallel_group()
        self.dp_gloo = ps.get_data_parallel_group_gloo() if on_gpu else self.dp_group
        self.algorithm = ActorCriticAlgorithm(algo, num_mini_batches=cfg.num_mini_batches,
                                              micro_batch_size=cfg.micro_batch_size,
                                              critic_warmup_steps=cfg.critic_warmup_steps, seed=cfg.seed)
        self.bridge = make_bridge(model_dir, dtype)
        self.bridge.set_extra_args(calculate_per_token_loss=True)  # DDP sums rank gradients (no 1/dp)
        if recompute:
            self.bridge.set_extra_args(recompute_granularity="full", recompute_method="uniform",
                                       recompute_num_layers=1)
        self.actor = self._wrap(build_actor(self.bridge, model_dir, self.device))
        self.critic = None
        if algo.use_critic:
            self.critic = self._wrap(build_critic(self.bridge, model_dir, self.device))

        def make_opt(model: nn.Module, lr: float) -> RankOptimizer:
            if on_gpu:
                return MegatronRankOptimizer(model, cfg.optimizer, lr, cfg.weight_decay, cfg.warmup_steps,
                                             cfg.grad_clip, dtype)
            return TorchRankOptimizer(model, cfg.optimizer, lr, cfg.weight_decay, cfg.warmup_steps,
                                      cfg.grad_clip, ps.get_model_parallel_group())

        self.actor_opt = make_opt(self.actor, cfg.actor_lr)
        self.critic_opt = make_opt(self.critic, cfg.critic_lr) if self.critic is not None else None
        self.steps_done = 0

    def _wrap(self, model: nn.Module) -> nn.Module:
        """Megatron DDP (fp32 gradient buffers; distributed optimizer on GPU)."""
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        ddp_cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                use_distributed_optimizer=self.device.type == "cuda")
        return DistributedDataParallel(config=model.config, ddp_config=ddp_cfg, module=model)

    # -- the RankLearner protocol ----------------------------------------------------------
    @property
    def policy_version(self) -> int:
        """Updates done (resumes included)."""
        return self.steps_done

    def step(self, batch: RolloutBatch) -> dict[str, float]:
        """One learner step on this rank's rows of ``batch`` (the full batch, same on every rank);
        returns the whole batch's metrics (identical on every rank), keys as the torch backend."""
        t0 = time.perf_counter()
        alg = self.algorithm
        batch = _batch_to(batch, self.device)
        logp_old, values_old = self._recompute(batch)
        x, metrics = alg.advantages(batch, logp_old, values_old, self.policy_version,
                                    steps_done=self.steps_done)
        updates, update_actor = alg.mini_batch_updates(
            batch, x, self.steps_done, has_critic=self.critic is not None,
            denominators=lambda mini: global_denominators(alg, mini),
            actor_update=lambda mini, xm, den, acc: self._update(
                "actor", self.actor_opt, self.actor, mini, xm, acc,
                lambda mb, xs: self._actor_loss(mb, xs, den)),
            critic_update=lambda mini, xm, den, acc: self._update(
                "critic", self.critic_opt, self.critic, mini, xm, acc,
                lambda mb, xs: self._critic_loss(mb, xs, den)))
        if update_actor:
            self.actor_opt.schedule_step()
        if self.critic_opt is not None:
            self.critic_opt.schedule_step()
        self.steps_done += 1
        metrics.update(updates)
        metrics["actor/lr"] = self.actor_opt.lr
        metrics["actor/updated"] = float(update_actor)
        metrics["perf/learner_step_s"] = time.perf_counter() - t0
        metrics["perf/tokens"] = float(batch.attention_mask.sum())
        return metrics

    def export_policy_weights(self) -> Iterator[tuple[str, Tensor]]:
        """The actor's full tensors in Hugging Face names on rank 0's CPU (every rank must exhaust
        the iterator: the tensor-parallel gathers are collective; other ranks yield nothing)."""
        for name, t in export_actor(self.bridge, self.actor):
            if self.ctx.is_rank0:
                yield name, t

    def named_gradients(self) -> dict[str, Tensor]:
        """Full float32 gradients of the last update on rank 0: ``actor.<HF name>`` and
        ``critic.<ValueModel name>`` (collective)."""
        out: dict[str, Tensor] = {}
        parts = [("actor", export_actor(self.bridge, self.actor, grads=True))]
        if self.critic is not None:
            parts.append(("critic", export_critic(self.bridge, self.critic, grads=True)))
        for prefix, pairs in parts:
            for name, g in pairs:
                if self.ctx.is_rank0:
                    out[f"{prefix}.{name}"] = g.float()
        return out

    def export_critic_weights(self) -> Iterator[tuple[str, Tensor]]:
        """The critic's full tensors under :class:`~trainer.learner.critic.ValueModel` names on rank 0
        (collective as :meth:`export_policy_weights`); nothing without a critic."""
        if self.critic is None:
            return
        for name, t in export_critic(self.bridge, self.critic):
            if self.ctx.is_rank0:
                yield name, t

    def state_bytes(self) -> dict[str, int]:
        """This rank's persistent training state in bytes (``params``, ``grads`` = DDP's gradient
        buffers, ``optimizer``; :func:`~trainer.learner.distributed.shard.training_state_bytes`)."""
        models = self._models()
        opts = [getattr(o, "optimizer", None) for _, _, o in models]
        return training_state_bytes([m for _, m, _ in models],
                                    [o for o in opts if isinstance(o, torch.optim.Optimizer)])

    def save(self, directory: Path) -> None:
        """``dist_checkpointing`` of each model with its optimizer into ``directory/<actor|critic>``,
        step count and diagnostics by rank 0 into ``directory/learner_state.pt``. Collective."""
        from megatron.core import dist_checkpointing

        directory = Path(directory)
        for name, model, opt in self._models():
            (directory / name).mkdir(parents=True, exist_ok=True)
            dist.barrier(group=self.ctx.cpu_group)
            dist_checkpointing.save(self._sharded_state(model, opt, is_loading=False), str(directory / name))
        if self.ctx.is_rank0:
            torch.save({"steps_done": self.steps_done, "diagnostics": self.algorithm.value_bias.state_dict()},
                       directory / SMALL_STATE)
        dist.barrier(group=self.ctx.cpu_group)

    def load(self, directory: Path) -> None:
        """Restore :meth:`save` output (same tensor-parallel size; Megatron reshards across data parallel).

        Raises:
            FileNotFoundError: ``directory`` lacks a model sub-directory or ``learner_state.pt``.
        """
        from megatron.core import dist_checkpointing

        directory = Path(directory)
        for name, model, opt in self._models():
            if not (directory / name).is_dir() or not (directory / SMALL_STATE).is_file():
                raise FileNotFoundError(f"{directory}: not a megatron learner checkpoint (needs {name}/ and "
                                        f"{SMALL_STATE})")
            template = self._sharded_state(model, opt, is_loading=True)
            state = dist_checkpointing.load(template, str(directory / name))
            model.module.load_state_dict(state["model"], strict=True)
            opt.load_sharded_state_dict(state["optimizer"])
        small = torch.load(directory / SMALL_STATE, map_location="cpu", weights_only=False)
        self.steps_done = int(small["steps_done"])
        self.algorithm.value_bias.load_state_dict(small["diagnostics"])

    # -- backend part ----------------------------------------------------------------------
    def _models(self) -> list[tuple[str, nn.Module, RankOptimizer]]:
        out = [("actor", self.actor, self.actor_opt)]
        if self.critic is not None:
            out.append(("critic", self.critic, self.critic_opt))
        return out

    @staticmethod
    def _sharded_state(model: nn.Module, opt: RankOptimizer, *, is_loading: bool) -> dict[str, Any]:
        msd = model.module.sharded_state_dict()
        return {"model": msd, "optimizer": opt.sharded_state_dict(msd, is_loading=is_loading)}

    def _plan(self, n_rows: int) -> list[slice]:
        """This rank's micro-batch slices (no padding passes: Megatron's data-parallel collectives
        run once per update, in ``finalize_model_grads``, whatever the number of passes)."""
        return [s for s in micro_plan(n_rows, self.ctx.dp_rank, self.ctx.dp_size, self.cfg.micro_batch_size)
                if s is not None]

    @torch.no_grad()
    def _recompute(self, batch: RolloutBatch) -> tuple[Tensor, Tensor | None]:
        """Whole-batch ``logp_old`` / ``values_old`` ``(B, T)``: this rank's rows, all-gathered."""
        self.actor.eval()
        if self.critic is not None:
            self.critic.eval()
        lps, vals = [], []
        for sl in self._plan(len(batch)):
            mb = batch.select(sl)
            lps.append(response_logprobs(self.actor, mb, self.cfg.temperature, self.device))
            if self.critic is not None:
                vals.append(response_values(self.critic, mb, self.device))
        T = batch.loss_mask.shape[1]
        empty = torch.zeros((0, T), dtype=torch.float32, device=self.device)
        n, r, d = len(batch), self.ctx.dp_rank, self.ctx.dp_size
        logp = gather_rows(torch.cat(lps) if lps else empty, n, r, d, group=self.dp_group)
        values = None
        if self.critic is not None:
            values = gather_rows(torch.cat(vals) if vals else empty, n, r, d, group=self.dp_group)
        return logp, values

    def _actor_loss(self, mb: RolloutBatch, xs: StepInputs, den: copc.Denominators) -> tuple[Tensor, dict]:
        logp = response_logprobs(self.actor, mb, self.cfg.temperature, self.device)
        loss, met = self.algorithm.policy_loss(logp, mb, xs, den)
        return loss, {**met, "actor/total_loss": float(loss.detach())}

    def _critic_loss(self, mb: RolloutBatch, xs: StepInputs, den: copc.Denominators) -> tuple[Tensor, dict]:
        return self.algorithm.value_loss(response_values(self.critic, mb, self.device), mb, xs, den)

    def _update(self, prefix: str, opt: RankOptimizer, model: nn.Module, mini: RolloutBatch, xm: StepInputs,
                acc: MetricAccumulator, loss_fn: Callable[[RolloutBatch, StepInputs], tuple[Tensor, dict]]
                ) -> None:
        """One optimizer update on this rank's rows of ``mini`` (gradients summed over data parallel
        by Megatron DDP); the metrics of every data-parallel rank's micro-batches go into ``acc``."""
        model.train()
        opt.zero_grad()
        local = []
        for sl in self._plan(len(mini)):
            mb = mini.select(sl)
            loss, met = loss_fn(mb, xm.rows_slice(sl))
            loss.backward()
            local.append((met, float(mb.loss_mask.sum())))
        for rank_items in all_gather_objects(local, self.dp_gloo):
            for met, tokens in rank_items:
                acc.add_micro(met, tokens)
        norm = opt.step()
        if norm is not None:
            acc.add(f"{prefix}/grad_norm", norm)


def build_megatron_rank_learner(exp_cfg: Any, model_dir: Path, ctx: RankContext) -> MegatronRankLearner:
    """The ``megatron`` rank-learner factory
    (:func:`~trainer.learner.distributed.registry.register_rank_learner`).

    ``model.gradient_checkpointing`` turns on Megatron's activation recompute (see
    :class:`MegatronRankLearner`).

    Raises:
        ConfigError: ``learner.cpu_offload`` (an FSDP option), and as :class:`MegatronRankLearner`.
    """
    if exp_cfg.learner.cpu_offload:
        raise ConfigError("learner.cpu_offload=true: an fsdp option; learner.backend=megatron shards the "
                          "optimizer state over data parallel on GPU instead (set it to false)")
    return MegatronRankLearner(model_dir, exp_cfg.algorithm_config(), LearnerConfig.from_config(exp_cfg), ctx,
                               dtype=getattr(torch, exp_cfg.model.dtype),
                               recompute=bool(exp_cfg.model.gradient_checkpointing))
