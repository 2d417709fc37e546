"""``Trajectory``: one episode's tokens with masks, behavior log-probs and policy versions.

One chokepoint (:meth:`Trajectory._append`) appends tokens, so ids, loss mask,
log-probs and versions can never drift out of alignment:

* model tokens (sampled by the policy): ``loss_mask = 1``, with the behavior log-prob and
  the policy version that produced each;
* observation tokens (tool output / environment text): ``loss_mask = 0``, no log-prob and
  no version; passing log-probs for them is an error.

Rewards enter through one method too (:meth:`Trajectory.add_reward`): each environment
step's reward, non-terminal or terminal, is placed on the last model token present when it
is recorded — the last action token of the turn the step answered, so *before* that step's
observation. That is the spec's "fold" rule (``obs_reward: fold``: reward belonging to an
observation moves onto the preceding action token) applied at the source, so the batch
never carries reward on an observation token and is valid under ``obs_reward: error`` too.
:attr:`Trajectory.reward` is the episode return, the sum of all of them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

#: Version stored for observation tokens (no policy produced them).
NO_VERSION = -1

class FinishReason(str, Enum):
    """Why an episode ended: the part of :attr:`Trajectory.finish_reason` before ``':'``.

    The values are the strings records and logs carry (``finish_reason`` in evaluation records,
    ``rollout/finish_<reason>`` metrics); a reason with a detail is written
    ``"<value>: <detail>"`` (:func:`finish_text`), e.g. ``"env_error: RuntimeError: boom"``.
    ``INFRA_ERROR`` / ``ENGINE_ERROR`` are failures of the infrastructure (sandbox, retriever,
    reward checker, inference engine), not of the policy: such episodes are never trained on or
    scored (:attr:`Trajectory.infra_failed`). ``ENV_ERROR`` (the environment raised anything
    else: a bug) is not one of them: it stops training and evaluation
    (:attr:`Trajectory.env_failed`), so a bug never silently biases the data.
    """

    TERMINATED = "terminated"
    TRUNCATED = "truncated"
    MAX_TURNS = "max_turns"
    MAX_TOTAL_TOKENS = "max_total_tokens"
    INFRA_ERROR = "infra_error"
    ENGINE_ERROR = "engine_error"
    ENV_ERROR = "env_error"
    HISTORY_EDITED = "history_edited"

    @property
    def infra(self) -> bool:
        """True for an episode that is excluded and counted like a failure of the infrastructure:
        ``infra_error``, ``engine_error``, and ``history_edited`` (a harness agent sent back a history
        other than the one the model produced, so its sampled tokens are no longer the context:
        ``trainer/harness``, ``docs/harness.md``)."""
        return self in (FinishReason.INFRA_ERROR, FinishReason.ENGINE_ERROR, FinishReason.HISTORY_EDITED)


#: ``Trajectory.info`` key: the episode's latest model turn was cut at ``rollout.max_new_tokens``
#: (the engine's ``finish_reason == "length"``) and still passed to the environment; a turn cut by
#: the episode's ``rollout.max_total_tokens`` ends it with ``finish_reason = "max_total_tokens"``.
LENGTH_CAPPED = "length_capped"

#: ``finish_reason`` prefixes of episodes ended by a failure of the infrastructure (see
#: :class:`FinishReason`).
INFRA_FAILURE_REASONS = tuple(r.value for r in FinishReason if r.infra)


def finish_text(reason: FinishReason, detail: str | None = None) -> str:
    """The ``finish_reason`` string of ``reason``: its value, then ``": <detail>"`` when a detail is given."""
    return reason.value if detail is None else f"{reason.value}: {detail}"


def split_finish(text: str) -> tuple[str, str]:
    """``(prefix, detail)`` of a ``finish_reason`` string: the part before the first ``':'``
    (stripped) and the rest (one leading space dropped); ``("", "")`` for ``""``.

    Works on any record's string, also a reason this module does not define (the prefix is
    returned as written); :meth:`FinishReason` of the prefix gives the enum member.
    """
    prefix, _, detail = text.partition(":")
    return prefix.strip(), detail[1:] if detail.startswith(" ") else detail


@dataclass
class Trajectory:
    """Prompt + response tokens of one episode, aligned per response token.

    Attributes:
        prompt_ids: prompt token ids (never trained on).
        response_ids: response token ids (model and observation tokens interleaved).
        loss_mask: per response token, 1 = model token, 0 = observation token.
        logp_mu: per response token, behavior log-prob (0.0 for observation tokens).
        versions: per response token, policy version (:data:`NO_VERSION` for observations).
        reward: episode return: the sum of every step's reward (for the built-in environments
            only the terminal step rewards, so it is the outcome reward). Evaluation's
            correctness (``reward > 0.5``), the loop's reward logging and the batch's
            ``scores`` (GRPO/SAO/DAPO) all read this value. :meth:`add_reward` adds to it; a
            value assigned directly (hand-built trajectories) that :attr:`step_rewards` does
            not account for is an outcome reward on the last model token
            (:meth:`token_rewards`).
        step_rewards: ``(response index, reward)`` per :meth:`add_reward` call, in order: the
            index is that of the last model token when the reward was recorded (so
            ``loss_mask[index] == 1``). Zero rewards are recorded too (one entry per
            environment step).
        sample_id: id of the data row; group_id: prompt group (GRPO), defaults to sample_id.
        turns: number of model turns.
        finish_reason: why the episode ended, as records write it: a :class:`FinishReason`
            value (``"terminated"``, ``"truncated"``, ``"max_total_tokens"``, ``"max_turns"``;
            an infrastructure failure: ``"infra_error: ..."`` (the env raised
            ``InfrastructureError``) or ``"engine_error: ..."``; or ``"env_error: ..."`` (any
            other env exception: a bug)), with its detail after ``': '``. Set it with
            :meth:`finish`; read it with :attr:`finish_kind` / :attr:`finish_detail`.
        info: the environment's last ``info`` and anything else worth logging.
    """

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logp_mu: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    reward: float = 0.0
    step_rewards: list[tuple[int, float]] = field(default_factory=list)
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

    def add_reward(self, reward: float) -> None:
        """Record one environment step's reward on the current last model token.

        Call it right after the step, before appending that step's observation: the reward
        lands on the last action token of the turn the step answered (the spec's fold rule).
        ``reward`` (the episode return) grows by it.

        Args:
            reward: the step's reward (a real number; 0 is recorded too).

        Raises:
            TypeError, ValueError: if ``reward`` is not a finite real number (``float()``
                refuses it, or NaN/inf), or it is non-zero and the trajectory has no model
                token to put it on. Nothing is recorded then.
        """
        r = float(reward)
        if not math.isfinite(r):
            raise ValueError(f"reward {reward!r} is not finite")
        last = self._last_model_index()
        if last is None and r != 0.0:
            raise ValueError(f"reward {r!r} but no model token to put it on (sample {self.sample_id!r})")
        self.step_rewards.append((-1 if last is None else last, r))
        self.reward += r

    def clear_rewards(self) -> None:
        """Forget every reward: ``reward = 0`` and no :attr:`step_rewards` (failed episodes)."""
        self.step_rewards.clear()
        self.reward = 0.0

    def token_rewards(self) -> dict[int, float]:
        """Non-zero reward per response index, as :func:`~trainer.rollout.batch.to_batch` places it.

        Each :attr:`step_rewards` entry at its index (entries on one index add up); the part of
        :attr:`reward` they do not account for (``reward − Σ step rewards``, exactly 0 when
        every reward went through :meth:`add_reward`) on the last model token. The values
        therefore always sum to :attr:`reward`, and every index is a model token.

        Returns:
            ``{response index: reward}`` in increasing index order, zeros left out.

        Raises:
            ValueError: if a step reward's index is not a model token of this trajectory, or
                a non-zero reward (step or remainder) has no model token to go on.
        """
        out: dict[int, float] = {}
        placed = 0.0
        for i, r in self.step_rewards:
            placed += r  # same order as add_reward's sum: the remainder is exactly 0 then
            if r == 0.0:
                continue
            if not (0 <= i < len(self.loss_mask) and self.loss_mask[i] == 1):
                raise ValueError(f"step reward {r!r} at response index {i} of sample {self.sample_id!r}: "
                                 "not a model token (no model token to put it on)")
            out[i] = out.get(i, 0.0) + r
        rest = float(self.reward) - placed if self.step_rewards else float(self.reward)
        if rest != 0.0:
            last = self._last_model_index()
            if last is None:
                raise ValueError(f"sample {self.sample_id!r} has reward {self.reward!r} but no model "
                                 "token to put it on")
            out[last] = out.get(last, 0.0) + rest
        return {i: out[i] for i in sorted(out) if out[i] != 0.0}

    def _last_model_index(self) -> int | None:
        """Response index of the last model token (None if there is none)."""
        for i in range(len(self.loss_mask) - 1, -1, -1):
            if self.loss_mask[i]:
                return i
        return None

    def finish(self, reason: FinishReason, detail: str | None = None) -> None:
        """End the episode with ``reason`` (and a detail): :attr:`finish_reason` = :func:`finish_text`."""
        self.finish_reason = finish_text(FinishReason(reason), detail)

    @property
    def finish_kind(self) -> FinishReason | None:
        """The :class:`FinishReason` of :attr:`finish_reason` (``None``: not finished, or a reason
        this module does not define)."""
        prefix = split_finish(self.finish_reason)[0]
        return FinishReason(prefix) if prefix in FinishReason._value2member_map_ else None

    @property
    def finish_detail(self) -> str:
        """The detail of :attr:`finish_reason` after ``': '`` (``""`` when none)."""
        return split_finish(self.finish_reason)[1]

    @property
    def infra_failed(self) -> bool:
        """True when the episode was ended by an infrastructure failure, not by the policy.

        Such an episode has no meaningful reward: the trainer excludes it from the batch and
        re-queues its prompt; evaluation excludes it from the metrics and counts it.
        """
        kind = self.finish_kind
        return kind is not None and kind.infra

    @property
    def env_failed(self) -> bool:
        """True when the environment raised an exception other than ``InfrastructureError`` (a bug)."""
        return self.finish_kind is FinishReason.ENV_ERROR

    @property
    def num_model_tokens(self) -> int:
        """Number of response tokens sampled by the policy (|y|)."""
        return sum(self.loss_mask)

    def model_token_ids(self) -> list[int]:
        """The response's model tokens only, in order (decoding gives the model's text)."""
        return [t for t, m in zip(self.response_ids, self.loss_mask, strict=True) if m]

    def sequence(self) -> tuple[list[int], list[int]]:
        """The whole sequence and its loss mask: ``(prompt_ids + response_ids, [0] * len(prompt_ids)
        + loss_mask)``, equal-length int lists (supervised warm-start rows, right-padded there)."""
        return self.prompt_ids + self.response_ids, [0] * len(self.prompt_ids) + self.loss_mask

    def min_version(self) -> int | None:
        """Oldest policy version among model tokens (None if there are none)."""
        vs = [v for v, m in zip(self.versions, self.loss_mask, strict=True) if m]
        return min(vs) if vs else None
