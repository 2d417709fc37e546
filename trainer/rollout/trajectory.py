"""``Trajectory``: one episode's tokens with masks, behavior log-probs and policy versions.

One chokepoint (:meth:`Trajectory._append`) appends tokens, so ids, loss mask,
log-probs and versions can never drift out of alignment:

* model tokens (sampled by the policy): ``loss_mask = 1``, with the behavior log-prob and
  the policy version that produced each;
* observation tokens (tool output / environment text): ``loss_mask = 0``, no log-prob and
  no version; passing log-probs for them is an error.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

#: Version stored for observation tokens (no policy produced them).
NO_VERSION = -1

#: ``finish_reason`` prefixes of episodes ended by a failure of the infrastructure (sandbox,
#: retriever, reward checker, inference engine), not by the policy. Such episodes are never
#: trained on or scored (see :attr:`Trajectory.infra_failed`). An ``env_error`` (the
#: environment raised anything else: a bug) is not one of them: it stops training and
#: evaluation (:attr:`Trajectory.env_failed`), so a bug never silently biases the data.
INFRA_FAILURE_REASONS = ("infra_error", "engine_error")


@dataclass
class Trajectory:
    """Prompt + response tokens of one episode, aligned per response token.

    Attributes:
        prompt_ids: prompt token ids (never trained on).
        response_ids: response token ids (model and observation tokens interleaved).
        loss_mask: per response token, 1 = model token, 0 = observation token.
        logp_mu: per response token, behavior log-prob (0.0 for observation tokens).
        versions: per response token, policy version (:data:`NO_VERSION` for observations).
        reward: episode reward (outcome), placed on the last model token by :func:`to_batch`.
        sample_id: id of the data row; group_id: prompt group (GRPO), defaults to sample_id.
        turns: number of model turns.
        finish_reason: why the episode ended (``"terminated"``, ``"truncated"``,
            ``"max_total_tokens"``, ``"max_turns"``; an infrastructure failure:
            ``"infra_error: ..."`` (the env raised ``InfrastructureError``) or
            ``"engine_error: ..."``; or ``"env_error: ..."`` (any other env exception: a bug).
        info: the environment's last ``info`` and anything else worth logging.
    """

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logp_mu: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    reward: float = 0.0
    sample_id: Any = None
    group_id: Any = None
    turns: int = 0
    finish_reason: str = ""
    info: dict[str, Any] = field(default_factory=dict)

    def append_model_tokens(self, token_ids: Sequence[int], logprobs: Sequence[float],
                            versions: Sequence[int] | int) -> None:
        """Append tokens sampled by the policy (one model turn).

        Args:
            token_ids: the sampled ids.
            logprobs: behavior log-prob of each (finite, ≤ 0).
            versions: policy version of each token, or one int for all.

        Raises:
            ValueError: on length mismatch or a non-finite / positive log-prob.
        """
        n = len(token_ids)
        vers = [int(versions)] * n if isinstance(versions, int) else [int(v) for v in versions]
        self._append(token_ids, 1, list(logprobs), vers)
        self.turns += 1

    def append_observation_tokens(self, token_ids: Sequence[int], logprobs: Any = None) -> None:
        """Append environment tokens (``loss_mask = 0``).

        Raises:
            ValueError: if ``logprobs`` is given (observation tokens have no behavior log-prob).
        """
        if logprobs is not None:
            raise ValueError("observation tokens have no behavior log-probs; got logprobs="
                             f"{type(logprobs).__name__} (only model tokens carry them)")
        n = len(token_ids)
        self._append(token_ids, 0, [0.0] * n, [NO_VERSION] * n)

    def _append(self, token_ids: Sequence[int], mask: int, logprobs: list[float],
                versions: list[int]) -> None:
        """The single place where tokens enter a trajectory."""
        n = len(token_ids)
        if len(logprobs) != n or len(versions) != n:
            raise ValueError(f"{n} token ids but {len(logprobs)} logprobs and {len(versions)} versions")
        if mask == 1:
            for i, lp in enumerate(logprobs):
                if not (math.isfinite(lp) and lp <= 1e-6):
                    raise ValueError(f"logprobs[{i}] = {lp!r}: a behavior log-prob must be finite and <= 0")
        self.response_ids.extend(int(t) for t in token_ids)
        self.loss_mask.extend([mask] * n)
        self.logp_mu.extend(float(x) for x in logprobs)
        self.versions.extend(versions)

    @property
    def infra_failed(self) -> bool:
        """True when the episode was ended by an infrastructure failure, not by the policy.

        Such an episode has no meaningful reward: the trainer excludes it from the batch and
        re-queues its prompt; evaluation excludes it from the metrics and counts it.
        """
        return self.finish_reason.split(":")[0] in INFRA_FAILURE_REASONS

    @property
    def env_failed(self) -> bool:
        """True when the environment raised an exception other than ``InfrastructureError`` (a bug)."""
        return self.finish_reason.startswith("env_error")

    @property
    def num_model_tokens(self) -> int:
        """Number of response tokens sampled by the policy (|y|)."""
        return sum(self.loss_mask)

    def model_token_ids(self) -> list[int]:
        """The response's model tokens only, in order (decoding gives the model's text)."""
        return [t for t, m in zip(self.response_ids, self.loss_mask, strict=True) if m]

    def min_version(self) -> int | None:
        """Oldest policy version among model tokens (None if there are none)."""
        vs = [v for v, m in zip(self.versions, self.loss_mask, strict=True) if m]
        return min(vs) if vs else None
