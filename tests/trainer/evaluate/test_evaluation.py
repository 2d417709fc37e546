"""Evaluation through the real agent loop, real environments and a tiny model with forced outputs."""

from __future__ import annotations

import asyncio
import math
import re
from collections import Counter

import pytest
import torch
from search_server import QA_DIR, retriever_url  # noqa: F401 - pytest fixture

from environments.math_tool import MathToolEnv
from environments.math_tool.reward import MathRewardConfig
from environments.search.env import SearchEnv
from trainer.engines.embedded import EmbeddedEngine
from trainer.evaluate.heldout import evaluate, run_eval_episodes, summarize
from trainer.evaluate.runner import eval_sampling_params
from trainer.models.tiny import TinyModelConfig, build_byte_tokenizer, build_tiny_model
from trainer.rollout.agent_loop import AgentLoopConfig
from trainer.rollout.trajectory import Trajectory
from trainer.tasks.math_tool import SHORT_MATH_PROMPT, retool_arithmetic_samples
from trainer.tasks.search import SHORT_SEARCH_PROMPT, search_r1_samples

PROBLEMS = retool_arithmetic_samples(3, seed=11)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tok():
    return build_byte_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    return build_tiny_model(TinyModelConfig(), len(tok), tok.eos_token_id, tok.pad_token_id)


def forced(tok, first_action, final_action):
    """Sampling-only logits processor forcing per-episode scripts.

    At the first token of an episode's first turn, ``first_action(prompt_text, copy)`` is
    chosen (``copy`` counts the episodes started on that prompt); turns after a tool reply
    get ``final_action(context_text)``. Scripts with distinct first tokens keep concurrent
    copies of one prompt apart. Each script is followed by EOS.
    """
    started: Counter = Counter()
    enc = lambda s: [*tok.encode(s, add_special_tokens=False), tok.eos_token_id]  # noqa: E731

    def proc(prompt_ids, new_ids, logits):
        ctx = tok.decode(prompt_ids)
        if "<interpreter>" in ctx or "<information>" in ctx:
            script = enc(final_action(ctx))
        elif not new_ids:
            script = enc(first_action(ctx, started[ctx]))
            started[ctx] += 1
        else:  # the copy's script is the one whose first token was drawn
            copies = [enc(first_action(ctx, c)) for c in range(started[ctx])]
            script = next(s for s in copies if s[0] == new_ids[0])
        out = torch.full_like(logits, -1e9)
        out[script[min(len(new_ids), len(script) - 1)]] = 0.0
        return out

    return proc


def problem_of(ctx: str) -> dict:
    return next(p for p in PROBLEMS if p["problem"] in ctx)


def math_scripts(n_correct: dict[str, int]):
    """Copies ``< n_correct[id]`` call the tool and box its output; others box a wrong number."""
    def first(ctx, copy):
        p = problem_of(ctx)
        if copy < n_correct[p["id"]]:
            expr = p["problem"].removeprefix("What is ").removesuffix("?")
            return f"Let me compute it.\n<code>\n```python\n{expr}\n```\n</code>"
        return "\\boxed{7}"

    def final(ctx):
        return "\\boxed{" + re.findall(r"<interpreter>\n(.*?)\n</interpreter>", ctx)[-1] + "}"

    return first, final


def run_math(model, tok, sandbox, n_correct, k, reward=None):
    reward = reward or MathRewardConfig(mode="dapo_strict")

    async def main():
        eng = EmbeddedEngine(model, tok, logits_processor=forced(tok, *math_scripts(n_correct)))
        try:
            return await evaluate(eng, lambda: MathToolEnv(sandbox=sandbox, prompt_template=SHORT_MATH_PROMPT,
                                                            reward=reward),
                                  tok, PROBLEMS, k=k, agent_cfg=AgentLoopConfig(max_turns=3),
                                  max_new_tokens=80, concurrency=4)
        finally:
            await eng.close()

    return asyncio.run(main())


def test_always_correct_and_always_wrong(model, tok, sandbox):
    right = run_math(model, tok, sandbox, {p["id"]: 1 for p in PROBLEMS}, k=1)
    assert right["accuracy"] == 1.0 and right["avg@1"] == 1.0 and right["mean_reward"] == 1.0
    assert right["n"] == 3 and right["episodes"] == 3 and right["mean_turns"] == 2.0
    assert right["tool_call_rate"] == 1.0 and right["finish/terminated"] == 1.0 and "em" not in right
    wrong = run_math(model, tok, sandbox, {p["id"]: 0 for p in PROBLEMS}, k=1)
    assert wrong["accuracy"] == 0.0 and wrong["mean_reward"] == 0.0
    assert wrong["mean_turns"] == 1.0 and wrong["tool_call_rate"] == 0.0


def test_avg_at_k_and_pass_at_k(model, tok, sandbox):
    """k = 4 copies of 3 problems with 4, 2, 0 correct copies; DAPO's ±1 reward."""
    n_correct = dict(zip([p["id"] for p in PROBLEMS], (4, 2, 0), strict=True))
    m = run_math(model, tok, sandbox, n_correct, k=4,
                 reward=MathRewardConfig(mode="dapo_strict", incorrect_reward=-1.0))
    assert m["episodes"] == 12 and m["n"] == 3
    assert m["accuracy"] == m["avg@4"] == pytest.approx(6 / 12)
    assert m["pass@4"] == pytest.approx(2 / 3)
    assert m["mean_reward"] == pytest.approx(0.0)  # six +1 and six -1
    assert m["mean_turns"] == pytest.approx((6 * 2 + 6 * 1) / 12)
    assert m["tool_call_rate"] == pytest.approx(0.5)


