"""Name → rank-learner factory for the distributed backends (``learner.backend: fsdp | megatron``).

:func:`register_rank_learner` registers the per-rank factory AND the driver-side backend: the
name becomes a :data:`~trainer.learner.base.LEARNERS` backend built as a
:class:`~trainer.learner.distributed.runtime.DistributedLearner`, which starts the ranks and
builds the factory's learner in each. A factory must be registered at import time of a module
that the rank processes import too (:mod:`trainer.learner` or a ``plugins`` entry), and should
import its heavy dependencies inside the call, not at module import.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from copc.registries import Registry

from .base import RankContext, RankLearner

#: ``factory(exp_cfg, model_dir, ctx) -> RankLearner``, called inside a rank process after
#: ``torch.distributed`` is initialised.
RankLearnerFactory = Callable[[Any, Path, RankContext], RankLearner]


#: The rank-learner registry, ``learner.backend`` → per-rank factory (``fsdp`` registered by
#: :mod:`trainer.learner`, ``megatron`` by :mod:`trainer.learner.backends.megatron`); a
#: :class:`copc.Registry`.
RANK_LEARNERS: Registry[RankLearnerFactory] = Registry("distributed rank learner", key="learner.backend")


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
