"""The harness endpoint records a call cut at ``rollout.max_new_tokens`` (issue 45, item 4): the
episode's ``info["length_capped"]`` feeds ``rollout/truncated_fraction`` and the truncation warning,
so a hidden response cap (the harness example once ran behind 16 tokens) shows. A real endpoint,
the real embedded engine, the example agent; the tiny model's tokens scripted."""

from __future__ import annotations

import asyncio

import pytest
from scripted import scripted

from trainer.engines.base import SamplingParams
from trainer.engines.embedded import EmbeddedEngine
from trainer.harness.env import HarnessEnv
from trainer.orchestration.step_metrics import truncation_metrics
from trainer.rollout.agent_loop import AgentLoopConfig

from . import test_harness as th

pytestmark = pytest.mark.usefixtures("one_torch_thread")
chat_model_tok = th.chat_model_tok  # the fixture, shared


def _play(model, tok, max_new_tokens: int):
    async def main():
        eng = EmbeddedEngine(model, tok, logits_processor=scripted(tok, th.ACTIONS, th.turn_of))
        env = HarnessEnv(agent=th.AGENT)
        try:
            return await env.play_episode(eng, tok, th.ROW, SamplingParams(max_new_tokens=max_new_tokens),
                                          AgentLoopConfig())
        finally:
            env.close()
            await eng.close()
    return asyncio.run(main())


def test_a_call_cut_by_the_cap_is_recorded(chat_model_tok):
    model, tok = chat_model_tok
    cut = _play(model, tok, 4)  # the first tool call is cut after 4 tokens: the agent gets no tool call
    whole = _play(model, tok, 120)
    assert cut.info["length_capped"] is True and cut.info["harness_calls"] == 1 and cut.reward == 0.0
    assert whole.info["length_capped"] is False and whole.info["harness_calls"] == 3 and whole.reward > 1.0
    assert truncation_metrics([cut, whole]) == {"rollout/max_new_tokens_cut_fraction": 0.5,
                                                "rollout/truncated_fraction": 0.5}
