"""COPC: Coupled Off-Policy Correction — the algorithm, as pure tensor code (no I/O).

Spec: ``docs/algorithm.md``. Everything here takes ``(B, T)`` tensors aligned on
response tokens plus a ``loss_mask`` (1 = action token, 0 = observation/padding).
"""

from .advantages import clipped_ratio, coupled_advantage_return, gae_advantage_return, vtrace_advantage_return
from .aggregation import LOSS_AGG_MODES, Denominators, aggregate_loss, batch_denominators
from .analysis import TabularMDP, corrected_return_operator, solve_value, target_policy
from .brace import BraceSettings, brace_advantage_return
from .coupling import CouplingGrid, CouplingTerms, coordination_reversal, coupling_grid, coupling_terms
from .margins import margins
from .metrics import advantage_channel_metrics, interval_fractions, ratio_statistics, staleness_metrics
from .outcome import (
    batch_normalized_advantages,
    broadcast_to_tokens,
    group_relative_advantages,
    masked_whiten,
)
from .policy_losses import (
    decoupled_ppo_policy_loss,
    dis_policy_loss,
    icepop_policy_loss,
    ppo_clip_policy_loss,
    ppo_token_loss,
    tis_policy_loss,
)
from .presets import PRESET_NAMES, AlgorithmConfig, get_preset
from .registries import ADVANTAGE_ESTIMATORS, POLICY_LOSSES
from .registry import AdvantageInputs, PolicyLossInputs, compute_advantages, compute_policy_loss
from .token_tree import TokenTree
from .value_loss import value_loss

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
