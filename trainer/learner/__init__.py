"""Learner backends behind one protocol (:class:`~trainer.learner.base.Learner`).

``make_learner(spec, model_dir)`` builds the backend named by ``learner.backend`` from its
:class:`LearnerSpec` (:func:`trainer.config.specs.learner_spec`);
``register_learner(name, factory)`` adds one. Built in: ``torch`` (one process), ``fsdp``
(PyTorch FSDP2 over ``learner.backend_settings.world_size`` ranks) and, when
:mod:`trainer.learner.backends.megatron` is present, ``megatron``, all registered by
:mod:`trainer.learner.registry` without importing them. Their own settings
(``learner.backend_settings``) are :class:`TorchSettings` / :class:`DistributedSettings`.
Distributed backends register a per-rank factory with
:func:`~trainer.learner.distributed.registry.register_rank_learner`; the driver side is then
:class:`~trainer.learner.distributed.runtime.DistributedLearner`.

Importing this package imports no torch (a config's validation reads the registry and the
settings); the torch-backed names (:class:`TorchLearner`, :func:`make_learner`, ...) are
imported on first access (PEP 562).
"""

from seams.lazy import lazy_exports

from .backend_settings import DistributedSettings, TorchSettings
from .registry import LEARNERS, RANK_LEARNERS, register_learner, register_rank_learner
from .settings import LearnerConfig, OptimizerSettings
from .spec import LearnerSpec

#: The torch-backed public names, by the submodule that defines them (imported on first access).
_LAZY: dict[str, tuple[str, ...]] = {
    "backends.torch": ("TorchLearner",),
    "base": ("Learner", "ShardedCheckpoint", "learner_checkpoint_state", "make_learner", "restore_learner"),
}
__getattr__, __dir__ = lazy_exports(__name__, _LAZY)

__all__ = ["LEARNERS", "RANK_LEARNERS", "DistributedSettings", "Learner", "LearnerConfig", "LearnerSpec",
           "OptimizerSettings", "ShardedCheckpoint", "TorchLearner", "TorchSettings",
           "learner_checkpoint_state", "make_learner", "register_learner", "register_rank_learner",
           "restore_learner"]
