"""The learner-backend registries and the built-in backends, importable without torch.

:data:`LEARNERS` maps ``learner.backend`` to a factory, :data:`RANK_LEARNERS` a distributed
backend's name to its per-rank factory. The built-ins are registered here by reference
(:class:`seams.registry.LazyRef`) with their capability metadata and settings dataclasses, so a
config's validation reads them (:func:`trainer.config.check_plugins`) without importing torch or
transformers; the first ``get`` of a backend imports its code:

* ``torch`` — :class:`~trainer.learner.backends.torch.TorchLearner` (one process, one device; LoRA),
  settings :class:`~trainer.learner.backend_settings.TorchSettings`;
* ``fsdp`` — PyTorch FSDP2 data parallel (:mod:`trainer.learner.backends.fsdp` per rank),
  settings :class:`~trainer.learner.backend_settings.DistributedSettings`;
* ``megatron`` — Megatron-core tensor + data parallel (:mod:`trainer.learner.backends.megatron`),
  when that package is present.

:mod:`trainer.learner` imports this module first, so the built-ins are registered in every process
that imports any part of the learner (the driver, the rank processes).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any

from seams.registry import LazyRef, Registry, RegistryError

from .backend_settings import DistributedSettings, TorchSettings

#: A factory of :data:`LEARNERS` (:data:`trainer.learner.base.LearnerFactory`: ``(spec, model_dir) ->
#: Learner``) or of :data:`RANK_LEARNERS` (:data:`trainer.learner.distributed.base.RankLearnerFactory`:
#: ``(spec, model_dir, ctx) -> RankLearner``); spelled here without their torch-typed modules.
Factory = Callable[..., Any]

#: Capability metadata of a learner backend (checked against the config's ``learner`` section by
#: :meth:`~trainer.config.learner_section.LearnerSection.check_plugin`): ``distributed`` (it runs on
#: ``learner.backend_settings.world_size`` rank processes; set by :func:`register_rank_learner`),
#: ``tensor_parallel`` and ``pipeline_parallel`` (it accepts a ``tensor_parallel_size`` /
#: ``pipeline_parallel_size`` > 1 in its :class:`~trainer.learner.backend_settings.DistributedSettings`),
#: ``lora`` (it trains ``learner.lora`` / ``learner.critic_lora`` adapters and has ``export_adapter()``),
#: ``truncated_sampling`` (default True: its log-probs replay the sampler's top-k / top-p support,
#: :mod:`trainer.logprobs`; False refuses ``rollout.top_k`` / ``top_p`` truncation at config load).
#: A backend's other features are its settings dataclass's fields (``settings=``): a setting it
#: lacks is refused.
LEARNER_METADATA = {"distributed": (bool, False), "tensor_parallel": (bool, False),
                    "pipeline_parallel": (bool, False), "lora": (bool, False),
                    "truncated_sampling": (bool, True)}

#: The learner-backend registry, ``learner.backend`` → factory (:data:`~trainer.learner.base.LearnerFactory`;
#: ``torch``, ``fsdp`` and ``megatron`` registered below); a :class:`seams.registry.Registry`.
LEARNERS: Registry[Factory] = Registry("learner backend", LEARNER_METADATA, key="learner.backend")

#: The rank-learner registry, ``learner.backend`` → per-rank factory
#: (:data:`~trainer.learner.distributed.base.RankLearnerFactory`), filled by
#: :func:`register_rank_learner`; the driver and the rank processes read it.
RANK_LEARNERS: Registry[Factory] = Registry("distributed rank learner", key="learner.backend")

#: The driver-side learner of every distributed backend (imported when a backend is first built).
_DISTRIBUTED_LEARNER = LazyRef("trainer.learner.distributed.runtime:DistributedLearner.from_spec")


def register_learner(name: str, factory: Factory, overwrite: bool = False, *,
                     settings: type | None = None, **metadata: Any) -> Factory:
    """Register a learner backend in :data:`LEARNERS`.

    Args:
        name: the value of ``learner.backend``.
        factory: ``factory(spec, model_dir) -> Learner`` (:data:`~trainer.learner.base.LearnerFactory`),
            or a :class:`seams.registry.LazyRef` to it.
        overwrite: replace an existing registration.
        settings: the backend's settings dataclass (``learner.backend_settings``), or None.
        **metadata: capability metadata of :data:`LEARNER_METADATA`.

    Returns:
        ``factory``.

    Raises:
        seams.registry.RegistryError: (a ``ValueError``) empty name, or ``name`` taken and
            ``overwrite`` is False.
    """
    return LEARNERS.register(name, factory, overwrite=overwrite, settings=settings, **metadata)


def register_rank_learner(name: str, factory: Factory, overwrite: bool = False, *,
                          settings: type | None = None, **metadata: Any) -> None:
    """Register a distributed backend: ``factory`` builds one rank's
    :class:`~trainer.learner.distributed.base.RankLearner`, and ``learner.backend: <name>`` builds a
    driver-side :class:`~trainer.learner.distributed.runtime.DistributedLearner` running it on
    ``learner.backend_settings.world_size`` ranks.

    A factory must be registered at import time of a module that the rank processes import too
    (:mod:`trainer.learner` or a ``plugins`` entry), and should import its heavy dependencies inside
    the call, not at module import.

    Args:
        name: the value of ``learner.backend``.
        factory: builds one rank's learner (or a :class:`seams.registry.LazyRef` to it).
        overwrite: replace an existing backend of that name.
        settings: the backend's settings dataclass (``learner.backend_settings``):
            :class:`~trainer.learner.backend_settings.DistributedSettings` (default) or a subclass
            of it (the runtime reads the rank layout, launch and timeout from it).
        **metadata: further capability metadata (:data:`LEARNER_METADATA`).

    Raises:
        seams.registry.RegistryError: (a ``ValueError``) empty name, ``name`` already a backend and
            ``overwrite`` is False, or ``settings`` not a subclass of ``DistributedSettings``.
    """
    settings = DistributedSettings if settings is None else settings
    if not (isinstance(settings, type) and issubclass(settings, DistributedSettings)):
        raise RegistryError(f"learner backend {name!r}: settings={settings!r} must be DistributedSettings or "
                            "a subclass of it (trainer.learner.backend_settings)")
    register_learner(name, _DISTRIBUTED_LEARNER, overwrite=overwrite, settings=settings,
                     distributed=True, **metadata)
    RANK_LEARNERS.register(name, factory, overwrite=True)


register_learner("torch", LazyRef("trainer.learner.backends.torch:TorchLearner.from_spec"), lora=True,
                 settings=TorchSettings)
register_rank_learner("fsdp", LazyRef("trainer.learner.backends.fsdp:build_fsdp_rank_learner"),
                      settings=DistributedSettings)  # FSDP is imported inside the rank processes only
_MEGATRON = "trainer.learner.backends.megatron"
if importlib.util.find_spec(_MEGATRON) is not None:  # the package imports Megatron-core only in the ranks
    register_rank_learner("megatron", LazyRef(f"{_MEGATRON}:build_rank_learner"),
                          settings=DistributedSettings, tensor_parallel=True,
                          truncated_sampling=False)  # refused at load: rank_learner.py's log-probs
