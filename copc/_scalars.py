"""What :mod:`copc` validates without tensors: the scalar checks and the names of the modes.

Kept free of torch so that :mod:`copc.presets`, :mod:`copc.margins` and
:mod:`copc.component_settings` (what a config's validation reads) import no tensor library;
:mod:`copc._checks`, :mod:`copc.aggregation` and :mod:`copc.advantages` re-export them.
"""

from __future__ import annotations

#: ``loss_agg_mode`` values (:func:`copc.aggregation.aggregate_loss`).
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
#: ``obs_discount`` values (:func:`copc.advantages.coupled_advantage_return`).
OBS_DISCOUNT_MODES = ("skip", "per_token")


def check_number(name: str, value: object) -> float:
    """Return ``value`` as a float if it is a real number (not a bool or a string).

    Raises:
        ValueError: naming ``name`` and the value otherwise.
    """
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    return float(value)


def check_unit_interval(name: str, value: object) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``value`` is a number with ``0 <= value <= 1``."""
    if not (0.0 <= check_number(name, value) <= 1.0):
        raise ValueError(f"{name} must be in [0, 1], got {value!r}")
