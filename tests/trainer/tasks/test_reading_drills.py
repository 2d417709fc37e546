"""Reading drills (trainer.tasks.search.drills): cloze questions about corpus passages, played
through the REAL SearchEnv against a real BM25 retriever server over the shared corpus.

Hand-computed span / question tests first (no server); then every drill is replayed through a
fresh env and its ``<information>`` block re-fetched from the retriever."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from search_server import CORPUS, QA_DIR, retriever_url  # noqa: F401 - pytest fixture

import environments
from environments.search.env import ANSWER_PATTERN, SearchTool
from environments.search.reward import normalize_answer
from retriever.corpus import iter_corpus
from trainer.config import load_config
from trainer.config.specs import task_spec
from trainer.tasks import build_task
from trainer.tasks.search.drills import (
    VISIBLE_WORDS,
    answer_spans,
    cloze_question,
    reading_drills,
    reservoir_sample,
)
from trainer.tasks.search.traces import information_text

CPU_TINY = Path(__file__).parent.resolve().parents[2] / "configs" / "search" / "cpu_tiny.yaml"


def ws(sentence: str) -> list[str]:
    """The sentence split on whitespace, as cloze_question splits passages."""
    return sentence.split()


def test_answer_spans_by_hand():
    words = ws("In 1969 the Apollo 11 crew of Neil Armstrong landed 2 men on the Moon.")
    # "Apollo" (idx 3) then the number 11, "Neil Armstrong" (7-8), 2 (idx 10), "Moon." (14)
    assert answer_spans(words) == [(1, 2, "when"), (3, 4, "what"), (4, 5, "how many"), (7, 9, "who"),
                                   (10, 11, "how many"), (14, 15, "what")]
    # a list of names is two names ("and" never joins)
    assert answer_spans(ws("by John Lennon and Paul McCartney")) == [(1, 3, "who"), (4, 6, "who")]


def test_answer_spans_join_names_and_stop_at_punctuation_and_parentheses():
    assert answer_spans(ws("He met the Bank of England governor.")) == [(3, 6, "who")]
    # a comma ends a name; "(Ти́хон" never starts or continues one; the first word never counts
    assert answer_spans(ws("Born in Paris, France (Europe) today")) == [(2, 3, "what"), (3, 4, "what")]
    assert answer_spans(ws("Paris is big")) == []
    # at most 4 words per name, never ending in a joiner the cap cut off
    assert answer_spans(ws("x Aa Bb Cc Dd Ee")) == [(1, 5, "who"), (5, 6, "what")]
    assert answer_spans(ws("x Maryland Institute College of Art")) == [(1, 4, "who"), (5, 6, "what")]


def test_cloze_question_cuts_a_visible_span_and_asks_around_it():
    text = ("The Beatles were an English rock band formed in Liverpool in 1960. "
            "The group comprised John Lennon and Paul McCartney among others.")
    made = [cloze_question("The Beatles", text, random.Random(s)) for s in range(60)]
    made = [c for c in made if c is not None]
    assert len(made) >= 40
    for c in made:
        assert c.question.endswith("?") and c.question.split()[0] in ("when", "how", "who", "what")
        assert c.answer in text                                   # cut from the passage, as written
        assert c.answer.lower() not in c.question.lower()       # never given away, title included
        if c.wh == "when":
            assert c.answer == "1960"
    assert {c.answer for c in made} >= {"1960", "Liverpool", "John Lennon"}
    assert cloze_question("T", "too short.", random.Random(0)) is None
    assert cloze_question("T", "no capitalised words or numbers in this long sentence here.",
                          random.Random(0)) is None


def test_cloze_question_skips_the_repeated_title_and_never_gives_the_answer_away():
    # DPR passages repeat the title before the first sentence; a span must not cross into it,
    # and no run of question words may normalise to the answer (the env's EM normalises)
    text = ("Qin dynasty The Qin dynasty () was the first dynasty of Imperial China, lasting from "
            "221 to 206 before Christ. Its first emperor Qin Shi Huang unified China in 221 before Christ.")
    made = [c for c in (cloze_question("Qin dynasty", text, random.Random(s)) for s in range(200)) if c]
    assert made
    for c in made:
        norm = normalize_answer(c.answer)
        assert norm and f" {norm} " not in f" {normalize_answer(c.question)} "
        assert not c.answer.startswith("The Qin dynasty The")
    assert "The Qin" not in {c.answer for c in made}       # "Qin" is in every question with the title


def test_reservoir_sample_is_uniform_one_pass_and_exact_for_short_streams():
    rng = random.Random(0)
    counts = dict.fromkeys(range(5), 0)
    for _ in range(20_000):
        for x in reservoir_sample(iter(range(5)), 2, rng):
            counts[x] += 1
    assert all(abs(c / 20_000 - 0.4) < 0.015 for c in counts.values())  # each item kept 2/5 of the time
    assert reservoir_sample(iter("abc"), 5, rng) == ["a", "b", "c"]
    assert reservoir_sample(iter("abc"), 0, rng) == []
    with pytest.raises(ValueError, match="k=-1"):
        reservoir_sample([], -1, rng)


def test_reading_drills_warn_when_they_fall_short(caplog):
    never = [("T", "all lowercase words in this one long sentence here.")]
    with caplog.at_level("WARNING", logger="trainer.tasks.search.drills"):
        assert reading_drills(never, 5, lambda: object()) == []
    assert "0 of the 5 asked for" in caplog.text


def test_cloze_question_only_uses_the_visible_words():
    hidden = " ".join(["filler"] * VISIBLE_WORDS) + " Then Zanzibar won in 1999."
    assert all(cloze_question("T", hidden, random.Random(s)) is None for s in range(20))


def test_reading_drills_rejects_bad_arguments():
    with pytest.raises(ValueError, match="n >= 0"):
        reading_drills([("T", "x")], -1, lambda: None)
    with pytest.raises(ValueError, match="passages"):
        reading_drills([], 3, lambda: None)


# -- through the real env and retriever ---------------------------------------------------------

@pytest.fixture(scope="module")
def passages():
    return [(p.title, p.text) for p in iter_corpus(CORPUS)]


def make_env(url: str):
    return lambda: environments.make("search", retriever_url=url, topk=1)


def test_reading_drills_are_real_searches_answered_from_the_block(retriever_url, passages):  # noqa: F811
    drills = reading_drills(passages, 60, make_env(retriever_url), seed=3)
    assert len(drills) == 60
    assert drills == reading_drills(passages, 60, make_env(retriever_url), seed=3)  # seeded
    env = make_env(retriever_url)()
    try:
        for d in drills:
            (k1, search), (k2, obs), (k3, answer) = d.pieces
            assert (k1, k2, k3) == ("action", "observation", "action")
            query = SearchTool.pattern.fullmatch(search).group(1).strip()
            span = ANSWER_PATTERN.search(answer).group(1).strip()
            assert span in information_text(obs)                # copied as written in the block
            assert span.lower() not in query.lower()               # the answer is not given away
            # replay: the same prompt, the same block from the retriever, EM 1 for the answer
            sample = {"id": "r", "question": query, "golden_answers": [span]}
            assert env.reset(options={"sample": sample})[0] == d.prompt
            replay_obs, _, term, _, _ = env.step(search)
            assert replay_obs == obs and not term
            _, reward, term, _, _ = env.step(answer)
            assert term and reward == 1.0
    finally:
        env.close()


def test_reading_drills_stop_at_n_and_never_use_dataset_questions(retriever_url, passages):  # noqa: F811
    from environments.search.env import load_qa

    questions = {" ".join(r["question"].lower().split()) for n in ("nq", "hotpotqa", "triviaqa", "popqa")
                 for r in load_qa(n, str(QA_DIR))}
    drills = reading_drills(passages, 25, make_env(retriever_url), seed=0)
    assert len(drills) == 25
    for d in drills:
        q = SearchTool.pattern.fullmatch(d.pieces[0][1]).group(1).strip()
        assert " ".join(q.lower().split()) not in questions
    assert reading_drills(passages, 0, make_env(retriever_url)) == []


def test_search_task_mixes_query_and_reading_drills(retriever_url):  # noqa: F811
    cfg = load_config(CPU_TINY, [f"task.settings.retriever_url={retriever_url}", f"task.data_dir={QA_DIR}"])
    with build_task(task_spec(cfg)) as task:
        drills = task.drill_traces(40, seed=0, reading_fraction=0.25)
    assert len(drills) == 40
    shapes = [len(d.pieces) for d in drills]
    assert shapes.count(1) == 30 and shapes.count(3) == 10   # 30 query drills, 10 reading drills

