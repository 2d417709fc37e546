"""A multi-turn tool agent written against the official ``openai`` client (the harness tests' agent).

Two tools (``add``, ``mul``); the agent loops: ask the model, run every tool call it makes, send the
results back, until the model answers in plain text; the reward is 1 for the row's answer.
"""

from __future__ import annotations

import json

from openai import AsyncOpenAI

TOOLS = [{"type": "function", "function": {
    "name": name, "description": f"{name} two integers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}} for name in ("add", "mul")]


def run_tool(name: str, args: dict) -> str:
    """The tools' results, as text."""
    return str(args["a"] + args["b"] if name == "add" else args["a"] * args["b"])


async def run(base_url: str, api_key: str, row: dict) -> dict:
    """Play one episode; the reward components are ``correct`` (0/1) and ``tool_bonus``."""
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": row["problem"]}]
    used = 0
    try:
        for _ in range(6):
            reply = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
            msg = reply.choices[0].message
            messages.append(msg.model_dump(exclude_none=True))
            if not msg.tool_calls:
                break
            for call in msg.tool_calls:
                used += 1
                result = run_tool(call.function.name, json.loads(call.function.arguments))
                messages.append({"role": "tool", "tool_call_id": call.id, "name": call.function.name,
                                 "content": result})
    finally:
        await client.close()
    return {"correct": float((msg.content or "").strip() == row["answer"]), "tool_bonus": 0.1 * (used > 0)}
