"""Retriever benchmark: latency and throughput of the micro-batching server vs a naive one.

For BM25 (bm25s) and Pyserini (Lucene BM25, Java 21) on the full shared corpus (17,939 passages),
and dense (MiniLM, flat IP, on the first
``--dense-passages`` passages: CPU encoding of the whole corpus takes ~20 min on 2 cores),
it measures, with 1, 8 and 32 concurrent clients each sending one-question requests
(HotpotQA questions, topk 3, return_scores true):

* per-query latency p50 / p99 (ms) and throughput (queries/s),
* for this package's server (``retriever.server``: event loop never blocks, concurrent
  requests micro-batched into one search call) and for a naive server in the anchor's style
  (Search-R1 ``retrieval_server.py``: the handler searches inline, one request at a time),
* build time per 1k passages (s) for each index kind,
* answer recall@5 on the HotpotQA questions (not yes/no) for the full-corpus kinds (bm25, pyserini).

Ratios are against the naive server measured in the same run. Goals: >= 5x the naive
throughput at 32 clients; BM25 p50 <= 5 ms per query. Run: ``python benchmarks/bench_retriever.py``.
"""

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from retriever.launch import free_port, wait_healthy

REPO = Path(__file__).resolve().parents[1]
CORPUS = REPO / "data" / "wiki" / "corpus.jsonl"
QA = REPO / "data" / "qa" / "hotpotqa.jsonl"
CONCURRENCY = (1, 8, 32)
KINDS = ("bm25", "pyserini", "dense")


def naive_app(index_dir: str):
    """The anchor's design: ``async`` handler that searches inline (blocks the loop), so
    requests are served strictly one at a time; response built from Python dicts."""
    from fastapi import FastAPI
    from pydantic import BaseModel

    from retriever.index import load_index

    # Same encoder threads as ``copc retriever serve`` uses by default (cores - 1).
    loaded = load_index(index_dir, device="cpu", torch_threads=max(1, (os.cpu_count() or 2) - 1))
    app = FastAPI()

    class QueryRequest(BaseModel):
        queries: list[str]
        topk: int | None = None
        return_scores: bool = False

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.post("/retrieve")
    async def retrieve(request: QueryRequest) -> dict:
        k = request.topk or 3
        idx, scores = loaded.searcher.search(request.queries, k)
        resp = []
        for row, srow in zip(idx.tolist(), scores.tolist(), strict=True):
            hits = [(i, s) for i, s in zip(row, srow, strict=True) if i >= 0]  # -1: no hit
            docs = [{"id": loaded.passages[i].id, "contents": loaded.passages[i].contents} for i, _ in hits]
            if request.return_scores:
                resp.append([{"document": d, "score": s} for d, (_, s) in zip(docs, hits, strict=True)])
            else:
                resp.append(docs)
        return {"result": resp}

    return app


