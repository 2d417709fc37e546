"""QA rewards: exact match / F1 after SQuAD normalisation, and substring EM (Search-R1).

Normalisation (SQuAD v1.1 evaluation script, Rajpurkar et al. 2016): lowercase, remove
punctuation, remove the articles a/an/the, collapse whitespace. F1 is the token-overlap F1.

Empty strings never match (all three metrics). A golden answer that normalises to ``""``
(only punctuation, articles or spaces, e.g. NQ ``test_1420``'s ``"---"`` or
``test_1986``'s ``"*"``) is skipped, and a prediction that normalises to ``""`` scores 0.
The SQuAD scripts would give EM 1 for ``"" == ""`` (SQuAD v2 uses that for unanswerable
questions); here every question has an answer, so an empty match would reward ``<answer>
the </answer>`` or ``<answer></answer>``. Search-R1's substring EM (``subem_check``)
would likewise count ``"" in prediction`` as a hit.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Sequence

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = set(string.punctuation)


def normalize_answer(s: str) -> str:
    """SQuAD normalisation: lowercase, strip punctuation and articles, collapse whitespace.

    Returns ``""`` for strings made only of punctuation, articles and whitespace.
    """
    s = "".join(ch for ch in s.lower() if ch not in _PUNCT)
    return " ".join(_ARTICLES.sub(" ", s).split())


def _golden(golden_answers: Sequence[str]) -> list[str]:
    """Normalised golden answers, those that normalise to ``""`` left out."""
    return [g for g in (normalize_answer(a) for a in golden_answers) if g]


def exact_match(prediction: str, golden_answers: Sequence[str]) -> float:
    """1.0 if the normalised prediction equals a normalised golden answer, else 0.0.

    Empty-normalising predictions and golden answers never match (module docstring).
    """
    p = normalize_answer(prediction)
    return float(bool(p) and p in _golden(golden_answers))


def substring_match(prediction: str, golden_answers: Sequence[str]) -> float:
    """1.0 if a normalised golden answer occurs inside the normalised prediction, else 0.0.

    Plain string containment (Search-R1 ``subem_check``: ``"paris" in "parisian"`` counts).
    Empty-normalising predictions and golden answers never match (module docstring).
    """
    p = normalize_answer(prediction)
    return float(bool(p) and any(g in p for g in _golden(golden_answers)))


def f1_score(prediction: str, golden_answers: Sequence[str]) -> float:
    """Max over golden answers of the token F1 of the normalised strings, in [0, 1].

    ``precision = common / len(pred tokens)``, ``recall = common / len(golden tokens)``
    with ``common`` the multiset intersection size; 0.0 when nothing overlaps, when the
    prediction normalises to ``""``, or when every golden answer does.
    """
    p_tokens = normalize_answer(prediction).split()
    if not p_tokens:
        return 0.0
    best = 0.0
    for g in _golden(golden_answers):
        g_tokens = g.split()
        same = sum((Counter(p_tokens) & Counter(g_tokens)).values())
        if same == 0:
            continue
        precision, recall = same / len(p_tokens), same / len(g_tokens)
        best = max(best, 2 * precision * recall / (precision + recall))
    return best
