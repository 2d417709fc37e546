"""Run named benchmarks against an engine, one JSONL line per episode, resumable.

For each benchmark (:mod:`trainer.evaluate.benchmarks`) every question ``i`` gets ``n``
episodes played by the shared group runner (:func:`trainer.rollout.groups.run_group`), so
episode ``j`` of question ``i`` samples with seed ``seed + 7919·i + j`` whatever else runs.
Each finished episode is appended to ``<out>/results.jsonl`` at once (flushed), so a killed
evaluation loses at most the episodes in flight; ``resume`` skips every (benchmark, question,
episode) already there with a result. An episode ended by an infrastructure failure
(sandbox, retriever, reward checker, engine) is re-played up to ``retries`` times; if it still
fails it is recorded with ``failed: true`` and excluded from the metrics (counted) — never
scored as a wrong answer. A bug in an environment (``env_error``) stops the evaluation.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..engines.base import InferenceEngine
from ..evaluation import eval_sampling_params
from ..rollout.agent_loop import AgentLoopConfig
from ..rollout.groups import EnvPool, run_group
from ..rollout.trajectory import Trajectory

log = logging.getLogger(__name__)

RESULTS_FILE = "results.jsonl"


@dataclass(frozen=True)
class EvalSettings:
    """How to evaluate (validated).

    Attributes:
        k: episodes per question (``n`` of avg@n / pass@k); None: each benchmark's default.
        temperature: sampling temperature (0 = greedy); None: each benchmark's default.
        max_samples: first N questions of each benchmark (0 = all).
        seed: base sampling seed (episode ``j`` of question ``i``: ``seed + 7919·i + j``).
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
    seed: int = 0
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
        if self.concurrency < 1:
            raise ValueError(f"concurrency={self.concurrency!r}: must be >= 1")


def _segments(tr: Trajectory, tokenizer: Any) -> list[dict[str, str]]:
    """The response as turns: ``[{"action": model text, "observation": env text}, ...]``."""
    ids, mask, turns = tr.response_ids, tr.loss_mask, []
    i = 0
    while i < len(ids):
        j = i
        while j < len(ids) and mask[j] == mask[i]:
            j += 1
        text = tokenizer.decode(ids[i:j], skip_special_tokens=True)
        if mask[i] == 1:
            turns.append({"action": text, "observation": ""})
        elif turns:
            turns[-1]["observation"] += text
        else:
            turns.append({"action": "", "observation": text})
        i = j
    return turns


def episode_record(benchmark: str, kind: str, index: int, sample: Mapping[str, Any], tr: Trajectory,
                   tokenizer: Any, seed: int | None, attempts: int) -> dict[str, Any]:
    """The ``results.jsonl`` line of one episode.

    ``correct``: for ``qa``, exact match (``score_components["em"] == 1``; an episode cut before
    it answered has EM / cover-EM / F1 0); for ``math``, reward > 0.5. ``failed``: an
    infrastructure failure (excluded from the metrics).
    """
    comps = dict(tr.info.get("reward_components") or {})
    if kind == "qa":  # an episode that never answered (cut by a budget) scores 0 on every metric
        comps = {"em": 0.0, "substring_em": 0.0, "f1": 0.0, **comps}
    correct = comps.get("em", 0.0) >= 1.0 if kind == "qa" else tr.reward > 0.5
    turns = _segments(tr, tokenizer)
    return {"benchmark": benchmark, "sample_id": sample.get("id"), "sample_index": index,
            "episode": int(tr.info.get("episode", 0)), "seed": seed,
            "prompt": tokenizer.decode(tr.prompt_ids, skip_special_tokens=True),
            "response": "".join(t["action"] + t["observation"] for t in turns), "turns_text": turns,
            "answer": tr.info.get("final_answer"), "reward": float(tr.reward),
            "score_components": comps, "correct": bool(correct and not tr.infra_failed),
            "response_tokens": tr.num_model_tokens, "turns": tr.turns,
            "tool_calls": int(tr.info.get("tool_calls", 0)), "finish_reason": tr.finish_reason,
            "failed": tr.infra_failed, "attempts": attempts}