def test_greedy_is_argmax_decoding(model, tok, sandbox):
    """temperature 0 → top_k = 1: the episode's tokens are the argmax continuation."""
    assert eval_sampling_params(0.0, 5) .top_k == 1 and eval_sampling_params(0.0, 5).temperature == 1.0
    with pytest.raises(ValueError, match="temperature=-1"):
        eval_sampling_params(-1.0, 5)

    async def main():
        eng = EmbeddedEngine(model, tok)
        try:
            return await run_eval_episodes(
                eng, lambda: MathToolEnv(sandbox=sandbox, prompt_template=SHORT_MATH_PROMPT,
                                         reward=MathRewardConfig(mode="dapo_strict")),
                tok, PROBLEMS[:2], k=2, agent_cfg=AgentLoopConfig(max_turns=1), max_new_tokens=12)
        finally:
            await eng.close()

    trajs = asyncio.run(main())
    assert len(trajs) == 4
    for tr in trajs:
        ids = list(tr.prompt_ids)
        with torch.no_grad():
            for _ in range(len(tr.response_ids)):
                ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
        assert ids[len(tr.prompt_ids):] == tr.response_ids
    assert trajs[0].response_ids == trajs[1].response_ids
    m = summarize(trajs, k=2)
    assert m["accuracy"] == 0.0 and m["n"] == 2
    with pytest.raises(ValueError, match="multiple of k=3"):
        summarize(trajs, k=3)


def test_bad_arguments(model, tok, sandbox):
    with pytest.raises(ValueError, match="k=0"):
        asyncio.run(evaluate(None, MathToolEnv, tok, PROBLEMS, k=0))
    with pytest.raises(ValueError, match="samples is empty"):
        asyncio.run(evaluate(None, MathToolEnv, tok, [], k=1))


def test_search_exact_match_with_real_retriever(model, tok, retriever_url):  # noqa: F811
    questions = search_r1_samples(("nq", "hotpotqa"), n=4, seed=0, data_dir=str(QA_DIR))
    by_q = {q["question"].strip(): q for q in questions}

    def question_of(ctx):
        return next(v for k, v in by_q.items() if k in ctx)

    def first(ctx, copy):
        return f"<search>{question_of(ctx)['question'].strip()}</search>"

    def make(final):
        async def main():
            eng = EmbeddedEngine(model, tok, logits_processor=forced(tok, first, final))
            try:
                return await evaluate(eng, lambda: SearchEnv(retriever_url=retriever_url,
                                                             prompt_template=SHORT_SEARCH_PROMPT),
                                      tok, questions, agent_cfg=AgentLoopConfig(max_turns=3),
                                      max_new_tokens=200, concurrency=4)
            finally:
                await eng.close()
        return asyncio.run(main())

    right = make(lambda ctx: f"<answer>{question_of(ctx)['golden_answers'][0]}</answer>")
    assert right["em"] == 1.0 and right["accuracy"] == 1.0 and right["tool_call_rate"] == 1.0
    assert right["mean_turns"] == 2.0 and right["n"] == 4
    wrong = make(lambda ctx: "<answer>qwertyuiop</answer>")
    assert wrong["em"] == 0.0 and wrong["accuracy"] == 0.0 and wrong["tool_call_rate"] == 1.0


def _traj(reward: float, reason: str = "terminated") -> Trajectory:
    tr = Trajectory(prompt_ids=[1], finish_reason=reason, reward=reward)
    tr.append_model_tokens([2, 3], [-0.1, -0.2], 0)
    return tr


def test_infra_failures_are_excluded_not_scored_zero():
    """An episode ended by a sandbox/retriever/engine failure is not a wrong answer."""
    trajs = [_traj(1.0), _traj(0.0, "infra_error: sandbox died"),          # problem 0: 1/1 scored
             _traj(0.0), _traj(1.0),                                       # problem 1: 1/2
             _traj(0.0, "engine_error: boom"), _traj(0.0, "infra_error: retriever down")]  # problem 2: none
    m = summarize(trajs, k=2)
    assert m["n"] == 2.0 and m["episodes"] == 3.0 and m["infra_failed"] == 3.0
    assert m["accuracy"] == m["avg@2"] == pytest.approx((1.0 + 0.5) / 2)
    assert m["pass@2"] == 1.0 and m["mean_reward"] == pytest.approx(2 / 3)
    assert m["finish/infra_error"] == pytest.approx(2 / 6) and m["finish/terminated"] == pytest.approx(3 / 6)
    every = summarize([_traj(0.0, "infra_error: retriever down")] * 2, k=2)
    assert every["n"] == 0.0 and every["infra_failed"] == 2.0 and math.isnan(every["accuracy"])


def test_a_bug_in_the_environment_fails_the_evaluation(model, tok):
    """An env that raises (not InfrastructureError) is a bug: never scored, never silently dropped."""
    class Buggy(SearchEnv):
        def step(self, action):
            raise KeyError("golden_answerz")

    async def main():
        eng = EmbeddedEngine(model, tok)
        try:
            return await run_eval_episodes(eng, lambda: Buggy(retriever=object.__new__(_NoRetriever)), tok,
                                           [{"id": "q1", "question": "?", "golden_answers": ["x"]}],
                                           agent_cfg=AgentLoopConfig(max_turns=1), max_new_tokens=4)
        finally:
            await eng.close()

    with pytest.raises(RuntimeError, match=r"environment raised on 1 of 1 episodes; first \(sample 'q1'\): "
                                           r"env_error: KeyError: 'golden_answerz'"):
        asyncio.run(main())


class _NoRetriever:
    def retrieve(self, queries, topk=None):
        return [[] for _ in queries]
