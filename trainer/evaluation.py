"""Evaluation of a policy on held-out samples through the real agent loop.

:func:`evaluate` plays ``k`` episodes per sample with the shared group runner
(:func:`trainer.rollout.groups.run_group`: engine × real environment, the training seed rule)
and reports accuracy / avg@k and episode statistics, with 95 % confidence intervals of
accuracy and exact match (:func:`summarize`). :func:`episode_records` turns the episodes into
per-question records (written as JSONL by :func:`write_records`), and :func:`paired_difference`
compares two evaluations of the same questions (paired bootstrap of the per-question change).

Greedy decoding: ``temperature == 0`` is run as ``SamplingParams(temperature=1.0, top_k=1)``:
sampling from the single most likely token is argmax decoding, and the reported behavior
log-probs (irrelevant for evaluation) stay those of ``softmax(logits)``.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .engines.base import InferenceEngine, SamplingParams
from .evaluate.metrics import bootstrap_ci
from .metrics_log import _atomic_write_text
from .rollout.agent_loop import AgentLoopConfig
from .rollout.groups import EnvPool, run_group
from .rollout.trajectory import Trajectory

#: An episode counts as correct when its reward exceeds this (1/0 and DAPO's 1/-1 rewards).
CORRECT_THRESHOLD = 0.5
#: Two-sided 95 % standard normal quantile, Φ⁻¹(0.975).
Z95 = 1.959963984540054
#: Per-question record files of ``copc train`` under ``<output_dir>/eval/``.
BEFORE_RL, AFTER_RL = "before_rl", "after_rl"


def wilson_interval(p_hat: float, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion (Wilson 1927, JASA 22:209, eq. of the
    "probable inference" limits):

    ``(p̂ + z²/2n ± z·sqrt(p̂(1 − p̂)/n + z²/4n²)) / (1 + z²/n)``.

    Unlike the normal (Wald) interval it stays inside [0, 1] and is not degenerate at 0/n or
    n/n (0/n gives ``[0, z²/(n + z²)]``, n/n gives ``[n/(n + z²), 1]``).

    Args:
        p_hat: observed proportion of successes in [0, 1] (successes / n).
        n: number of trials (problems scored); 0 gives ``(nan, nan)``.
        z: standard normal quantile (default :data:`Z95`, a 95 % interval).

    Returns:
        ``(low, high)`` as floats, clipped to [0, 1].

    Raises:
        ValueError: ``n < 0`` or ``p_hat`` not in [0, 1].
    """
    if n < 0:
        raise ValueError(f"wilson_interval: n={n!r} must be >= 0")
    if n == 0:
        return float("nan"), float("nan")
    if not 0.0 <= p_hat <= 1.0:
        raise ValueError(f"wilson_interval: p_hat={p_hat!r} must be in [0, 1]")
    z2 = z * z
    denom = 1.0 + z2 / n
    center = (p_hat + z2 / (2 * n)) / denom
    half = z / denom * math.sqrt(p_hat * (1.0 - p_hat) / n + z2 / (4 * n * n))
    return max(0.0, center - half), min(1.0, center + half)


def normal_mean_interval(values: Sequence[float], z: float = Z95) -> tuple[float, float]:
    """Normal-approximation (z, not Student t) interval of the mean of per-problem scores in
    [0, 1]: ``mean ± z · s / sqrt(n)`` with ``s`` the sample standard deviation (ddof = 1),
    clipped to [0, 1]. Used for avg@k with k > 1, whose per-problem values are not 0/1.

    With n < 30 problems the z quantile makes the interval slightly too narrow (the t
    quantile would be wider); when every problem has the same score ``s = 0`` and the interval
    collapses to a point.

    Args:
        values: per-problem scores (e.g. each problem's fraction of correct copies).
        z: standard normal quantile (default :data:`Z95`).

    Returns:
        ``(low, high)`` floats; ``(nan, nan)`` with fewer than 2 values.
    """
    n = len(values)
    if n < 2:
        return float("nan"), float("nan")
    arr = np.asarray(values, dtype=np.float64)
    mean, half = float(arr.mean()), z * float(arr.std(ddof=1)) / math.sqrt(n)
    return max(0.0, mean - half), min(1.0, mean + half)


def _ci95(per_problem: list[float], k: int) -> tuple[float, float]:
    if k == 1:  # per-problem 0/1 outcomes: a binomial proportion over the problems scored
        n = len(per_problem)
        return wilson_interval(sum(per_problem) / n if n else 0.0, n)
    return normal_mean_interval(per_problem)


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


