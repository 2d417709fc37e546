"""Drills of the ``search`` task (``task.settings.drill_steps``): query drills and reading drills.

Query drills (:func:`query_drills`) teach a model built from scratch to copy: one-action traces
that copy a pseudo-question of random corpus words into ``<search>``.

Reading drills are cloze questions made from corpus passages, searched for and answered through the
REAL search environment and retriever. A tiny model trained from scratch can copy (the query drills)
but has never learned to *read*: to find where a question's words sit in a retrieved passage and
copy the span next to them. The ~2,200 training questions are too few to teach that (the model
memorises them). Cloze questions made from the corpus itself are unlimited: take a sentence of a
passage, cut out an answer span (a year, a number, a run of capitalised words), and ask for it with
the words around it ("cloze translation" as in Lewis et al. 2019, *Unsupervised Question Answering
by Cloze Translation*, ACL, Section 3, in its simplest form: wh-word + context words, no translation
model).

Each drill is a Search-R1 trace played through the env: ``<search> Q</search>`` → the real
``<information>`` block → ``<answer> A</answer>`` with ``A`` copied as written in that block. A
drill whose answer is not in what the retriever returned is dropped (it would teach guessing). No
dataset question or golden answer is used.
"""

from __future__ import annotations

import logging
import random
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from ...warmstart.traces import Trace, TraceError, play_traces
from .traces import copied_answer

log = logging.getLogger(__name__)
T = TypeVar("T")

_YEAR = re.compile(r"^(1[0-9]\d\d|20[0-2]\d)$")
_NUMBER = re.compile(r"^\d[\d,.]*$")
#: lowercase words allowed inside a capitalised name ("Bank of England", "Ludwig van Beethoven")
_NAME_JOINERS = frozenset({"of", "the", "de", "von", "van", "la", "du", "da", "del"})
_STRIP = ",.;:()\"'"
#: words of a passage's text a drill may use (about what a 160-token observation shows)
VISIBLE_WORDS = 90


@dataclass(frozen=True)
class Cloze:
    """One cloze question.

    Attributes:
        question: wh-word + context words (+ the title half of the time) + ``?``.
        answer: the cut span as written in the passage (punctuation at its ends stripped).
        wh: ``when`` (a year), ``how many`` (a number), ``who`` (2+ capitalised words) or
            ``what`` (one capitalised word).
    """

    question: str
    answer: str
    wh: str


def answer_spans(words: list[str]) -> list[tuple[int, int, str]]:
    """Candidate answer spans of a sentence: ``(start, end, wh)`` word index ranges (end exclusive).

    A year (1000-2029) → ``when``; another number → ``how many``; a run of 1-4 capitalised words
    (joined by :data:`_NAME_JOINERS`, never ending in one, not crossing punctuation, never the
    sentence's first word) → ``who`` for 2+ words, else ``what``.

    Args:
        words: the sentence split on whitespace.

    Returns:
        Non-overlapping spans, left to right (possibly none).
    """
    out: list[tuple[int, int, str]] = []
    i = 0
    while i < len(words):
        w = words[i].strip(_STRIP)
        if _YEAR.match(w):
            out.append((i, i + 1, "when"))
        elif _NUMBER.match(w):
            out.append((i, i + 1, "how many"))
        elif i > 0 and w[:1].isupper() and not words[i].startswith("("):
            j = i + 1
            while j < len(words) and j - i < 4 and words[j - 1][-1:] not in ",.;:)\"":
                v = words[j].strip(_STRIP)
                joins = v in _NAME_JOINERS and j + 1 < len(words) and words[j + 1][:1].isupper()
                if not (v[:1].isupper() or joins) or words[j].startswith("("):
                    break
                j += 1
            while j - i > 1 and words[j - 1].strip(_STRIP) in _NAME_JOINERS:  # cut by the 4-word cap
                j -= 1
            out.append((i, j, "who" if j - i >= 2 else "what"))
            i = j
            continue
        i += 1
    return out


