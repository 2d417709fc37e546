"""The ``learner`` section of :class:`trainer.config.ExperimentConfig` (:class:`LearnerSection`):
which backend trains the actor and critic, its rank layout, memory and precision options, and the
LoRA adapters; validated at load and against the backend's capability metadata.

Import it from :mod:`trainer.config` (re-exported there).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError
from ..learner.allocator import DEFAULT_MMAP_THRESHOLD, check_mmap_threshold
from ..learner.settings import AUTOCAST_DTYPES
from ..models.chunked_logprobs import DEFAULT_CHUNK_TOKENS
from .lora import CriticLoraSection, LoraSection, resolve_lora
from .sections import require


@dataclass
class LearnerSection:
    """Which learner backend trains the actor and critic, and how its ranks are laid out.

    Attributes:
        backend: a registered backend (:mod:`trainer.learner.base`): ``torch`` (one process,
            CPU or one GPU; default) | ``fsdp`` (PyTorch FSDP2, data parallel) | ``megatron``
            (Megatron-core, tensor/pipeline/data parallel) | a user's.
        world_size: rank processes of a distributed backend (1 for ``torch``).
        tensor_parallel_size / pipeline_parallel_size: model-parallel sizes (``megatron``;
            1 for ``torch`` and ``fsdp``). Data parallel size =
            ``world_size / (tensor_parallel_size × pipeline_parallel_size)``.
        launch: how the rank processes start: ``spawn`` (child processes on this machine,
            default) | ``ray`` (one Ray actor per rank in a placement group; ``launcher.ray_address``
            joins an existing cluster) | ``torchrun`` (this process is rank 0 of a group started by
            ``torchrun``; the other ranks serve it).
        dist_backend: ``auto`` (nccl with CUDA, else gloo) | ``gloo`` | ``nccl``.
        cpu_offload: keep the optimizer state (and the sharded fp32 parameters) in CPU memory
            (``fsdp``: FSDP2's ``CPUOffloadPolicy``).
        optimizer: ``adamw`` (default) | ``sgd`` (plain SGD at the same learning rates; for exact
            cross-backend parity checks, where Adam amplifies rounding differences).
        timeout_s: seconds a collective or a rank's reply may take before the run fails
            (a crashed or hung rank raises in the driver instead of hanging it).
        gradient_checkpointing: activation checkpointing of the actor's and the critic's decoder
            layers (recomputed in backward instead of kept: less memory, ~1/3 more compute per
            update; ``megatron``: its full activation recompute).
        logprob_chunk_tokens: tokens whose logits the LM head computes at a time for the actor's
            log-probs (``torch`` / ``fsdp``: the full-vocabulary logits are never held; peak
            extra memory ~3 × chunk × vocabulary × 4 bytes), >= 1.
        malloc_mmap_threshold: bytes from which the learner's process ``mmap``-s an allocation
            (glibc ``mallopt``, :mod:`trainer.learner.allocator`): freed activations leave the
            resident set instead of staying in the heap (1 MiB: ~1/3 less peak RSS, 0–20 %
            slower steps, ``benchmarks/bench_learner_memory.py``); 0 (default): glibc's dynamic
            threshold.
        malloc_trim: after every learner step, hand the C heap's free pages back to the OS
            (glibc ``malloc_trim(0)``, :func:`trainer.learner.allocator.release_free_heap`; metric
            ``perf/malloc_trim_s``): without it a long run's resident set can grow by the step's
            fragments each step (the search main job: ~3 GB per step, OOM at step 5); default True.
        autocast_dtype: ``bfloat16``: the learner's forward passes (actor and critic, recompute and
            training) run under :func:`torch.autocast` in bfloat16 (weights, gradients and
            optimizer state stay float32; the LM head's log-softmax stays float32); ~2x faster
            steps on a CPU with AMX / bf16 units and on GPUs, at the price of log-probs that
            differ from the engine's float32 ones by bfloat16 rounding (~1e-2 nats); the
            weight-sync attestation's reference stays float32. null (default): float32
            throughout. Backends with the ``autocast`` capability only (``torch``).
        shared_prefix_tokens: when every row of a micro-batch begins with the same >= this many
            tokens (a few-shot prompt), the learner's forward passes (actor and critic, recompute
            and training) run that prefix once and the rows' remaining tokens against its keys and
            values (:mod:`trainer.models.shared_prefix`): the same log-probs, values and gradients,
            up to float rounding; ~3.5x faster on the search main job's micro-batches. 0 (default):
            off. Backends with the ``shared_prefix`` capability only (``torch``); not with
            ``gradient_checkpointing`` (whose recomputation keeps no key/value cache).
        critic_freeze_attention: the critic's attention parameters are not trained (SAO's critic
            recipe; :func:`~trainer.learner.critic.freeze_attention`); backends with the
            ``critic_freeze_attention`` capability only (``torch``).
        backend_settings: the backend's own settings, validated by the settings dataclass it
            was registered with (none of the built-in backends has any yet); empty: defaults.
        lora: the actor's LoRA adapter (:class:`~trainer.config.lora.LoraSection`: ``rank``,
            ``alpha``, ``dropout``, ``target_modules``); null: full fine-tuning. Only adapter
            parameters (and the critic's value head) are trained, optimised and checkpointed, and
            weight syncs send the adapter only.
        critic_lora: the critic's (:class:`~trainer.config.lora.CriticLoraSection`); null: the
            actor's ``lora``; a field set here overrides it, ``enabled: false`` trains the critic fully.

    Which rank-layout keys a backend accepts is its capability metadata
    (:data:`~trainer.learner.base.LEARNER_METADATA`: ``distributed``, ``tensor_parallel``,
    ``pipeline_parallel``), checked by :meth:`check_plugin`.
    """

    backend: str = "torch"
    world_size: int = 1
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    launch: str = "spawn"
    dist_backend: str = "auto"
    cpu_offload: bool = False
    optimizer: str = "adamw"
    timeout_s: float = 1800.0
    gradient_checkpointing: bool = False
    logprob_chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    malloc_mmap_threshold: int = DEFAULT_MMAP_THRESHOLD
    malloc_trim: bool = True
    autocast_dtype: str | None = None
    shared_prefix_tokens: int = 0
    critic_freeze_attention: bool = False
    backend_settings: dict[str, Any] = field(default_factory=dict)
    lora: LoraSection | None = None
    critic_lora: CriticLoraSection | None = None

    def lora_settings(self) -> tuple[Any, Any]:
        """``(actor, critic)`` :class:`~trainer.models.lora.LoraSettings` of ``lora`` /
        ``critic_lora`` (None: full fine-tuning; :func:`~trainer.config.lora.resolve_lora`)."""
        return resolve_lora(self.lora, self.critic_lora)

    @property
    def data_parallel_size(self) -> int:
        """``world_size // (tensor_parallel_size × pipeline_parallel_size)`` (exact after
        :meth:`validate`)."""
        return self.world_size // (self.tensor_parallel_size * self.pipeline_parallel_size)

    def validate(self) -> None:
        """Raise :class:`ConfigError` naming the key on a bad value.

        Model-dependent checks (``tensor_parallel_size`` vs the number of attention heads) run
        when the learner is built (:func:`trainer.learner.distributed.runtime.check_model_parallel`).
        """
        for k in ("world_size", "tensor_parallel_size", "pipeline_parallel_size"):
            v = getattr(self, k)
            require(isinstance(v, int) and v >= 1, f"learner.{k}", v, "must be an int >= 1")
        model_parallel = self.tensor_parallel_size * self.pipeline_parallel_size
        require(self.world_size % model_parallel == 0, "learner.world_size", self.world_size,
                 f"must be divisible by learner.tensor_parallel_size × learner.pipeline_parallel_size "
                 f"= {self.tensor_parallel_size} × {self.pipeline_parallel_size}")
        require(self.launch in ("spawn", "ray", "torchrun"), "learner.launch", self.launch,
                 "must be 'spawn', 'ray' or 'torchrun'")
        require(self.dist_backend in ("auto", "gloo", "nccl"), "learner.dist_backend", self.dist_backend,
                 "must be 'auto', 'gloo' or 'nccl'")
        require(self.optimizer in ("adamw", "sgd"), "learner.optimizer", self.optimizer,
                 "must be 'adamw' or 'sgd'")
        require(self.timeout_s > 0, "learner.timeout_s", self.timeout_s, "must be > 0")
        self.lora_settings()
        require(isinstance(self.logprob_chunk_tokens, int) and self.logprob_chunk_tokens >= 1,
                 "learner.logprob_chunk_tokens", self.logprob_chunk_tokens, "must be an int >= 1")
        require(self.autocast_dtype in AUTOCAST_DTYPES, "learner.autocast_dtype", self.autocast_dtype,
                 "must be null (float32) or 'bfloat16'")
        n = self.shared_prefix_tokens
        require(isinstance(n, int) and not isinstance(n, bool) and n >= 0, "learner.shared_prefix_tokens",
                n, "must be an int >= 0 (0: off)")
        require(not (n and self.gradient_checkpointing), "learner.shared_prefix_tokens", n,
                "cannot be combined with learner.gradient_checkpointing: true (the recomputed layers keep "
                "no key/value cache); set one of them off")
        try:
            check_mmap_threshold(self.malloc_mmap_threshold)
        except ValueError as e:  # the allocator's own one-line check, naming the key
            raise ConfigError(str(e)) from None

    def check_plugin(self, meta: Mapping[str, Any], registry: Any) -> None:
        """Check the rank layout against the backend's capability metadata (called by
        :func:`trainer.plugins.check_plugins` once ``backend`` is known to be registered).

        Args:
            meta: the backend's metadata (``distributed``, ``tensor_parallel``,
                ``pipeline_parallel``).
            registry: the learner-backend registry (to name the backends that can).

        Raises:
            ConfigError: a rank-layout key the backend does not support, naming it.
        """
        b = self.backend
        if self.autocast_dtype is not None and not meta.get("autocast", False):
            raise ConfigError(f"learner.autocast_dtype={self.autocast_dtype!r}: learner.backend={b!r} does "
                              f"not run its forward passes under autocast (backends that do: "
                              f"{registry.names(autocast=True)})")
        if self.shared_prefix_tokens and not meta.get("shared_prefix", False):
            raise ConfigError(f"learner.shared_prefix_tokens={self.shared_prefix_tokens}: "
                              f"learner.backend={b!r} cannot run a shared prefix once (backends that can: "
                              f"{registry.names(shared_prefix=True)})")
        if self.critic_freeze_attention and not meta.get("critic_freeze_attention", False):
            raise ConfigError(f"learner.critic_freeze_attention: learner.backend={b!r} cannot freeze the "
                              f"critic's attention (backends that can: "
                              f"{registry.names(critic_freeze_attention=True)})")
        if any(self.lora_settings()) and not meta.get("lora", False):
            key = "learner.lora" if self.lora is not None else "learner.critic_lora"
            raise ConfigError(f"{key}: learner.backend={b!r} does not train LoRA adapters (backends that "
                              f"do: {registry.names(lora=True)}); drop {key} or use one of those")
        if not meta.get("distributed", False):  # a single-process backend (torch, a user's)
            for k, default in (("world_size", 1), ("tensor_parallel_size", 1), ("pipeline_parallel_size", 1),
                               ("cpu_offload", False), ("launch", "spawn"), ("dist_backend", "auto")):
                require(getattr(self, k) == default, f"learner.{k}", getattr(self, k),
                         f"only for a distributed backend ({registry.names(distributed=True)}); "
                         f"learner.backend={b!r} runs in one process (leave it at {default!r})")
            return
        tp, pp = meta.get("tensor_parallel", False), meta.get("pipeline_parallel", False)
        if not (tp or pp):
            for k in ("tensor_parallel_size", "pipeline_parallel_size"):
                require(getattr(self, k) == 1, f"learner.{k}", getattr(self, k),
                         f"learner.backend={b!r} is data parallel only (model-parallel backends: "
                         f"{registry.names(tensor_parallel=True)})")
        require(tp or self.tensor_parallel_size == 1, "learner.tensor_parallel_size",
                 self.tensor_parallel_size,
                 f"learner.backend={b!r} has no tensor parallelism (backends with it: "
                 f"{registry.names(tensor_parallel=True)})")
        require(pp or self.pipeline_parallel_size == 1, "learner.pipeline_parallel_size",
                 self.pipeline_parallel_size,
                 f"learner.backend={b!r} runs pipeline size 1 only" + (
                     " (tensor x data parallel); use learner.tensor_parallel_size for model parallelism"
                     if tp else ""))
