"""Per-step rollout metrics of the training loop (``rollout/*``, ``staleness/per_token``)."""

from __future__ import annotations

import math
from typing import Any

from ..outputs.by_version import VersionTally, pool, version_metrics
from ..rollout.timing import TIME_KEYS
from ..rollout.trajectory import LENGTH_CAPPED, FinishReason, Trajectory, split_finish

#: An episode counts as correct in ``rollout/accuracy`` and ``rollout/accuracy_by_version/*`` when its
#: reward exceeds this (1/0 and DAPO's 1/-1 rewards).
CORRECT_REWARD = 0.5


def _quantile(xs: list[float], q: float) -> float:
    """The ``q``-quantile of ``xs`` by nearest rank: the ``⌈q·n⌉``-th smallest (``q`` in (0, 1],
    ``xs`` non-empty)."""
    s = sorted(xs)
    return float(s[max(0, math.ceil(q * len(s)) - 1)])


def length_reward_distribution(trajs: list[Trajectory], prefix: str) -> dict[str, float]:
    """``{prefix}_len_p50`` / ``_len_p90`` (model tokens, nearest rank) and ``{prefix}_reward_p50``
    / ``_reward_p90`` of ``trajs``: set beside each other for the trained and the dropped episodes,
    they show an admission bias (e.g. long episodes dropped as stale more often). Empty for none."""
    if not trajs:
        return {}
    lens, rewards = [float(t.num_model_tokens) for t in trajs], [float(t.reward) for t in trajs]
    return {f"{prefix}_len_p50": _quantile(lens, 0.5), f"{prefix}_len_p90": _quantile(lens, 0.9),
            f"{prefix}_reward_p50": _quantile(rewards, 0.5), f"{prefix}_reward_p90": _quantile(rewards, 0.9)}


def dropped_metrics(dropped: list[Trajectory]) -> dict[str, float]:
    """Mean response length (model tokens) and reward of the groups dropped as stale since
    the last step, next to the trained ones' ``rollout/model_tokens`` / ``reward_mean`` (a
    length bias from dropping is visible), their count and quantiles
    (:func:`length_reward_distribution`, ``rollout/dropped_stale_len_p50`` …). Empty when
    nothing was dropped."""
    if not dropped:
        return {}
    n = len(dropped)
    return {"rollout/dropped_stale_len": sum(t.num_model_tokens for t in dropped) / n,
            "rollout/dropped_stale_reward": sum(t.reward for t in dropped) / n,
            "rollout/dropped_stale_episodes": float(n),
            **length_reward_distribution(dropped, "rollout/dropped_stale")}


def staleness_split_metrics(trajs: list[Trajectory], trained_version: int) -> dict[str, float]:
    """A token's staleness ``trained_version − v_t`` split into in-flight and in-queue parts.

    For an episode whose newest model token came from version ``v_last``: **in flight**
    ``v_last − v_t`` (versions that passed while the episode was being generated, after token
    ``t``) and **in queue** ``trained_version − v_last`` (versions between the end of its
    generation and its training). They add up to the token's staleness exactly. ``v_last`` is the
    version of the last model token, so an update during the episode's final tool call counts as
    in queue.

    Returns:
        ``staleness/in_flight_{mean,max,token_mean}`` and ``staleness/in_queue_{mean,max,
        token_mean}``: ``mean``/``max`` per episode (in flight: ``v_last − v_first``),
        ``token_mean`` over every model token. Empty when no episode has model tokens.
    """
    flight_ep, queue_ep, flight_tok, queue_tok = [], [], [], []
    for t in trajs:
        vs = [v for v, m in zip(t.versions, t.loss_mask, strict=True) if m]
        if not vs:
            continue
        last = max(vs)
        flight_ep.append(last - min(vs))
        queue_ep.append(trained_version - last)
        flight_tok.extend(last - v for v in vs)
        queue_tok.extend([trained_version - last] * len(vs))
    if not flight_ep:
        return {}
    out = {}
    for name, ep, tok in (("in_flight", flight_ep, flight_tok), ("in_queue", queue_ep, queue_tok)):
        out[f"staleness/{name}_mean"] = sum(ep) / len(ep)
        out[f"staleness/{name}_max"] = float(max(ep))
        out[f"staleness/{name}_token_mean"] = sum(tok) / len(tok)
    return out


