"""Python client for the ``/retrieve`` API (this server or Search-R1's), built on httpx.

Splits long query lists into batches, applies a per-request timeout, and retries
connection errors, timeouts and HTTP 5xx with exponential backoff
(``backoff_s * 2**attempt``, capped at ``backoff_max_s``, seconds). A 4xx answer is not
retried: it raises :class:`RetrieverRequestError` with the server's message.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx


class RetrieverError(RuntimeError):
    """Base class of client errors."""


class RetrieverRequestError(RetrieverError):
    """The server rejected the request (HTTP 4xx); ``status`` and ``message`` from the server."""

    def __init__(self, status: int, message: str) -> None:
        self.status = status
        self.message = message
        super().__init__(f"retriever rejected the request (HTTP {status}): {message}")


class RetrieverUnavailableError(RetrieverError):
    """No successful answer after all attempts (connection errors, timeouts or HTTP 5xx)."""


@dataclass(frozen=True)
class ClientConfig:
    """Client behaviour.

    Attributes:
        url: server base URL, e.g. ``http://127.0.0.1:8000``.
        timeout_s: per-request timeout (connect, read, write, pool), seconds.
        max_retries: retries after the first attempt (total attempts = ``max_retries + 1``).
        backoff_s: first backoff delay, seconds; doubles each retry.
        backoff_max_s: largest backoff delay, seconds.
        batch_size: most queries sent in one request.
        topk: default passages per query.
        token: bearer token sent as ``Authorization: Bearer <token>`` (a server started with
            ``--token-file``); ``None``: none.
    """

    url: str = "http://127.0.0.1:8000"
    timeout_s: float = 30.0
    max_retries: int = 3
    backoff_s: float = 0.5
    backoff_max_s: float = 8.0
    batch_size: int = 64
    topk: int = 3
    token: str | None = None

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"client.url must start with http:// or https://, got {self.url!r}")
        if self.timeout_s <= 0:
            raise ValueError(f"client.timeout_s must be > 0, got {self.timeout_s}")
        if self.max_retries < 0:
            raise ValueError(f"client.max_retries must be >= 0, got {self.max_retries}")
        if self.backoff_s < 0 or self.backoff_max_s < 0:
            raise ValueError("client.backoff_s and client.backoff_max_s must be >= 0")
        if self.batch_size <= 0 or self.topk <= 0:
            raise ValueError("client.batch_size and client.topk must be > 0")
        if self.token is not None and (not isinstance(self.token, str) or not self.token.strip()):
            raise ValueError("client.token must be a non-empty str or None")

    def headers(self) -> dict[str, str]:
        """HTTP headers of every request (the bearer token, if any)."""
        return {"Authorization": f"Bearer {self.token.strip()}"} if self.token else {}

    def backoff(self, attempt: int) -> float:
        """Delay in seconds before retry number ``attempt`` (0-based)."""
        return min(self.backoff_max_s, self.backoff_s * (2**attempt))


def _needs_tls(url: str) -> bool:
    """Whether a client of ``url`` needs certificate verification: only ``https://`` URLs.

    An ``http://`` client never opens TLS (requests are relative to its base URL and redirects are
    not followed), yet httpx builds a verifying SSL context for every client unless told not to:
    ~36 ms of CPU per client here, paid by every search environment an evaluation or a rollout
    builds (``benchmarks/bench_eval.py``).
    """
    return url.startswith("https://")  # ClientConfig accepts only http:// and https:// URLs


def _error_message(resp: httpx.Response) -> str:
    try:
        body = resp.json()
    except ValueError:
        return resp.text[:500]
    if isinstance(body, dict):
        return str(body.get("message") or body.get("detail") or body)[:500]
    return str(body)[:500]


def _classify(resp: httpx.Response) -> tuple[bool, str]:
    """``(True, "")`` on 2xx, ``(False, reason)`` on 5xx (retry); raises on 4xx."""
    if resp.status_code >= 500:
        return False, f"HTTP {resp.status_code}: {_error_message(resp)}"
    if resp.status_code >= 400:
        raise RetrieverRequestError(resp.status_code, _error_message(resp))
    return True, ""


def _unavailable(cfg: ClientConfig, path: str, last: str) -> RetrieverUnavailableError:
    return RetrieverUnavailableError(
        f"retriever at {cfg.url}{path} failed after {cfg.max_retries + 1} attempts "
        f"(timeout {cfg.timeout_s} s each); last error: {last}"
    )


def _batches(cfg: ClientConfig, queries: Sequence[str], topk: int | None, scores: bool):
    if isinstance(queries, str):
        raise TypeError("queries must be a sequence of strings, not a single string")
    k = cfg.topk if topk is None else topk
    for start in range(0, len(queries), cfg.batch_size):
        chunk = list(queries[start : start + cfg.batch_size])
        yield chunk, {"queries": chunk, "topk": k, "return_scores": scores}


def _check_result(body: Any, n: int) -> list[list[dict[str, Any]]]:
    result = body.get("result") if isinstance(body, dict) else None
    if not isinstance(result, list) or len(result) != n:
        got = len(result) if isinstance(result, list) else type(result).__name__
        raise RetrieverError(f"server returned {got} result lists for {n} queries")
    return result


class RetrieverClient:
    """Synchronous client; one ``httpx.Client`` (connection pool) per instance.

    Use as a context manager or call :meth:`close`. Thread-safe (httpx clients are).
    """

    def __init__(self, cfg: ClientConfig | None = None, **overrides: Any) -> None:
        cfg = cfg or ClientConfig()
        if overrides:
            cfg = ClientConfig(**{**cfg.__dict__, **overrides})
        self.cfg = cfg
        self._http = httpx.Client(base_url=cfg.url.rstrip("/"), timeout=cfg.timeout_s, headers=cfg.headers(),
                                  verify=_needs_tls(cfg.url))
        self.attempts = 0  # HTTP attempts made (for diagnostics and tests)

    def __enter__(self) -> RetrieverClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the connection pool."""
        self._http.close()

    def _request(self, method: str, path: str, json: Any = None) -> Any:
        last = ""
        for attempt in range(self.cfg.max_retries + 1):
            if attempt:
                time.sleep(self.cfg.backoff(attempt - 1))
            self.attempts += 1
            try:
                resp = self._http.request(method, path, json=json)
            except httpx.TransportError as exc:  # connect/read errors and timeouts
                last = f"{type(exc).__name__}: {exc}"
                continue
            done, last = _classify(resp)
            if done:
                return resp.json()
        raise _unavailable(self.cfg, path, last)

    def health(self) -> dict[str, Any]:
        """``GET /health`` (retried like searches)."""
        return self._request("GET", "/health")

    def retrieve(
        self, queries: Sequence[str], topk: int | None = None, return_scores: bool = True
    ) -> list[list[dict[str, Any]]]:
        """Search-R1 ``/retrieve`` for each query, batched by ``cfg.batch_size``.

        Args:
            queries: query strings (sent as-is; the server validates them).
            topk: passages per query (default ``cfg.topk``).
            return_scores: include ``"score"`` in each hit.

        Returns:
            One list per query of hits ``{"document": {"id", "contents"}, "score"?}``,
            best first, in the order of ``queries``; a list holds at most ``topk`` hits
            and may be shorter or empty (BM25: no passage contains a query term).

        Raises:
            RetrieverRequestError: the server answered 4xx (bad query, topk too large ...).
            RetrieverUnavailableError: all attempts failed (connection, timeout, 5xx).
        """
        out: list[list[dict[str, Any]]] = []
        for chunk, body in _batches(self.cfg, queries, topk, return_scores):
            out.extend(_check_result(self._request("POST", "/retrieve", json=body), len(chunk)))
        return out

    def search(self, query: str, topk: int | None = None) -> list[dict[str, Any]]:
        """Hits for a single query (see :meth:`retrieve`)."""
        return self.retrieve([query], topk=topk)[0]


