"""QA rewards: exact match / F1 after SQuAD normalisation, and substring EM (Search-R1).

Normalisation (SQuAD v1.1 evaluation script, Rajpurkar et al. 2016): lowercase, remove
punctuation, remove the articles a/an/the, collapse whitespace. F1 is the token-overlap F1.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Sequence

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = set(string.punctuation)


def normalize_answer(s: str) -> str:
    """SQuAD normalisation: lowercase, strip punctuation and articles, collapse whitespace."""
    s = "".join(ch for ch in s.lower() if ch not in _PUNCT)
    return " ".join(_ARTICLES.sub(" ", s).split())


def exact_match(prediction: str, golden_answers: Sequence[str]) -> float:
    """1.0 if the normalised prediction equals any normalised golden answer, else 0.0."""
    p = normalize_answer(prediction)
    return float(any(p == normalize_answer(g) for g in golden_answers))


def substring_match(prediction: str, golden_answers: Sequence[str]) -> float:
    """1.0 if any normalised golden answer occurs inside the normalised prediction."""
    p = normalize_answer(prediction)
    return float(any(normalize_answer(g) in p for g in golden_answers if normalize_answer(g)))


def f1_score(prediction: str, golden_answers: Sequence[str]) -> float:
    """Max over golden answers of token F1 between normalised strings (0.0 if no overlap)."""
    best = 0.0
    p_tokens = normalize_answer(prediction).split()
    for g in golden_answers:
        g_tokens = normalize_answer(g).split()
        common = Counter(p_tokens) & Counter(g_tokens)
        same = sum(common.values())
        if same == 0:
            continue
        precision, recall = same / len(p_tokens), same / len(g_tokens)
        best = max(best, 2 * precision * recall / (precision + recall))
    return best
