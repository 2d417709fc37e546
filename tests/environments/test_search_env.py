"""Search-R1 env: scripted episodes against the real retriever server on the shared corpus."""

from __future__ import annotations

import pytest

from environments.search import (
    INVALID_ACTION_REPLY,
    SearchEnv,
    exact_match,
    f1_score,
    load_qa,
    normalize_answer,
    substring_match,
)


def test_squad_normalisation_and_scores():
    assert normalize_answer("  The  Eiffel-Tower!! ") == "eiffeltower"
    assert normalize_answer("An apple, a pear") == "apple pear"
    assert exact_match("the Beatles", ["Beatles", "x"]) == 1.0
    assert exact_match("Beatles band", ["Beatles"]) == 0.0
    assert substring_match("the Beatles band", ["Beatles"]) == 1.0
    # F1: pred tokens {paris, france}, gold {paris}: P = 1/2, R = 1 -> F1 = 2/3
    assert f1_score("Paris France", ["Paris"]) == pytest.approx(2 / 3)
    assert f1_score("Lyon", ["Paris", "Lyon city"]) == pytest.approx(2 / 3)


def test_search_episode_real_server(retriever_url):
    from retriever.client import ClientConfig, RetrieverClient

    client = RetrieverClient(ClientConfig(url=retriever_url))
    rows = load_qa("hotpotqa", limit=40)
    # a question whose golden answer is in the top-3 passages for the question itself
    chosen = None
    for row in rows:
        hits = client.retrieve([row["question"]], topk=3)[0]
        text = " ".join(h["document"]["contents"] for h in hits)
        ans = row["golden_answers"][0]
        if len(ans) > 3 and ans.lower() not in ("yes", "no") and ans in text:
            chosen = row
            break
    assert chosen is not None
    env = SearchEnv(retriever=client)
    obs, info = env.reset(options={"sample": chosen})
    assert chosen["question"].rstrip("?") in obs and "<search>" in obs
    obs, r, term, trunc, info = env.step(f"<think>I need to look it up.</think>\n"
                                         f"<search>{chosen['question']}</search>")
    assert obs.startswith("\n\n<information>Doc 1(Title: ") and "Doc 3(Title: " in obs
    assert chosen["golden_answers"][0] in obs and info["tool_calls"] == 1
    obs, r, term, trunc, info = env.step(
        f"<think>found it</think>\n<answer> {chosen['golden_answers'][0]} </answer>")
    assert (obs, r, term, trunc) == ("", 1.0, True, False)
    assert info["reward_components"]["em"] == 1.0 and info["reward_components"]["f1"] == 1.0
    env.close()
    client.close()


def test_invalid_action_wrong_answer_and_turn_limit(retriever_url):
    env = SearchEnv(retriever_url=retriever_url)
    sample = {"id": "q", "question": "Who wrote Hamlet", "golden_answers": ["Shakespeare"]}
    env.reset(options={"sample": sample})
    obs, r, term, trunc, info = env.step("I think I know")  # neither tag
    assert obs == INVALID_ACTION_REPLY and info["invalid"] and not term
    obs, r, term, trunc, info = env.step("<search>Hamlet author")  # unclosed tag
    assert obs == INVALID_ACTION_REPLY and info["invalid"]
    obs, r, term, trunc, info = env.step("<answer>Marlowe</answer>")
    assert (r, term, info["final_answer"]) == (0.0, True, "Marlowe")
    env.reset(options={"sample": sample})
    for _ in range(3):
        obs, r, term, trunc, info = env.step("<search>Hamlet</search>")
        assert "<information>" in obs and not (term or trunc)
    obs, r, term, trunc, info = env.step("<search>Hamlet</search>")  # 4th = max_turns
    assert (obs, r, term, trunc, info["turn"]) == ("", 0.0, False, True, 4)
    env.close()


def test_substring_em_reward_option():
    class One:
        def retrieve(self, queries, topk=None):
            return [[] for _ in queries]

    env = SearchEnv(retriever=One(), reward="substring_em")
    env.reset(options={"sample": {"id": "q", "question": "q?", "golden_answers": ["Paris"]}})
    _, r, term, _, info = env.step("<answer>the city of Paris</answer>")
    assert term and r == 1.0 and info["reward_components"]["em"] == 0.0


def test_format_score_lifts_answered_episodes_only():
    """Search-R1's format score: answered and wrong -> format_score, right -> 1, partial F1 in
    between on the same line; no answer (or an unclosed tag) -> 0; components stay the metric."""
    class Empty:
        def retrieve(self, queries, topk=None):
            return [[] for _ in queries]

    sample = {"id": "q", "question": "q?", "golden_answers": ["Paris"]}
    env = SearchEnv(retriever=Empty(), reward="f1", format_score=0.2)
    got = {}
    for action in ("<answer>Lyon</answer>", "<answer>Paris</answer>", "<answer>Paris France</answer>"):
        env.reset(options={"sample": sample})
        _, r, term, _, info = env.step(action)
        assert term
        got[action] = (r, info["reward_components"]["f1"])
    assert got["<answer>Lyon</answer>"] == (pytest.approx(0.2), 0.0)
    assert got["<answer>Paris</answer>"] == (pytest.approx(1.0), 1.0)
    # F1 2/3 -> 0.2 + 0.8 * 2/3
    assert got["<answer>Paris France</answer>"] == (pytest.approx(0.2 + 0.8 * 2 / 3), pytest.approx(2 / 3))
    env = SearchEnv(retriever=Empty(), reward="em", format_score=0.2,
                    limits={"max_turns": 1, "max_tool_calls": 1})
    env.reset(options={"sample": sample})
    _, r, term, trunc, info = env.step("<answer>Paris")  # unclosed: invalid, then out of turns
    assert (r, term, trunc) == (0.0, False, True)
    for bad in (1.0, -0.1, True, "0.1"):
        with pytest.raises(ValueError, match=r"SearchConfig.format_score="):
            SearchEnv(retriever=Empty(), format_score=bad)
