"""Evaluation of a policy on held-out samples through the real agent loop.

:func:`evaluate` plays ``k`` episodes per sample with the shared group runner
(:func:`trainer.rollout.groups.run_group`: engine × real environment, the training seed rule)
and reports accuracy / avg@k and episode statistics.

Greedy decoding: ``temperature == 0`` is run as ``SamplingParams(temperature=1.0, top_k=1)``:
sampling from the single most likely token is argmax decoding, and the reported behavior
log-probs (irrelevant for evaluation) stay those of ``softmax(logits)``.
"""

from __future__ import annotations

import asyncio
import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .engines.base import InferenceEngine, SamplingParams
from .rollout.agent_loop import AgentLoopConfig
from .rollout.groups import EnvPool, run_group
from .rollout.trajectory import Trajectory

#: An episode counts as correct when its reward exceeds this (1/0 and DAPO's 1/-1 rewards).
CORRECT_THRESHOLD = 0.5


def eval_sampling_params(temperature: float, max_new_tokens: int, top_p: float = 1.0,
                         seed: int | None = None) -> SamplingParams:
    """Sampling parameters of evaluation: greedy (``top_k = 1`` at temperature 1) when
    ``temperature == 0``, else plain sampling at ``temperature``.

    Raises:
        ValueError: ``temperature < 0`` (or invalid ``SamplingParams`` fields).
    """
    if temperature < 0 or math.isnan(temperature):
        raise ValueError(f"evaluate: temperature={temperature!r} must be >= 0 (0 = greedy)")
    if temperature == 0:
        return SamplingParams(temperature=1.0, top_k=1, max_new_tokens=max_new_tokens, seed=seed)
    return SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens, seed=seed)


async def run_eval_episodes(engine: InferenceEngine, env_factory: Callable[[], Any], tokenizer: Any,
                            samples: Sequence[Mapping[str, Any]], *, k: int = 1,
                            temperature: float = 0.0, agent_cfg: AgentLoopConfig | None = None,
                            max_new_tokens: int = 256, concurrency: int = 32,
                            seed: int | None = None, progress: bool = False) -> list[Trajectory]:
    """Play ``k`` episodes per sample with the shared group runner
    (:func:`trainer.rollout.groups.run_group`): sample ``i`` is prompt draw ``i``, so its
    episode ``j`` samples with seed ``seed + 7919·i + j`` (the training seed rule).
    Environments are pooled (at most ``concurrency``, each reset per episode, closed at the
    end — reward helpers are started once per env).

    Returns:
        Trajectories ordered ``(sample 0, copy 0), (sample 0, copy 1), ...``.

    Raises:
        ValueError: ``k < 1``, ``concurrency < 1``, no samples, or a bad temperature.
        RuntimeError: the environment raised on an episode (``env_error``: a bug); episodes
            ended by an infrastructure failure are returned (and excluded by :func:`summarize`).
    """
    from tqdm.auto import tqdm

    if not isinstance(k, int) or k < 1:
        raise ValueError(f"evaluate: k={k!r} must be an int >= 1")
    if not isinstance(concurrency, int) or concurrency < 1:
        raise ValueError(f"evaluate: concurrency={concurrency!r} must be an int >= 1")
    if not samples:
        raise ValueError("evaluate: samples is empty")
    sampling = eval_sampling_params(temperature, max_new_tokens, seed=seed)
    pool = EnvPool(env_factory, min(concurrency, len(samples) * k))
    bar = tqdm(total=len(samples) * k, desc="eval", disable=not progress, leave=False)

    async def one(i: int, sample: Mapping[str, Any]) -> list[Trajectory]:
        group = await run_group(engine, pool, tokenizer, sample, k, sampling, agent_cfg, uid=i,
                                group_id=sample.get("id", i))
        bar.update(k)
        return group

    try:
        groups = await asyncio.gather(*(one(i, s) for i, s in enumerate(samples)))
    finally:
        bar.close()
        await pool.close()
    trajs = [t for g in groups for t in g]
    broken = [t for t in trajs if t.env_failed]
    if broken:  # a bug in the environment, not a wrong answer nor an infrastructure failure
        raise RuntimeError(f"evaluation: the environment raised on {len(broken)} of {len(trajs)} episodes; "
                           f"first (sample {broken[0].sample_id!r}): {broken[0].finish_reason}")
    return trajs


