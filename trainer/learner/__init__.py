"""Learner backends behind one protocol (:class:`~trainer.learner.base.Learner`).

``make_learner(spec, model_dir)`` builds the backend named by ``learner.backend`` from its
:class:`LearnerSpec` (:func:`trainer.config.specs.learner_spec`);
``register_learner(name, factory)`` adds one. Built in: ``torch`` (one process), ``fsdp``
(PyTorch FSDP2 over ``learner.backend_settings.world_size`` ranks) and, when
:mod:`trainer.learner.backends.megatron` is present, ``megatron``. Their own settings
(``learner.backend_settings``) are :class:`TorchSettings` / :class:`DistributedSettings`.
Distributed backends register a per-rank factory with
:func:`~trainer.learner.distributed.registry.register_rank_learner`; the driver side is then
:class:`~trainer.learner.distributed.runtime.DistributedLearner`.
"""

import importlib
import importlib.util

from .backend_settings import DistributedSettings, TorchSettings
from .backends.torch import TorchLearner
from .base import (
    LEARNERS,
    Learner,
    ShardedCheckpoint,
    learner_checkpoint_state,
    make_learner,
    register_learner,
    restore_learner,
)
from .distributed.registry import RANK_LEARNERS, register_rank_learner
from .settings import LearnerConfig, OptimizerSettings
from .spec import LearnerSpec


def _build_fsdp(spec, model_dir, ctx):
    """The ``fsdp`` rank learner (imports FSDP only inside the rank process)."""
    from .backends.fsdp import build_fsdp_rank_learner

    return build_fsdp_rank_learner(spec, model_dir, ctx)


register_learner("torch", TorchLearner.from_spec, lora=True, settings=TorchSettings)
register_rank_learner("fsdp", _build_fsdp, settings=DistributedSettings)
_MEGATRON = f"{__name__}.backends.megatron"
if importlib.util.find_spec(_MEGATRON) is not None:  # registers "megatron" (lazy factory)
    importlib.import_module(_MEGATRON)

__all__ = ["LEARNERS", "RANK_LEARNERS", "DistributedSettings", "Learner", "LearnerConfig", "LearnerSpec",
           "OptimizerSettings", "ShardedCheckpoint", "TorchLearner", "TorchSettings",
           "learner_checkpoint_state", "make_learner", "register_learner", "register_rank_learner",
           "restore_learner"]
