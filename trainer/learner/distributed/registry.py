"""Name → rank-learner factory for the distributed backends (``learner.backend: fsdp | megatron``).

:func:`register_rank_learner` registers the per-rank factory AND the driver-side backend: the
name becomes a :data:`~trainer.learner.base.LEARNERS` backend built as a
:class:`~trainer.learner.distributed.runtime.DistributedLearner`, which starts the ranks and
builds the factory's learner in each. A factory must be registered at import time of a module
that the rank processes import too (:mod:`trainer.learner` or a ``plugins`` entry), and should
import its heavy dependencies inside the call, not at module import.

Both are defined in :mod:`trainer.learner.registry` (no torch: a config's validation reads the
backends' names and settings) and re-exported here.
"""

from __future__ import annotations

from ..registry import RANK_LEARNERS, register_rank_learner
from .base import RankLearnerFactory

__all__ = ["RANK_LEARNERS", "RankLearnerFactory", "register_rank_learner"]
