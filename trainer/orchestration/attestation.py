"""Weight-sync attestation: after a sync the engine's log-probs must be the learner's.

COPC reweights every token by ``π_old / µ``, where µ is the policy version the engine reports.
If a weight sync silently did not happen (a failed load, a stale adapter, a wrong version
counter), µ is not that version and the run looks merely stale. So after every sync of the
learner's own weights the engine samples a short continuation of a fixed probe prompt, the
learner scores the same tokens under its current weights, and the largest difference of the
per-token log-probs must stay within ``train.sync_check_tolerance``
(``sync/probe_max_abs_logp_diff`` is logged every step; above the tolerance the run stops).

Checked when the version the engine gets IS the learner's current weights (bounded staleness):
with a fixed lag the producer syncs a kept copy of version n − k, which the learner no longer
holds, so the loop does not call it. :func:`probe_logp_diff` returns None (nothing compared)
when the rollouts cannot sample one request directly (no ``probe``: Ray rollouts) or the learner
cannot score a batch (no ``recompute``: a distributed learner).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import torch

from ..engines.base import SamplingParams
from ..errors import TrainingError
from ..rollout.batch import to_batch
from ..rollout.trajectory import Trajectory

#: The probe prompt: fixed token ids every vocabulary of >= 26 tokens has (no tokenizer needed).
PROBE_PROMPT_IDS = tuple(range(10, 26))
#: Tokens the engine samples after the probe prompt.
PROBE_NEW_TOKENS = 8


@dataclass(frozen=True)
class SyncCheck:
    """Settings of the attestation.

    Attributes:
        tolerance: the largest allowed ``|log π_learner − log π_engine|`` over the probe's
            sampled tokens (nats, > 0).
        temperature: the rollout sampling temperature (both sides score ``logits / T``).
        pad_token_id: the tokenizer's pad id (the probe batch is padded with it).

    Raises:
        ValueError: ``tolerance`` not > 0, naming ``train.sync_check_tolerance``.
    """

    tolerance: float
    temperature: float = 1.0
    pad_token_id: int = 0

    def __post_init__(self) -> None:
        if not self.tolerance > 0:
            raise ValueError(f"train.sync_check_tolerance={self.tolerance!r}: must be > 0 (or null: off)")


async def probe_logp_diff(rollouts: Any, learner: Any, version: int, check: SyncCheck) -> float | None:
    """Max abs difference (nats) between the engine's and the learner's log-probs of a probe
    continuation sampled by the engine right after it was synced to ``version``.

    Returns:
        The difference; ``inf`` when the engine reports another version than ``version`` for the
        probe's tokens; None when either side cannot take part (module docstring).
    """
    probe, score = getattr(rollouts, "probe", None), getattr(learner, "recompute", None)
    if probe is None or score is None:
        return None
    params = SamplingParams(temperature=check.temperature, max_new_tokens=PROBE_NEW_TOKENS, seed=version)
    res = await probe(list(PROBE_PROMPT_IDS), params)
    if not res.token_ids:
        return None
    if set(res.versions) != {version}:
        return float("inf")
    tr = Trajectory(prompt_ids=list(PROBE_PROMPT_IDS))
    tr.append_model_tokens(res.token_ids, res.logprobs, res.versions)
    batch = to_batch([tr], check.pad_token_id)

    def learner_logp() -> torch.Tensor:
        with torch.no_grad():
            return score(batch)[0]

    logp = await asyncio.to_thread(learner_logp)
    m = batch.loss_mask.bool()
    return float((logp[m].double() - batch.logp_mu[m].double()).abs().max())


async def attest_sync(rollouts: Any, learner: Any, version: int, check: SyncCheck | None
                      ) -> dict[str, float]:
    """Run :func:`probe_logp_diff` and enforce the tolerance.

    Returns:
        ``{"sync/probe_max_abs_logp_diff": d}`` (empty when off or not comparable).

    Raises:
        TrainingError: the difference exceeds ``check.tolerance`` (one line naming the version and
            ``train.sync_check_tolerance``), or the engine reported another version.
    """
    if check is None:
        return {}
    diff = await probe_logp_diff(rollouts, learner, version, check)
    if diff is None:
        return {}
    if not diff <= check.tolerance:
        what = "reported another policy version than" if diff == float("inf") else \
            f"log-probs differ by {diff:.3g} nats from the learner's at"
        raise TrainingError(f"weight sync check failed: after the sync the engine {what} policy version "
                            f"{version} (train.sync_check_tolerance={check.tolerance:g}); the behaviour "
                            "policy is not the recorded version, so COPC's ratios would be wrong")
    return {"sync/probe_max_abs_logp_diff": diff}
