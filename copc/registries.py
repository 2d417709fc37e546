"""The registries of advantage estimators and policy losses (instances of the house's one
:class:`seams.registry.Registry` class), with their capability-metadata schemas.

Only the two empty registries live here, so that :mod:`copc.presets` can validate names against
them and :mod:`copc.registry` can fill them with the built-in adapters without an import cycle.
Users register their own with ``copc.ADVANTAGE_ESTIMATORS.register("name", needs_critic=...)(fn)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from seams.registry import REQUIRED, Registry

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
