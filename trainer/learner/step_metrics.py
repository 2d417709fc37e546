"""Step metrics a learner keeps: micro-batch metrics combined into step metrics
(:class:`MetricAccumulator`) and the critic's value-bias drift (:class:`ValueBiasTracker`)."""

from __future__ import annotations

from collections import defaultdict

from copc.metrics import ema_drift

#: EMA decay of the value-bias drift probe (:class:`ValueBiasTracker`).
VALUE_BIAS_EMA_DECAY = 0.9


class MetricAccumulator:
    """Combines micro-batch metrics into step metrics.

    Rules (by key): ``*_loss`` — summed within an optimizer update (micro-batch losses with global
    denominators add up to the mini-batch loss; :meth:`end_mini_batch` closes the update), then
    averaged over updates (mini-batches, and a critic's K updates per mini-batch);
    ``*_max`` / ``*_min`` — max / min; ``*grad_norm`` — mean over optimizer updates;
    everything else (fractions, means) — weighted by the micro-batch's action-token count.
    """

    def __init__(self) -> None:
        self._loss_mb: dict[str, float] = defaultdict(float)  # current mini-batch's sums
        self._loss: dict[str, list[float]] = defaultdict(list)
        self._wsum: dict[str, float] = defaultdict(float)
        self._w: dict[str, float] = defaultdict(float)
        self._ext: dict[str, float] = {}
        self._plain: dict[str, list[float]] = defaultdict(list)

    def add_micro(self, metrics: dict[str, float], tokens: float) -> None:
        """Add one micro-batch's metrics; ``tokens`` = its number of action (loss-mask-1) tokens."""
        for k, v in metrics.items():
            v = float(v)
            if k.endswith("_loss"):
                self._loss_mb[k] += v
            elif k.endswith("_max"):
                self._ext[k] = max(self._ext.get(k, v), v)
            elif k.endswith("_min"):
                self._ext[k] = min(self._ext.get(k, v), v)
            else:
                self._wsum[k] += v * tokens
                self._w[k] += tokens

    def end_mini_batch(self) -> None:
        """Close the current mini-batch (its summed losses become one value each)."""
        for k, v in self._loss_mb.items():
            self._loss[k].append(v)
        self._loss_mb.clear()

    def add(self, key: str, value: float) -> None:
        """A once-per-update value (e.g. a gradient norm), averaged over updates."""
        self._plain[key].append(float(value))

    def result(self) -> dict[str, float]:
        """The combined metrics."""
        self.end_mini_batch()
        out = {k: sum(v) / len(v) for k, v in self._loss.items()}
        out.update(self._ext)
        out.update({k: self._wsum[k] / self._w[k] if self._w[k] > 0 else 0.0 for k in self._wsum})
        out.update({k: sum(v) / len(v) for k, v in self._plain.items()})
        return out


class ValueBiasTracker:
    """Drift of the critic's start-of-episode bias: ``critic/value_bias`` minus its EMA.

    ``critic/value_bias_drift = bias − EMA(previous steps' bias)`` (0 at the first step), then the
    EMA (decay :data:`VALUE_BIAS_EMA_DECAY`) takes in this step's bias (:func:`copc.metrics.ema_drift`).
    The EMA is learner state: :meth:`state_dict` goes into the learner's checkpoint.

    Args:
        decay: EMA decay in [0, 1).
    """

    def __init__(self, decay: float = VALUE_BIAS_EMA_DECAY) -> None:
        ema_drift(0.0, None, decay)  # validates decay
        self.decay = decay
        self.ema: float | None = None

    def update(self, metrics: dict[str, float]) -> dict[str, float]:
        """``{"critic/value_bias_drift": d}`` from ``metrics["critic/value_bias"]`` (advancing the EMA);
        ``{}`` (EMA unchanged) when the step has no bias (no critic or no episode)."""
        if "critic/value_bias" not in metrics:
            return {}
        drift, self.ema = ema_drift(metrics["critic/value_bias"], self.ema, self.decay)
        return {"critic/value_bias_drift": drift}

    def state_dict(self) -> dict[str, float | None]:
        """``{"value_bias_ema": float | None}`` (None before the first step with a bias)."""
        return {"value_bias_ema": self.ema}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` output.

        Raises:
            ValueError: ``state`` is not a dict with ``value_bias_ema`` a number or None.
        """
        ema = state.get("value_bias_ema", "missing") if isinstance(state, dict) else "missing"
        if ema is not None and (isinstance(ema, bool) or not isinstance(ema, int | float)):
            raise ValueError("value-bias state must be {'value_bias_ema': float | None}, "
                             f"got {state!r:.100}")
        self.ema = None if ema is None else float(ema)
