"""A deliberately unreliable ``/retrieve`` server for client retry tests (run as a script).

``python flaky_server.py PORT FAILS HANGS``: the first FAILS ``POST /retrieve`` calls answer
HTTP 503, the next HANGS calls sleep 3 s before answering, later calls answer a valid
Search-R1 response (one hit per query whose contents echo the query). ``GET /stats``
returns the number of ``/retrieve`` calls received.
"""

from __future__ import annotations

import asyncio
import sys

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse


def make_app(fails: int, hangs: int) -> FastAPI:
    """The flaky app; call counts live in the app's state."""
    app = FastAPI()
    app.state.calls = 0

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/stats")
    async def stats() -> dict:
        return {"calls": app.state.calls}

    @app.post("/retrieve")
    async def retrieve(request: Request):
        app.state.calls += 1
        n = app.state.calls
        body = await request.json()
        if n <= fails:
            return JSONResponse({"message": f"flaky failure {n}"}, status_code=503)
        if n <= fails + hangs:
            await asyncio.sleep(3.0)
        hits = [
            [{"document": {"id": str(i), "contents": q}, "score": 1.0}] for i, q in enumerate(body["queries"])
        ]
        return {"result": hits}

    return app


if __name__ == "__main__":
    port, fails, hangs = (int(x) for x in sys.argv[1:4])
    uvicorn.run(make_app(fails, hangs), host="127.0.0.1", port=port, log_level="warning")
