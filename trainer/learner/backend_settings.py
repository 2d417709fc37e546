"""The built-in learner backends' own settings (``learner.backend_settings``), one dataclass per
regime, registered with the backend (:func:`~trainer.learner.base.register_learner`'s
``settings=``) and validated at load by :func:`trainer.config.check_plugins`:

* :class:`TorchSettings` — ``learner.backend: torch`` (one process): precision, the shared-prefix
  forward, the critic's frozen attention, activation checkpointing, the log-prob chunk size.
* :class:`DistributedSettings` — ``learner.backend: fsdp | megatron`` (every backend registered with
  :func:`~trainer.learner.distributed.registry.register_rank_learner`): the rank layout, how the
  ranks start (``spawn`` / ``ray`` / ``torchrun``, with the Ray cluster of ``launch: ray``), the
  process-group backend and timeout, CPU offload, activation checkpointing, the log-prob chunk size.

A setting a backend does not have is refused at load naming it (``learner.backend_settings.
world_size=2: unknown setting of TorchSettings; known: [...]``): its presence in the backend's
dataclass is the capability. What crosses components (LoRA, the optimiser, the allocator) stays in
the central ``learner`` section. A backend reads its settings from its
:class:`~trainer.learner.spec.LearnerSpec`: ``spec.settings``, or ``spec.settings_as(cls)`` typed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..models.settings import DEFAULT_CHUNK_TOKENS
from .settings import AUTOCAST_DTYPES

#: ``launch`` values of :class:`DistributedSettings`.
RANK_LAUNCHES = ("spawn", "ray", "torchrun")
#: ``dist_backend`` values of :class:`DistributedSettings`.
DIST_BACKENDS = ("auto", "gloo", "nccl")


def _positive_int(name: str, v: Any, floor: int = 1) -> None:
    """Raise ``ValueError("<name>=<v>: must be an int >= <floor>")`` unless ``v`` is one."""
    if isinstance(v, bool) or not isinstance(v, int) or v < floor:
        raise ValueError(f"{name}={v!r}: must be an int >= {floor}" + (" (0: off)" if floor == 0 else ""))


@dataclass
class TorchSettings:
    """Settings of the ``torch`` backend (``learner.backend_settings`` with ``learner.backend: torch``).

    Attributes:
        gradient_checkpointing: activation checkpointing of the actor's and the critic's decoder
            layers (recomputed in backward instead of kept: less memory, ~1/3 more compute per update).
        logprob_chunk_tokens: tokens whose logits the LM head computes at a time for the actor's
            log-probs (the full-vocabulary logits are never held; peak extra memory
            ~3 × chunk × vocabulary × 4 bytes), >= 1.
        autocast_dtype: ``bfloat16``: the forward passes (actor and critic, recompute and training)
            run under :func:`torch.autocast` in bfloat16 (weights, gradients and optimizer state stay
            float32; the LM head's log-softmax stays float32); ~2x faster steps on a CPU with AMX /
            bf16 units and on GPUs, at the price of log-probs that differ from the engine's float32
            ones by bfloat16 rounding (~1e-2 nats). null (default): float32 throughout.
        shared_prefix_tokens: when every row of a micro-batch begins with the same >= this many tokens
            (a few-shot prompt), the forward passes run that prefix once and the rows' remaining
            tokens against its keys and values (:mod:`trainer.models.shared_prefix`): the same
            log-probs, values and gradients up to float rounding. 0 (default): off. Not with
            ``gradient_checkpointing`` (whose recomputation keeps no key/value cache).
        critic_freeze_attention: the critic's attention parameters are not trained (SAO's critic
            recipe; :func:`~trainer.learner.critic.freeze_attention`).

    Raises:
        ValueError: ``logprob_chunk_tokens`` not an int >= 1, ``shared_prefix_tokens`` not an int
            >= 0 or set together with ``gradient_checkpointing``, ``autocast_dtype`` not in
            :data:`~trainer.learner.settings.AUTOCAST_DTYPES` (one line naming the field; the config
            key is prefixed by :func:`copc.build_settings`).
    """

    gradient_checkpointing: bool = False
    logprob_chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    autocast_dtype: str | None = None
    shared_prefix_tokens: int = 0
    critic_freeze_attention: bool = False

    def __post_init__(self) -> None:
        _positive_int("logprob_chunk_tokens", self.logprob_chunk_tokens)
        if self.autocast_dtype not in AUTOCAST_DTYPES:
            raise ValueError(f"autocast_dtype={self.autocast_dtype!r}: must be null (float32) or 'bfloat16'")
        _positive_int("shared_prefix_tokens", self.shared_prefix_tokens, floor=0)
        if self.shared_prefix_tokens and self.gradient_checkpointing:
            raise ValueError(f"shared_prefix_tokens={self.shared_prefix_tokens!r}: cannot be combined with "
                             "gradient_checkpointing: true (the recomputed layers keep no key/value cache); "
                             "set one of them off")


@dataclass
class DistributedSettings:
    """Settings of a distributed backend (``fsdp``, ``megatron``, a user's rank learner).

    Attributes:
        world_size: rank processes. Data parallel size =
            ``world_size / (tensor_parallel_size × pipeline_parallel_size)``.
        tensor_parallel_size / pipeline_parallel_size: model-parallel sizes; > 1 only for a backend
            registered with the ``tensor_parallel`` / ``pipeline_parallel`` capability (``megatron``:
            tensor parallel), checked at load.
        launch: how the ranks start: ``spawn`` (child processes on this machine, default) | ``ray``
            (one Ray actor per rank in a placement group, on the cluster of ``ray_address``) |
            ``torchrun`` (this process is rank 0 of a group started by ``torchrun``).
        ray_address / ray_num_cpus: ``launch: ray`` only: the Ray cluster the rank actors join
            (empty: a local one with ``ray_num_cpus`` CPUs started here, unless Ray is running in
            this process already); :func:`trainer.ray_util.connect_ray`.
        dist_backend: ``auto`` (nccl with CUDA, else gloo) | ``gloo`` | ``nccl``.
        cpu_offload: keep the optimizer state (and the sharded fp32 parameters) in CPU memory
            (``fsdp``: FSDP2's ``CPUOffloadPolicy``; ``megatron`` refuses it when its ranks build).
        timeout_s: seconds a collective or a rank's reply may take before the run fails (a crashed
            or hung rank raises in the driver instead of hanging it), > 0.
        gradient_checkpointing: activation checkpointing of both models' decoder layers
            (``megatron``: its full activation recompute).
        logprob_chunk_tokens: tokens whose logits the LM head computes at a time for the actor's
            log-probs (``fsdp``; ``megatron`` computes vocab-parallel log-probs and ignores it), >= 1.

    Raises:
        ValueError: a size not an int >= 1, ``world_size`` not divisible by the model-parallel
            sizes, an unknown ``launch`` / ``dist_backend``, ``timeout_s <= 0``,
            ``ray_num_cpus < 1`` or ``logprob_chunk_tokens < 1`` (one line naming the field).
    """

    world_size: int = 1
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    launch: str = "spawn"
    ray_address: str = ""
    ray_num_cpus: int = 2
    dist_backend: str = "auto"
    cpu_offload: bool = False
    timeout_s: float = 1800.0
    gradient_checkpointing: bool = False
    logprob_chunk_tokens: int = DEFAULT_CHUNK_TOKENS

    def __post_init__(self) -> None:
        for name in ("world_size", "tensor_parallel_size", "pipeline_parallel_size"):
            _positive_int(name, getattr(self, name))
        tp, pp = self.tensor_parallel_size, self.pipeline_parallel_size
        if self.world_size % (tp * pp):
            raise ValueError(f"world_size={self.world_size!r}: must be divisible by tensor_parallel_size × "
                             f"pipeline_parallel_size = {tp} × {pp}")
        if self.launch not in RANK_LAUNCHES:
            raise ValueError(f"launch={self.launch!r}: must be 'spawn', 'ray' or 'torchrun'")
        if self.dist_backend not in DIST_BACKENDS:
            raise ValueError(f"dist_backend={self.dist_backend!r}: must be 'auto', 'gloo' or 'nccl'")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s={self.timeout_s!r}: must be > 0")
        _positive_int("ray_num_cpus", self.ray_num_cpus)
        _positive_int("logprob_chunk_tokens", self.logprob_chunk_tokens)

    @property
    def data_parallel_size(self) -> int:
        """``world_size // (tensor_parallel_size × pipeline_parallel_size)`` (exact: checked on
        construction)."""
        return self.world_size // (self.tensor_parallel_size * self.pipeline_parallel_size)
