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

from .base import RankContext, RankLearner

#: ``factory(exp_cfg, model_dir, ctx) -> RankLearner``, called inside a rank process after
#: ``torch.distributed`` is initialised.
RankLearnerFactory = Callable[[Any, Path, RankContext], RankLearner]


class RankLearnerRegistry:
    """Name → :data:`RankLearnerFactory`."""

    def __init__(self) -> None:
        self._factories: dict[str, RankLearnerFactory] = {}

    def register(self, name: str, factory: RankLearnerFactory, overwrite: bool = False) -> None:
        """Register ``factory`` under ``name``.

        Raises:
            ValueError: empty name, or ``name`` taken and ``overwrite`` is False.
        """
        if not isinstance(name, str) or not name:
            raise ValueError(f"rank learner name must be a non-empty str, got {name!r}")
        if name in self._factories and not overwrite:
            raise ValueError(f"rank learner {name!r} is already registered (pass overwrite=True)")
        self._factories[name] = factory

    def names(self) -> list[str]:
        """Registered names, sorted."""
        return sorted(self._factories)

    def get(self, name: str) -> RankLearnerFactory:
        """The factory of ``name``.

        Raises:
            KeyError: unknown name (the message lists the registered ones).
        """
        if name not in self._factories:
            raise KeyError(f"learner.backend={name!r}: no distributed rank learner registered; "
                           f"known: {self.names()}")
        return self._factories[name]


#: The default registry (``fsdp`` registered by :mod:`trainer.learner`, ``megatron`` by
#: :mod:`trainer.learner.backends.megatron`).
RANK_LEARNERS = RankLearnerRegistry()


def register_rank_learner(name: str, factory: RankLearnerFactory, overwrite: bool = False) -> None:
    """Register a distributed backend: ``factory`` builds one rank's :class:`RankLearner`, and
    ``learner.backend: <name>`` builds a driver-side
    :class:`~trainer.learner.distributed.runtime.DistributedLearner` running it on
    ``learner.world_size`` ranks.

    Raises:
        ValueError: as :meth:`RankLearnerRegistry.register` (also when ``name`` is already a
            single-process backend and ``overwrite`` is False).
    """
    from ..base import register_learner
    from .runtime import DistributedLearner

    register_learner(name, DistributedLearner.from_config, overwrite=overwrite)
    RANK_LEARNERS.register(name, factory, overwrite=True)
