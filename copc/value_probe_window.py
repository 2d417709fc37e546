"""The π-referenced value probes pooled over the last W learner steps (issue 46 item 3).

One step's batch is too small for the probes of :mod:`copc.value_probes` to tell a critic of µ
from a critic of π (``docs/research.md``, "How much a probe can see"). :class:`ValueProbeWindow`
keeps the per-episode terms (:class:`~copc.value_probes.ProbeTerms`) of the last W steps and
evaluates the same estimators on their union, so every episode counts once:

    Ê_π[R] = Σ_{b ∈ window} w_b R_b / Σ_{b ∈ window} w_b,    Ê_µ[R] = mean_{b ∈ window} R_b,
    value/pooled_policy_value_gap = | mean_{b ∈ window} V̂_b − Ê_π[R] |,  value/pooled_b_hat = Ê_π − Ê_µ

— not a mean of the W per-step values: a step of many episodes weighs more than one of few, and
the self-normalisation runs over the whole window (a mean of per-step self-normalised means
carries W times their O(1/B) bias; the pooled one O(1/(W·B))). Its standard errors
(``value/pooled_se_gap``, ``value/pooled_se_b_hat``) are those of :func:`copc.value_probes.probe_metrics`
on the union, so they shrink as 1/√(W·B).

What it estimates: each episode's weight is π/µ of *its* step's π (the weights before that
step's update) and V̂_b is that step's critic, so the pooled gap is the episode-weighted mean over
the window of per-step gaps, not the gap of the current critic. A critic or policy that moves
within W steps blurs it; W trades noise (1/√(W·B)) for lag (W steps).
"""

from __future__ import annotations

from collections import deque

import torch

from .component_settings import ValueProbeSettings
from .value_probes import ProbeTerms, probe_metrics

Tensor = torch.Tensor

#: Columns of a step's saved terms (``(n, 4)`` float64), in this order.
_COLUMNS = ("v", "r", "w", "capped")


class ValueProbeWindow:
    """The episodes of the last ``window_steps`` steps and their pooled probes.

    Args:
        settings: :class:`~copc.component_settings.ValueProbeSettings` (its ``window_steps``);
            None: the defaults.

    Learner state: :meth:`state_dict` goes into the learner's checkpoint (at most W·B·4 floats).
    """

    def __init__(self, settings: ValueProbeSettings | None = None) -> None:
        self.settings = settings or ValueProbeSettings()
        self.steps: deque[ProbeTerms] = deque(maxlen=self.settings.window_steps)

    def update(self, terms: ProbeTerms | None) -> dict[str, float]:
        """Add one step's episodes (dropping the oldest step beyond W) and return the pooled probes.

        Args:
            terms: the step's :func:`copc.value_probes.probe_terms`, or None (no episode with an
                action token, or no finite weight): the window is left as it is and ``{}`` returned.

        Returns:
            :func:`copc.value_probes.probe_metrics` of the window's episodes with prefix
            ``pooled_`` (``value/pooled_policy_value_gap``, ``value/pooled_b_hat``,
            ``value/pooled_se_gap``, ``value/pooled_se_b_hat``, ``value/pooled_seq_weight_ess_frac``,
            ``value/pooled_seq_weight_capped_frac``), plus ``value/pooled_episodes`` (n) and
            ``value/pooled_steps`` (≤ W).
        """
        if terms is None:
            return {}
        # kept on the CPU in float64: a checkpoint loads it there, and a backend whose batch lives on
        # a GPU (megatron) would otherwise join CPU and GPU tensors after a resume
        self.steps.append(ProbeTerms(*(getattr(terms, c).detach().to("cpu", torch.float64)
                                       for c in _COLUMNS)))
        pooled = ProbeTerms.cat(list(self.steps))
        return {**probe_metrics(pooled, prefix="pooled_"), "value/pooled_episodes": float(pooled.w.numel()),
                "value/pooled_steps": float(len(self.steps))}

    def state_dict(self) -> dict[str, list[Tensor]]:
        """``{"value_probe_window": [one (n, 4) float64 tensor per step, oldest first]}``."""
        return {"value_probe_window": [torch.stack([getattr(t, c) for c in _COLUMNS], dim=1)
                                       for t in self.steps]}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` output; a state without ``value_probe_window`` (a checkpoint
        from before the window existed) empties the window. Steps beyond W (a smaller W now) drop
        the oldest.

        Raises:
            ValueError: ``value_probe_window`` not a list of ``(n, 4)`` floating tensors.
        """
        saved = state.get("value_probe_window", []) if isinstance(state, dict) else None
        ok = isinstance(saved, list) and all(isinstance(x, Tensor) and x.is_floating_point() and x.dim() == 2
                                             and x.shape[1] == len(_COLUMNS) for x in saved)
        if not ok:
            raise ValueError(f"value_probe_window must be a list of (n, 4) float tensors, got {saved!r:.100}")
        self.steps.clear()
        for x in saved:
            self.steps.append(ProbeTerms(*(x[:, i].double() for i in range(len(_COLUMNS)))))
