"""Errors shared across the trainer (kept in a leaf module so any layer may raise them)."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration error; the message names the key (e.g. ``train.total_steps``)."""
