"""Search env reliability (issue 9): empty-normalising golden answers and predictions never
match, and a search without hits is reported as such. Real NQ rows from the shared data and
the real retriever server."""

from __future__ import annotations

import re

import pytest

from environments.search import (
    NO_RESULTS,
    SearchEnv,
    exact_match,
    f1_score,
    format_passages,
    load_qa,
    normalize_answer,
    substring_match,
)

METRICS = {"em": exact_match, "substring_em": substring_match, "f1": f1_score}
EMPTY_PREDICTIONS = ["", "   ", "the", "?", "---", "a an the", " . , ! "]


def _nq_row(row_id: str) -> dict:
    rows = [r for r in load_qa("nq") if r["id"] == row_id]
    assert len(rows) == 1, row_id
    return rows[0]


def _scores(pred: str, golden: list[str]) -> dict[str, float]:
    return {name: fn(pred, golden) for name, fn in METRICS.items()}


ZERO = {"em": 0.0, "substring_em": 0.0, "f1": 0.0}
ONE = {"em": 1.0, "substring_em": 1.0, "f1": 1.0}


def test_nq_test_1420_punctuation_golden_matches_nothing():
    row = _nq_row("test_1420")
    assert row["golden_answers"] == ["---"] and normalize_answer("---") == ""
    for pred in [*EMPTY_PREDICTIONS, "pigs", "there are many breeds"]:
        assert _scores(pred, row["golden_answers"]) == ZERO, pred


def test_nq_test_1986_real_answers_still_match_next_to_star():
    row = _nq_row("test_1986")
    golden = row["golden_answers"]
    assert golden == ["a rotationally symmetric saltire", "the symbol ×", "*"]
    for pred in [*EMPTY_PREDICTIONS, "*"]:
        assert _scores(pred, golden) == ZERO, pred
    assert _scores("symbol ×", golden) == {"em": 1.0, "substring_em": 1.0, "f1": 1.0}
    assert _scores("A rotationally symmetric saltire.", golden)["em"] == 1.0
    # "×" alone: tokens {×} vs {symbol, ×}: P = 1, R = 1/2 -> F1 = 2/3; not EM, not substring.
    assert _scores("×", golden) == {"em": 0.0, "substring_em": 0.0, "f1": pytest.approx(2 / 3)}


def test_synthetic_mixed_golden_lists():
    golden = ["---", "Paris"]
    for pred in EMPTY_PREDICTIONS:
        assert _scores(pred, golden) == ZERO, pred
    assert _scores("Paris", golden) == {"em": 1.0, "substring_em": 1.0, "f1": 1.0}
    assert _scores("the Paris!", golden) == {"em": 1.0, "substring_em": 1.0, "f1": 1.0}
    # tokens {city, of, paris} vs {paris}: P = 1/3, R = 1 -> F1 = 2 * 1/3 / (4/3) = 1/2.
    assert _scores("the city of Paris", golden) == {"em": 0.0, "substring_em": 1.0, "f1": 0.5}
    assert _scores("Lyon", golden) == ZERO
    # Only empty-normalising golden answers, or none at all.
    for golden in (["...", " "], []):
        for pred in ["", "a", "Paris"]:
            assert _scores(pred, golden) == ZERO, (pred, golden)
    # "a" is made only of an article: kept unstripped, matched by exactly that answer (issue 21)
    for pred, expected in [("", ZERO), ("Paris", ZERO), ("a", ONE), ("A.", ONE)]:
        assert _scores(pred, ["a", "...", " "]) == expected, pred
    # An empty prediction never matches a real answer either.
    assert _scores("", ["Paris"]) == ZERO


def test_gold_made_only_of_articles_is_matched_by_exactly_that_answer():
    """Issue 21 item 14: "The The" (a band) and "A" normalise to ""; their unstripped form
    (lowercase, punctuation removed, articles kept) is used instead, so exactly that answer
    matches and nothing else does (in particular not every sentence holding "the")."""
    for golden, exact in [(["The The"], ["The The", "the the", " THE  the! "]), (["A"], ["A", "a", "a."])]:
        for pred in exact:
            assert _scores(pred, golden) == ONE, (pred, golden)
        for pred in ["", "   ", "?", "---", "Paris", "the the band", "an", "I like the the"]:
            assert _scores(pred, golden)["em"] == 0.0, (pred, golden)
            assert _scores(pred, golden)["substring_em"] == 0.0, (pred, golden)
    # token F1 against the article-only form: {the} vs {the, the}: P = 1, R = 1/2 -> F1 = 2/3
    assert _scores("The", ["The The"]) == {"em": 0.0, "substring_em": 0.0, "f1": pytest.approx(2 / 3)}
    # a real answer beside it is normalised as before (articles dropped)
    assert _scores("the Beatles", ["The The", "Beatles"]) == ONE
    # an empty answer never matches, whatever the golden list
    for golden in (["The The"], ["A"], ["a", "the"], ["---"], []):
        assert _scores("", golden) == ZERO and _scores(" . ", golden) == ZERO