def read_results(path: Path) -> list[dict[str, Any]]:
    """Records of a ``results.jsonl`` (a torn last line — a killed writer — is ignored)."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            log.warning("%s: ignoring a torn line", path)
    return out


def latest_records(records: Sequence[Mapping[str, Any]]) -> dict[tuple[str, int, int], dict]:
    """The last record of each (benchmark, question, episode)."""
    return {(r["benchmark"], int(r["sample_index"]), int(r["episode"])): dict(r) for r in records}


class ResultsWriter:
    """Appends records to ``results.jsonl`` and flushes each one (``fsync`` every ``sync_every``).

    Opening an existing file first cuts a torn last line (a killed writer), so appended records
    always start on a line of their own.
    """

    def __init__(self, path: Path, sync_every: int = 16) -> None:
        self.path, self.sync_every, self._n = path, sync_every, 0
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists():  # a writer killed mid-line left a torn record: cut it (it is re-run)
            data = path.read_bytes()
            keep = data.rfind(b"\n") + 1
            if keep < len(data):
                with path.open("r+b") as f:
                    f.truncate(keep)
        self._f = path.open("a")

    def write(self, record: Mapping[str, Any]) -> None:
        """Append one record (one line)."""
        self._f.write(json.dumps(record, ensure_ascii=False) + "\n")
        self._f.flush()
        self._n += 1
        if self._n % self.sync_every == 0:
            os.fsync(self._f.fileno())

    def close(self) -> None:
        """Flush, fsync and close."""
        if not self._f.closed:
            self._f.flush()
            os.fsync(self._f.fileno())
            self._f.close()


async def run_benchmark(engine: InferenceEngine, tokenizer: Any, name: str, kind: str,
                        rows: Sequence[Mapping[str, Any]], make_env: Any, settings: EvalSettings,
                        n: int, temperature: float, writer: ResultsWriter,
                        done: Mapping[tuple[str, int, int], Mapping[str, Any]], progress: Any = None
                        ) -> list[dict[str, Any]]:
    """Play every missing episode of one benchmark; return all its records (old and new).

    Args:
        rows: the benchmark's questions (index = position). make_env: environment factory.
        n: episodes per question. temperature: sampling temperature (0 = greedy).
        done: records already in ``results.jsonl`` (resume): kept when not ``failed``.
        progress: optional object with ``update(count)`` (a progress bar).

    Raises:
        RuntimeError: the environment raised (a bug, ``env_error``).
    """
    sampling = eval_sampling_params(temperature, settings.max_new_tokens, seed=settings.seed)
    pool = EnvPool(make_env, min(settings.concurrency, max(len(rows) * n, 1)))
    # resume: keep earlier results of this benchmark's questions/episodes (not failed ones, and
    # not those outside the current --max-samples / --k)
    records = {key: rec for key, rec in done.items()
               if key[0] == name and not rec.get("failed") and key[1] < len(rows) and key[2] < n}

    async def question(i: int, sample: Mapping[str, Any]) -> None:
        todo = [j for j in range(n) if (name, i, j) not in records]
        attempt = 0
        while todo:
            attempt += 1
            trajs = await run_group(engine, pool, tokenizer, sample, n, sampling, settings.agent, uid=i,
                                    group_id=sample.get("id", i), episodes=todo)
            retry = []
            for tr in trajs:
                if tr.env_failed:
                    raise RuntimeError(f"{name}: the environment raised on question {i} "
                                       f"({sample.get('id')!r}): {tr.finish_reason}")
                j = int(tr.info["episode"])
                if tr.infra_failed and attempt <= settings.retries:
                    retry.append(j)
                    continue
                seed = None if sampling.seed is None else sampling.seed + 7919 * i + j
                rec = episode_record(name, kind, i, sample, tr, tokenizer, seed, attempt)
                writer.write(rec)
                records[(name, i, j)] = rec
                if progress is not None:
                    progress.update(1)
            todo = retry

    try:
        await asyncio.gather(*(question(i, s) for i, s in enumerate(rows)))
    finally:
        await pool.close()
    return [records[key] for key in sorted(k for k in records if k[0] == name)]
