"""The episodes of a run or evaluation directory, in the one shape the viewer page draws.

Sources, whichever are present:

* ``samples/step_N.jsonl`` (a ``copc train`` run, :mod:`.samples`): per-token episodes with the
  loss mask, advantage, ratio ρ and the channel intervals;
* ``eval/*.jsonl`` (``copc train``'s held-out records) and ``results.jsonl`` (``copc eval --out``):
  :class:`~trainer.evaluate.records.EpisodeRecord` lines, drawn from their ``turns_text``.

An episode is a dict: ``id``, ``source`` (``train`` | the records file's stem), ``benchmark``,
``step`` (None for evaluation records), ``reward``, ``finish`` (the finish reason's prefix),
``finish_reason``, ``prompt``, ``meta`` (a few numbers shown in its header) and either
``tokens`` (training samples: ``[{"t": text, "m": loss mask, "a": advantage, "r": ratio ρ,
"c": 1 inside a tool call}]``, with ``policy_interval`` / ``advantage_interval``) or ``turns``
(``[{"action", "observation"}]``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from .samples import SAMPLES_DIR, read_samples

#: a tool call in a model turn: the tags of the house's formats (ReTool ``<code>``, Search-R1
#: ``<search>``, hermes ``<tool_call>``).
TOOL_CALL_RE = re.compile(r"<(code|search|tool_call|python)>.*?(</\1>|$)", re.S)
_META = ("turns", "tool_calls", "llm_s", "env_s", "other_s", "response_tokens")


def _finish(reason: str) -> str:
    return (reason or "").partition(":")[0].strip()


def call_flags(pieces: list[str], mask: list[int]) -> list[int]:
    """Per token, 1 when it lies (even partly) inside a tool call (:data:`TOOL_CALL_RE`) of its
    model turn (a run of ``mask`` = 1 tokens); 0 elsewhere."""
    flags = [0] * len(pieces)
    i = 0
    while i < len(pieces):
        j = i
        while j < len(pieces) and mask[j] == mask[i]:
            j += 1
        if mask[i]:
            starts, pos = [], 0
            for p in range(i, j):
                starts.append(pos)
                pos += len(pieces[p])
            text = "".join(pieces[i:j])
            for m in TOOL_CALL_RE.finditer(text):
                for k, p in enumerate(range(i, j)):
                    end = starts[k] + len(pieces[p])
                    if starts[k] < m.end() and end > m.start():
                        flags[p] = 1
        i = j
    return flags


def sample_episode(rec: dict[str, Any], n: int) -> dict[str, Any]:
    """A training sample record (:func:`trainer.orchestration.samples.step_samples`) as an episode."""
    pieces, mask = list(rec.get("tokens", [])), list(rec.get("loss_mask", []))
    adv, ratio = rec.get("advantage", []), rec.get("ratio", [])
    calls = call_flags(pieces, mask)
    tokens = [{"t": p, "m": int(mask[i]), "a": adv[i] if i < len(adv) else None,
               "r": ratio[i] if i < len(ratio) else None, "c": calls[i]} for i, p in enumerate(pieces)]
    return {"id": f"train-{n}", "source": "train", "benchmark": "train", "step": rec.get("step"),
            "sample_id": rec.get("sample_id"), "reward": float(rec.get("reward", 0.0)),
            "finish": _finish(rec.get("finish_reason", "")), "finish_reason": rec.get("finish_reason", ""),
            "prompt": rec.get("prompt", ""), "meta": {k: rec[k] for k in _META if rec.get(k) is not None},
            "tokens": tokens, "policy_interval": rec.get("policy_interval"),
            "advantage_interval": rec.get("advantage_interval"), "cut_tokens": rec.get("cut_tokens")}


def record_episode(rec: dict[str, Any], source: str, n: int) -> dict[str, Any]:
    """An evaluation record (:class:`~trainer.evaluate.records.EpisodeRecord` JSON) as an episode."""
    turns = rec.get("turns_text")
    if turns is None:  # built without a tokenizer: the response (if any) as one turn
        turns = [{"action": rec.get("response") or "", "observation": ""}]
    return {"id": f"{source}-{n}", "source": source, "benchmark": rec.get("benchmark") or source,
            "step": None, "sample_id": rec.get("sample_id"), "reward": float(rec.get("reward") or 0.0),
            "finish": _finish(rec.get("finish_reason", "")), "finish_reason": rec.get("finish_reason", ""),
            "prompt": rec.get("prompt") or "", "answer": rec.get("answer"), "gold": rec.get("gold"),
            "correct": rec.get("correct"),
            "meta": {k: rec[k] for k in _META if rec.get(k) is not None}, "turns": list(turns)}


def _records(path: Path) -> list[dict[str, Any]]:
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            r = json.loads(line)
        except json.JSONDecodeError:  # a killed writer's torn line
            continue
        if isinstance(r, dict):
            out.append(r)
    return out


def load_episodes(directory: str | Path) -> list[dict[str, Any]]:
    """Every episode of a run directory (samples, then held-out records) or of an evaluation
    directory (``results.jsonl``).

    Raises:
        FileNotFoundError: ``directory`` is not a directory, or holds none of the sources.
    """
    d = Path(directory)
    if not d.is_dir():
        raise FileNotFoundError(f"{d}: not a directory")
    episodes = [sample_episode(r, i) for i, r in enumerate(read_samples(d))]
    files = sorted((d / "eval").glob("*.jsonl")) if (d / "eval").is_dir() else []
    if (d / "results.jsonl").is_file():
        files.append(d / "results.jsonl")
    for f in files:
        episodes += [record_episode(r, f.stem, i) for i, r in enumerate(_records(f))]
    if not episodes and not (d / SAMPLES_DIR).is_dir() and not files:
        raise FileNotFoundError(f"{d}: no {SAMPLES_DIR}/step_N.jsonl, eval/*.jsonl or results.jsonl "
                                "(not a copc train run or copc eval --out directory)")
    return episodes


__all__ = ["TOOL_CALL_RE", "call_flags", "load_episodes", "record_episode", "sample_episode"]
