"""The harness endpoint's overhead per call: ``POST /v1/chat/completions`` vs ``engine.generate``.

Both paths generate the same completion (a scripted tiny chat model on the embedded engine: the
same 12 tokens from the same prompt). Direct: ``await engine.generate(prompt_ids, params)`` with
the prompt already rendered. Endpoint: the same messages posted to the endpoint on 127.0.0.1 with
an ``httpx`` keep-alive client from the engine's event loop, as an agent does — one new episode per
call, so each call renders the messages with the chat template and builds the response (a later
call of an episode renders only its new messages). Calls alternate between the two paths; p50/p99
latency (ms) of each is printed, and the per-call overhead: an endpoint call's latency minus the
time of its own ``engine.generate`` (paired, so the engine's variance on a loaded machine cancels;
the unpaired p50 difference is printed too), also through the ``openai`` client (its client-side
cost included) for reference, and a whole endpoint call with an engine that answers at once (the
endpoint's own cost, client included). Then 3-call episodes (the messages sent back with a new user
turn each time, as an agent does): the paired overhead of every call, and of the later calls alone
(they render only the new messages). Goal (issue 25): the endpoint adds <= 2 ms p50 per call
(judged on the paired overhead of the episodes' calls with the real engine; the first-call number
is printed beside it).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "trainer"))

from bpe_tokenizer import bpe_tokenizer
from chat_tokenizer import chat_tokenizer
from scripted import scripted

from trainer.engines.base import SamplingParams
from trainer.engines.embedded import EmbeddedEngine
from trainer.harness.episode import Episode
from trainer.harness.server import HarnessServer
from trainer.models.tiny import TinyModelConfig, build_tiny_model
from trainer.rollout.agent_loop import AgentLoopConfig
from trainer.rollout.observation import ChatTurns

REPLY = "The answer is 25."
TOOLS = [{"type": "function", "function": {"name": "add", "description": "add two integers", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]
MESSAGES = [{"role": "system", "content": "You are a careful calculator."},
            {"role": "user", "content": "What is (2+3)*5? Use the tools if you need them."}]


class TimedEngine:
    """The engine, with the seconds of each ``generate`` kept (the endpoint's calls are timed inside
    it, so a call's overhead is its latency minus its own engine time: paired, robust to the engine's
    variance on a loaded machine)."""

    def __init__(self, engine: EmbeddedEngine) -> None:
        self.engine, self.seconds = engine, []

    async def generate(self, prompt_ids, params):
        """``engine.generate``, timed."""
        t = time.perf_counter()
        res = await self.engine.generate(prompt_ids, params)
        self.seconds.append(time.perf_counter() - t)
        return res


class InstantEngine:
    """An engine that answers at once with the reply's ids (no model): the endpoint's own cost."""

    def __init__(self, tok) -> None:
        self.ids = [*tok.encode(REPLY, add_special_tokens=False), tok.eos_token_id]
        self.seconds = [0.0, 0.0]

    async def generate(self, prompt_ids, params):
        """The reply, at once."""
        from trainer.engines.base import GenerationResult

        return GenerationResult(list(self.ids), [-0.1] * len(self.ids), [0] * len(self.ids), "eos")


def pct(xs: list[float], q: float) -> float:
    """q-quantile of xs in ms (nearest rank)."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1e3