class AsyncRetrieverClient:
    """``asyncio`` twin of :class:`RetrieverClient` (``httpx.AsyncClient``), for rollout
    loops that run many episodes concurrently. Same config, errors and retry policy;
    backoff uses ``asyncio.sleep`` so other tasks keep running. Use ``async with``."""

    def __init__(self, cfg: ClientConfig | None = None, **overrides: Any) -> None:
        cfg = cfg or ClientConfig()
        if overrides:
            cfg = ClientConfig(**{**cfg.__dict__, **overrides})
        self.cfg = cfg
        self._http = httpx.AsyncClient(base_url=cfg.url.rstrip("/"), timeout=cfg.timeout_s,
                                       headers=cfg.headers(), verify=_needs_tls(cfg.url))
        self.attempts = 0

    async def __aenter__(self) -> AsyncRetrieverClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the connection pool."""
        await self._http.aclose()

    async def _request(self, method: str, path: str, json: Any = None) -> Any:
        last = ""
        for attempt in range(self.cfg.max_retries + 1):
            if attempt:
                await asyncio.sleep(self.cfg.backoff(attempt - 1))
            self.attempts += 1
            try:
                resp = await self._http.request(method, path, json=json)
            except httpx.TransportError as exc:
                last = f"{type(exc).__name__}: {exc}"
                continue
            done, last = _classify(resp)
            if done:
                return resp.json()
        raise _unavailable(self.cfg, path, last)

    async def health(self) -> dict[str, Any]:
        """``GET /health`` (retried like searches)."""
        return await self._request("GET", "/health")

    async def retrieve(
        self, queries: Sequence[str], topk: int | None = None, return_scores: bool = True
    ) -> list[list[dict[str, Any]]]:
        """As :meth:`RetrieverClient.retrieve` (same shapes and errors)."""
        out: list[list[dict[str, Any]]] = []
        for chunk, body in _batches(self.cfg, queries, topk, return_scores):
            res = await self._request("POST", "/retrieve", json=body)
            out.extend(_check_result(res, len(chunk)))
        return out
