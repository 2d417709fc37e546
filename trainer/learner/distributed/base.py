"""The per-rank seam of a distributed learner backend (``fsdp``, ``megatron``, a user's).

A distributed backend runs one process per rank. Inside each rank process, after
``torch.distributed`` is initialised, the runtime (:mod:`.worker`) builds the backend's
:class:`RankLearner` through a factory registered with
:func:`~trainer.learner.distributed.registry.register_rank_learner`::

    factory(spec: LearnerSpec, model_dir, ctx: RankContext) -> RankLearner

and then calls the SAME method on EVERY rank, in the same order (each call is collective):

* ``step(batch)`` with the SAME full :class:`~trainer.rollout.batch.RolloutBatch` on every
  rank. The rank trains on its data-parallel share of every mini-batch (the contiguous row
  split of :func:`~trainer.learner.distributed.shard.dp_rows`) with GLOBAL loss denominators
  (counts of the whole mini-batch, :meth:`~trainer.learner.algorithm.ActorCriticAlgorithm.denominators`),
  so the sum of the ranks' gradients equals the single-process gradient. It returns the step's
  metrics for the whole batch (at least valid on rank 0; the driver reads rank 0's).
* ``export_policy_weights()``: the actor's full (gathered) tensors in Hugging Face names on
  rank 0, on the CPU; other ranks may yield nothing (but must take part in the gathers).
* ``save(directory)`` / ``load(directory)``: the complete resumable state (sharded model and
  optimizer state, schedulers, counters, diagnostics) in ``directory`` (DCP for FSDP,
  Megatron ``dist_checkpointing`` for Megatron). ``directory`` is inside the atomic checkpoint
  being built (:mod:`trainer.outputs.checkpoint`); every rank sees the same path.
* ``policy_version``: updates done (resumes included), identical on every rank.

Optional (tests, diagnostics, benchmarks): ``named_gradients()`` → ``{"actor.<HF name>": grad,
"critic.<name>": grad}``, full tensors on rank 0 (:class:`GradientProbe`); ``state_bytes()`` →
this rank's bytes of parameters, gradients and optimizer state (:class:`MemoryProbe`).
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from ...rollout.batch import RolloutBatch
from ..registry import RANK_LEARNERS  # noqa: F401 - re-exported: the rank-learner registry (defined without torch)
from ..spec import LearnerSpec


@dataclass(frozen=True)
class RankContext:
    """Where a rank sits in the world; built by the runtime after ``init_process_group``.

    Rank layout (Megatron's default order ``tp-cp-ep-dp-pp`` with cp = ep = 1): tensor-parallel
    ranks are adjacent, then data parallel, then pipeline stages::

        tp_rank = rank % tp_size
        dp_rank = (rank // tp_size) % dp_size
        pp_rank = rank // (tp_size * dp_size)

    Attributes:
        rank / world_size: global rank and number of ranks.
        dp_rank / dp_size: data-parallel rank and size (``world_size / (tp_size · pp_size)``).
        tp_rank / tp_size, pp_rank / pp_size: tensor- and pipeline-parallel rank and size.
        local_rank: rank on this machine (picks the CUDA device).
        device: ``torch.device`` of this rank (``cuda:<local_rank>`` with NCCL, else ``cpu``).
        dist_backend: ``gloo`` or ``nccl`` (the default group's).
        cpu_group: a gloo process group over all ranks for object/metadata collectives
            (``all_gather_object``, command broadcast); the default group when that is gloo.
        dp_group: the process group of the ranks that hold the same model shard (``None`` =
            the default group, which is exact when ``tp_size == pp_size == 1``). Model-parallel
            backends build their own groups (Megatron: ``parallel_state``) from the same layout.
        timeout: collective timeout (``learner.backend_settings.timeout_s``).
    """

    rank: int
    world_size: int
    dp_rank: int
    dp_size: int
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    dist_backend: str = "gloo"
    cpu_group: Any = None
    dp_group: Any = None
    timeout: datetime.timedelta = datetime.timedelta(seconds=1800)

    @property
    def is_rank0(self) -> bool:
        """True on global rank 0 (the rank whose results the driver reads)."""
        return self.rank == 0

    @staticmethod
    def layout(rank: int, world_size: int, tp_size: int = 1, pp_size: int = 1) -> dict[str, int]:
        """``{"dp_rank", "dp_size", "tp_rank", "pp_rank"}`` of ``rank`` (the order above).

        Raises:
            ValueError: ``world_size`` not divisible by ``tp_size · pp_size``, or ``rank`` out of range.
        """
        if tp_size < 1 or pp_size < 1 or world_size % (tp_size * pp_size):
            raise ValueError(f"world_size={world_size} is not divisible by tensor_parallel_size × "
                             f"pipeline_parallel_size = {tp_size} × {pp_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} is not in [0, {world_size})")
        dp_size = world_size // (tp_size * pp_size)
        return {"dp_rank": (rank // tp_size) % dp_size, "dp_size": dp_size, "tp_rank": rank % tp_size,
                "pp_rank": rank // (tp_size * dp_size)}


@runtime_checkable
class RankLearner(Protocol):
    """One rank's part of a distributed learner (see the module docstring for the contract).

    Every method is collective: the runtime calls it on all ranks in the same order.
    """

    @property
    def policy_version(self) -> int:
        """Updates done (resumes included); identical on every rank."""

    def step(self, batch: RolloutBatch) -> dict[str, float]:
        """Train on this rank's data-parallel share of ``batch`` (the full batch, same on every
        rank) with global denominators; return the whole batch's metrics (valid on rank 0)."""

    def export_policy_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The actor's full tensors in Hugging Face names (CPU) on rank 0; others may yield nothing."""

    def save(self, directory: Path) -> None:
        """Write the complete resumable state into ``directory`` (same path on every rank)."""

    def load(self, directory: Path) -> None:
        """Restore :meth:`save` output from ``directory``."""


@runtime_checkable
class GradientProbe(Protocol):
    """Optional: the gradients left by the last optimizer update (tests, diagnostics)."""

    def named_gradients(self) -> dict[str, torch.Tensor]:
        """``{"actor.<HF name>": grad, "critic.<name>": grad}``: full float32 CPU tensors on rank 0
        (other ranks: may be empty); parameters without a gradient are left out."""


@runtime_checkable
class MemoryProbe(Protocol):
    """Optional: the memory this rank holds for training state (``benchmarks/bench_learners.py``)."""

    def state_bytes(self) -> dict[str, int]:
        """``{"params", "grads", "optimizer"}``: bytes of the distinct tensor storages this rank
        holds (its shards; padding included), after at least one step; see
        :func:`trainer.learner.distributed.shard.training_state_bytes`."""


#: ``factory(spec, model_dir, ctx) -> RankLearner``, called inside a rank process after
#: ``torch.distributed`` is initialised (``spec``: the :class:`~trainer.learner.spec.LearnerSpec` the
#: driver pickled to the rank; the backend's own settings are ``spec.settings``).
RankLearnerFactory = Callable[[LearnerSpec, Path, RankContext], RankLearner]
