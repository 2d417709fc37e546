"""The FSDP2 rank learner (``learner.backend: fsdp``): PyTorch ``fully_shard`` over the actor and
the critic, data parallel over the ranks of a
:class:`~trainer.learner.distributed.runtime.DistributedLearner`.

Per rank: parameters, gradients and optimizer state are sharded (each decoder layer its own
FSDP unit, then the root: embeddings, final norm, LM / value head). The step is the template's
(:class:`~trainer.learner.template.TemplateLearner`, as the torch backend) with the rows of
every mini-batch split over the data-parallel ranks in the hooks:

* ``logp_old`` / ``values_old`` are recomputed on each rank's rows and all-gathered, so the
  advantages (:class:`~trainer.learner.algorithm.ActorCriticAlgorithm`, any estimator, group
  statistics and whitening included) are those of the whole batch on every rank;
* micro-batch losses use the denominators of the WHOLE mini-batch (every rank holds it:
  :meth:`~trainer.learner.algorithm.ActorCriticAlgorithm.denominators`);
* FSDP's reduce-scatter would AVERAGE the rank gradients; the gradient divide factor is set to
  1 so they are SUMMED, which with global denominators is exactly the single-process gradient;
* gradient clipping uses the global norm over all shards (the DTensor norm's ``full_tensor``);
* metrics of every rank's micro-batches are all-gathered and combined by the same
  :class:`~trainer.learner.step_metrics.MetricAccumulator` rules.

Forward passes (:func:`~trainer.learner.backends.torch.response_scores`,
:func:`~trainer.learner.backends.torch.mb_values`) and the critic
(:class:`~trainer.learner.critic.ValueModel`) are the torch backend's; no RL maths here. The
actor's log-probs run the decoder and the chunked LM head directly, not the model's ``forward``;
they are registered as an FSDP forward method of the root unit (:data:`SCORES_FORWARD`), so the
root's parameters (embeddings, final norm, LM head) are all-gathered for them and their gradients
reduce-scattered after backward, as for ``forward``.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
    register_fsdp_forward_method,
)
from torch.distributed.tensor import DTensor

import copc

from ...models.lm_head import check_output_head, token_scores
from ...rollout.batch import RolloutBatch
from ..algorithm import ActorCriticAlgorithm, MiniBatchDenominators, StepInputs
from ..backend_settings import DistributedSettings
from ..critic import ValueModel
from ..distributed.base import RankContext
from ..distributed.collectives import all_gather_objects
from ..distributed.safe_dcp import safe_dcp_load
from ..distributed.shard import batch_to, gather_rows, micro_plan, training_state_bytes
from ..optim import TorchOptimizer
from ..settings import LearnerConfig
from ..spec import LearnerSpec
from ..template import TemplateLearner
from .torch import TransformersForward, enable_activation_checkpointing

Tensor = torch.Tensor

#: DCP sub-directory and the small (replicated) state file inside a rank learner's save directory.
DCP_DIR, SMALL_STATE = "dcp", "learner_state.pt"
#: The sharded actor's attribute that runs :func:`~trainer.models.lm_head.token_scores` on it as an
#: FSDP forward method (``register_fsdp_forward_method``).
SCORES_FORWARD = "copc_token_scores"


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of a ``transformers`` causal LM or base model (``….layers``).

    Raises:
        ValueError: no ``layers`` list found (the model is not a decoder-only transformer).
    """
    base = model.get_decoder() if hasattr(model, "get_decoder") else model
    layers = getattr(base, "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        raise ValueError(f"{type(model).__name__}: no decoder `layers` to shard (learner.backend=fsdp "
                         "needs a decoder-only transformers model)")
    return list(layers)


def global_grad_norm_clip_(params: list[nn.Parameter], max_norm: float) -> float:
    """Clip gradients in place to global L2 norm ``max_norm`` over ALL shards; returns the norm
    before clipping (as :func:`torch.nn.utils.clip_grad_norm_` on the unsharded model).

    The norm of sharded (DTensor) gradients is a partial DTensor; ``full_tensor()`` all-reduces it.
    """
    grads = [p.grad for p in params if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads, 2.0)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return float(total)


class FSDPRankLearner(TransformersForward, TemplateLearner):
    """One data-parallel rank of the ``fsdp`` backend (a
    :class:`~trainer.learner.distributed.base.RankLearner`).

    Args:
        actor: the policy, identical on every rank (loaded from the same directory); sharded here.
        algo: the preset. cfg: :class:`LearnerConfig` (same settings as the torch backend).
        ctx: this rank's :class:`RankContext` (``tp_size == pp_size == 1``).
        critic: the value model (default: built from the actor before sharding, zero head).
        cpu_offload: FSDP2 ``CPUOffloadPolicy`` (sharded parameters, gradients and optimizer
            state in CPU memory; on a CPU-only machine everything is there already).
        param_dtype: compute dtype (``bfloat16`` / ``float16``: mixed precision with float32
            sharded master weights and float32 gradient reduction; None: the loaded dtype).

    Raises:
        ValueError: model parallel sizes > 1, or a model without decoder layers.
    """

    def __init__(self, actor: nn.Module, algo: copc.AlgorithmConfig, cfg: LearnerConfig, ctx: RankContext,
                 critic: ValueModel | None = None, *, cpu_offload: bool = False,
                 param_dtype: torch.dtype | None = None) -> None:
        if ctx.tp_size != 1 or ctx.pp_size != 1:
            raise ValueError(f"learner.backend=fsdp is data parallel only; got tensor_parallel_size="
                             f"{ctx.tp_size}, pipeline_parallel_size={ctx.pp_size}")
        self.ctx, self.algo, self.cfg = ctx, algo, cfg
        # ValueModel returns a (read-only) view of the head output; nothing here writes into it in place
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
        check_output_head(actor)  # before sharding: the chunked log-prob path scores this model exactly
        self.export_dtype = param_dtype or next(actor.parameters()).dtype
        self.algorithm = ActorCriticAlgorithm.from_config(algo, cfg)
        self.critic = (critic or ValueModel.from_causal_lm(actor)) if algo.use_critic else None
        self.mesh = init_device_mesh(ctx.device.type, (ctx.dp_size,), mesh_dim_names=("dp",))
        mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32) if param_dtype else \
            MixedPrecisionPolicy()
        self._shard_kw = {"mesh": self.mesh, "mp_policy": mp,
                          "offload_policy": CPUOffloadPolicy(pin_memory=ctx.device.type == "cuda")
                          if cpu_offload else OffloadPolicy()}
        self.actor = self._shard(actor.to(ctx.device))
        setattr(self.actor, SCORES_FORWARD, functools.partial(token_scores, self.actor))
        register_fsdp_forward_method(self.actor, SCORES_FORWARD)
        self.scorer = getattr(self.actor, SCORES_FORWARD)  # the actor's log-probs: response_scores through it
        if self.critic is not None:
            self.critic = self._shard(self.critic.to(ctx.device))
        self.actor_opt = TorchOptimizer(self.actor.parameters(), cfg.optim, "actor",
                                        clip=global_grad_norm_clip_)
        self.critic_opt = None if self.critic is None else \
            TorchOptimizer(self.critic.parameters(), cfg.optim, "critic", clip=global_grad_norm_clip_)
        self.steps_done = 0

    def _shard(self, model: nn.Module) -> nn.Module:
        """``fully_shard`` each decoder layer, then the root. Every FSDP unit SUMS the rank gradients
        (divide factor 1, plain SUM collectives: gloo has no PREMUL_SUM); with global denominators
        that is exactly the single-process gradient."""
        units = decoder_layers(model.backbone if isinstance(model, ValueModel) else model)
        for layer in units:
            fully_shard(layer, **self._shard_kw)
        fully_shard(model, **self._shard_kw)
        for unit in [*units, model]:  # the factor is per FSDP unit (parameter group)
            unit.set_gradient_divide_factor(1.0)
            unit.set_force_sum_reduction_for_comms(self.ctx.dist_backend == "gloo")
        return model

    # -- the RankLearner protocol (step and policy_version: TemplateLearner) ----------------
    def export_policy_weights(self) -> Iterator[tuple[str, Tensor]]:
        """The actor's full state dict in Hugging Face names, on the CPU of rank 0 (collective
        gather; other ranks yield nothing), in the model's dtype."""
        full = get_model_state_dict(self.actor,
                                    options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.ctx.is_rank0:
            for name, t in full.items():
                yield name, t.to(self.export_dtype)

    def named_gradients(self) -> dict[str, Tensor]:
        """Full float32 gradients of the last update (``actor.<HF name>``, ``critic.<name>``) on
        rank 0 (collective)."""
        out: dict[str, Tensor] = {}
        for prefix, model in (("actor", self.actor), ("critic", self.critic)):
            if model is None:
                continue
            for name, p in model.named_parameters():
                if p.grad is None:
                    continue
                g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                if self.ctx.is_rank0:
                    out[f"{prefix}.{name}"] = g.detach().float().cpu().clone()
        return out

    def state_bytes(self) -> dict[str, int]:
        """This rank's bytes of parameter, gradient and optimizer-state shards
        (:func:`~trainer.learner.distributed.shard.training_state_bytes`)."""
        models = self.models()
        return training_state_bytes([m for _, m, _ in models], [o.optimizer for _, _, o in models])

    def save(self, directory: Path) -> None:
        """Sharded model + optimizer state with DCP into ``directory/dcp``; schedulers, step count and
        diagnostics (replicated) by rank 0 into ``directory/learner_state.pt``. Collective."""
        dcp.save(self._dcp_state(), checkpoint_id=str(Path(directory) / DCP_DIR))
        if self.ctx.is_rank0:
            torch.save(self._small_state(), Path(directory) / SMALL_STATE)
        dist.barrier(group=self.ctx.cpu_group)

    def load(self, directory: Path) -> None:
        """Restore :meth:`save` output (DCP reshards: another data-parallel size may have written it).

        The DCP files are read by :func:`~trainer.learner.distributed.safe_dcp.safe_dcp_load` (no code
        from the checkpoint runs), ``learner_state.pt`` with ``torch.load(weights_only=True)``.

        Raises:
            FileNotFoundError: ``directory`` lacks the DCP files or ``learner_state.pt``.
            UnsafeCheckpointError: the DCP metadata or a value would run code, or names a file outside it.
        """
        directory = Path(directory)
        if not (directory / DCP_DIR).is_dir() or not (directory / SMALL_STATE).is_file():
            raise FileNotFoundError(f"{directory}: not an fsdp learner checkpoint (needs {DCP_DIR}/ and "
                                    f"{SMALL_STATE})")
        state = self._dcp_state()
        safe_dcp_load(state, directory / DCP_DIR)  # never unpickles code from the checkpoint
        for name, model, opt in self.models():
            set_state_dict(model, opt.optimizer, model_state_dict=state[name],
                           optim_state_dict=state[f"{name}_opt"])
        small = torch.load(directory / SMALL_STATE, map_location="cpu", weights_only=True)
        self.actor_opt.scheduler.load_state_dict(small["actor_sched"])
        if self.critic_opt is not None:
            self.critic_opt.scheduler.load_state_dict(small["critic_sched"])
        self.steps_done = int(small["steps_done"])
        self.algorithm.load_diagnostics_state_dict(small["diagnostics"])

    # -- backend part ----------------------------------------------------------------------
    def _dcp_state(self) -> dict[str, Any]:
        state: dict[str, Any] = {}
        for name, model, opt in self.models():
            state[name], state[f"{name}_opt"] = get_state_dict(model, opt.optimizer)
        return state

    def _small_state(self) -> dict[str, Any]:
        out = {"steps_done": self.steps_done, "actor_sched": self.actor_opt.scheduler.state_dict(),
               "diagnostics": self.algorithm.diagnostics_state_dict()}
        if self.critic_opt is not None:
            out["critic_sched"] = self.critic_opt.scheduler.state_dict()
        return out

    def _plan(self, n_rows: int) -> list[slice | None]:
        return micro_plan(n_rows, self.ctx.dp_rank, self.ctx.dp_size, self.cfg.micro_batch_size)

    @torch.no_grad()
    def recompute(self, batch: RolloutBatch) -> tuple[Tensor, Tensor | None]:
        """Whole-batch ``logp_old`` / ``values_old`` ``(B, T)``: this rank's rows, all-gathered."""
        self.actor.eval()
        if self.critic is not None:
            self.critic.eval()
        lps, vals = [], []
        for sl in self._plan(len(batch)):  # None: a padding pass, for the collectives only
            mb = batch_to(batch.select(sl if sl is not None else slice(0, 1)), self.ctx.device)
            lp = self.logprobs(mb)
            v = self.values(mb) if self.critic is not None else None
            if sl is not None:
                lps.append(lp)
                vals.append(v)
        T = batch.loss_mask.shape[1]
        empty = torch.zeros((0, T), dtype=torch.float32, device=self.ctx.device)
        n, r, d = len(batch), self.ctx.dp_rank, self.ctx.dp_size
        logp = gather_rows(torch.cat(lps) if lps else empty, n, r, d).cpu()
        values = None
        if self.critic is not None:
            values = gather_rows(torch.cat(vals) if vals else empty, n, r, d).cpu()
        return logp, values

    def backward(self, role: str, mini: RolloutBatch, x: StepInputs, den: MiniBatchDenominators
                 ) -> list[tuple[dict[str, float], float]]:
        """Backward of ``role``'s loss on this rank's rows of ``mini`` (FSDP sums the gradients over
        the ranks); the metrics of every rank's micro-batches, in rank order."""
        local = []
        for sl in self._plan(len(mini)):
            rows = sl if sl is not None else slice(0, 1)
            mb = batch_to(mini.select(rows), self.ctx.device)
            loss, met = self.micro_loss(role, mb, x.rows_slice(rows).to(self.ctx.device), den)
            if sl is None:  # a padding pass: zero weight, keeps the FSDP collectives in step
                (loss * 0.0).backward()
                continue
            loss.backward()
            local.append((met, float(mb.loss_mask.sum())))
        return [item for rank_items in all_gather_objects(local, self.ctx.cpu_group) for item in rank_items]


def build_fsdp_rank_learner(spec: LearnerSpec, model_dir: Path, ctx: RankContext) -> FSDPRankLearner:
    """The ``fsdp`` rank-learner factory (see
    :func:`~trainer.learner.distributed.registry.register_rank_learner`).

    Loads the actor from ``model_dir`` (float32 master weights; ``model.dtype`` bfloat16/float16
    becomes the compute dtype through FSDP mixed precision), the critic from the actor (as the
    torch backend). Its settings are the backend's
    :class:`~trainer.learner.backend_settings.DistributedSettings` (``spec.settings_as``):
    ``gradient_checkpointing`` checkpoints both models' decoder layers (before sharding),
    ``cpu_offload`` keeps the sharded state in CPU memory, ``logprob_chunk_tokens`` as the torch backend.
    """
    from ...models.loading import load_model_and_tokenizer

    own = spec.settings_as(DistributedSettings)
    dtype = getattr(torch, spec.dtype)
    actor, _ = load_model_and_tokenizer(model_dir, dtype=torch.float32,
                                        attn_implementation=spec.attn_implementation)
    algo = spec.algorithm
    critic = ValueModel.from_causal_lm(actor) if algo.use_critic else None
    if own.gradient_checkpointing:
        enable_activation_checkpointing(actor, critic)
    return FSDPRankLearner(actor, algo, spec.step_with(own), ctx, critic,
                           cpu_offload=own.cpu_offload,
                           param_dtype=None if dtype == torch.float32 else dtype)