def rollout_metrics(trajs: list[Trajectory], version: int) -> dict[str, Any]:
    """Means over the step's trained episodes, and the staleness of every trained model token.

    Args:
        trajs: the step's trained episodes (non-empty).
        version: the learner's policy version after the step (staleness is counted against the
            version the step trained, ``version − 1``).

    Returns:
        ``rollout/reward_mean``, ``rollout/accuracy`` (reward > 0.5), ``rollout/response_tokens``,
        ``rollout/model_tokens`` (tokens), ``rollout/turns``, ``rollout/tool_calls`` (executed
        tool calls per episode), ``rollout/invalid_action_rate`` (share of model turns the
        environment rejected as invalid), ``rollout/episodes``,
        ``rollout/finish_<reason>`` fractions, ``rollout/truncated_fraction`` /
        ``rollout/max_new_tokens_cut_fraction`` (:func:`truncation_metrics`), ``time/rollout_llm_s``,
        ``time/rollout_env_s``,
        ``time/rollout_other_s`` (:func:`rollout_time_metrics`), ``rollout/trained_len_p50`` …
        (:func:`length_reward_distribution`), ``staleness/in_flight_*`` / ``in_queue_*``
        (:func:`staleness_split_metrics`), and ``staleness/per_token``: a
        list of ints, one per loss-mask-1 token (policy versions behind), when any.
    """
    n = len(trajs)
    rewards = [t.reward for t in trajs]
    reasons: dict[str, int] = {}
    for t in trajs:
        key = split_finish(t.finish_reason)[0]
        reasons[key] = reasons.get(key, 0) + 1
    vers = [v for t in trajs for v, m in zip(t.versions, t.loss_mask, strict=True) if m]
    out = {"rollout/reward_mean": sum(rewards) / n,
           "rollout/accuracy": sum(r > CORRECT_REWARD for r in rewards) / n,
           "rollout/response_tokens": sum(len(t.response_ids) for t in trajs) / n,
           "rollout/model_tokens": sum(t.num_model_tokens for t in trajs) / n,
           "rollout/turns": sum(t.turns for t in trajs) / n,
           "rollout/tool_calls": sum(float(t.info.get("tool_calls", 0)) for t in trajs) / n,
           "rollout/invalid_action_rate": (sum(float(t.info.get("invalid_actions", 0)) for t in trajs)
                                           / max(1, sum(t.turns for t in trajs))),
           "rollout/episodes": float(n)}
    out.update({f"rollout/finish_{k}": v / n for k, v in reasons.items()})
    out.update(truncation_metrics(trajs))
    out.update(rollout_time_metrics(trajs))
    out.update(length_reward_distribution(trajs, "rollout/trained"))
    out.update(staleness_split_metrics(trajs, version - 1))
    if vers:
        out["staleness/per_token"] = [version - 1 - v for v in vers]  # type: ignore[assignment]
    return out


def generating_version(traj: Trajectory) -> int | None:
    """The policy version that generated ``traj``: that of its first model token (the policy that
    started the episode; later turns may be newer in bounded mode). None without a model token."""
    return next((v for v, m in zip(traj.versions, traj.loss_mask, strict=True) if m), None)


def tally_by_version(trajs: list[Trajectory]) -> dict[int, VersionTally]:
    """Generating version (:func:`generating_version`) → count, reward sum and number with reward
    > 0.5 of ``trajs``; episodes without a model token are left out."""
    out: dict[int, VersionTally] = {}
    for t in trajs:
        v = generating_version(t)
        if v is not None:
            pool(out, {v: VersionTally(1, float(t.reward), float(t.reward > CORRECT_REWARD))})
    return out


def by_version_metrics(trajs: list[Trajectory], totals: dict[int, VersionTally]) -> dict[str, float]:
    """The step's reward / accuracy / episodes by generating version, and the run's cumulative ones.

    Adds the step's tallies to ``totals`` (version → :class:`~trainer.outputs.by_version.VersionTally`,
    the loop state's, in place) and returns ``rollout/{reward,accuracy,episodes}_by_version/v<k>``
    over ``trajs`` plus ``..._by_version_total/v<k>`` from ``totals`` for the versions ``trajs``
    holds (:mod:`trainer.outputs.by_version`). E.g. versions 0, 0, 1 with rewards 1, 0, 1:
    ``reward_by_version/v0`` 0.5, ``v1`` 1.0, ``episodes_by_version/v0`` 2, ``v1`` 1.
    """
    step = tally_by_version(trajs)
    pool(totals, step)
    return {**version_metrics(step), **version_metrics({v: totals[v] for v in step}, total=True)}


def truncation_metrics(trajs: list[Trajectory]) -> dict[str, float]:
    """How many of the step's episodes a token cap cut (non-empty ``trajs``).

    Returns:
        ``rollout/max_new_tokens_cut_fraction``: share of episodes whose last model turn ended at
        ``rollout.max_new_tokens`` (``info["length_capped"]``, the engine's ``finish_reason ==
        "length"``); ``rollout/truncated_fraction``: that share plus the episodes the
        ``rollout.max_total_tokens`` budget ended (``finish_reason == "max_total_tokens"``).
    """
    total = FinishReason.MAX_TOTAL_TOKENS.value
    by_total = [split_finish(t.finish_reason)[0] == total for t in trajs]
    by_new = [bool(t.info.get(LENGTH_CAPPED)) and not cut for t, cut in zip(trajs, by_total, strict=True)]
    n = len(trajs)
    return {"rollout/max_new_tokens_cut_fraction": sum(by_new) / n,
            "rollout/truncated_fraction": (sum(by_new) + sum(by_total)) / n}


def rollout_time_metrics(trajs: list[Trajectory]) -> dict[str, float]:
    """Where the step's rollout time went: ``time/rollout_{llm,env,other}_s``.

    Each is the **sum over the step's episodes** of that episode's ``info["llm_s"]`` /
    ``["env_s"]`` / ``["other_s"]`` (seconds, :class:`~trainer.rollout.timing.EpisodeClock`):
    episode-seconds, not the step's wall time, since episodes overlap (they run concurrently,
    and asynchronously with training). Their ratio says what rollouts wait on: ``env_s`` ≫
    ``llm_s`` means the tools (sandbox, retriever, remote env) are the bottleneck. Episodes
    without timings (none recorded) count 0; empty when no episode has any.
    """
    if not any(k in t.info for t in trajs for k in TIME_KEYS):
        return {}
    return {f"time/rollout_{k}": float(sum(float(t.info.get(k, 0.0)) for t in trajs)) for k in TIME_KEYS}