@pytest.mark.parametrize("reward", ["em", "substring_em", "f1"])
def test_env_reward_test_1420_real_server(retriever_url, reward):
    row = _nq_row("test_1420")
    env = SearchEnv(retriever_url=retriever_url, reward=reward)
    for answer in ["", " the ", " ? ", "---"]:
        env.reset(options={"sample": row})
        obs, r, term, trunc, info = env.step(f"<search>{row['question']}</search>")
        assert obs.startswith("\n\n<information>Doc 1(Title: ") and not term
        obs, r, term, trunc, info = env.step(f"<think>x</think><answer>{answer}</answer>")
        assert (r, term, trunc) == (0.0, True, False), answer
        assert info["reward_components"] == {**ZERO, "has_answer": 1.0}
    env.close()


def test_no_results_block_real_server(retriever_url):
    assert format_passages([]) == NO_RESULTS == "No results found for this query."
    env = SearchEnv(retriever_url=retriever_url)
    env.reset(options={"sample": {"id": "q", "question": "who?", "golden_answers": ["x"]}})
    for query in ["the of and a to", "zzqxv flurbnik", "?!? ..."]:
        obs, r, term, trunc, info = env.step(f"<search> {query} </search>")
        assert obs == "\n\n<information>No results found for this query.</information>\n\n"
        assert r == 0.0 and not (term or trunc or info["invalid"])
    # "Cocteau" occurs in exactly two passages (rows 18 and 6084): two docs, not three.
    env.reset(options={"sample": {"id": "q", "question": "who?", "golden_answers": ["x"]}})
    obs, *_ = env.step("<search>Cocteau</search>")
    assert obs.startswith("\n\n<information>Doc 1(Title: ") and obs.endswith("</information>\n\n")
    assert "Doc 2(Title: " in obs and "Doc 3" not in obs
    assert "(Title: Eileen Herlie)" in obs and "(Title: Beauty and the Beast (1946 film))" in obs
    env.close()


def test_retriever_down_is_an_infrastructure_failure_not_an_observation(retriever_url):
    """A retriever that does not answer must not be shown to the policy (nor scored 0)."""
    import socket

    from environments.errors import InfrastructureError
    from retriever.client import ClientConfig, RetrieverClient

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    env = SearchEnv(retriever=RetrieverClient(ClientConfig(url=dead, max_retries=1, backoff_s=0.01)))
    env.reset(options={"sample": {"id": "q", "question": "who?", "golden_answers": ["x"]}})
    with pytest.raises(InfrastructureError, match=r"retriever failed: RetrieverUnavailableError"):
        env.step("<search>Cocteau</search>")
    env.close()
    # a query the server rejects (too long: HTTP 422) is the policy's doing: it sees why
    env = SearchEnv(retriever_url=retriever_url)
    env.reset(options={"sample": {"id": "q", "question": "who?", "golden_answers": ["x"]}})
    obs, reward, term, trunc, _ = env.step(f"<search>{'word ' * 20000}</search>")
    assert obs.startswith("\n\n<information>search failed: ") and reward == 0.0 and not (term or trunc)
    env.close()


def test_nested_settings_from_yaml_mappings_and_bad_values(retriever_url):
    """YAML gives ``limits`` as a mapping: it is built into EnvLimits (other limits kept)."""
    env = SearchEnv(retriever_url=retriever_url, limits={"max_turns": 2})
    assert env.limits.max_turns == 2 and env.limits.max_tool_calls == SearchEnv(
        retriever_url=retriever_url).limits.max_tool_calls
    for kwargs, needle in [({"limits": 5}, "SearchConfig.limits=5: must be a mapping of EnvLimits fields"),
                           ({"topk": 1000}, "SearchConfig.topk=1000: must be an int in [1, 100]"),
                           ({"prompt_template": "Q {question} {"}, "not a str.format template")]:
        with pytest.raises(ValueError, match=re.escape(needle)):
            SearchEnv(retriever_url=retriever_url, **kwargs)