async def measure(n: int) -> dict[str, list[float]]:
    """Seconds per call of each path, ``n`` calls each (after 20 warm-up calls of each)."""
    tok = chat_tokenizer(bpe_tokenizer())
    model = build_tiny_model(TinyModelConfig(hidden_size=32, intermediate_size=64, num_layers=1),
                             len(tok), tok.eos_token_id, tok.pad_token_id)
    engine = EmbeddedEngine(model, tok, logits_processor=scripted(tok, [REPLY], lambda _: 0))
    params = SamplingParams(max_new_tokens=64)
    chat = ChatTurns(tok, TOOLS)
    ids = chat.encode(chat.render(MESSAGES, add_generation_prompt=True))
    server = await HarnessServer().start()
    body = {"model": "policy", "messages": MESSAGES, "tools": TOOLS}
    out: dict[str, list[float]] = {"direct": [], "endpoint": [], "openai client": [], "endpoint - engine": [],
                                   "openai - engine": [], "zero-time engine": []}
    instant = InstantEngine(tok)
    from openai import AsyncOpenAI

    timed = TimedEngine(engine)

    def key() -> str:
        return server.open(Episode(timed, tok, params, AgentLoopConfig(), "hermes", "b", "b"))

    async with httpx.AsyncClient() as http:
        url = server.base_url + "/chat/completions"
        client = AsyncOpenAI(base_url=server.base_url, api_key="per-call", max_retries=0, http_client=http)
        for i in range(n + 20):
            t = time.perf_counter()
            res = await engine.generate(ids, params)
            direct = time.perf_counter() - t
            k = key()
            t = time.perf_counter()
            reply = await http.post(url, json=body, headers={"Authorization": f"Bearer {k}"})
            endpoint = time.perf_counter() - t
            server.finish(k)
            assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"] == REPLY
            assert reply.json()["usage"]["completion_tokens"] == len(res.token_ids)
            k = key()
            t = time.perf_counter()
            await client.chat.completions.create(**body, extra_headers={"Authorization": f"Bearer {k}"})
            via_openai = time.perf_counter() - t
            server.finish(k)
            k = server.open(Episode(instant, tok, params, AgentLoopConfig(), "hermes", "b", "b"))
            t = time.perf_counter()
            await http.post(url, json=body, headers={"Authorization": f"Bearer {k}"})
            zero = time.perf_counter() - t
            server.finish(k)
            if i >= 20:
                out["zero-time engine"].append(zero)
                out["direct"].append(direct)
                out["endpoint"].append(endpoint)
                out["openai client"].append(via_openai)
                out["endpoint - engine"].append(endpoint - timed.seconds[-2])
                out["openai - engine"].append(via_openai - timed.seconds[-1])
        out["episode calls - engine"], out["later calls - engine"] = [], []
        for i in range(n // 3 + 7):  # 3-call episodes: a later call renders only its new message
            k, msgs = key(), list(MESSAGES)
            for turn in range(3):
                t = time.perf_counter()
                reply = await http.post(url, json={**body, "messages": msgs},
                                        headers={"Authorization": f"Bearer {k}"})
                overhead = time.perf_counter() - t - timed.seconds[-1]
                assert reply.status_code == 200, reply.text
                if i >= 7:
                    out["episode calls - engine"].append(overhead)
                    if turn:
                        out["later calls - engine"].append(overhead)
                msgs = [*msgs, reply.json()["choices"][0]["message"],
                        {"role": "user", "content": "Are you sure? Check it again."}]
            server.finish(k)
    server.close()
    await engine.close()
    return out


def main() -> None:
    """Run the benchmark and print the table."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=300, help="calls per path")
    args = ap.parse_args()
    torch.set_num_threads(1)
    out = asyncio.run(measure(args.n))
    base = pct(out["direct"], .5)
    print(f"{'path':<18} {'p50':>9} {'p99':>9} {'p50 - direct p50':>17}")
    for name in ("direct", "endpoint", "openai client"):
        xs = out[name]
        print(f"{name:<18} {pct(xs, .5):>7.3f}ms {pct(xs, .99):>7.3f}ms {pct(xs, .5) - base:>15.3f}ms")
    print("per-call overhead (a call's latency minus its own engine.generate time):")
    for name in ("endpoint - engine", "openai - engine", "zero-time engine", "episode calls - engine",
                 "later calls - engine"):
        print(f"{name:<24} {pct(out[name], .5):>7.3f}ms {pct(out[name], .99):>7.3f}ms")
    first, calls = pct(out["endpoint - engine"], .5), pct(out["episode calls - engine"], .5)
    print(f"goal: the endpoint adds <= 2 ms p50 per call -> {'met' if calls <= 2.0 else 'NOT met'} "
          f"({calls:.3f} ms p50 over the calls of 3-call episodes; a first call, which renders the whole "
          f"prompt: {first:.3f} ms)")

if __name__ == "__main__":
    main()
