"""Search-R1 compatible retrieval server (FastAPI + uvicorn).

API (same as Search-R1's ``retrieval_server.py``, so its clients work unchanged):

* ``POST /retrieve`` with ``{"queries": [str, ...], "topk": k, "return_scores": bool}`` →
  ``{"result": [[{"document": {"id", "contents"}, "score": float}, ...], ...]}``, one inner
  list per query, best first; ``"score"`` is left out when ``return_scores`` is false.
  An inner list holds at most ``topk`` hits and may be shorter or empty: BM25 returns
  only passages containing a query term (see :mod:`retriever.index`).
  ``topk`` defaults to ``ServerConfig.default_topk``; ``return_scores`` to false.
* ``GET /health`` → ``{"status": "ok", ...index facts and counters...}``.

Limits and access. A request body over ``ServerConfig.max_request_bytes`` is refused with 413
``{"message": "request body larger than N bytes (--max-request-bytes)"}`` while it is read
(never buffered whole); the default is the longest valid request, 12 bytes per query character
(a JSON-escaped character outside the BMP) x ``max_queries`` x ``max_query_chars``, plus 64
KiB. Access control is :mod:`retriever.access`, the same rule as ``copc env serve``: a
non-loopback host needs a bearer token (``--token-file``; every request but ``GET /health``
must then carry it), and without a token a request whose ``Origin`` or ``Host`` is not loopback
is refused with 403.

Invalid requests get HTTP 422 with FastAPI's ``detail`` list plus a one-line ``message``
naming the field (e.g. ``queries.2: query is empty``). Searching and JSON formatting run in
a worker thread through :class:`~retriever.batcher.MicroBatcher`, which merges concurrent
requests into one backend call; the event loop never blocks.
"""

import json
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Annotated

import numpy as np
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import (
    AfterValidator,
    BaseModel,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
)

from retriever.access import protect
from retriever.batcher import MicroBatcher
from retriever.index import LoadedIndex


@dataclass(frozen=True)
class ServerConfig:
    """Server limits and batching.

    Attributes:
        default_topk: ``topk`` when a request leaves it out (Search-R1 default: 3).
        max_topk: largest ``topk`` accepted.
        max_queries: most queries in one request.
        max_query_chars: longest query accepted, in characters.
        max_batch_queries: most queries merged into one backend call.
        max_wait_ms: extra wait for more requests before a backend call (milliseconds).
        workers: backend calls that may run at once (threads).
        max_request_bytes: largest request body (bytes); ``0``: :attr:`request_limit`'s default.
    """

    default_topk: int = 3
    max_topk: int = 100
    max_queries: int = 1024
    max_query_chars: int = 2048
    max_batch_queries: int = 256
    max_wait_ms: float = 0.0
    workers: int = 1
    max_request_bytes: int = 0

    @property
    def request_limit(self) -> int:
        """The body limit in bytes: ``max_request_bytes``, or by default the longest valid
        request (12 bytes per query character x ``max_queries`` x ``max_query_chars``) plus
        64 KiB (24 MiB + 64 KiB with the default limits)."""
        return self.max_request_bytes or 12 * self.max_queries * self.max_query_chars + 65536

    def __post_init__(self) -> None:
        for name in (
            "default_topk",
            "max_topk",
            "max_queries",
            "max_query_chars",
            "max_batch_queries",
            "workers",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"server.{name} must be > 0, got {getattr(self, name)}")
        if self.default_topk > self.max_topk:
            raise ValueError(f"server.default_topk ({self.default_topk}) > server.max_topk ({self.max_topk})")
        if isinstance(self.max_request_bytes, bool) or not isinstance(self.max_request_bytes, int) \
                or self.max_request_bytes < 0:
            raise ValueError(f"server.max_request_bytes must be an int >= 0, got {self.max_request_bytes!r}")
        if self.max_wait_ms < 0:
            raise ValueError(f"server.max_wait_ms must be >= 0, got {self.max_wait_ms}")


def _not_blank(q: str) -> str:
    if not q.strip():
        raise ValueError("query is empty or only whitespace")
    return q


def make_request_model(cfg: ServerConfig) -> type[BaseModel]:
    """The pydantic model of a ``/retrieve`` body with ``cfg``'s limits baked in."""
    Query = Annotated[StrictStr, Field(max_length=cfg.max_query_chars), AfterValidator(_not_blank)]

    class RetrieveRequest(BaseModel):
        """Body of ``POST /retrieve`` (Search-R1 ``QueryRequest``)."""

        queries: list[Query] = Field(min_length=1, max_length=cfg.max_queries)
        topk: StrictInt | None = Field(default=None, gt=0, le=cfg.max_topk)
        return_scores: StrictBool = False

    return RetrieveRequest


