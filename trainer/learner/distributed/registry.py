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

from .base import RANK_LEARNERS, RankLearnerFactory

__all__ = ["RANK_LEARNERS", "RankLearnerFactory", "register_rank_learner"]


def register_rank_learner(name: str, factory: RankLearnerFactory, overwrite: bool = False, *,
                          settings: type | None = None, **metadata: Any) -> None:
    """Register a distributed backend: ``factory`` builds one rank's :class:`RankLearner`, and
    ``learner.backend: <name>`` builds a driver-side
    :class:`~trainer.learner.distributed.runtime.DistributedLearner` running it on
    ``learner.world_size`` ranks.

    Args:
        name: the value of ``learner.backend``.
        factory: builds one rank's learner.
        overwrite: replace an existing backend of that name.
        settings: the backend's settings dataclass (``learner.backend_settings``), or None.
        **metadata: further capability metadata (:data:`~trainer.learner.base.LEARNER_METADATA`).

    Raises:
        copc.registries.RegistryError: (a ``ValueError``) empty name, or ``name`` already a
            backend and ``overwrite`` is False.
    """
    from ..base import register_learner
    from .runtime import DistributedLearner

    register_learner(name, DistributedLearner.from_config, overwrite=overwrite, settings=settings,
                     distributed=True, **metadata)
    RANK_LEARNERS.register(name, factory, overwrite=True)
