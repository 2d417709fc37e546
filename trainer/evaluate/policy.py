"""The policy weights ``copc eval`` evaluates: those of a training checkpoint directory."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import ConfigError
from ..learner import make_learner, restore_learner
from ..learner.spec import LearnerSpec
from ..outputs.checkpoint import CheckpointManager

if TYPE_CHECKING:
    import torch


def checkpoint_policy_weights(learner: LearnerSpec, checkpoint: Path,
                              model_dir: Path) -> dict[str, torch.Tensor]:
    """The policy weights (Hugging Face names) saved in a training checkpoint directory.

    The learner of ``learner`` (the run's :func:`trainer.config.specs.learner_spec`) is built on
    ``model_dir``'s architecture, its state loaded from ``checkpoint``, and its weights exported
    (so any backend's checkpoint layout works).

    Raises:
        ConfigError: ``checkpoint`` is not a complete training checkpoint (names ``--checkpoint``).
    """
    try:
        state = CheckpointManager(checkpoint.parent, 1).load(checkpoint)
    except (FileNotFoundError, ValueError) as e:
        state, why = None, f" ({e})"
    else:
        why = ""
    if state is None:
        raise ConfigError(f"--checkpoint={str(checkpoint)!r}: neither a model directory (config.json) nor "
                          f"a complete training checkpoint{why}")
    built = make_learner(learner, model_dir)
    try:
        restore_learner(built, state)
        return dict(built.export_policy_weights())
    finally:
        close = getattr(built, "close", None)  # distributed backends: stop their processes
        if callable(close):
            close()


__all__ = ["checkpoint_policy_weights"]
