"""The one record of an evaluated episode, and its one writer and reader.

Every evaluation of the house writes :class:`EpisodeRecord` lines: ``copc eval``'s
``results.jsonl`` (appended episode by episode, resumable) and ``copc train``'s
``eval/before_rl.jsonl`` / ``eval/after_rl.jsonl`` (written atomically). The fields are listed
in ``docs/evaluation.md``; :func:`record_of` builds one from a trajectory, the benchmark kind
deciding ``correct`` and ``score_components``.

Readers accept the records of earlier versions too (``copy``, ``final_answer``, ``em``,
``infra_failed``): see :func:`is_failed` and :func:`score_value`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..rollout.trajectory import Trajectory
    from .kinds import BenchmarkKind

log = logging.getLogger(__name__)

#: ``copc eval``'s per-episode file in ``--out``.
RESULTS_FILE = "results.jsonl"


@dataclass
class EpisodeRecord:
    """One evaluated episode (one JSONL line).

    Attributes:
        benchmark: benchmark name (``copc train``: :data:`trainer.evaluate.heldout.HELD_OUT`).
        sample_id: the data row's id (the trajectory's ``sample_id``).
        sample_index: the row's index in the evaluated rows (one question).
        episode: sample number ``0..n-1`` within the question.
        seed: its sampling seed (``seed + 7919·sample_index + episode``; None: engine RNG).
        prompt / response: decoded prompt and response (None when built without a tokenizer).
        turns_text: the response as ``[{"action", "observation"}, ...]`` (None likewise).
        answer: the environment's extracted final answer (None when none was extracted).
        gold: the row's reference answer (:meth:`~trainer.evaluate.kinds.BenchmarkKind.gold`:
            math ``answer``, QA ``golden_answers``; None when not known).
        reward: the environment's reward.
        score_components: the kind's score components (QA: ``em``, ``substring_em``, ``f1``, ...).
        correct: the kind's correctness (math: reward > 0.5; QA: EM = 1); False when failed.
        response_tokens / turns / tool_calls / invalid_actions: episode statistics (model
            tokens, model turns, executed tool calls, turns the environment rejected).
        finish_reason: how the episode ended (``terminated``, ``max_turns``, ``infra_error: ...``).
        failed: an infrastructure failure (after retries): excluded from every metric, counted.
        attempts: plays of this episode (1 + retries used).
        llm_s / env_s / other_s: the episode's wall time in generation, in the environment
            (``reset`` / ``step``: sandbox, retriever, remote env, tools) and the rest, in seconds
            (:class:`~trainer.rollout.timing.EpisodeClock`; None when not measured).
    """

    benchmark: str | None
    sample_id: Any
    sample_index: int
    episode: int
    seed: int | None = None
    prompt: str | None = None
    response: str | None = None
    turns_text: list[dict[str, str]] | None = None
    answer: Any = None
    gold: Any = None
    reward: float = 0.0
    score_components: dict[str, Any] = field(default_factory=dict)
    correct: bool = False
    response_tokens: int = 0
    turns: int = 0
    tool_calls: int = 0
    invalid_actions: int = 0
    finish_reason: str = ""
    failed: bool = False
    attempts: int = 1
    llm_s: float | None = None
    env_s: float | None = None
    other_s: float | None = None

    def to_json(self) -> dict[str, Any]:
        """The record as a JSON-able dict (field order as declared)."""
        return dataclasses.asdict(self)


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


def record_of(tr: Trajectory, kind: BenchmarkKind, *, index: int, benchmark: str | None = None,
              tokenizer: Any = None, seed: int | None = None, attempts: int = 1,
              gold: Any = None) -> EpisodeRecord:
    """The record of one played episode.

    Args:
        tr: the trajectory (its ``info["episode"]`` is the episode number, default 0).
        kind: the benchmark kind: :meth:`~trainer.evaluate.kinds.BenchmarkKind.score` gives
            ``correct`` and ``score_components``.
        index: the question's index. benchmark: the benchmark name.
        tokenizer: decodes ``prompt`` / ``response`` / ``turns_text`` (None: they stay None).
        seed: the episode's sampling seed. attempts: plays of the episode.
        gold: the row's reference answer (``kind.gold(row)``).
    """
    correct, comps = kind.score(tr)
    turns = _segments(tr, tokenizer) if tokenizer is not None else None
    return EpisodeRecord(
        benchmark=benchmark, sample_id=tr.sample_id, sample_index=index,
        episode=int(tr.info.get("episode", 0)), seed=seed,
        prompt=None if tokenizer is None else tokenizer.decode(tr.prompt_ids, skip_special_tokens=True),
        response=None if turns is None else "".join(t["action"] + t["observation"] for t in turns),
        turns_text=turns, answer=tr.info.get("final_answer"), gold=gold, reward=float(tr.reward),
        score_components=comps, correct=bool(correct and not tr.infra_failed),
        response_tokens=int(tr.num_model_tokens), turns=int(tr.turns),
        tool_calls=int(tr.info.get("tool_calls", 0)), invalid_actions=int(tr.info.get("invalid_actions", 0)),
        finish_reason=tr.finish_reason, failed=bool(tr.infra_failed), attempts=attempts,
        **{k: _seconds(tr.info.get(k)) for k in ("llm_s", "env_s", "other_s")})


def _seconds(v: Any) -> float | None:
    """A timing of ``info`` as a float rounded to microseconds; None when absent."""
    return None if v is None else round(float(v), 6)


def is_failed(r: Mapping[str, Any]) -> bool:
    """Whether a record is an infrastructure failure (``failed``; older files: ``infra_failed``)."""
    return bool(r.get("failed", r.get("infra_failed", False)))


def score_value(r: Mapping[str, Any], key: str) -> Any:
    """A record's value of ``key``: the field itself when present (``reward``, ``correct``, or an
    older file's ``em``), else that score component (``score_components[key]``), else None."""
    if key in r:
        return r[key]
    return (r.get("score_components") or {}).get(key)


