"""The ``learner`` section of :class:`trainer.config.ExperimentConfig` (:class:`LearnerSection`):
which backend trains the actor and critic and its own settings (``backend_settings``: rank layout,
precision, memory options of that backend), the optimiser, the allocator and the LoRA adapters;
validated at load and against the backend's capability metadata.

Import it from :mod:`trainer.config` (re-exported there).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError
from ..learner.allocator import DEFAULT_MMAP_THRESHOLD, check_mmap_threshold
from .lora import CriticLoraSection, LoraSection, resolve_lora
from .sections import require

#: The config key of the backend's own settings.
SETTINGS_KEY = "learner.backend_settings"


@dataclass
class LearnerSection:
    """Which learner backend trains the actor and critic, with what crosses components (the
    optimiser, the allocator, the LoRA adapters); the backend's own knobs are its settings.

    Attributes:
        backend: a registered backend (:mod:`trainer.learner.base`): ``torch`` (one process,
            CPU or one GPU; default) | ``fsdp`` (PyTorch FSDP2, data parallel) | ``megatron``
            (Megatron-core, tensor/data parallel) | a user's.
        backend_settings: the backend's own settings, validated by the settings dataclass it was
            registered with; empty: its defaults. ``torch``:
            :class:`~trainer.learner.backend_settings.TorchSettings` (``gradient_checkpointing``,
            ``logprob_chunk_tokens``, ``autocast_dtype``, ``shared_prefix_tokens``,
            ``critic_freeze_attention``); ``fsdp`` / ``megatron``:
            :class:`~trainer.learner.backend_settings.DistributedSettings` (``world_size``,
            ``tensor_parallel_size``, ``pipeline_parallel_size``, ``launch``, ``ray_address``,
            ``ray_num_cpus``, ``dist_backend``, ``cpu_offload``, ``timeout_s``,
            ``gradient_checkpointing``, ``logprob_chunk_tokens``). A setting the backend does not
            have is refused at load, naming it.
        optimizer: ``adamw`` (default) | ``sgd`` (plain SGD at the same learning rates; for exact
            cross-backend parity checks, where Adam amplifies rounding differences).
        malloc_mmap_threshold: bytes from which the learner's process ``mmap``-s an allocation
            (glibc ``mallopt``, :mod:`trainer.learner.allocator`): freed activations leave the
            resident set instead of staying in the heap (1 MiB: ~1/3 less peak RSS, 0–20 %
            slower steps, ``benchmarks/bench_learner_memory.py``); 0 (default): glibc's dynamic
            threshold.
        malloc_trim: after every learner step, hand the C heap's free pages back to the OS
            (glibc ``malloc_trim(0)``, :func:`trainer.learner.allocator.release_free_heap`; metric
            ``perf/malloc_trim_s``): without it a long run's resident set can grow by the step's
            fragments each step (the search main job: ~3 GB per step, OOM at step 5); default True.
        lora: the actor's LoRA adapter (:class:`~trainer.config.lora.LoraSection`: ``rank``,
            ``alpha``, ``dropout``, ``target_modules``); null: full fine-tuning. Only adapter
            parameters (and the critic's value head) are trained, optimised and checkpointed, and
            weight syncs send the adapter only.
        critic_lora: the critic's (:class:`~trainer.config.lora.CriticLoraSection`); null: the
            actor's ``lora``; a field set here overrides it, ``enabled: false`` trains the critic fully.
        memory_check: before any model is loaded, ``copc train`` estimates the run's peak memory
            (:mod:`trainer.models.memory_estimate`: weights, optimizer state, activations of one
            micro-batch, the engines' weights and KV cache) and refuses to start, in one line naming
            the setting to change, when it exceeds the machine's available memory (default True);
            false: the estimate is only logged.

    Which backends train LoRA adapters, and which accept a model-parallel size > 1, is their
    capability metadata (:data:`~trainer.learner.base.LEARNER_METADATA`: ``lora``,
    ``tensor_parallel``, ``pipeline_parallel``), checked by :meth:`check_plugin`.
    """

    backend: str = "torch"
    backend_settings: dict[str, Any] = field(default_factory=dict)
    optimizer: str = "adamw"
    malloc_mmap_threshold: int = DEFAULT_MMAP_THRESHOLD
    malloc_trim: bool = True
    lora: LoraSection | None = None
    critic_lora: CriticLoraSection | None = None
    memory_check: bool = True

    def lora_settings(self) -> tuple[Any, Any]:
        """``(actor, critic)`` :class:`~trainer.models.lora.LoraSettings` of ``lora`` /
        ``critic_lora`` (None: full fine-tuning; :func:`~trainer.config.lora.resolve_lora`)."""
        return resolve_lora(self.lora, self.critic_lora)

    def validate(self) -> None:
        """Raise :class:`ConfigError` naming the key on a bad value (``backend_settings`` is checked
        by the backend's settings dataclass, in :func:`trainer.config.check_plugins`)."""
        require(self.optimizer in ("adamw", "sgd"), "learner.optimizer", self.optimizer,
                 "must be 'adamw' or 'sgd'")
        self.lora_settings()
        try:
            check_mmap_threshold(self.malloc_mmap_threshold)
        except ValueError as e:  # the allocator's own one-line check, naming the key
            raise ConfigError(str(e)) from None

    def check_plugin(self, meta: Mapping[str, Any], registry: Any) -> None:
        """Check the LoRA adapters and the model-parallel sizes against the backend's capability
        metadata (called by :func:`trainer.config.check_plugins` once ``backend`` is registered and
        ``backend_settings`` passed its dataclass).

        Args:
            meta: the backend's metadata (``lora``, ``tensor_parallel``, ``pipeline_parallel``).
            registry: the learner-backend registry (to build the settings and name the backends
                that can).

        Raises:
            ConfigError: LoRA for a backend without the ``lora`` capability, or a model-parallel size
                > 1 for a backend without that parallelism, naming the key.
        """
        b = self.backend
        if any(self.lora_settings()) and not meta.get("lora", False):
            key = "learner.lora" if self.lora is not None else "learner.critic_lora"
            raise ConfigError(f"{key}: learner.backend={b!r} does not train LoRA adapters (backends that "
                              f"do: {registry.names(lora=True)}); drop {key} or use one of those")
        own = registry.build_settings(b, self.backend_settings, SETTINGS_KEY)
        tp, pp = meta.get("tensor_parallel", False), meta.get("pipeline_parallel", False)
        tp_size = getattr(own, "tensor_parallel_size", 1)  # a size its settings lack is refused there
        pp_size = getattr(own, "pipeline_parallel_size", 1)
        if not (tp or pp):
            for k, v in (("tensor_parallel_size", tp_size), ("pipeline_parallel_size", pp_size)):
                require(v == 1, f"{SETTINGS_KEY}.{k}", v,
                         f"learner.backend={b!r} is data parallel only (model-parallel backends: "
                         f"{registry.names(tensor_parallel=True)})")
        require(tp or tp_size == 1, f"{SETTINGS_KEY}.tensor_parallel_size", tp_size,
                 f"learner.backend={b!r} has no tensor parallelism (backends with it: "
                 f"{registry.names(tensor_parallel=True)})")
        require(pp or pp_size == 1, f"{SETTINGS_KEY}.pipeline_parallel_size", pp_size,
                 f"learner.backend={b!r} runs pipeline size 1 only" + (
                     f" (tensor x data parallel); use {SETTINGS_KEY}.tensor_parallel_size for model "
                     "parallelism" if tp else ""))
