"""Retrieval quality: answer recall@k on QA sets with gold answers (Search-R1 / FlashRAG style).

A question counts as a hit when any retrieved passage contains any gold answer as a
case-insensitive substring (DPR's "top-k retrieval accuracy", Karpukhin et al. 2020, with
plain lower-casing instead of DPR's tokenised match).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

_YES_NO = ("yes", "no")


def load_qa(path: str | Path, drop_yes_no: bool = True) -> list[dict[str, Any]]:
    """Read a QA JSONL file of ``{"id", "question", "golden_answers": [str, ...]}``.

    Args:
        path: the file.
        drop_yes_no: drop questions whose first gold answer is "yes"/"no" (substring
            matching is meaningless for them; HotpotQA comparison questions).

    Raises:
        ValueError: a line lacks ``question`` or ``golden_answers`` (line number given).
    """
    rows = []
    for lineno, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        rec = json.loads(line)
        if not isinstance(rec.get("question"), str) or not rec.get("golden_answers"):
            raise ValueError(f"{path}:{lineno}: needs 'question' and non-empty 'golden_answers'")
        if drop_yes_no and rec["golden_answers"][0].strip().lower() in _YES_NO:
            continue
        rows.append(rec)
    return rows


def answer_hit(golden_answers: Sequence[str], contents: Sequence[str]) -> bool:
    """True if some answer is a case-insensitive substring of some passage text."""
    answers = [a.lower() for a in golden_answers if a.strip()]
    return any(a in c.lower() for c in contents for a in answers)


def answer_recall(questions: Sequence[dict[str, Any]], hits: Sequence[Sequence[dict]]) -> float:
    """Answer recall over ``questions`` given Search-R1 hit lists (one per question).

    Args:
        questions: records with ``golden_answers``.
        hits: per question, the hits ``{"document": {"contents": ...}, ...}`` (top-k).

    Returns:
        Fraction in [0, 1].

    Raises:
        ValueError: the two sequences differ in length or are empty.
    """
    if len(questions) != len(hits) or not questions:
        raise ValueError(f"need equal non-empty lengths, got {len(questions)} and {len(hits)}")
    found = sum(
        answer_hit(q["golden_answers"], [h["document"]["contents"] for h in row])
        for q, row in zip(questions, hits, strict=True)
    )
    return found / len(questions)
