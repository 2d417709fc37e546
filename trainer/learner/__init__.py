"""Learner backends behind one protocol (:class:`~trainer.learner.base.Learner`).

``make_learner(exp_cfg, model_dir)`` builds the backend named by ``learner.backend``;
``register_learner(name, factory)`` adds one. Built in: ``torch`` (one process).
"""

from .base import LEARNERS, Learner, LearnerRegistry, make_learner, register_learner
from .torch_learner import LearnerConfig, TorchLearner

register_learner("torch", TorchLearner.from_config)

__all__ = ["LEARNERS", "Learner", "LearnerConfig", "LearnerRegistry", "TorchLearner", "make_learner",
           "register_learner"]