def start_server(index_dir: Path, naive: bool) -> tuple[subprocess.Popen, str]:
    """Start the batched (``copc retriever serve``) or naive server; wait for /health."""
    port = free_port()
    if naive:
        args = [__file__, "--serve-naive", str(index_dir), "--port", str(port)]
    else:
        args = ["-m", "retriever.cli", "serve", "--index", str(index_dir), "--port", str(port),
                "--device", "cpu"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    log = Path(tempfile.mkstemp(prefix="bench-retriever-", suffix=".log")[1])
    with log.open("w") as out:  # a file, not a pipe: an unread pipe could block the server
        proc = subprocess.Popen([sys.executable, *args], cwd=REPO, env=env, stdout=out,
                                stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc, 180, output=log)
    return proc, url


async def _post(reader, writer, host: str, body: bytes) -> int:
    """One HTTP/1.1 keep-alive POST /retrieve on an open connection; returns the status."""
    writer.write(
        b"POST /retrieve HTTP/1.1\r\nHost: " + host.encode() + b"\r\n"
        b"Content-Type: application/json\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )
    await writer.drain()
    status = int((await reader.readline()).split()[1])
    length = 0
    while (line := await reader.readline()) not in (b"\r\n", b""):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    await reader.readexactly(length)
    return status


async def _load(url: str, questions: list[str], clients: int, per_client: int) -> dict:
    """``clients`` keep-alive connections, each sending ``per_client`` sequential requests.

    A minimal asyncio HTTP/1.1 client (not httpx) keeps the load generator's own CPU cost
    small: it shares the 2 cores with the server under test.
    """
    host, port = url.removeprefix("http://").split(":")
    bodies = [json.dumps({"queries": [q], "topk": 3, "return_scores": True}).encode() for q in questions]
    lat: list[float] = []
    errors = 0

    async def one(c: int, n: int, record: bool) -> None:
        nonlocal errors
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            for i in range(n):
                body = bodies[(c * per_client + i) % len(bodies)]
                t0 = time.perf_counter()
                status = await _post(reader, writer, f"{host}:{port}", body)
                if record:
                    lat.append(time.perf_counter() - t0)
                    errors += status != 200
        finally:
            writer.close()

    await one(0, 5, record=False)  # warm-up
    t0 = time.perf_counter()
    await asyncio.gather(*(one(c, per_client, True) for c in range(clients)))
    wall = time.perf_counter() - t0
    return {"lat_ms": np.array(lat) * 1000, "qps": len(lat) / wall, "errors": errors}


def run_both(index_dir: Path, questions: list[str], total: dict[int, int], rounds: int):
    """Latency/throughput of both variants at each concurrency.

    Both servers run at once (an idle one costs nothing) and the variants are measured
    alternately, ``rounds`` times per level, so background load on a shared machine hits
    both alike. Per level: median throughput over rounds, latency percentiles over all
    requests, errors summed.

    Returns:
        ``{variant: {clients: {"p50_ms", "p99_ms", "qps", "errors", "n"}}}``.
    """
    servers = {v: start_server(index_dir, v == "naive") for v in ("batched", "naive")}
    out: dict[str, dict[int, dict]] = {v: {} for v in servers}
    try:
        for c in CONCURRENCY:
            runs: dict[str, list[dict]] = {v: [] for v in servers}
            for _ in range(rounds):
                for v, (_proc, url) in servers.items():
                    runs[v].append(asyncio.run(_load(url, questions, c, max(1, total[c] // c))))
            for v, rs in runs.items():
                lat = np.concatenate([r["lat_ms"] for r in rs])
                out[v][c] = {
                    "p50_ms": float(np.percentile(lat, 50)),
                    "p99_ms": float(np.percentile(lat, 99)),
                    "qps": float(np.median([r["qps"] for r in rs])),
                    "errors": sum(r["errors"] for r in rs),
                    "n": len(lat),
                }
    finally:
        for proc, _url in servers.values():
            proc.terminate()
            proc.wait(timeout=30)
    return out


def build(kind: str, corpus: Path, out: Path) -> float:
    """Build an index; returns seconds per 1k passages."""
    from retriever.encoder import EncoderConfig
    from retriever.index import BuildConfig, build_index

    meta = build_index(
        BuildConfig(
            kind=kind,
            corpus=str(corpus),
            out=str(out),
            encoder=EncoderConfig(device="cpu"),
            show_progress=False,
        )
    )
    return meta.build_seconds / meta.num_passages * 1000


def recall_at_5(index_dir: Path) -> float:
    """Answer recall@5 of an index on the HotpotQA questions that are not yes/no (480 of 500):
    a question is a hit when a top-5 passage contains a gold answer (``retriever.quality``)."""
    from retriever.index import load_index
    from retriever.quality import answer_recall, load_qa

    loaded = load_index(index_dir)
    questions = load_qa(QA)
    idx, _ = loaded.searcher.search([q["question"] for q in questions], 5)
    hits = [[{"document": {"contents": loaded.passages[i].contents}} for i in row if i >= 0] for row in idx]
    return answer_recall(questions, hits)


def main() -> int:
    """Build indexes, benchmark both server variants, print the table; 1 if any error."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--serve-naive", metavar="INDEX", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--dense-passages", type=int, default=1000)
    ap.add_argument("--requests", type=int, default=480, help="BM25 requests per level and round")
    ap.add_argument("--dense-requests", type=int, default=128, help="dense requests per level and round")
    ap.add_argument("--only", choices=KINDS, default=None)
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds per level")
    args = ap.parse_args()
    if args.serve_naive:
        import uvicorn

        uvicorn.run(
            naive_app(args.serve_naive),
            host="127.0.0.1",
            port=args.port,
            log_level="warning",
            access_log=False,
        )
        return 0
    if not CORPUS.is_file():
        print(f"shared corpus not found at {CORPUS}; skipping")
        return 0
    questions = [json.loads(line)["question"] for line in QA.read_text().splitlines()]
    load_before = os.getloadavg()[0]
    rows, failed = [], False
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        wanted = {args.only} if args.only else set(KINDS)
        kinds = [(k, CORPUS, args.requests) for k in ("bm25", "pyserini") if k in wanted]
        if "dense" in wanted:
            sub = tmp / "dense_corpus.jsonl"
            with CORPUS.open() as src, sub.open("w") as dst:
                for _, line in zip(range(args.dense_passages), src, strict=False):
                    dst.write(line)
            kinds.append(("dense", sub, args.dense_requests))
        for kind, corpus, n in kinds:
            per_1k = build(kind, corpus, tmp / kind)
            print(f"[{kind}] build: {per_1k:.2f} s per 1k passages", flush=True)
            if corpus == CORPUS:
                print(f"[{kind}] answer recall@5: {recall_at_5(tmp / kind):.3f}", flush=True)
            total = {c: n if c > 1 else max(n // 4, 50) for c in CONCURRENCY}
            res = run_both(tmp / kind, questions, total, args.rounds)
            for c in CONCURRENCY:
                b, nv = res["batched"][c], res["naive"][c]
                failed |= bool(b["errors"] or nv["errors"])
                rows.append((kind, c, b, nv, per_1k))
    print(
        "\n| index | clients | p50 ms | p99 ms | q/s | naive p50 ms | naive p99 ms | naive q/s "
        "| q/s ratio | errors |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for kind, c, b, nv, _ in rows:
        print(
            f"| {kind} | {c} | {b['p50_ms']:.1f} | {b['p99_ms']:.1f} | {b['qps']:.0f} | "
            f"{nv['p50_ms']:.1f} | {nv['p99_ms']:.1f} | {nv['qps']:.0f} | "
            f"{b['qps'] / nv['qps']:.2f}x | {b['errors'] + nv['errors']} |"
        )
    print(
        f"1-min load average: {load_before:.1f} before, {os.getloadavg()[0]:.1f} after "
        f"({os.cpu_count()} cores; other processes' load skews absolute numbers)"
    )
    for kind, c, b, nv, per_1k in rows:
        if c == 32:
            print(
                f"{kind}: throughput at 32 clients = {b['qps'] / nv['qps']:.2f}x naive "
                f"(goal >= 5x); build {per_1k:.2f} s / 1k passages"
            )
        if kind == "bm25" and c == 1:
            print(f"bm25: p50 at 1 client = {b['p50_ms']:.2f} ms per query (goal <= 5 ms)")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
