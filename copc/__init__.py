"""COPC: Coupled Off-Policy Correction — the algorithm, as pure tensor code (no I/O).

Spec: ``docs/algorithm.md``. Everything here takes ``(B, T)`` tensors aligned on
response tokens plus a ``loss_mask`` (1 = action token, 0 = observation/padding).

The configuration half (:func:`get_preset`, :class:`AlgorithmConfig`, the registries with their
built-ins' names, metadata and settings, :func:`margins`) imports no tensor library, so a config is
validated without torch; the tensor functions (:func:`compute_advantages`, the estimators, losses
and metrics) are imported on first access (``copc.compute_advantages``, ``from copc import
value_loss``), PEP 562.
"""

from seams.lazy import lazy_exports

from ._scalars import LOSS_AGG_MODES
from .component_settings import BraceSettings
from .margins import margins
from .presets import PRESET_NAMES, AlgorithmConfig, get_preset
from .registries import ADVANTAGE_ESTIMATORS, POLICY_LOSSES

#: The torch-backed public names, by the submodule that defines them (imported on first access).
_LAZY: dict[str, tuple[str, ...]] = {
    "advantages": ("clipped_ratio", "coupled_advantage_return", "gae_advantage_return",
                   "vtrace_advantage_return"),
    "aggregation": ("Denominators", "aggregate_loss", "batch_denominators"),
    "analysis": ("TabularMDP", "corrected_return_operator", "solve_value", "target_policy"),
    "brace": ("brace_advantage_return",),
    "coupling": ("CouplingGrid", "CouplingTerms", "coordination_reversal", "coupling_grid", "coupling_terms"),
    "metrics": ("advantage_channel_metrics", "interval_fractions", "ratio_statistics", "staleness_metrics"),
    "outcome": ("batch_normalized_advantages", "broadcast_to_tokens", "group_relative_advantages",
                "masked_whiten"),
    "policy_losses": ("decoupled_ppo_policy_loss", "dis_policy_loss", "icepop_policy_loss",
                      "ppo_clip_policy_loss", "ppo_token_loss", "tis_policy_loss"),
    "registry": ("AdvantageInputs", "PolicyLossInputs", "compute_advantages", "compute_policy_loss"),
    "token_tree": ("TokenTree",),
    "value_loss": ("value_loss",),
}
__getattr__, __dir__ = lazy_exports(__name__, _LAZY)

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "LOSS_AGG_MODES",
    "POLICY_LOSSES",
    "PRESET_NAMES",
    "AdvantageInputs",
    "AlgorithmConfig",
    "BraceSettings",
    "CouplingGrid",
    "CouplingTerms",
    "Denominators",
    "PolicyLossInputs",
    "TabularMDP",
    "TokenTree",
    "advantage_channel_metrics",
    "aggregate_loss",
    "batch_denominators",
    "batch_normalized_advantages",
    "brace_advantage_return",
    "broadcast_to_tokens",
    "clipped_ratio",
    "compute_advantages",
    "compute_policy_loss",
    "coordination_reversal",
    "corrected_return_operator",
    "coupled_advantage_return",
    "coupling_grid",
    "coupling_terms",
    "decoupled_ppo_policy_loss",
    "dis_policy_loss",
    "gae_advantage_return",
    "get_preset",
    "group_relative_advantages",
    "icepop_policy_loss",
    "interval_fractions",
    "margins",
    "masked_whiten",
    "ppo_clip_policy_loss",
    "ppo_token_loss",
    "ratio_statistics",
    "solve_value",
    "staleness_metrics",
    "target_policy",
    "tis_policy_loss",
    "value_loss",
    "vtrace_advantage_return",
]