def cloze_question(title: str, text: str, rng: random.Random) -> Cloze | None:
    """A cloze question about one passage, or None when it has no usable sentence.

    A sentence (6+ words, ending in ``.``) of the first :data:`VISIBLE_WORDS` words of the text
    (after the title the corpus repeats at its start) is chosen, then one of its
    :func:`answer_spans`; the question is the span's wh-word, 3-8 words before the span and 2-7
    after it, and (half of the time, when not already in it) the title. None when the answer
    normalises to ``""`` or its normalised words occur in the normalised question (SQuAD
    normalisation, as the env scores: copying from the question could never score EM 1).

    Args:
        title: the passage title (without quotes). text: its text.
        rng: the generator (every choice is drawn from it).

    Returns:
        A :class:`Cloze`, or None.
    """
    from environments.search.reward import normalize_answer

    body = text.strip()
    if title and body.startswith(title):  # DPR passages repeat the title before the first sentence
        body = body[len(title):]
    sentences: list[list[str]] = []
    current: list[str] = []
    for w in body.split()[:VISIBLE_WORDS]:
        current.append(w)
        if w.endswith(".") and len(w) > 3:  # "U.S." / "Jr." rarely end a sentence of 4+ chars
            sentences.append(current)
            current = []
    sentences = [s for s in sentences if len(s) >= 6]
    if not sentences:
        return None
    words = rng.choice(sentences)
    spans = answer_spans(words)
    if not spans:
        return None
    a, b, wh = rng.choice(spans)
    answer = " ".join(words[a:b]).strip(_STRIP)
    left = words[max(0, a - rng.randint(3, 8)):a]
    right = words[b:b + rng.randint(2, 7)]
    question = " ".join([wh, *left, *right]).rstrip(_STRIP)
    if rng.random() < 0.5 and title and title.lower() not in question.lower():
        question = f"{question} {title}"
    norm = normalize_answer(answer)
    # the env scores SQuAD-normalised EM: no run of question words may normalise to the answer
    if not norm or f" {norm} " in f" {normalize_answer(question)} ":
        return None
    return Cloze(question=f"{question}?", answer=answer, wh=wh)


def reservoir_sample(items: Iterable[T], k: int, rng: random.Random) -> list[T]:
    """``k`` items drawn uniformly without replacement from a stream of unknown length, in one pass
    holding at most ``k`` (Algorithm R: Vitter 1985, *Random sampling with a reservoir*, ACM TOMS
    11(1)). All items when there are at most ``k``, in stream order.

    Raises:
        ValueError: ``k < 0``.
    """
    if k < 0:
        raise ValueError(f"reservoir_sample: k={k} must be >= 0")
    out: list[T] = []
    for i, item in enumerate(items):
        if i < k:
            out.append(item)
        else:
            j = rng.randint(0, i)
            if j < k:
                out[j] = item
    return out


