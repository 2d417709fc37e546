"""Correction intervals shared by both COPC channels (spec, "Margins")."""

from __future__ import annotations

from ._scalars import check_number, check_unit_interval

#: Paper defaults (spec, "Margins"): ε_ℓ = 0.4, ε_h = 0.56, η_P = η_A = 0.5.
EPS_LOW = 0.4
EPS_HIGH = 0.56
ETA = 0.5


def margins(eta: float, eps_low: float = EPS_LOW, eps_high: float = EPS_HIGH) -> tuple[float, float]:
    """Interval ``(ℓ, u) = (1 − η·ε_ℓ, 1 + η·ε_h)`` of one correction channel.

    Spec "Margins": smaller η = narrower interval = stronger correction; the
    paper defaults give ``(0.8, 1.28)``. ``η = 0`` gives ``(1, 1)``.

    Args:
        eta: channel strength η ∈ [0, 1] (dimensionless).
        eps_low: base lower margin ε_ℓ ∈ [0, 1].
        eps_high: base upper margin ε_h ≥ 0.

    Returns:
        ``(low, high)`` as Python floats, ``0 ≤ low ≤ 1 ≤ high``.

    Raises:
        ValueError: if ``eta`` or ``eps_low`` is outside [0, 1], ``eps_high < 0``, or any is
            not a number.
    """
    check_unit_interval("eta", eta)
    check_unit_interval("eps_low", eps_low)
    if not check_number("eps_high", eps_high) >= 0.0:
        raise ValueError(f"eps_high must be >= 0, got {eps_high!r}")
    return 1.0 - eta * eps_low, 1.0 + eta * eps_high