def summarize(trajectories: Sequence[Trajectory], k: int) -> dict[str, float]:
    """Metrics of ``n * k`` trajectories ordered by sample then copy (see :func:`evaluate`).

    Episodes ended by an infrastructure failure (:attr:`Trajectory.infra_failed`: sandbox,
    retriever, reward checker or engine failure) are not wrong answers: they are excluded from
    every metric and counted in ``infra_failed``; a problem whose ``k`` episodes all failed that
    way is excluded from the per-problem metrics (``n`` counts the problems scored).

    Returns:
        ``accuracy`` = ``avg@k`` (mean over scored problems of the fraction of their scored
        episodes with reward > 0.5), ``pass@k`` (fraction of scored problems with at least one),
        ``mean_reward``, ``em`` (mean exact match from the env's ``reward_components["em"]``;
        search only), ``n`` (problems scored), ``episodes`` (episodes scored),
        ``infra_failed`` (episodes excluded), ``mean_turns`` (model turns per episode),
        ``tool_call_rate`` (fraction of episodes with >= 1 executed tool call),
        ``mean_tool_calls``, ``mean_response_tokens`` (model tokens per episode), and
        ``finish/<reason>`` (fraction of all episodes, failed ones included; errors grouped by
        their prefix). With no scored episode at all the rates are NaN.

    Raises:
        ValueError: if the number of trajectories is not a positive multiple of ``k``.
    """
    m_all = len(trajectories)
    if k < 1 or m_all == 0 or m_all % k:
        raise ValueError(f"summarize: {m_all} trajectories is not a positive multiple of k={k}")
    groups = [[t for t in trajectories[i * k:(i + 1) * k] if not t.infra_failed] for i in range(m_all // k)]
    groups = [g for g in groups if g]
    scored = [t for g in groups for t in g]
    m, n = len(scored), len(groups)
    nan = float("nan")

    def mean(xs: list[float], d: int) -> float:
        return sum(xs) / d if d else nan

    correct = [[t.reward > CORRECT_THRESHOLD for t in g] for g in groups]
    avg = mean([sum(c) / len(c) for c in correct], n)
    out = {"accuracy": avg, f"avg@{k}": avg, f"pass@{k}": mean([float(any(c)) for c in correct], n),
           "mean_reward": mean([t.reward for t in scored], m),
           "n": float(n), "episodes": float(m), "infra_failed": float(m_all - m),
           "mean_turns": mean([t.turns for t in scored], m),
           "tool_call_rate": mean([float(t.info.get("tool_calls", 0) > 0) for t in scored], m),
           "mean_tool_calls": mean([t.info.get("tool_calls", 0) for t in scored], m),
           "mean_response_tokens": mean([t.num_model_tokens for t in scored], m)}
    ems = [t.info.get("reward_components", {}).get("em") for t in scored]
    if any(e is not None for e in ems):
        out["em"] = mean([float(e or 0.0) for e in ems], m)
    reasons = Counter(t.finish_reason.split(":")[0] for t in trajectories)
    out.update({f"finish/{r}": c / m_all for r, c in sorted(reasons.items())})
    return out


async def evaluate(engine: InferenceEngine, env_factory: Callable[[], Any], tokenizer: Any,
                   samples: Sequence[Mapping[str, Any]], *, k: int = 1, temperature: float = 0.0,
                   agent_cfg: AgentLoopConfig | None = None, max_new_tokens: int = 256,
                   concurrency: int = 32, seed: int | None = None,
                   progress: bool = False) -> dict[str, float]:
    """Evaluate ``engine``'s policy on ``samples``: ``k`` episodes each, real environments.

    Greedy when ``temperature == 0`` (``SamplingParams(temperature=1.0, top_k=1)``; then k > 1
    repeats the same episode). An episode is correct when its reward > 0.5; episodes that end
    by a budget count as incorrect; episodes ended by an infrastructure failure (engine,
    sandbox, retriever, reward checker) are excluded from the metrics and counted in
    ``infra_failed`` (never scored 0).

    Args:
        engine: inference engine holding the policy to evaluate.
        env_factory: ``() -> env`` (a fresh environment; a pool of them is reused).
        tokenizer: the policy's tokenizer.
        samples: data rows (e.g. held-out problems).
        k: episodes per sample (avg@k / pass@k).
        temperature: 0 = greedy, else sampling temperature.
        agent_cfg: :class:`AgentLoopConfig` (turn / token budgets).
        max_new_tokens: most tokens per model turn.
        concurrency: episodes in flight (and environments created).
        seed: per-episode sampling seeds ``seed + copy`` (None: engine RNG).
        progress: show a tqdm bar.

    Returns:
        The metrics of :func:`summarize` (all floats).
    """
    trajs = await run_eval_episodes(engine, env_factory, tokenizer, samples, k=k,
                                    temperature=temperature, agent_cfg=agent_cfg,
                                    max_new_tokens=max_new_tokens, concurrency=concurrency,
                                    seed=seed, progress=progress)
    return summarize(trajs, k)