def _as_json(r: EpisodeRecord | Mapping[str, Any]) -> dict[str, Any]:
    return r.to_json() if isinstance(r, EpisodeRecord) else dict(r)


class RecordWriter:
    """The writer of record files (JSON lines).

    ``append=True`` (``copc eval``'s ``results.jsonl``): opens ``path`` for appending (a torn
    last line left by a killed writer is cut first, so every record starts a line), flushes each
    record and fsyncs every ``sync_every``. ``append=False`` (``copc train``'s records): writes a
    temporary sibling and, on :meth:`close`, fsyncs it and renames it over ``path`` (atomic: a
    reader sees the old file or the whole new one); :meth:`discard` drops it instead.

    Values that are not JSON types are written as ``str``. Use as a context manager (an
    exception inside discards an atomic file, closes an appended one).
    """

    def __init__(self, path: str | Path, *, append: bool = True, sync_every: int = 16) -> None:
        self.path, self.append, self.sync_every, self._n = Path(path), append, sync_every, 0
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if append:
            if self.path.exists():  # a writer killed mid-line left a torn record: cut it (it is re-run)
                data = self.path.read_bytes()
                keep = data.rfind(b"\n") + 1
                if keep < len(data):
                    with self.path.open("r+b") as f:
                        f.truncate(keep)
            self._target = self.path
        else:
            self._target = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        self._f = self._target.open("a" if append else "w", encoding="utf-8")

    def write(self, record: EpisodeRecord | Mapping[str, Any]) -> None:
        """Write one record (one line)."""
        self._f.write(json.dumps(_as_json(record), ensure_ascii=False, default=str) + "\n")
        self._f.flush()
        self._n += 1
        if self.sync_every and self._n % self.sync_every == 0:
            os.fsync(self._f.fileno())

    def close(self) -> None:
        """Flush, fsync and close (an atomic file is then renamed over ``path``); idempotent."""
        if self._f.closed:
            return
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        if not self.append:
            os.replace(self._target, self.path)

    def discard(self) -> None:
        """Close without publishing: an atomic file's temporary is removed (``path`` untouched)."""
        if not self._f.closed:
            self._f.close()
        if not self.append:
            self._target.unlink(missing_ok=True)

    def __enter__(self) -> RecordWriter:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is not None and not self.append:
            self.discard()
        else:
            self.close()


def write_records(path: str | Path, records: Iterable[EpisodeRecord | Mapping[str, Any]]) -> Path:
    """Write ``records`` as JSON lines to ``path`` atomically (:class:`RecordWriter` with
    ``append=False``); the parent directory is created.

    Returns:
        The path written.
    """
    with RecordWriter(path, append=False, sync_every=0) as w:
        for r in records:
            w.write(r)
    return Path(path)


def read_records(path: str | Path, *, torn_ok: bool = False) -> list[dict[str, Any]]:
    """The records of a file of JSON lines (as dicts).

    Args:
        path: the file.
        torn_ok: skip, with a warning, lines that are not JSON (a killed writer's torn line)
            instead of raising.

    Raises:
        FileNotFoundError: no such file.
        ValueError: a line is not JSON and ``torn_ok`` is False (the message names file and line).
    """
    path = Path(path)
    out = []
    for no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError as e:
            if not torn_ok:
                raise ValueError(f"{path}:{no}: not a JSON record ({e})") from None
            log.warning("%s:%d: ignoring a torn line", path, no)
    return out


def read_results(path: str | Path) -> list[dict[str, Any]]:
    """Records of a ``results.jsonl`` being resumed: none when it does not exist; a torn line
    (a killed writer) is ignored."""
    path = Path(path)
    return read_records(path, torn_ok=True) if path.exists() else []


def latest_records(records: Sequence[Mapping[str, Any]]) -> dict[tuple[str, int, int], dict]:
    """The last record of each (benchmark, question, episode)."""
    return {(r["benchmark"], int(r["sample_index"]), int(r["episode"])): dict(r) for r in records}


__all__ = ["RESULTS_FILE", "EpisodeRecord", "RecordWriter", "is_failed", "latest_records", "read_records",
           "read_results", "record_of", "score_value", "write_records"]
