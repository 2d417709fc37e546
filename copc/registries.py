"""The registries of advantage estimators and policy losses (instances of the house's one
:class:`seams.registry.Registry` class), with their capability-metadata schemas and the built-ins.

The built-ins are registered here by reference (:class:`seams.registry.LazyRef` to their adapters
in :mod:`copc.registry`), with their metadata and settings dataclasses
(:mod:`copc.component_settings`): :mod:`copc.presets` validates names, metadata and settings
against these registries without importing torch, and the first ``get`` of a built-in imports
:mod:`copc.registry`. Users register their own with
``copc.ADVANTAGE_ESTIMATORS.register("name", needs_critic=...)(fn)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from seams.registry import REQUIRED, LazyRef, Registry

from .component_settings import (
    BraceSettings,
    CopcSettings,
    DecoupledPpoSettings,
    DisSettings,
    GrpoSettings,
    IcePopSettings,
    PPOClip,
    TisSettings,
    VTraceSettings,
)
from .margins import margins

_OPTIONAL_FN = (type(None), Callable)

#: Capability metadata of an advantage estimator:
#:
#: * ``needs_critic`` (bool, required): it reads ``inputs.values``; ``use_critic`` must equal it.
#: * ``needs_groups`` (bool): it compares samples of one prompt; ``n_samples_per_prompt >= 2``.
#: * ``per_token_obs_discount`` (bool, default True): it honours ``obs_discount='per_token'``.
#: * ``lambda_rows`` (``fn(inputs, cfg, lam) -> (advantages, returns)`` or None): the estimator
#:   with a per-row ``(B,)`` λ in one pass (length-adaptive λ); None: it is run once per λ value.
#: * ``channel_margins`` (``fn(cfg) -> (low, high)`` or None): the clipped-ratio interval of its
#:   advantage channel, logged as an off-policy diagnostic; None: it has none.
ESTIMATOR_METADATA: dict[str, tuple[Any, Any]] = {
    "needs_critic": (bool, REQUIRED), "needs_groups": (bool, False), "per_token_obs_discount": (bool, True),
    "lambda_rows": (_OPTIONAL_FN, None), "channel_margins": (_OPTIONAL_FN, None)}
#: Capability metadata of a policy loss: ``channel_margins`` (``fn(cfg) -> (low, high)`` or None),
#: the interval of its policy channel, logged as an off-policy diagnostic.
POLICY_LOSS_METADATA: dict[str, tuple[Any, Any]] = {"channel_margins": (_OPTIONAL_FN, None)}

#: Advantage estimators: ``fn(inputs: AdvantageInputs, cfg: AlgorithmConfig) -> (advantages,
#: returns)``; metadata :data:`ESTIMATOR_METADATA`; settings: ``cfg.estimator_settings``.
ADVANTAGE_ESTIMATORS: Registry[Callable[..., Any]] = Registry("advantage estimator", ESTIMATOR_METADATA)
#: Policy losses: ``fn(logp, inputs: PolicyLossInputs, cfg: AlgorithmConfig) -> (loss, metrics)``;
#: metadata :data:`POLICY_LOSS_METADATA`; settings: ``cfg.policy_loss_settings``.
POLICY_LOSSES: Registry[Callable[..., Any]] = Registry("policy loss", POLICY_LOSS_METADATA)


def _advantage_margins(cfg: Any) -> tuple[float, float]:
    """(ℓ_A, u_A) of the COPC advantage channel of ``cfg`` (a :class:`copc.AlgorithmConfig`;
    η_A = 0: ρ̄ ≡ 1, ``copc_wo_rc``)."""
    return margins(cfg.estimator_settings.eta_a, cfg.eps_low, cfg.eps_high)


def _policy_margins(cfg: Any) -> tuple[float, float]:
    """(ℓ_P, u_P) of the DIS policy channel of ``cfg`` (a :class:`copc.AlgorithmConfig`)."""
    return margins(cfg.policy_loss_settings.eta_p, cfg.eps_low, cfg.eps_high)


def _adapter(name: str) -> LazyRef:
    """The built-in adapter ``name`` of :mod:`copc.registry` (imported on first use: torch)."""
    return LazyRef(f"copc.registry:{name}")


ADVANTAGE_ESTIMATORS.register("copc", _adapter("_copc"), needs_critic=True,
                              channel_margins=_advantage_margins, settings=CopcSettings)
ADVANTAGE_ESTIMATORS.register("gae", _adapter("_gae"), needs_critic=True)
ADVANTAGE_ESTIMATORS.register("vtrace", _adapter("_vtrace"), needs_critic=True, per_token_obs_discount=False,
                              lambda_rows=_adapter("_vtrace_rows"), settings=VTraceSettings)
ADVANTAGE_ESTIMATORS.register("brace", _adapter("_brace"), needs_critic=True, per_token_obs_discount=False,
                              lambda_rows=_adapter("_brace_rows"), settings=BraceSettings)
ADVANTAGE_ESTIMATORS.register("grpo", _adapter("_grpo"), needs_critic=False, needs_groups=True,
                              settings=GrpoSettings)
ADVANTAGE_ESTIMATORS.register("batch_norm", _adapter("_batch_norm"), needs_critic=False)
POLICY_LOSSES.register("dis", _adapter("_dis"), channel_margins=_policy_margins, settings=DisSettings)
POLICY_LOSSES.register("ppo", _adapter("_ppo"), settings=PPOClip)
POLICY_LOSSES.register("decoupled_ppo", _adapter("_decoupled"), settings=DecoupledPpoSettings)
POLICY_LOSSES.register("tis", _adapter("_tis"), settings=TisSettings)
POLICY_LOSSES.register("icepop", _adapter("_icepop"), settings=IcePopSettings)
