"""Distributed learner backends: the per-rank seam (:mod:`.base`), the rank-learner registry
(:mod:`.registry`), the driver (:mod:`.runtime`), rank processes (:mod:`.worker`,
:mod:`.launch`) and data-parallel helpers (:mod:`.shard`). Heavy parts import lazily."""

from .base import GradientProbe, MemoryProbe, RankContext, RankLearner
from .registry import RANK_LEARNERS, RankLearnerFactory, register_rank_learner

__all__ = ["RANK_LEARNERS", "GradientProbe", "MemoryProbe", "RankContext", "RankLearner",
           "RankLearnerFactory", "register_rank_learner"]