def _em(t: Trajectory) -> float | None:
    """The env's exact match of an episode (``reward_components["em"]``), None when not given."""
    em = (t.info.get("reward_components") or {}).get("em")
    return None if em is None else float(em)


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
        ``mean_tool_calls``, ``mean_response_tokens`` (model tokens per episode),
        ``invalid_action_rate`` (share of model turns the environment rejected as invalid), and
        ``finish/<reason>`` (fraction of all episodes, failed ones included; errors grouped by
        their prefix). With no scored episode at all the rates are NaN.

        95 % confidence intervals ``accuracy_ci95_low`` / ``accuracy_ci95_high`` (and
        ``em_ci95_low`` / ``em_ci95_high`` when ``em`` is reported) over the ``n`` problems
        scored: with ``k == 1`` the Wilson score interval of a proportion (per-problem 0/1;
        :func:`wilson_interval`, Wilson 1927, JASA 22:209); with ``k > 1`` the normal (z = 1.96)
        interval of the mean of the per-problem avg@k (:func:`normal_mean_interval`), clipped
        to [0, 1] — for ``em`` around the mean of per-problem EM, which equals ``em`` unless
        some of a problem's episodes failed. NaN when ``n == 0`` (or ``n < 2`` with k > 1).

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
    per_problem = [sum(c) / len(c) for c in correct]
    avg = mean(per_problem, n)
    out = {"accuracy": avg, f"avg@{k}": avg, f"pass@{k}": mean([float(any(c)) for c in correct], n),
           "mean_reward": mean([t.reward for t in scored], m),
           "n": float(n), "episodes": float(m), "infra_failed": float(m_all - m),
           "mean_turns": mean([t.turns for t in scored], m),
           "tool_call_rate": mean([float(t.info.get("tool_calls", 0) > 0) for t in scored], m),
           "mean_tool_calls": mean([t.info.get("tool_calls", 0) for t in scored], m),
           "mean_response_tokens": mean([t.num_model_tokens for t in scored], m),
           "invalid_action_rate": mean([float(t.info.get("invalid_actions", 0)) for t in scored],
                                       sum(t.turns for t in scored))}
    out["accuracy_ci95_low"], out["accuracy_ci95_high"] = _ci95(per_problem, k)
    ems = [_em(t) for t in scored]
    if any(e is not None for e in ems):
        out["em"] = mean([float(e or 0.0) for e in ems], m)
        em_per_problem = [sum(float(_em(t) or 0.0) for t in g) / len(g) for g in groups]
        out["em_ci95_low"], out["em_ci95_high"] = _ci95(em_per_problem, k)
    reasons = Counter(t.finish_reason.split(":")[0] for t in trajectories)
    out.update({f"finish/{r}": c / m_all for r, c in sorted(reasons.items())})
    return out


