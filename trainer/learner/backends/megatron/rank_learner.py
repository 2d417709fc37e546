"""The Megatron-core rank learner (``learner.backend: megatron``): tensor and data parallel.

One rank of a :class:`~trainer.learner.distributed.runtime.DistributedLearner`. The actor and the
critic are Megatron ``GPTModel`` s built from the Hugging Face checkpoint through mbridge
(:mod:`.bridge`), wrapped in Megatron ``DistributedDataParallel``; ``parallel_state`` lays out
``tp × dp`` ranks (pipeline size 1) in the runtime's order (tensor-parallel ranks adjacent).

The step is the template's (:class:`~trainer.learner.template.TemplateLearner`, as the torch
backend): every algorithmic part comes from
:class:`~trainer.learner.algorithm.ActorCriticAlgorithm`; per mini-batch, the rows are split over
the data-parallel ranks (contiguous,
:func:`~trainer.learner.distributed.shard.micro_plan`), the losses use the denominators of the
WHOLE mini-batch and Megatron DDP SUMS the rank gradients (``calculate_per_token_loss``: no
division by the data-parallel size), so the update is the single-process one:

* ``logp_old`` / ``values_old`` are recomputed on each data-parallel rank's rows and all-gathered
  over the data-parallel group, so advantages (group statistics, whitening) are whole-batch;
* log-probs are computed vocab-parallel (:mod:`.logprobs`), never gathering the full logits;
* micro-batch metrics are all-gathered over the data-parallel group and combined by the same
  :class:`~trainer.learner.step_metrics.MetricAccumulator` rules.

Checkpoints: Megatron ``dist_checkpointing`` (sharded model + optimizer state, one sub-directory
per model) plus a small replicated file (schedules are in the sharded state; step count and
diagnostics here).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import copc

from ....errors import ConfigError
from ....logprobs import truncates
from ....rollout.batch import RolloutBatch
from ...algorithm import ActorCriticAlgorithm, MiniBatchDenominators, StepInputs
from ...backend_settings import DistributedSettings
from ...distributed.base import RankContext
from ...distributed.collectives import all_gather_objects
from ...distributed.shard import batch_to, gather_rows, micro_plan, training_state_bytes
from ...optim import ModelOptimizer
from ...settings import LearnerConfig
from ...spec import LearnerSpec
from ...template import TemplateLearner
from . import shims
from .bridge import build_actor, build_critic, export_actor, export_critic, make_bridge
from .logprobs import response_logprobs, response_values
from .optim import MegatronRankOptimizer, TorchRankOptimizer

Tensor = torch.Tensor

#: The replicated small-state file inside a rank learner's save directory.
SMALL_STATE = "learner_state.pt"


def init_parallel_state(ctx: RankContext) -> None:
    """``parallel_state.initialize_model_parallel`` for ``ctx``'s sizes (re-initialised when a
    previous learner in this process used other sizes).

    Raises:
        ConfigError: ``pp_size != 1`` (naming ``learner.backend_settings.pipeline_parallel_size``).
        RuntimeError: Megatron's rank layout differs from ``ctx``'s (a runtime bug).
    """
    from megatron.core import parallel_state as ps

    if ctx.pp_size != 1:
        raise ConfigError(f"learner.backend_settings.pipeline_parallel_size={ctx.pp_size}: the megatron "
                          "backend runs pipeline size 1 only (tensor and data parallel); use "
                          "tensor_parallel_size")
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


class MegatronRankLearner(TemplateLearner):
    """One rank of the ``megatron`` backend (a :class:`~trainer.learner.distributed.base.RankLearner`
    with :meth:`named_gradients`).

    Args:
        model_dir: ``save_pretrained`` directory of the actor (and the critic's backbone).
        algo: the preset. cfg: :class:`LearnerConfig` (the torch backend's settings).
        ctx: this rank's :class:`RankContext` (``torch.distributed`` initialised).
        dtype: parameter dtype (float32 only on CPU).
        recompute: activation recompute (``learner.backend_settings.gradient_checkpointing``):
            Megatron's full, uniform recompute of every transformer layer
            (``recompute_granularity="full"``, ``recompute_method="uniform"``,
            ``recompute_num_layers=1``): each layer keeps only its input and is re-run in the
            backward pass. Same gradients, less activation memory.

    Raises:
        ConfigError: ``rollout.top_k > 1`` or ``rollout.top_p < 1`` (the vocabulary-parallel
            log-probs do not replay the sampler's top-k / top-p support, :mod:`trainer.logprobs`);
            ``model.dtype`` other than float32 on CPU; CPU ranks (gloo) on a CUDA
            machine; pipeline size ≠ 1; tensor-parallel
            size not dividing heads / vocabulary; an architecture mbridge does not know.
        MegatronVersionError: megatron-core / mbridge not at the pinned versions.
    """

    def __init__(self, model_dir: str | Path, algo: copc.AlgorithmConfig, cfg: LearnerConfig,
                 ctx: RankContext, dtype: torch.dtype = torch.float32, recompute: bool = False) -> None:
        if truncates(cfg.top_k, cfg.top_p):
            raise ConfigError(f"rollout.top_k={cfg.top_k!r} / rollout.top_p={cfg.top_p!r} with "
                              "learner.backend=megatron: its vocabulary-parallel log-probs are untruncated "
                              "and cannot replay the sampler's top-k / top-p support; use top_k=-1 and "
                              "top_p=1, or the torch / fsdp backend")
        shims.check_versions()
        shims.apply_checkpoint_shims()
        on_gpu = ctx.device.type == "cuda"
        if not on_gpu:
            if shims.cuda_available():  # the CPU shims stay off on a CUDA machine
                raise ConfigError("learner.backend_settings.dist_backend=gloo on a machine with CUDA: the "
                                  "megatron backend runs on the GPUs there "
                                  "(learner.backend_settings.dist_backend=auto or nccl)")
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
        self.algorithm = ActorCriticAlgorithm.from_config(algo, cfg)
        self.bridge = make_bridge(model_dir, dtype)
        self.bridge.set_extra_args(calculate_per_token_loss=True)  # DDP sums rank gradients (no 1/dp)
        if recompute:
            self.bridge.set_extra_args(recompute_granularity="full", recompute_method="uniform",
                                       recompute_num_layers=1)
        self.actor = self._wrap(build_actor(self.bridge, model_dir, self.device))
        self.critic = None
        if algo.use_critic:
            self.critic = self._wrap(build_critic(self.bridge, model_dir, self.device))

        def make_opt(model: nn.Module, role: str) -> ModelOptimizer:
            if on_gpu:
                return MegatronRankOptimizer(model, cfg.optim, role, dtype)
            return TorchRankOptimizer(model, cfg.optim, role, ps.get_model_parallel_group())

        self.actor_opt = make_opt(self.actor, "actor")
        self.critic_opt = make_opt(self.critic, "critic") if self.critic is not None else None
        self.steps_done = 0

    def _wrap(self, model: nn.Module) -> nn.Module:
        """Megatron DDP (fp32 gradient buffers; distributed optimizer on GPU)."""
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        ddp_cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                use_distributed_optimizer=self.device.type == "cuda")
        return DistributedDataParallel(config=model.config, ddp_config=ddp_cfg, module=model)

    # -- the RankLearner protocol (step and policy_version: TemplateLearner) ----------------
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

    def state_bytes(self) -> dict[str, int]:
        """This rank's persistent training state in bytes (``params``, ``grads`` = DDP's gradient
        buffers, ``optimizer``; :func:`~trainer.learner.distributed.shard.training_state_bytes`)."""
        models = self.models()
        opts = [getattr(o, "optimizer", None) for _, _, o in models]
        return training_state_bytes([m for _, m, _ in models],
                                    [o for o in opts if isinstance(o, torch.optim.Optimizer)])

    def save(self, directory: Path) -> None:
        """``dist_checkpointing`` of each model with its optimizer into ``directory/<actor|critic>``,
        step count and diagnostics by rank 0 into ``directory/learner_state.pt``. Collective."""
        from megatron.core import dist_checkpointing

        directory = Path(directory)
        for name, model, opt in self.models():
            (directory / name).mkdir(parents=True, exist_ok=True)
            dist.barrier(group=self.ctx.cpu_group)
            dist_checkpointing.save(self._sharded_state(model, opt, is_loading=False), str(directory / name))
        if self.ctx.is_rank0:
            small = {"steps_done": self.steps_done, "diagnostics": self.algorithm.diagnostics_state_dict()}
            torch.save(small, directory / SMALL_STATE)
        dist.barrier(group=self.ctx.cpu_group)

    def load(self, directory: Path) -> None:
        """Restore :meth:`save` output (same tensor-parallel size; Megatron reshards across data parallel).

        Raises:
            FileNotFoundError: ``directory`` lacks a model sub-directory or ``learner_state.pt``.
        """
        from megatron.core import dist_checkpointing

        directory = Path(directory)
        for name, model, opt in self.models():
            if not (directory / name).is_dir() or not (directory / SMALL_STATE).is_file():
                raise FileNotFoundError(f"{directory}: not a megatron learner checkpoint (needs {name}/ and "
                                        f"{SMALL_STATE})")
            template = self._sharded_state(model, opt, is_loading=True)
            state = dist_checkpointing.load(template, str(directory / name))
            model.module.load_state_dict(state["model"], strict=True)
            opt.load_sharded_state_dict(state["optimizer"])
        small = torch.load(directory / SMALL_STATE, map_location="cpu", weights_only=True)
        self.steps_done = int(small["steps_done"])
        self.algorithm.load_diagnostics_state_dict(small["diagnostics"])

    # -- backend part ----------------------------------------------------------------------
    @staticmethod
    def _sharded_state(model: nn.Module, opt: Any, *, is_loading: bool) -> dict[str, Any]:
        msd = model.module.sharded_state_dict()
        return {"model": msd, "optimizer": opt.sharded_state_dict(msd, is_loading=is_loading)}

    def _plan(self, n_rows: int) -> list[slice]:
        """This rank's micro-batch slices (no padding passes: Megatron's data-parallel collectives
        run once per update, in ``finalize_model_grads``, whatever the number of passes)."""
        return [s for s in micro_plan(n_rows, self.ctx.dp_rank, self.ctx.dp_size, self.cfg.micro_batch_size)
                if s is not None]

    def place(self, batch: RolloutBatch) -> RolloutBatch:
        """The batch on this rank's device (advantages are computed there)."""
        return batch_to(batch, self.device)

    def logprobs(self, mb: RolloutBatch) -> Tensor:
        """Vocab-parallel actor log-probs of ``mb`` (:func:`.logprobs.response_logprobs`)."""
        return response_logprobs(self.actor, mb, self.cfg.temperature, self.device)

    def values(self, mb: RolloutBatch) -> Tensor:
        """Critic values of ``mb`` (:func:`.logprobs.response_values`)."""
        return response_values(self.critic, mb, self.device)

    @torch.no_grad()
    def recompute(self, batch: RolloutBatch) -> tuple[Tensor, Tensor | None]:
        """Whole-batch ``logp_old`` / ``values_old`` ``(B, T)``: this rank's rows, all-gathered."""
        self.actor.eval()
        if self.critic is not None:
            self.critic.eval()
        lps, vals = [], []
        for sl in self._plan(len(batch)):
            mb = batch.select(sl)
            lps.append(self.logprobs(mb))
            if self.critic is not None:
                vals.append(self.values(mb))
        T = batch.loss_mask.shape[1]
        empty = torch.zeros((0, T), dtype=torch.float32, device=self.device)
        n, r, d = len(batch), self.ctx.dp_rank, self.ctx.dp_size
        logp = gather_rows(torch.cat(lps) if lps else empty, n, r, d, group=self.dp_group)
        values = None
        if self.critic is not None:
            values = gather_rows(torch.cat(vals) if vals else empty, n, r, d, group=self.dp_group)
        return logp, values

    def backward(self, role: str, mini: RolloutBatch, x: StepInputs, den: MiniBatchDenominators
                 ) -> list[tuple[dict[str, float], float]]:
        """Backward of ``role``'s loss on this rank's rows of ``mini`` (Megatron DDP sums the
        gradients over data parallel at the optimizer step); every data-parallel rank's metrics."""
        local = []
        for sl in self._plan(len(mini)):
            mb = mini.select(sl)
            loss, met = self.micro_loss(role, mb, x.rows_slice(sl), den)
            loss.backward()
            local.append((met, float(mb.loss_mask.sum())))
        return [item for rank_items in all_gather_objects(local, self.dp_gloo) for item in rank_items]


def build_megatron_rank_learner(spec: LearnerSpec, model_dir: Path, ctx: RankContext) -> MegatronRankLearner:
    """The ``megatron`` rank-learner factory
    (:func:`~trainer.learner.distributed.registry.register_rank_learner`).

    Its settings are the :class:`~trainer.learner.backend_settings.DistributedSettings` of
    ``learner.backend_settings`` (``spec.settings_as``): ``gradient_checkpointing`` turns on Megatron's
    activation recompute (see :class:`MegatronRankLearner`).

    Raises:
        ConfigError: ``cpu_offload`` (an FSDP option, naming ``learner.backend_settings.cpu_offload``),
            and as :class:`MegatronRankLearner`.
    """
    own = spec.settings_as(DistributedSettings)
    if own.cpu_offload:
        raise ConfigError("learner.backend_settings.cpu_offload=true: an fsdp option; "
                          "learner.backend=megatron shards the optimizer state over data parallel on GPU "
                          "instead (set it to false)")
    return MegatronRankLearner(model_dir, spec.algorithm, spec.step_with(own),
                               ctx, dtype=getattr(torch, spec.dtype),
                               recompute=bool(own.gradient_checkpointing))
