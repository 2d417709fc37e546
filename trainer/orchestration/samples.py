"""The per-step training samples ``copc view`` shows: a few trained episodes with their per-token
tensors, as the learner saw them (``samples/step_N.jsonl``, :mod:`trainer.outputs.viewer.samples`).

For each sampled episode: the decoded prompt, one decoded piece per response token, and per token
the loss mask, the advantage the step used, and the off-policy ratio ρ = π_old/µ =
``exp(logp_old − logp_mu)`` (the learner's recomputed log-prob before the update over the
behaviour log-prob; 1 off model tokens), with the preset's channel intervals: the policy
channel's (ℓ_P, u_P) — a model token with ρ outside it is *masked* by DIS — and the advantage
channel's (ℓ_A, u_A) — ρ outside it is *clipped* in the coupled advantages.
"""

from __future__ import annotations

import math
from typing import Any

from ..rollout.trajectory import Trajectory


def sampled_rows(n_rows: int, k: int) -> list[int]:
    """``min(k, n_rows)`` batch rows spread evenly over ``0..n_rows-1`` (first and last included)."""
    if k <= 0 or n_rows <= 0:
        return []
    if k >= n_rows:
        return list(range(n_rows))
    if k == 1:
        return [0]
    return sorted({round(i * (n_rows - 1) / (k - 1)) for i in range(k)})


def _r(v: float) -> float | None:
    """A float for JSON: 4 significant digits; None when not finite."""
    return float(f"{v:.4g}") if math.isfinite(v) else None


def step_samples(step: int, trajs: list[Trajectory], learner: Any, tokenizer: Any, k: int) -> list[dict]:
    """The sample records of one trained step.

    Args:
        step: the step just trained (its number after the update).
        trajs: the step's trajectories in batch order (row ``i`` of the learner's tensors).
        learner: the learner that trained them; its ``last_step_inputs`` (``logp_old``,
            ``advantages``: ``(B, T)``) and ``algorithm`` intervals are read. A learner without
            them (e.g. one hosted in another process) gives no samples.
        tokenizer: decodes the prompt and each response token.
        k: episodes to sample.

    Returns:
        One dict per sampled episode (``[]`` when the learner exposes no step tensors).
    """
    x = getattr(learner, "last_step_inputs", None)
    algo = getattr(learner, "algorithm", None)
    if x is None or algo is None or x.advantages.shape[0] != len(trajs):
        return []
    rows = sampled_rows(len(trajs), k)
    adv = x.advantages[rows].detach().float().cpu()
    lp_old = x.logp_old[rows].detach().float().cpu()
    policy_iv, adv_iv = algo.policy_channel_interval(), algo.advantage_channel_interval()
    out = []
    for j, i in enumerate(rows):
        t = trajs[i]
        n = len(t.response_ids)
        pieces = tokenizer.batch_decode([[tid] for tid in t.response_ids], skip_special_tokens=False)
        ratio = [_r(math.exp(float(lp_old[j, p]) - t.logp_mu[p])) if t.loss_mask[p] else 1.0
                 for p in range(n)]
        out.append({
            "step": step, "sample_id": t.sample_id, "uid": t.info.get("uid"),
            "episode": t.info.get("episode"),
            "reward": float(t.reward), "finish_reason": t.finish_reason, "turns": t.turns,
            "tool_calls": int(t.info.get("tool_calls", 0)),
            **{k2: _r(float(t.info[k2])) for k2 in ("llm_s", "env_s", "other_s") if k2 in t.info},
            "prompt": tokenizer.decode(t.prompt_ids, skip_special_tokens=False),
            "tokens": pieces, "loss_mask": [int(m) for m in t.loss_mask],
            "advantage": [_r(float(adv[j, p])) if t.loss_mask[p] else 0.0 for p in range(n)],
            "ratio": ratio, "versions": list(t.versions),
            "policy_interval": None if policy_iv is None else [float(v) for v in policy_iv],
            "advantage_interval": None if adv_iv is None else [float(v) for v in adv_iv]})
    return out


__all__ = ["sampled_rows", "step_samples"]
