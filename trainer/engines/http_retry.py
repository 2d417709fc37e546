"""One HTTP call to an inference server, retried on connection errors and 5xx within one deadline:
what the SGLang and vLLM clients share (:class:`~trainer.engines.sglang.SGLangEngine`,
:class:`~trainer.engines.vllm.VLLMEngine`).
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from .base import EngineError


async def request_with_retries(client: httpx.AsyncClient, method: str, path: str, json: Any = None, *,
                               label: str, base_url: str, request_timeout_s: float, max_retries: int,
                               backoff_s: float) -> httpx.Response:
    """Send one request, retrying connection errors and 5xx with exponential backoff, within
    ``request_timeout_s`` in all (a total deadline: attempts, back-off and a slowly trickled answer
    all count).

    Args:
        client: the engine's client (its ``base_url`` set).
        method / path / json: the request.
        label: the server's name in messages (``SGLang``, ``vLLM``).
        base_url: the server's URL (for messages).
        request_timeout_s: the deadline of the whole call, in seconds.
        max_retries: retries after the first attempt (0: none).
        backoff_s: first retry delay in seconds; doubled after each retry.

    Returns:
        The first answer with a status below 400.

    Raises:
        EngineError: 4xx (not retried), the last attempt failed, or the deadline passed; the
            message names the endpoint, the attempts and the last error/answer.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + request_timeout_s
    last, tried = "", 0
    for attempt in range(max_retries + 1):
        if attempt:
            await asyncio.sleep(min(backoff_s * 2 ** (attempt - 1), max(0.0, deadline - loop.time())))
        left = deadline - loop.time()
        if left <= 0:
            break
        tried += 1
        try:
            resp = await asyncio.wait_for(client.request(method, path, json=json), timeout=left)
        except TimeoutError:
            raise EngineError(f"{label} {method} {path} at {base_url}: no complete answer within "
                              f"request_timeout_s={request_timeout_s:g} s (attempt {attempt + 1}; "
                              f"last error: {last or 'none'})") from None
        except httpx.TransportError as e:
            last = f"{type(e).__name__}: {e}"
            continue
        if resp.status_code >= 500:
            last = f"HTTP {resp.status_code}: {resp.text[:500]}"
            continue
        if resp.status_code >= 400:
            raise EngineError(f"{label} {method} {path} -> HTTP {resp.status_code}: {resp.text[:500]}")
        return resp
    raise EngineError(f"{label} {method} {path} at {base_url} failed after {tried} attempt(s); "
                      f"last error: {last} (deadline request_timeout_s={request_timeout_s:g} s)")
