"""Name → rank-learner factory for the distributed backends (``learner.backend: fsdp | megatron``).

:func:`register_rank_learner` registers the per-rank factory AND the driver-side backend: the
name becomes a :data:`~trainer.learner.base.LEARNERS` backend built as a
:class:`~trainer.learner.distributed.runtime.DistributedLearner`, which starts the ranks and
builds the factory's learner in each. A factory must be registered at import time of a module
that the rank processes import too (:mod:`trainer.learner` or a ``plugins`` entry), and should
import its heavy dependencies inside the call, not at module import.
"""

from __future__ import annotations

from typing import Any

from seams.registry import RegistryError

from ..backend_settings import DistributedSettings
from .base import RANK_LEARNERS, RankLearnerFactory

__all__ = ["RANK_LEARNERS", "RankLearnerFactory", "register_rank_learner"]


def register_rank_learner(name: str, factory: RankLearnerFactory, overwrite: bool = False, *,
                          settings: type | None = None, **metadata: Any) -> None:
    """Register a distributed backend: ``factory`` builds one rank's :class:`RankLearner`, and
    ``learner.backend: <name>`` builds a driver-side
    :class:`~trainer.learner.distributed.runtime.DistributedLearner` running it on
    ``learner.backend_settings.world_size`` ranks.

    Args:
        name: the value of ``learner.backend``.
        factory: builds one rank's learner.
        overwrite: replace an existing backend of that name.
        settings: the backend's settings dataclass (``learner.backend_settings``):
            :class:`~trainer.learner.backend_settings.DistributedSettings` (default) or a subclass
            of it (the runtime reads the rank layout, launch and timeout from it).
        **metadata: further capability metadata (:data:`~trainer.learner.base.LEARNER_METADATA`).

    Raises:
        seams.registry.RegistryError: (a ``ValueError``) empty name, ``name`` already a backend and
            ``overwrite`` is False, or ``settings`` not a subclass of ``DistributedSettings``.
    """
    from ..base import register_learner
    from .runtime import DistributedLearner

    settings = DistributedSettings if settings is None else settings
    if not (isinstance(settings, type) and issubclass(settings, DistributedSettings)):
        raise RegistryError(f"learner backend {name!r}: settings={settings!r} must be DistributedSettings or "
                            "a subclass of it (trainer.learner.backend_settings)")
    register_learner(name, DistributedLearner.from_spec, overwrite=overwrite, settings=settings,
                     distributed=True, **metadata)
    RANK_LEARNERS.register(name, factory, overwrite=True)
