"""docs/harness.md's complete example agent runs: extracted from the page, played against the real
endpoint by a scripted tiny chat model (two tool calls, then the answer)."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest
from bpe_tokenizer import bpe_tokenizer
from chat_tokenizer import chat_tokenizer
from scripted import scripted

from trainer.engines.base import SamplingParams
from trainer.engines.embedded import EmbeddedEngine
from trainer.harness.env import HarnessEnv
from trainer.models.tiny import TinyModelConfig, build_tiny_model
from trainer.rollout.agent_loop import AgentLoopConfig

pytestmark = pytest.mark.usefixtures("one_torch_thread")

DOC = Path(__file__).parent.resolve().parents[2] / "docs" / "harness.md"
ACTIONS = ['<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>',
           '<tool_call>\n{"name": "mul", "arguments": {"a": 5, "b": 5}}\n</tool_call>', "25"]


def example() -> str:
    """The page's first Python block."""
    return re.search(r"```python\n(.*?)```", DOC.read_text(), re.DOTALL).group(1)


def test_the_pages_example_agent_trains_through_the_endpoint(tmp_path):
    code = example()
    assert 30 <= len(code.splitlines()) <= 45 and "from openai import AsyncOpenAI" in code
    (tmp_path / "calc_agent.py").write_text(code)
    tok = chat_tokenizer(bpe_tokenizer())
    model = build_tiny_model(TinyModelConfig(hidden_size=32, intermediate_size=64, num_layers=1),
                             len(tok), tok.eos_token_id, tok.pad_token_id)

    def turn_of(prompt_text: str) -> int:
        return min(prompt_text.count("<|im_start|>assistant\n") - 1, 2)

    async def main():
        eng = EmbeddedEngine(model, tok, logits_processor=scripted(tok, ACTIONS, turn_of))
        env = HarnessEnv(agent=f"{tmp_path / 'calc_agent.py'}:run", timeout_s=60)
        try:
            row = {"id": "r0", "problem": "What is (2+3)*5?", "answer": "25"}
            return await env.play_episode(eng, tok, row, SamplingParams(max_new_tokens=100),
                                          AgentLoopConfig())
        finally:
            env.close()
            await eng.close()

    tr = asyncio.run(main())
    assert (tr.finish_reason, tr.reward, tr.turns, tr.info["tool_calls"]) == ("terminated", 1.0, 3, 2)
    assert tok.decode(tr.model_token_ids(), skip_special_tokens=True) == "".join(ACTIONS)
