"""The harness endpoint (``task.env: harness``): a real ``openai``-client agent against the real
endpoint on 127.0.0.1, a scripted tiny Qwen-style chat model on the embedded engine.

Checked: the trajectory is the sampled ids (never re-tokenised) with the tool results masked and
equals the template's rendering of the whole conversation; the behaviour log-probs equal a full
forward's; an edited history is detected, counted and the episode dropped (still answered); the
failure semantics (agent raises / times out, engine failure, unknown and finished keys, loopback).
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import torch
from bpe_tokenizer import bpe_tokenizer
from chat_tokenizer import chat_tokenizer
from harness_agent import TOOLS
from scripted import runs, scripted

from trainer.engines.base import EngineError, SamplingParams
from trainer.engines.embedded import EmbeddedEngine
from trainer.harness.env import HarnessEnv, harness_episode, reward_of
from trainer.harness.wire import assistant_message
from trainer.logprobs import sequence_logprobs
from trainer.models.tiny import TinyModelConfig, build_tiny_model
from trainer.rollout.agent_loop import AgentLoopConfig
from trainer.rollout.groups import EnvPool, run_group

pytestmark = pytest.mark.usefixtures("one_torch_thread")

AGENT = "tests/trainer/harness_agent.py:run"
ROW = {"id": "q0", "problem": "What is (2+3)*5?", "answer": "25"}
ACTIONS = ['<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>',
           'Now multiply.\n<tool_call>\n{"name": "mul", "arguments": {"a": 5, "b": 5}}\n</tool_call>', "25"]


def turn_of(prompt_text: str) -> int:
    """Scripted turn = generation prompts so far - 1 (one per model turn), at most the last."""
    return min(prompt_text.count("<|im_start|>assistant\n") - 1, len(ACTIONS) - 1)


@pytest.fixture(scope="module")
def chat_model_tok():
    tok = chat_tokenizer(bpe_tokenizer())
    model = build_tiny_model(TinyModelConfig(hidden_size=32, intermediate_size=64, num_layers=1),
                             len(tok), tok.eos_token_id, tok.pad_token_id)
    return model, tok


def play(model, tok, agent=AGENT, timeout_s=60.0, engine=None, cfg=None):
    """One episode through run_group (the group runner the loop and evaluation use)."""
    async def main():
        eng = engine or EmbeddedEngine(model, tok, logits_processor=scripted(tok, ACTIONS, turn_of),
                                       version=3)
        pool = EnvPool(lambda: HarnessEnv(agent=agent, timeout_s=timeout_s), 1, harness_episode)
        try:
            [tr] = await run_group(eng, pool, tok, ROW, 1, SamplingParams(max_new_tokens=120, seed=5),
                                   cfg or AgentLoopConfig(), uid=0)
        finally:
            await pool.close()
            await eng.close()
        return tr

    return asyncio.run(main())


def test_openai_agent_episode_is_the_sampled_tokens(chat_model_tok):
    model, tok = chat_model_tok
    tr = play(model, tok)
    assert (tr.finish_reason, tr.turns, tr.info["harness_calls"], tr.info["harness_history_edits"]) == \
        ("terminated", 3, 3, 0)
    assert tr.reward == pytest.approx(1.1)
    assert tr.info["reward_components"] == {"correct": 1.0, "tool_bonus": 0.1}
    assert tr.token_rewards() == {len(tr.response_ids) - 1: pytest.approx(1.1)}  # on the last model token
    # model tokens: exactly what was sampled (each action's ids, then EOS <|im_end|>)
    want = [[*tok.encode(a, add_special_tokens=False), tok.eos_token_id] for a in ACTIONS]
    assert runs(tr, masked=True) == want
    # everything else masked: the tool results as the template's tool turns
    turn = "\n<|im_start|>user\n<tool_response>\n{}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert [tok.decode(r) for r in runs(tr, masked=False)] == [turn.format("5"), turn.format("25")]
    # parity with the chat template's rendering of the whole conversation tokenised at once
    msgs = [{"role": "user", "content": ROW["problem"]}]
    for a, result in zip(ACTIONS, ["5", "25", None], strict=True):
        msgs.append({"role": "assistant", "content": a})
        if result is not None:
            msgs.append({"role": "tool", "tool_call_id": "c", "name": "x", "content": result})
    full = tok.encode(tok.apply_chat_template(msgs, tools=TOOLS, tokenize=False), add_special_tokens=False)
    assert tr.prompt_ids + tr.response_ids == full[:-1]  # the template's final "\n" is never generated
    # behaviour log-probs = a full forward's over the trajectory
    ids = torch.tensor([tr.prompt_ids + tr.response_ids])
    lp = sequence_logprobs(model, ids, torch.ones_like(ids), 1.0)[0, len(tr.prompt_ids):]
    mask = torch.tensor(tr.loss_mask, dtype=torch.bool)
    assert (lp - torch.tensor(tr.logp_mu))[mask].abs().max().item() < 1e-5
    assert {v for v, m in zip(tr.versions, tr.loss_mask, strict=True) if m} == {3}
    # where the time went: the engine's calls, the agent's side, the endpoint's own work
    assert all(isinstance(tr.info[k], float) and tr.info[k] >= 0 for k in ("llm_s", "env_s", "other_s"))
    assert tr.info["llm_s"] > 0 and tr.info["env_s"] > 0


EDITING_AGENT = '''
from openai import AsyncOpenAI
from harness_agent import TOOLS, run_tool
import json

async def run(base_url, api_key, row):
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": row["problem"]}]
    for turn in range(3):
        reply = await client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
        msg = reply.choices[0].message
        messages.append(msg.model_dump(exclude_none=True))
        if turn == 1:  # the agent rewrites the model's first call (context management, say)
            messages[1]["tool_calls"][0]["function"]["arguments"] = '{"a": 2, "b": 4}'
        for call in msg.tool_calls or []:
            messages.append({"role": "tool", "tool_call_id": call.id, "name": call.function.name,
                             "content": run_tool(call.function.name, json.loads(call.function.arguments))})
    await client.close()
    return 1.0
'''


def test_edited_history_drops_the_episode_and_is_counted(chat_model_tok, tmp_path):
    model, tok = chat_model_tok
    (tmp_path / "editing.py").write_text(EDITING_AGENT)
    tr = play(model, tok, agent=f"{tmp_path / 'editing.py'}:run")
    assert tr.finish_reason == ("history_edited: call 3: message 1 (assistant) differs from the one the "
                                "endpoint knows")
    assert tr.infra_failed and not tr.env_failed and tr.reward == 0.0  # excluded, never trained on
    assert tr.info["harness_calls"] == 3 and tr.info["harness_history_edits"] == 1  # still answered
    assert tr.turns == 2  # the trajectory holds only the calls made before the edit


FAILING_AGENTS = {
    "raises": "async def run(base_url, api_key, row):\n    raise KeyError('no such column: question2')\n",
    "sleeps": "import asyncio\nasync def run(base_url, api_key, row):\n    await asyncio.sleep(30)\n",
    "silent": "async def run(base_url, api_key, row):\n    return 1.0\n",
    "bad_reward": ("from harness_agent import run as play\nasync def run(base_url, api_key, row):\n"
                   "    await play(base_url, api_key, row)\n    return float('nan')\n"),
}


@pytest.mark.parametrize(("name", "want", "infra", "env_bug"), [
    ("raises", "env_error: harness agent raised: KeyError: 'no such column: question2'", False, True),
    ("sleeps", "infra_error: harness agent timed out after 0.5 s", True, False),
    ("silent", "env_error: harness agent returned without calling the model", False, True),
    ("bad_reward", "env_error: bad reward: the agent returned nan: expected a finite number or a dict "
     "of them", False, True),
])
def test_agent_failures(chat_model_tok, tmp_path, name, want, infra, env_bug):
    model, tok = chat_model_tok
    (tmp_path / f"{name}.py").write_text(FAILING_AGENTS[name])
    tr = play(model, tok, agent=f"{tmp_path / name}.py:run", timeout_s=0.5 if name == "sleeps" else 60)
    assert (tr.finish_reason, tr.infra_failed, tr.env_failed, tr.reward) == (want, infra, env_bug, 0.0)


class FailingEngine:
    """An engine whose every call fails (a dead inference server)."""

    version = 0

    async def generate(self, prompt_ids, params):
        raise EngineError("connection refused")

    async def close(self):
        pass


def test_engine_failure_is_an_infrastructure_failure(chat_model_tok):
    model, tok = chat_model_tok
    tr = play(model, tok, engine=FailingEngine(), cfg=AgentLoopConfig(engine_retries=1, retry_backoff_s=0.0))
    assert tr.finish_reason == "engine_error: connection refused" and tr.infra_failed and not tr.env_failed


KEYS_AGENT = '''
import httpx

async def run(base_url, api_key, row):
    body = {"model": "m", "messages": [{"role": "user", "content": row["problem"]}]}
    async with httpx.AsyncClient() as c:
        codes = [(await c.post(base_url + "/chat/completions", json=body,
                               headers={"Authorization": "Bearer " + k})).status_code
                 for k in ("copc-not-a-key", api_key)]
        codes.append((await c.post(base_url + "/chat/completions", content=b"{",
                                   headers={"Authorization": "Bearer " + api_key})).status_code)
        codes.append((await c.post(base_url + "/chat/completions", json={**body, "stream": True},
                                   headers={"Authorization": "Bearer " + api_key})).status_code)
    SEEN.update(base_url=base_url, api_key=api_key, codes=codes)
    return 0.0

SEEN = {}
'''


def test_keys_loopback_and_finished_episodes(chat_model_tok, tmp_path):
    import importlib.util

    model, tok = chat_model_tok
    (tmp_path / "keys.py").write_text(KEYS_AGENT)
    spec = importlib.util.spec_from_file_location("keys_agent", tmp_path / "keys.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)

    async def main():
        eng = EmbeddedEngine(model, tok, logits_processor=scripted(tok, ACTIONS, turn_of))
        env = HarnessEnv(agent=AGENT)
        env.agent = mod.run
        tr = await env.play_episode(eng, tok, ROW, SamplingParams(max_new_tokens=120), AgentLoopConfig())
        seen = mod.SEEN
        async with httpx.AsyncClient() as c:  # the episode is over: its key is refused with 410
            late = await c.post(seen["base_url"] + "/chat/completions", json={"messages": []},
                                headers={"Authorization": "Bearer " + seen["api_key"]})
        env.close()
        await eng.close()
        return tr, seen, late

    tr, seen, late = asyncio.run(main())
    assert seen["base_url"].startswith("http://127.0.0.1:") and seen["base_url"].endswith("/v1")
    assert seen["codes"] == [401, 200, 400, 400]
    assert late.status_code == 410 and late.json()["error"]["type"] == "episode_finished"
    assert tr.finish_reason == "terminated" and tr.turns == 1


def test_reward_of_and_settings():
    assert reward_of(1) == (1.0, {})
    assert reward_of({"a": 0.5, "b": 0.25}) == (0.75, {"a": 0.5, "b": 0.25})
    for bad in (True, "1", {"a": None}, float("inf")):
        with pytest.raises(ValueError, match="expected a finite number"):
            reward_of(bad)
    with pytest.raises(ValueError, match=r"HarnessEnv.agent='nomodule': must be 'pkg.module:function'"):
        HarnessEnv(agent="nomodule")
    with pytest.raises(ValueError, match=r"HarnessEnv.agent='json:dumps': 'json' has no async function"):
        HarnessEnv(agent="json:dumps")
    with pytest.raises(ValueError, match=r"HarnessEnv.timeout_s=0: must be a number > 0"):
        HarnessEnv(agent=AGENT, timeout_s=0)
    assert json.loads(json.dumps(TOOLS))[0]["function"]["name"] == "add"


def test_the_episode_is_the_tasks_named_seam(tmp_path):
    """Which episode a pool plays is the task's ``episode()``: the tool-environment loop by default,
    the agent for ``harness``, whose environment is no ``gymnasium.Env`` and has no ``step``."""
    import gymnasium

    from trainer.config import load_config
    from trainer.config.specs import task_spec
    from trainer.rollout.agent_loop import run_episode
    from trainer.tasks import Task, task_class
    from trainer.tasks.harness import HarnessTask

    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps(ROW) + "\n")
    cfg = load_config(None, ["task.env=harness", f"task.train_data=[{rows}]",
                             f"task.env_kwargs.agent={AGENT}"])
    spec = task_spec(cfg)
    assert task_class("harness") is HarnessTask and HarnessTask(spec, "harness").episode() is harness_episode
    assert Task(spec, "math_tool").episode() is run_episode
    assert EnvPool(lambda: None, 1).episode is run_episode
    env = HarnessEnv(agent=AGENT)
    try:
        assert not isinstance(env, gymnasium.Env) and not hasattr(env, "step")
        assert json.loads(env.reset(options={"sample": ROW})[0]) == ROW
    finally:
        env.close()
    with pytest.raises(TypeError, match="harness_episode: expected a HarnessEnv, got object"):
        asyncio.run(harness_episode(None, object(), None, ROW, SamplingParams()))


def test_budgets_end_the_episode_without_reward(chat_model_tok):
    model, tok = chat_model_tok
    # the agent's third call is refused (400): the episode ends max_turns, reward 0, not an agent bug
    tr = play(model, tok, cfg=AgentLoopConfig(max_turns=2))
    assert (tr.finish_reason, tr.reward, tr.turns, tr.env_failed) == ("max_turns", 0.0, 2, False)
    # the episode's token budget runs out in the second turn (the prompt alone is ~760 tokens)
    limit = len(play(model, tok).prompt_ids) + 40
    tr = play(model, tok, cfg=AgentLoopConfig(max_total_tokens=limit))
    assert (tr.finish_reason, tr.reward, tr.env_failed) == ("max_total_tokens", 0.0, False)
    assert 1 <= tr.turns < 3 and len(tr.prompt_ids) + len(tr.response_ids) <= limit


def test_openai_format_tool_calls_and_malformed_calls():
    call = ('{"tool_calls": [{"id": "x", "type": "function", '
            '"function": {"name": "add", "arguments": "{\\"a\\": 1}"}}]}')
    msg = assistant_message(call, "openai", "call_1")
    assert msg == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1_0", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}]}
    hermes = 'I will add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    assert assistant_message(hermes, "hermes", "call_2")["content"] == "I will add."
    broken = '<tool_call>\n{"name": "add", "arguments": {"a": 1}\n</tool_call>'  # invalid JSON: kept as text
    assert assistant_message(broken, "hermes", "call_3") == {"role": "assistant", "content": broken}
    assert assistant_message("25", "openai", "call_4") == {"role": "assistant", "content": "25"}
