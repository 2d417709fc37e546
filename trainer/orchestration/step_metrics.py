"""Per-step rollout metrics of the training loop (``rollout/*``, ``staleness/per_token``)."""

from __future__ import annotations

from typing import Any

from ..rollout.timing import TIME_KEYS
from ..rollout.trajectory import Trajectory, split_finish


def dropped_metrics(dropped: list[Trajectory]) -> dict[str, float]:
    """Mean response length (model tokens) and reward of the groups dropped as stale since
    the last step, next to the trained ones' ``rollout/model_tokens`` / ``reward_mean`` (a
    length bias from dropping is visible). Empty when nothing was dropped."""
    if not dropped:
        return {}
    n = len(dropped)
    return {"rollout/dropped_stale_len": sum(t.num_model_tokens for t in dropped) / n,
            "rollout/dropped_stale_reward": sum(t.reward for t in dropped) / n}


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
        ``rollout/finish_<reason>`` fractions, ``time/rollout_llm_s``, ``time/rollout_env_s``,
        ``time/rollout_other_s`` (:func:`rollout_time_metrics`), and ``staleness/per_token``: a
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
           "rollout/accuracy": sum(r > 0.5 for r in rewards) / n,
           "rollout/response_tokens": sum(len(t.response_ids) for t in trajs) / n,
           "rollout/model_tokens": sum(t.num_model_tokens for t in trajs) / n,
           "rollout/turns": sum(t.turns for t in trajs) / n,
           "rollout/tool_calls": sum(float(t.info.get("tool_calls", 0)) for t in trajs) / n,
           "rollout/invalid_action_rate": (sum(float(t.info.get("invalid_actions", 0)) for t in trajs)
                                           / max(1, sum(t.turns for t in trajs))),
           "rollout/episodes": float(n)}
    out.update({f"rollout/finish_{k}": v / n for k, v in reasons.items()})
    out.update(rollout_time_metrics(trajs))
    if vers:
        out["staleness/per_token"] = [version - 1 - v for v in vers]  # type: ignore[assignment]
    return out


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
