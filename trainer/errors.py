"""Errors shared across the trainer (kept in a leaf module so any layer may raise them)."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration error; the message names the key (e.g. ``train.total_steps``)."""


class TrainingError(RuntimeError):
    """The run cannot continue (a rollout task raised, or too many infrastructure failures).

    The message says what failed and where the last checkpoint is; ``__cause__`` is the
    original exception when there is one.
    """
