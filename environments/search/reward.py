"""QA rewards: exact match / F1 after SQuAD normalisation, and substring EM (Search-R1).

Normalisation (SQuAD v1.1 evaluation script, Rajpurkar et al. 2016): lowercase, remove
punctuation, remove the articles a/an/the, collapse whitespace. F1 is the token-overlap F1.

Empty strings never match (all three metrics). A golden answer that normalises to ``""``
because it is made only of punctuation and spaces (NQ ``test_1420``'s ``"---"``,
``test_1986``'s ``"*"``) is skipped, and a prediction that normalises to ``""`` scores 0.
The SQuAD scripts would give EM 1 for ``"" == ""`` (SQuAD v2 uses that for unanswerable
questions); here every question has an answer, so an empty match would reward ``<answer>
the </answer>`` or ``<answer></answer>``. Search-R1's substring EM (``subem_check``)
would likewise count ``"" in prediction`` as a hit.

Article-only answers. A golden answer made only of articles (the band ``"The The"``, the
letter ``"A"``) normalises to ``""`` too, yet is a real answer: it is compared in its
unstripped form instead (:func:`answer_form`: lowercase, punctuation removed, whitespace
collapsed, articles kept), and so is a prediction that normalises to ``""``. Exactly that
answer then matches (``"the the!"`` for ``"The The"``), nothing else does: for substring EM
such a golden answer must equal the whole prediction (``"a"`` inside ``"an apple"`` or
``"the"`` inside any sentence is no hit). An empty prediction still never matches.
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


def answer_form(s: str) -> tuple[str, bool]:
    """The form ``s`` is compared in, and whether it is the article-only fallback.

    :func:`normalize_answer` of ``s``; when that is ``""``, the unstripped form (lowercase,
    punctuation removed, whitespace collapsed, articles kept) — ``("the the", True)`` for
    ``"The The!"``; ``("", False)`` for ``"---"`` or ``""``.
    """
    n = normalize_answer(s)
    if n:
        return n, False
    kept = " ".join("".join(ch for ch in s.lower() if ch not in _PUNCT).split())
    return kept, bool(kept)


def _golden(golden_answers: Sequence[str]) -> list[tuple[str, bool]]:
    """:func:`answer_form` of each golden answer, those with an empty form left out."""
    return [g for g in (answer_form(a) for a in golden_answers) if g[0]]


def exact_match(prediction: str, golden_answers: Sequence[str]) -> float:
    """1.0 if the prediction's :func:`answer_form` equals a golden answer's, else 0.0.

    Empty predictions and golden answers never match (module docstring).
    """
    p, _ = answer_form(prediction)
    return float(bool(p) and any(p == g for g, _ in _golden(golden_answers)))


def substring_match(prediction: str, golden_answers: Sequence[str]) -> float:
    """1.0 if a normalised golden answer occurs inside the normalised prediction, else 0.0.

    Plain string containment (Search-R1 ``subem_check``: ``"paris" in "parisian"`` counts);
    an article-only golden answer must equal the prediction's :func:`answer_form`. Empty
    predictions and golden answers never match (module docstring).
    """
    p, _ = answer_form(prediction)
    return float(bool(p) and any(p == g if article_only else g in p
                                 for g, article_only in _golden(golden_answers)))


def f1_score(prediction: str, golden_answers: Sequence[str]) -> float:
    """Max over golden answers of the token F1 of the normalised strings, in [0, 1].

    ``precision = common / len(pred tokens)``, ``recall = common / len(golden tokens)``
    with ``common`` the multiset intersection size, tokens of the :func:`answer_form`; 0.0
    when nothing overlaps, when the prediction's form is ``""``, or when every golden
    answer's is.
    """
    p_tokens = answer_form(prediction)[0].split()
    if not p_tokens:
        return 0.0
    best = 0.0
    for g, _ in _golden(golden_answers):
        g_tokens = g.split()
        same = sum((Counter(p_tokens) & Counter(g_tokens)).values())
        if same == 0:
            continue
        precision, recall = same / len(p_tokens), same / len(g_tokens)
        best = max(best, 2 * precision * recall / (precision + recall))
    return best
