"""The harness warns once per run, naming the model, when the chat template drops ``tools``
(issue 42 item 4.6).

SmolLM2-135M-Instruct's template renders only the messages: the tool schemas an agent sends never
reach the model. Real pulled tokenizer (``realmodel_path``); a template that renders tools (the
tests' Qwen2.5-style one) is not warned about.
"""

from __future__ import annotations

import asyncio
import logging

import pytest
from bpe_tokenizer import bpe_tokenizer
from chat_tokenizer import chat_tokenizer
from harness_agent import TOOLS
from scripted import scripted
from transformers import AutoTokenizer

from trainer.engines.base import SamplingParams
from trainer.engines.embedded import EmbeddedEngine
from trainer.harness import episode
from trainer.harness.env import HarnessEnv, harness_episode
from trainer.models.tiny import TinyModelConfig, build_tiny_model
from trainer.rollout.agent_loop import AgentLoopConfig
from trainer.rollout.groups import EnvPool, run_group

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LOGGER = "trainer.harness.episode"


def _line(model: str) -> str:
    return (f"harness: the chat template of {model} ignores the requests' tools: the model never sees "
            "their schemas (describe them in the messages, as docs/harness.md's example does, or use a "
            "model whose template renders tools)")


@pytest.fixture(autouse=True)
def fresh_cache(monkeypatch):
    monkeypatch.setattr(episode, "_SHOWS_TOOLS", {})  # each test is a run of its own


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and "ignores" in r.getMessage()]


def test_smollm2_template_drops_tools_warned_once(realmodel_path, caplog):
    tok = AutoTokenizer.from_pretrained(str(realmodel_path))
    probe = [{"role": "user", "content": "?"}]
    plain = tok.apply_chat_template(probe, tokenize=False)
    assert tok.apply_chat_template(probe, tools=TOOLS, tokenize=False) == plain  # what is detected
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert episode.template_shows_tools(tok, TOOLS) is False
        assert episode.template_shows_tools(tok, TOOLS[:1]) is False  # checked once per model
    assert _warnings(caplog) == [_line(str(realmodel_path))]


def test_a_template_that_renders_tools_is_not_warned_about(caplog):
    tok = chat_tokenizer(bpe_tokenizer())
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert episode.template_shows_tools(tok, TOOLS) is True
    assert _warnings(caplog) == []


def test_the_endpoint_warns_once_per_run_naming_the_model(realmodel_path, caplog):
    """Two episodes of the openai-client agent (it sends ``tools``) on the SmolLM2 tokenizer."""
    tok = AutoTokenizer.from_pretrained(str(realmodel_path))
    model = build_tiny_model(TinyModelConfig(hidden_size=16, intermediate_size=32, num_layers=1),
                             len(tok), tok.eos_token_id, tok.pad_token_id or tok.eos_token_id)

    async def main():
        eng = EmbeddedEngine(model, tok, logits_processor=scripted(tok, ["25"], lambda _text: 0))
        pool = EnvPool(lambda: HarnessEnv(agent="tests/trainer/harness_agent.py:run", timeout_s=60), 2,
                       harness_episode)
        try:
            row = {"id": "q0", "problem": "What is (2+3)*5?", "answer": "25"}
            return await run_group(eng, pool, tok, row, 2, SamplingParams(max_new_tokens=8, seed=5),
                                   AgentLoopConfig(), uid=0)
        finally:
            await pool.close()
            await eng.close()

    with caplog.at_level(logging.WARNING, logger=LOGGER):
        trs = asyncio.run(main())
    assert [(t.finish_reason, t.reward) for t in trs] == [("terminated", 1.0), ("terminated", 1.0)]
    assert _warnings(caplog) == [_line(str(realmodel_path))]