async def evaluate(engine: InferenceEngine, env_factory: Callable[[], Any], tokenizer: Any,
                   samples: Sequence[Mapping[str, Any]], *, k: int = 1, temperature: float = 0.0,
                   agent_cfg: AgentLoopConfig | None = None, max_new_tokens: int = 256,
                   concurrency: int = 32, seed: int | None = None,
                   progress: bool = False, records_out: list | None = None) -> dict[str, float]:
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
        records_out: if given, the per-episode records of :func:`episode_records` are appended
            to it (the return value stays the metrics dict).

    Returns:
        The metrics of :func:`summarize` (all floats).
    """
    trajs = await run_eval_episodes(engine, env_factory, tokenizer, samples, k=k,
                                    temperature=temperature, agent_cfg=agent_cfg,
                                    max_new_tokens=max_new_tokens, concurrency=concurrency,
                                    seed=seed, progress=progress)
    if records_out is not None:
        records_out.extend(episode_records(trajs, k))
    return summarize(trajs, k)


def episode_records(trajectories: Sequence[Trajectory], k: int) -> list[dict[str, Any]]:
    """One JSON-able record per episode of ``n * k`` trajectories ordered by sample then copy.

    Fields: ``sample_id`` (the data row's ``id``, may be None), ``sample_index`` (position in
    the evaluated samples), ``copy`` (0..k-1), ``reward``, ``correct`` (reward > 0.5),
    ``em`` (the env's ``reward_components["em"]``, None when it gives none — e.g. an episode
    cut before it answered), ``tool_calls``, ``turns`` (model turns), ``invalid_actions``
    (turns the env rejected), ``response_tokens``, ``finish_reason``, ``final_answer`` (the
    env's parsed answer, or None) and ``infra_failed`` (excluded from every metric).

    Raises:
        ValueError: if the number of trajectories is not a positive multiple of ``k``.
    """
    if k < 1 or not trajectories or len(trajectories) % k:
        raise ValueError(f"episode_records: {len(trajectories)} trajectories is not a positive multiple "
                         f"of k={k}")
    return [{"sample_id": t.sample_id, "sample_index": i // k, "copy": i % k, "reward": float(t.reward),
             "correct": bool(t.reward > CORRECT_THRESHOLD), "em": _em(t),
             "tool_calls": int(t.info.get("tool_calls", 0)), "turns": int(t.turns),
             "invalid_actions": int(t.info.get("invalid_actions", 0)),
             "response_tokens": int(t.num_model_tokens), "finish_reason": t.finish_reason,
             "final_answer": t.info.get("final_answer"), "infra_failed": bool(t.infra_failed)}
            for i, t in enumerate(trajectories)]


def write_records(path: str | Path, records: Sequence[Mapping[str, Any]]) -> Path:
    """Write ``records`` as JSON lines to ``path`` atomically (temporary sibling, fsync, rename);
    the parent directory is created. Values that are not JSON types are written as ``str``.

    Returns:
        The path written.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _atomic_write_text(path, "".join(json.dumps(dict(r), default=str) + "\n" for r in records))
    return path


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """The records of a file written by :func:`write_records`.

    Raises:
        FileNotFoundError: no such file.
        ValueError: a line is not JSON (the message names the file and line).
    """
    path = Path(path)
    out = []
    for no, line in enumerate(path.read_text().splitlines(), 1):
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{no}: not a JSON record ({e})") from None
    return out


def _per_question(records: Sequence[Mapping[str, Any]], key: str) -> dict[str, float]:
    """Mean of ``key`` over each question's scored copies (``accuracy`` reads ``correct``;
    None counts 0, as in :func:`summarize`), keyed by the canonical JSON of ``sample_id``
    (records with no id are keyed by ``sample_index``)."""
    field = "correct" if key == "accuracy" else key
    values: dict[str, list[float]] = defaultdict(list)
    for r in records:
        if r.get("infra_failed"):
            continue
        sid = r.get("sample_id")
        qid = json.dumps(["id", sid] if sid is not None else ["index", r.get("sample_index")], default=str)
        values[qid].append(float(r.get(field) or 0.0))
    return {q: sum(v) / len(v) for q, v in values.items()}


def paired_difference(before_records: Sequence[Mapping[str, Any]], after_records: Sequence[Mapping[str, Any]],
                      key: str = "em", n_boot: int = 10000, seed: int = 0) -> dict[str, Any]:
    """Paired change of a per-question metric between two evaluations of the same questions.

    Each question's score is the mean of ``key`` over its copies (episodes that ended by an
    infrastructure failure are left out; ``None`` counts 0, as in :func:`summarize`); only
    questions present in both (matched by ``sample_id``, else ``sample_index``) count. The
    interval is the 95 % percentile bootstrap of the mean of the per-question differences,
    resampling questions (Efron & Tibshirani 1993, *An Introduction to the Bootstrap*,
    ch. 13; :func:`trainer.evaluate.metrics.bootstrap_ci`): pairing removes the between-question
    variance that two separate intervals would double count.

    Args:
        before_records / after_records: records of :func:`episode_records` (or read back).
        key: a record field (``em``, ``reward``, ...) or ``accuracy`` (reads ``correct``).
        n_boot: bootstrap resamples (>= 1).
        seed: seed of the numpy generator (the result is deterministic for a seed).

    Returns:
        ``{"metric": key, "mean": after − before, "ci95_low", "ci95_high", "n": questions
        paired}``; mean and interval are NaN when no question is in both.

    Raises:
        ValueError: ``n_boot < 1``.
    """
    if not isinstance(n_boot, int) or n_boot < 1:
        raise ValueError(f"paired_difference: n_boot={n_boot!r} must be an int >= 1")
    before, after = _per_question(before_records, key), _per_question(after_records, key)
    common = sorted(set(before) & set(after))
    diffs = np.array([after[q] - before[q] for q in common], dtype=np.float64)
    if not common:
        nan = float("nan")
        return {"metric": key, "mean": nan, "ci95_low": nan, "ci95_high": nan, "n": 0}
    low, high = bootstrap_ci(diffs, n_boot=n_boot, seed=seed)
    return {"metric": key, "mean": float(diffs.mean()), "ci95_low": low, "ci95_high": high, "n": len(common)}


def eval_delta(eval_dir: str | Path, n_boot: int = 10000, seed: int = 0) -> dict[str, Any] | None:
    """``copc train``'s ``eval_delta``: :func:`paired_difference` of ``<eval_dir>/after_rl.jsonl``
    against ``<eval_dir>/before_rl.jsonl`` for ``em`` when the records give it (search tasks),
    else ``accuracy``. None when either file is missing (e.g. a run resumed from a checkpoint
    written before these files existed).
    """
    files = [Path(eval_dir) / f"{name}.jsonl" for name in (BEFORE_RL, AFTER_RL)]
    if not all(f.exists() for f in files):
        return None
    before, after = (read_records(f) for f in files)
    has_em = any(r.get("em") is not None for r in before) and any(r.get("em") is not None for r in after)
    return paired_difference(before, after, key="em" if has_em else "accuracy", n_boot=n_boot, seed=seed)
