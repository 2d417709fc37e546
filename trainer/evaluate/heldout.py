"""``copc train``'s held-out evaluation, a run of the evaluation core on the task's held-out set.

:func:`evaluate_held_out` plays ``task.eval_samples`` through :func:`trainer.evaluate.runner.run_benchmark`
(the same loop, seeds and records as ``copc eval``; benchmark name :data:`HELD_OUT`, the kind
inferred from the rows), writes the records atomically to ``<output_dir>/eval/<name>.jsonl`` and
returns :func:`summarize_records`: accuracy / avg@k / pass@k and episode statistics, with 95 %
intervals of accuracy and exact match (Wilson for k = 1, Wilson at the effective sample size for
k > 1; :mod:`trainer.evaluate.stats`). :func:`eval_delta` compares the records after RL with those
before (:func:`paired_difference`, a paired bootstrap of the per-question change).

:func:`evaluate`, :func:`run_eval_episodes`, :func:`summarize` and :func:`episode_records` are
the same core for callers holding an engine, an env factory and rows (tests, warm-start checks).
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..engines.base import InferenceEngine
from ..rollout.agent_loop import AgentLoopConfig
from ..rollout.trajectory import Trajectory, split_finish
from .kinds import BenchmarkKind, kind_of_row, make_kind
from .records import is_failed, read_records, record_of, score_value, write_records
from .runner import BenchmarkJob, EvalSettings, play_benchmark, run_benchmark, run_benchmark_with_bar
from .stats import paired_bootstrap, proportion_or_mean_interval

if TYPE_CHECKING:
    from ..config.specs import HeldOutSpec

#: An episode counts towards ``accuracy`` when its reward exceeds this (1/0 and DAPO's 1/-1 rewards).
CORRECT_THRESHOLD = 0.5
#: Per-question record files of ``copc train`` under ``<output_dir>/eval/``.
BEFORE_RL, AFTER_RL = "before_rl", "after_rl"
#: The benchmark name of ``copc train``'s held-out records.
HELD_OUT = "held_out"
#: Episodes in flight of ``copc train``'s held-out evaluation.
HELD_OUT_CONCURRENCY = 32


def kind_of_rows(rows: Sequence[Mapping[str, Any]]) -> BenchmarkKind:
    """The kind scoring a task's held-out rows: :func:`~trainer.evaluate.kinds.kind_of_row` of
    the first row (QA rows, with ``golden_answers``: ``qa``), else ``math`` (reward > 0.5)."""
    return make_kind((kind_of_row(rows[0]) if rows else None) or "math")


def _check(n: int, k: int, what: str) -> None:
    if not isinstance(k, int) or k < 1 or n == 0 or n % k:
        raise ValueError(f"{what}: {n} trajectories is not a positive multiple of k={k}")


def episode_records(trajectories: Sequence[Trajectory], k: int,
                    kind: BenchmarkKind | None = None) -> list[dict[str, Any]]:
    """One record (:class:`~trainer.evaluate.records.EpisodeRecord`, as a dict) per episode of
    ``n * k`` trajectories ordered by sample then copy: ``sample_index = i // k``,
    ``episode = i % k``; no tokenizer, so ``prompt`` / ``response`` / ``turns_text`` are None.

    Args:
        kind: scores the episodes (default ``math``: correct = reward > 0.5, the environment's
            ``reward_components`` as ``score_components``).

    Raises:
        ValueError: if the number of trajectories is not a positive multiple of ``k``.
    """
    _check(len(trajectories), k, "episode_records")
    kind = kind or make_kind("math")
    out = []
    for i, t in enumerate(trajectories):
        rec = record_of(t, kind, index=i // k)
        rec.episode = i % k
        out.append(rec.to_json())
    return out


def _mean(xs: Sequence[float], d: int) -> float:
    return sum(xs) / d if d else float("nan")


def summarize_records(records: Sequence[Mapping[str, Any]], k: int) -> dict[str, float]:
    """The held-out metrics of the records of one evaluation (``k`` episodes per question).

    Failed records (infrastructure failures) are excluded from every metric and counted in
    ``infra_failed``; a question all of whose episodes failed is excluded from the per-question
    metrics (``n`` counts the questions scored).

    Returns:
        ``accuracy`` = ``avg@k`` (mean over scored questions of the fraction of their scored
        episodes with reward > 0.5), ``pass@k`` (fraction of scored questions with at least one),
        ``mean_reward``, ``em`` (mean exact match, the ``em`` score component; only when the
        records give one), ``n``, ``episodes`` (scored), ``infra_failed``, ``mean_turns``,
        ``tool_call_rate`` (fraction of episodes with >= 1 tool call), ``mean_tool_calls``,
        ``mean_response_tokens``, ``answer_rate`` (fraction of episodes whose final answer the kind
        extracted, e.g. a ``\\boxed{}``), ``invalid_action_rate`` (share of model turns the environment
        rejected) and ``finish/<reason>`` (fraction of all episodes, failed ones included;
        grouped by the part before ``':'``); all floats, NaN rates with no scored episode.
        ``accuracy_ci95_low`` / ``_high`` (and ``em_ci95_low`` / ``_high``):
        :func:`~trainer.evaluate.stats.proportion_or_mean_interval` of the per-question values.
    """
    by_q: dict[int, list[Mapping[str, Any]]] = defaultdict(list)
    for r in sorted(records, key=lambda r: (int(r["sample_index"]), int(r.get("episode", 0)))):
        by_q[int(r["sample_index"])].append(r)
    groups = [g for g in ([r for r in by_q[q] if not is_failed(r)] for q in sorted(by_q)) if g]
    scored = [r for g in groups for r in g]
    m, n = len(scored), len(groups)
    correct = [[r["reward"] > CORRECT_THRESHOLD for r in g] for g in groups]
    per_problem = [sum(c) / len(c) for c in correct]
    avg = _mean(per_problem, n)
    out = {"accuracy": avg, f"avg@{k}": avg, f"pass@{k}": _mean([float(any(c)) for c in correct], n),
           "mean_reward": _mean([r["reward"] for r in scored], m),
           "n": float(n), "episodes": float(m), "infra_failed": float(len(records) - m),
           "mean_turns": _mean([r["turns"] for r in scored], m),
           "tool_call_rate": _mean([float(r["tool_calls"] > 0) for r in scored], m),
           "mean_tool_calls": _mean([r["tool_calls"] for r in scored], m),
           "mean_response_tokens": _mean([r["response_tokens"] for r in scored], m),
           "answer_rate": _mean([float(r.get("answer") is not None) for r in scored], m),
           "invalid_action_rate": _mean([float(r.get("invalid_actions", 0)) for r in scored],
                                        sum(r["turns"] for r in scored))}
    out["accuracy_ci95_low"], out["accuracy_ci95_high"] = proportion_or_mean_interval(per_problem, k)
    if any(score_value(r, "em") is not None for r in scored):
        out["em"] = _mean([float(score_value(r, "em") or 0.0) for r in scored], m)
        em_per_problem = [sum(float(score_value(r, "em") or 0.0) for r in g) / len(g) for g in groups]
        out["em_ci95_low"], out["em_ci95_high"] = proportion_or_mean_interval(em_per_problem, k)
    reasons = Counter(split_finish(str(r["finish_reason"]))[0] for r in records)
    out.update({f"finish/{r}": c / len(records) for r, c in sorted(reasons.items())})  # failed included
    return {key: float(v) for key, v in out.items()}


def summarize(trajectories: Sequence[Trajectory], k: int) -> dict[str, float]:
    """:func:`summarize_records` of :func:`episode_records` (``n * k`` trajectories ordered by
    sample then copy).

    Raises:
        ValueError: if the number of trajectories is not a positive multiple of ``k``.
    """
    _check(len(trajectories), k, "summarize")
    return summarize_records(episode_records(trajectories, k), k)


def _job(env_factory: Callable[[], Any], samples: Sequence[Mapping[str, Any]], k: int, temperature: float,
         kind: BenchmarkKind | None) -> BenchmarkJob:
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"evaluate: k={k!r} must be an int >= 1")
    if not samples:
        raise ValueError("evaluate: samples is empty")
    return BenchmarkJob(HELD_OUT, kind or kind_of_rows(samples), list(samples), env_factory, k, temperature)


def _settings(agent_cfg: AgentLoopConfig | None, max_new_tokens: int, concurrency: int,
              seed: int | None) -> EvalSettings:
    if not isinstance(concurrency, int) or concurrency < 1:
        raise ValueError(f"evaluate: concurrency={concurrency!r} must be an int >= 1")
    return EvalSettings(seed=seed, max_new_tokens=max_new_tokens, agent=agent_cfg or AgentLoopConfig(),
                        retries=0, concurrency=concurrency)


async def run_eval_episodes(engine: InferenceEngine, env_factory: Callable[[], Any], tokenizer: Any,
                            samples: Sequence[Mapping[str, Any]], *, k: int = 1,
                            temperature: float = 0.0, agent_cfg: AgentLoopConfig | None = None,
                            max_new_tokens: int = 256, concurrency: int = 32,
                            seed: int | None = None) -> list[Trajectory]:
    """Play ``k`` episodes per sample with the evaluation core
    (:func:`~trainer.evaluate.runner.play_benchmark`, no retries) and return the trajectories.

    Returns:
        Trajectories ordered ``(sample 0, copy 0), (sample 0, copy 1), ...``.

    Raises:
        ValueError: ``k < 1``, ``concurrency < 1``, no samples, or a bad temperature.
        RuntimeError: the environment raised on an episode (``env_error``: a bug).
    """
    job, settings = _job(env_factory, samples, k, temperature, make_kind("math")), \
        _settings(agent_cfg, max_new_tokens, concurrency, seed)
    trajs: dict[tuple[int, int], Trajectory] = {}

    def keep(i: int, sample: Mapping[str, Any], tr: Trajectory, attempts: int) -> None:
        trajs[(i, int(tr.info["episode"]))] = tr

    await play_benchmark(engine, tokenizer, job, settings, keep)
    return [trajs[key] for key in sorted(trajs)]


async def evaluate(engine: InferenceEngine, env_factory: Callable[[], Any], tokenizer: Any,
                   samples: Sequence[Mapping[str, Any]], *, k: int = 1, temperature: float = 0.0,
                   agent_cfg: AgentLoopConfig | None = None, max_new_tokens: int = 256,
                   concurrency: int = 32, seed: int | None = None,
                   records_out: list | None = None) -> dict[str, float]:
    """Evaluate ``engine``'s policy on ``samples``: ``k`` episodes each through the evaluation
    core, real environments; return :func:`summarize_records` of the records.

    Greedy when ``temperature == 0``; episodes ended by an infrastructure failure are excluded
    and counted in ``infra_failed`` (never scored 0). ``records_out``, if given, receives the
    records (dicts). The kind scoring the episodes is :func:`kind_of_rows` of ``samples``.

    Raises:
        ValueError / RuntimeError: as :func:`run_eval_episodes`.
    """
    job, settings = _job(env_factory, samples, k, temperature, None), \
        _settings(agent_cfg, max_new_tokens, concurrency, seed)
    records = await run_benchmark(engine, tokenizer, job, settings)
    if records_out is not None:
        records_out.extend(records)
    return summarize_records(records, k)


async def evaluate_held_out(spec: HeldOutSpec, engine: InferenceEngine, task: Any, tokenizer: Any,
                            name: str) -> dict[str, float]:
    """``copc train``'s held-out evaluation: ``task.eval_samples`` with ``spec.k`` episodes each
    at ``spec.temperature``, seed ``spec.seed``, the rollout budgets; records (each with the
    row's gold answer, as ``copc eval``'s) written atomically to
    ``<spec.output_dir>/eval/<name>.jsonl`` (ordered by question, then episode); a progress bar
    with its ETA (``eval <name>``) while it runs, unless ``spec.progress`` is off.

    Args:
        spec: what to run (:func:`trainer.config.specs.held_out_spec` of the experiment config).
        engine: the policy. task: the started task (``eval_samples``, ``make_env``, ``episode``).
        tokenizer: the policy's tokenizer. name: the record file's stem (``before_rl``, ...).

    Returns:
        :func:`summarize_records` of the records.

    Raises:
        ValueError: a negative temperature. RuntimeError: the environment raised (a bug).
    """
    job = BenchmarkJob(HELD_OUT, getattr(task, "benchmark_kind", None) or kind_of_rows(task.eval_samples),
                       list(task.eval_samples), task.make_env, spec.k, spec.temperature, task.episode())
    settings = EvalSettings(seed=spec.seed, max_new_tokens=spec.max_new_tokens, agent=spec.agent, retries=0,
                            concurrency=HELD_OUT_CONCURRENCY)
    records = await run_benchmark_with_bar(engine, tokenizer, job, settings, show=spec.progress,
                                           desc=f"eval {name}")  # ordered by question, then episode
    write_records(Path(spec.output_dir) / "eval" / f"{name}.jsonl", records)
    return summarize_records(records, spec.k)


def _per_question(records: Sequence[Mapping[str, Any]], key: str) -> dict[str, float]:
    """Mean of ``key`` over each question's scored episodes (``accuracy`` reads ``correct``;
    None counts 0), keyed by the canonical JSON of ``sample_id`` (else ``sample_index``)."""
    field = "correct" if key == "accuracy" else key
    values: dict[str, list[float]] = defaultdict(list)
    for r in records:
        if is_failed(r):
            continue
        sid = r.get("sample_id")
        qid = json.dumps(["id", sid] if sid is not None else ["index", r.get("sample_index")], default=str)
        values[qid].append(float(score_value(r, field) or 0.0))
    return {q: sum(v) / len(v) for q, v in values.items()}


def paired_difference(before_records: Sequence[Mapping[str, Any]], after_records: Sequence[Mapping[str, Any]],
                      key: str = "em", n_boot: int = 10000, seed: int = 0) -> dict[str, Any]:
    """Paired change of a per-question metric between two evaluations of the same questions.

    Each question's score is the mean of ``key`` over its episodes (failed ones left out; None
    counts 0); questions are matched by ``sample_id`` (else ``sample_index``), and only those
    in both count. The interval: :func:`~trainer.evaluate.stats.paired_bootstrap`.

    Args:
        before_records / after_records: records (read back, or of :func:`episode_records`).
        key: a record field or score component (``em``, ``reward``, ...) or ``accuracy``
            (reads ``correct``).
        n_boot: bootstrap resamples (>= 1). seed: the numpy generator's seed.

    Returns:
        ``{"metric": key, "mean": after − before, "ci95_low", "ci95_high", "n": questions paired}``.

    Raises:
        ValueError: ``n_boot < 1``.
    """
    paired = paired_bootstrap(_per_question(before_records, key), _per_question(after_records, key),
                              n_boot=n_boot, seed=seed)
    return {"metric": key, **paired}


def eval_delta(eval_dir: str | Path, n_boot: int = 10000, seed: int = 0) -> dict[str, Any] | None:
    """``copc train``'s ``eval_delta``: :func:`paired_difference` of ``<eval_dir>/after_rl.jsonl``
    against ``<eval_dir>/before_rl.jsonl`` for ``em`` when both give it (QA tasks), else
    ``accuracy``. None when either file is missing."""
    files = [Path(eval_dir) / f"{name}.jsonl" for name in (BEFORE_RL, AFTER_RL)]
    if not all(f.exists() for f in files):
        return None
    before, after = (read_records(f) for f in files)
    has_em = all(any(score_value(r, "em") is not None for r in rs) for rs in (before, after))
    return paired_difference(before, after, key="em" if has_em else "accuracy", n_boot=n_boot, seed=seed)


__all__ = ["AFTER_RL", "BEFORE_RL", "CORRECT_THRESHOLD", "HELD_OUT", "episode_records", "eval_delta",
           "evaluate", "evaluate_held_out", "kind_of_rows", "paired_difference", "run_eval_episodes",
           "summarize", "summarize_records"]