def _short(value: object, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def validation_message(errors: list[dict]) -> str:
    """One line per pydantic error: ``field.path: message (got value)``, joined by ``; ``."""
    parts = []
    for err in errors:
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body") or "body"
        msg = err.get("msg", "invalid")
        got = f" (got {_short(err['input'])})" if "input" in err and err["type"] != "missing" else ""
        parts.append(f"{loc}: {msg}{got}")
    return "; ".join(parts)


class BodyTooLargeError(Exception):
    """A request body over the limit (answered 413)."""


async def read_body(request: Request, limit: int) -> bytes:
    """The body of ``request``, read up to ``limit`` bytes.

    Raises:
        BodyTooLargeError: a ``Content-Length`` over ``limit``, or more bytes than ``limit`` arrive.
    """
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise BodyTooLargeError
    size, chunks = 0, []
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLargeError
        chunks.append(chunk)
    return b"".join(chunks)


class _Formatter:
    """Turns result rows into JSON fragments, using pre-serialised documents."""

    def __init__(self, loaded: LoadedIndex) -> None:
        self.docs = [
            json.dumps({"id": p.id, "contents": p.contents}, ensure_ascii=False) for p in loaded.passages
        ]

    def __call__(self, idx: np.ndarray, scores: np.ndarray, k: int) -> tuple[str, str]:
        """JSON lists (with, without scores) of the hits of one query; rows ``-1`` dropped."""
        with_s, without = [], []
        for i, s in zip(idx.tolist(), scores.tolist(), strict=True):
            if i < 0:
                continue
            doc = self.docs[i]
            with_s.append(f'{{"document":{doc},"score":{s!r}}}')
            without.append(f'{{"document":{doc}}}')
        return "[" + ",".join(with_s) + "]", "[" + ",".join(without) + "]"


def create_app(loaded: LoadedIndex, cfg: ServerConfig | None = None) -> FastAPI:
    """Build the FastAPI app serving ``loaded``.

    Args:
        loaded: index, passages and metadata from :func:`retriever.index.load_index`.
        cfg: limits and batching (defaults of :class:`ServerConfig`).

    Returns:
        The app; the micro-batcher starts and stops with the app's lifespan.
    """
    cfg = cfg or ServerConfig()
    formatter = _Formatter(loaded)
    batcher = MicroBatcher(
        loaded.searcher.search,
        max_batch_queries=cfg.max_batch_queries,
        max_wait_s=cfg.max_wait_ms / 1000.0,
        workers=cfg.workers,
        post_fn=formatter,
    )
    RetrieveRequest = make_request_model(cfg)

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        await batcher.start()
        try:
            yield
        finally:
            await batcher.stop()

    app = FastAPI(title="copc retriever", lifespan=lifespan)
    app.state.batcher = batcher

    @app.exception_handler(RequestValidationError)
    async def _on_invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        detail = [
            {
                k: (_short(v) if k == "input" else v)
                for k, v in e.items()
                if k in ("loc", "msg", "type", "input")
            }
            for e in errors
        ]
        return JSONResponse(
            status_code=422, content={"message": validation_message(errors), "detail": detail}
        )

    @app.get("/health")
    async def health() -> dict:
        """Liveness plus index facts and batching counters."""
        m = loaded.meta
        return {
            "status": "ok",
            "kind": m.kind,
            "num_passages": m.num_passages,
            "encoder": m.encoder,
            "dimension": m.dimension,
            "corpus_sha256": m.corpus_sha256,
            "batches": batcher.batches,
            "queries": batcher.queries,
            "max_request_bytes": cfg.request_limit,
        }

    @app.post("/retrieve")
    async def retrieve(raw: Request) -> Response:
        """Search-R1 ``/retrieve``; see the module docstring for shapes.

        The body is parsed as JSON whatever the ``Content-Type`` (curl's default is form).
        """
        try:
            body = await read_body(raw, cfg.request_limit)
        except BodyTooLargeError:
            message = f"request body larger than {cfg.request_limit} bytes (--max-request-bytes)"
            return JSONResponse(status_code=413, content={"message": message, "detail": message})
        try:
            request = RetrieveRequest.model_validate_json(body)
        except ValidationError as exc:
            raise RequestValidationError(exc.errors(include_url=False)) from None
        k = request.topk if request.topk is not None else cfg.default_topk
        rows = await batcher.submit(list(request.queries), k)
        pick = 0 if request.return_scores else 1
        body = '{"result":[' + ",".join(r[pick] for r in rows) + "]}"
        return Response(content=body.encode("utf-8"), media_type="application/json")

    return app


def serve(
    loaded: LoadedIndex,
    host: str,
    port: int,
    cfg: ServerConfig | None = None,
    log_level: str = "warning",
    token: str | None = None,
) -> None:
    """Run the server with uvicorn until interrupted (blocking).

    Args:
        loaded: the index to serve.
        host / port: address to bind (port 0 = any free port).
        cfg: server limits and batching.
        log_level: uvicorn log level; access logs are off (they cost throughput).
        token: bearer token every request but ``/health`` must carry (``None``: none, then
            loopback only, with the ``Origin`` / ``Host`` check; :func:`retriever.access.protect`).

    Raises:
        ValueError: a non-loopback ``host`` without ``token``.
    """
    import uvicorn

    app = protect(create_app(loaded, cfg), host, token)
    uvicorn.run(app, host=host, port=port, log_level=log_level, access_log=False)