def reading_drills(passages: Iterable[tuple[str, str]], n: int, env_factory: Callable[[], Any], *,
                   seed: int = 0, max_tries: int = 4) -> list[Trace]:
    """``n`` reading drills (module docstring) from random ``passages``, played through the env.

    Args:
        passages: ``(title, text)`` pairs of the retriever's corpus (read once, into a list).
        n: drills wanted (>= 0).
        env_factory: ``() -> SearchEnv`` querying the real retriever.
        seed: seeds the passage and span choices.
        max_tries: cloze questions tried per drill wanted (``max_tries * n`` in all) before
            returning fewer than ``n``.

    Returns:
        Up to ``n`` :class:`Trace` s ``(prompt, [search, observation, answer])``; each answer is
        copied from its observation (the env scores it EM 1). Fewer (with a warning logged) when
        ``max_tries * n`` cloze questions did not give ``n`` drills.

    Raises:
        ValueError: ``n < 0``, ``max_tries < 1`` or no passages.
        TraceError: the env did not run a search or did not end the episode on the answer.
    """
    pool = list(passages)
    if n < 0 or max_tries < 1 or not pool:
        raise ValueError(f"reading_drills: need n >= 0 (got {n}), max_tries >= 1 (got {max_tries}) "
                         f"and passages (got {len(pool)})")
    rng = random.Random(seed)
    samples = []
    for i in range(n * max_tries):
        c = cloze_question(*rng.choice(pool), rng)
        if c is not None:
            samples.append({"id": f"reading-{i}", "question": c.question, "golden_answers": [c.answer]})
    made = 0

    def play(env: Any, s: Mapping[str, Any]) -> Trace | None:
        nonlocal made
        if made >= n:  # enough: the remaining cloze questions are not searched
            return None
        prompt, _ = env.reset(options={"sample": dict(s)})
        action = f"<search> {s['question']}</search>"
        obs, _, term, trunc, info = env.step(action)
        if term or trunc or not info.get("tool"):
            raise TraceError(f"drill {s['id']!r}: the search {action!r} was not executed (info={info})")
        answer = copied_answer(obs, s["golden_answers"])
        if answer is None:  # the retriever returned another passage: no drill
            return None
        final = f"<answer> {answer}</answer>"
        _, reward, term, _, _ = env.step(final)
        if not term or reward < 1.0:
            raise TraceError(f"drill {s['id']!r}: the copied answer {final!r} scored {reward} (term={term})")
        made += 1
        return Trace(prompt, [("action", action), ("observation", obs), ("action", final)])

    kept = play_traces(samples, env_factory, play, desc="reading drills")
    if len(kept) < n:
        log.warning("reading drills: %d of the %d asked for (%d cloze questions tried; the others had "
                    "no usable sentence or the retriever returned another passage)", len(kept), n,
                    len(samples))
    return kept


def query_drills(words: Sequence[str], n: int, env_factory: Callable[[], Any], *, seed: int = 0,
                 min_words: int = 4, max_words: int = 18) -> list[Trace]:
    """Copy drills: ``n`` one-action traces ``(prompt, [("action", "<search> Q </search>")])``.

    ``Q`` is a pseudo-question of ``min_words``..``max_words`` words drawn uniformly from ``words``
    (with a final ``?``); the prompt is what the env's ``reset`` renders for it. Nothing is
    searched and no dataset question is used. Sequences never repeat, so a model can only lower
    its loss by copying from its context (induction), not by memorising questions.

    Args:
        words: the vocabulary (e.g. words of corpus passages), non-empty.
        n: drills to make (>= 0). env_factory: ``() -> SearchEnv`` (its prompt template).
        seed: generator seed. min_words / max_words: pseudo-question length range in words.

    Returns:
        ``n`` :class:`Trace` s.

    Raises:
        ValueError: empty ``words``, negative ``n`` or a bad length range.
    """
    if not words or n < 0 or not 1 <= min_words <= max_words:
        raise ValueError(f"query_drills: need words (got {len(words)}), n >= 0 (got {n}) and "
                         f"1 <= min_words <= max_words (got {min_words}, {max_words})")
    rng = random.Random(seed)
    questions = [" ".join(rng.choice(words) for _ in range(rng.randint(min_words, max_words))) + "?"
                 for _ in range(n)]
    samples = [{"id": f"drill-{i}", "question": q, "golden_answers": []} for i, q in enumerate(questions)]

    def play(env: Any, s: Mapping[str, Any]) -> Trace:
        prompt, _ = env.reset(options={"sample": dict(s)})
        return Trace(prompt, [("action", f"<search> {s['question']}</search>")])

    return play_traces(samples, env_factory, play, desc="query drills")


__all__ = ["Cloze", "answer_spans", "cloze_question", "query_drills", "reading_drills", "reservoir_sample"]
