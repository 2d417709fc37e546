"""The evaluation core: play a benchmark's episodes and record each one.

:func:`play_benchmark` is the one loop every evaluation of the house runs (``copc eval``,
``copc train``'s held-out evaluation before and after RL, :func:`trainer.evaluate.heldout.evaluate`):
every question ``i`` gets ``n`` episodes played by the shared group runner
(:func:`trainer.rollout.groups.run_group`), so episode ``j`` of question ``i`` samples with seed
``seed + 7919·i + j`` whatever else runs. An episode ended by an infrastructure failure (sandbox,
retriever, reward checker, engine) is re-played up to ``retries`` times; if it still fails it is
kept, marked failed, and excluded from the metrics (counted) — never scored as a wrong answer.
A bug in an environment (``env_error``) stops the evaluation.

:func:`run_benchmark` records each finished episode (:func:`trainer.evaluate.records.record_of`)
and writes it at once through a :class:`~trainer.evaluate.records.RecordWriter`, so a killed
``copc eval`` loses at most the episodes in flight; ``done`` (resume) skips every (benchmark,
question, episode) already recorded.

Greedy decoding: ``temperature == 0`` is run as ``SamplingParams(temperature=1.0, top_k=1)``:
sampling from the single most likely token is argmax decoding, and the reported behaviour
log-probs (irrelevant for evaluation) stay those of ``softmax(logits)``.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..engines.base import InferenceEngine, SamplingParams
from ..rollout.agent_loop import AgentLoopConfig
from ..rollout.groups import EnvPool, EpisodeFn, episode_seed, run_group
from ..rollout.trajectory import Trajectory
from .records import EpisodeRecord, RecordWriter, record_of

if TYPE_CHECKING:
    from .kinds import BenchmarkKind

#: ``on_episode(question index, sample, trajectory, attempts)``, awaited once per finished episode.
OnEpisode = Callable[[int, Mapping[str, Any], Trajectory, int], Awaitable[None] | None]


@dataclass(frozen=True)
class EvalSettings:
    """How to evaluate (validated).

    Attributes:
        k: episodes per question (``n`` of avg@n / pass@k); None: each benchmark's default.
        temperature: sampling temperature (0 = greedy); None: each benchmark's default.
        max_samples: first N questions of each benchmark (0 = all).
        seed: base sampling seed (episode ``j`` of question ``i``: ``seed + 7919·i + j``); None:
            the engine's RNG.
        max_new_tokens: tokens per model turn.
        agent: episode budgets (:class:`AgentLoopConfig`).
        retries: re-plays of an episode ended by an infrastructure failure.
        concurrency: episodes in flight (environments kept) per benchmark.

    Raises:
        ValueError: naming the field (``k < 1``, negative temperature, ...).
    """

    k: int | None = None
    temperature: float | None = None
    max_samples: int = 0
    seed: int | None = 0
    max_new_tokens: int = 256
    agent: AgentLoopConfig = field(default_factory=AgentLoopConfig)
    retries: int = 2
    concurrency: int = 32

    def __post_init__(self) -> None:
        """Validate."""
        if self.k is not None and (isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 1):
            raise ValueError(f"--k={self.k!r}: must be an int >= 1")
        if self.temperature is not None and not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"--temperature={self.temperature!r}: must be a finite number >= 0 (0 = greedy)")
        for name in ("max_samples", "retries"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')}={getattr(self, name)!r}: must be >= 0")
        c = self.concurrency
        if isinstance(c, bool) or not isinstance(c, int) or c < 1:
            raise ValueError(f"concurrency={self.concurrency!r}: must be an int >= 1")


@dataclass(frozen=True)
class BenchmarkJob:
    """One benchmark to play: its rows, environments, kind and sampling.

    Attributes:
        name: the benchmark's name (records are keyed by it).
        kind: the :class:`~trainer.evaluate.kinds.BenchmarkKind` scoring its episodes.
        rows: the questions (index = position).
        make_env: a zero-argument environment factory (a pool of them is reused).
        n: episodes per question (>= 1).
        temperature: sampling temperature (0 = greedy).
        episode: how an episode is played on one environment (the task's
            :meth:`~trainer.tasks.base.Task.episode`); None: the tool-environment loop.
    """

    name: str
    kind: BenchmarkKind
    rows: Sequence[Mapping[str, Any]]
    make_env: Callable[[], Any]
    n: int
    temperature: float
    episode: EpisodeFn | None = None


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


async def play_benchmark(engine: InferenceEngine, tokenizer: Any, job: BenchmarkJob, settings: EvalSettings,
                         on_episode: OnEpisode, skip: Callable[[int, int], bool] | None = None) -> None:
    """Play every episode of ``job`` not skipped; call ``on_episode`` for each finished one.

    Args:
        engine: the policy. tokenizer: its tokenizer.
        job: the benchmark. settings: budgets, seed, retries, concurrency.
        on_episode: called (and awaited if it returns an awaitable) with ``(question index,
            sample, trajectory, attempts)`` once per episode, after its retries.
        skip: ``skip(question, episode)`` True for episodes already done (resume).

    Raises:
        ValueError: ``job.n < 1`` or a bad temperature.
        RuntimeError: the environment raised on an episode (``env_error``: a bug), naming the
            benchmark, the question and the count.
    """
    sampling = eval_sampling_params(job.temperature, settings.max_new_tokens, seed=settings.seed)
    pool = EnvPool(job.make_env, min(settings.concurrency, max(len(job.rows) * job.n, 1)), job.episode)

    async def question(i: int, sample: Mapping[str, Any]) -> None:
        todo = [j for j in range(job.n) if skip is None or not skip(i, j)]
        attempt = 0
        while todo:
            attempt += 1
            trajs = await run_group(engine, pool, tokenizer, sample, job.n, sampling, settings.agent, uid=i,
                                    group_id=sample.get("id", i), episodes=todo)
            broken = [t for t in trajs if t.env_failed]
            if broken:  # a bug in the environment, not a wrong answer nor an infrastructure failure
                first = broken[0]
                raise RuntimeError(f"{job.name}: the environment raised on {len(broken)} of {len(trajs)} "
                                   f"episodes; first (sample {first.sample_id!r}): {first.finish_reason}")
            retry = []
            for tr in trajs:
                if tr.infra_failed and attempt <= settings.retries:
                    retry.append(int(tr.info["episode"]))
                    continue
                done = on_episode(i, sample, tr, attempt)
                if done is not None:
                    await done
            todo = retry

    try:
        await asyncio.gather(*(question(i, s) for i, s in enumerate(job.rows)))
    finally:
        await pool.close()


async def run_benchmark(engine: InferenceEngine, tokenizer: Any, job: BenchmarkJob, settings: EvalSettings,
                        writer: RecordWriter | None = None,
                        done: Mapping[tuple[str, int, int], Mapping[str, Any]] | None = None,
                        progress: Any = None) -> list[dict[str, Any]]:
    """Play every missing episode of one benchmark; return all its records (old and new) as dicts,
    ordered by question then episode.

    Args:
        engine, tokenizer, job, settings: see :func:`play_benchmark`.
        writer: each new record is written through it at once (None: kept in memory only).
        done: records already written (resume): kept when not ``failed`` and inside the
            current rows / ``n``.
        progress: optional object with ``update(count)`` (a progress bar).

    Raises:
        RuntimeError: the environment raised (a bug, ``env_error``).
    """
    records = {key: dict(rec) for key, rec in (done or {}).items()
               if key[0] == job.name and not rec.get("failed") and key[1] < len(job.rows) and key[2] < job.n}
    def record(i: int, sample: Mapping[str, Any], tr: Trajectory, attempts: int) -> None:
        j = int(tr.info["episode"])
        rec: EpisodeRecord = record_of(tr, job.kind, index=i, benchmark=job.name, tokenizer=tokenizer,
                                       seed=episode_seed(settings.seed, i, j), attempts=attempts,
                                       gold=job.kind.gold(sample))
        if writer is not None:
            writer.write(rec)
        records[(job.name, i, j)] = rec.to_json()
        if progress is not None:
            progress.update(1)

    await play_benchmark(engine, tokenizer, job, settings, record,
                         skip=lambda i, j: (job.name, i, j) in records)
    return [records[key] for key in sorted(records)]


async def run_benchmark_with_bar(engine: InferenceEngine, tokenizer: Any, job: BenchmarkJob,
                                 settings: EvalSettings, *, show: bool, desc: str | None = None,
                                 writer: RecordWriter | None = None,
                                 done: Mapping[tuple[str, int, int], Mapping[str, Any]] | None = None
                                 ) -> list[dict[str, Any]]:
    """:func:`run_benchmark` with a ``tqdm`` bar of its ``len(job.rows) × job.n`` episodes (count,
    rate, ETA; labelled ``desc``, default the benchmark's name), closed when the run ends or raises;
    ``show=False``: no bar.

    Raises:
        RuntimeError: as :func:`run_benchmark`.
    """
    from ..outputs.progress import phase_bar

    bar = phase_bar(total=len(job.rows) * job.n, desc=desc or job.name, show=show)
    try:
        return await run_benchmark(engine, tokenizer, job, settings, writer, done, progress=bar)
    finally:
        bar.close()


__all__ = ["BenchmarkJob", "EvalSettings", "OnEpisode", "eval_sampling_params",
           "play_benchmark", "run_benchmark", "run_benchmark_with_bar"]
