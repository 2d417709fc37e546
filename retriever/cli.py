"""``copc retriever build`` and ``copc retriever serve`` (registered by ``trainer/cli.py``).

Examples::

    copc retriever build --corpus data/wiki/corpus.jsonl --kind bm25 --out runs/idx/bm25
    copc retriever serve --index runs/idx/bm25 --host 127.0.0.1 --port 8000
    copc retriever serve --index runs/idx/bm25 --host 0.0.0.0 --token-file /run/secrets/retriever-token

A non-loopback ``--host`` without ``--token-file`` (or an unreadable / empty token file) prints
one line and exits with status 2, as ``copc env serve`` does.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

#: The repository's data folder (``environments.data.FALLBACK_DATA_DIR``; this lower layer
#: cannot import it).
REPO_DATA_DIR = str(Path(__file__).resolve().parents[1] / "data")


def default_corpus() -> str:
    """``$COPC_DATA_DIR/wiki/corpus.jsonl``, else ``wiki/corpus.jsonl`` of the repository's
    ``data/``: the same data-directory rule as the trainer's ``task.data_dir``."""
    return os.path.join(os.environ.get("COPC_DATA_DIR") or REPO_DATA_DIR, "wiki", "corpus.jsonl")


def add_subcommands(sub: argparse._SubParsersAction) -> None:
    """Add ``build`` and ``serve`` parsers to ``sub`` (each sets ``func``)."""
    b = sub.add_parser("build", help="build a BM25 / dense / pyserini index directory")
    b.add_argument("--corpus", default=None,
                   help="JSONL corpus {id, contents} (default: $COPC_DATA_DIR/wiki/corpus.jsonl, else "
                        "the repository's data/wiki/corpus.jsonl)")
    b.add_argument("--kind", choices=("bm25", "dense", "pyserini"), default="bm25")
    b.add_argument("--out", required=True, help="output index directory")
    b.add_argument("--overwrite", action="store_true", help="allow a non-empty --out")
    b.add_argument("--k1", type=float, default=0.9, help="BM25 k1 (bm25, pyserini)")
    b.add_argument("--b", type=float, default=0.4, help="BM25 b (bm25, pyserini)")
    b.add_argument(
        "--model-path",
        default=None,
        help="dense: local HF model dir (e5 prefixes); default bundled MiniLM",
    )
    b.add_argument("--query-prefix", default=None, help="dense: override the query prefix")
    b.add_argument("--passage-prefix", default=None, help="dense: override the passage prefix")
    b.add_argument("--batch-size", type=int, default=64, help="dense: passages per forward pass")
    b.add_argument("--max-tokens", type=int, default=256, help="dense: passage truncation")
    b.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    b.add_argument("--faiss", default="flat", choices=("flat", "hnsw", "ivf"), help="dense: FAISS index type")
    b.add_argument("--nlist", type=int, default=1024, help="dense ivf: number of cells")
    b.add_argument("--nprobe", type=int, default=32, help="dense ivf: cells probed per query")
    b.add_argument("--hnsw-m", type=int, default=32, help="dense hnsw: links per node")
    b.add_argument("--ef-search", type=int, default=128, help="dense hnsw: search beam")
    b.add_argument(
        "--lucene-index",
        default=None,
        help="pyserini: reuse this existing Lucene index instead of building one",
    )
    b.add_argument("--threads", type=int, default=1, help="pyserini: indexing/search threads")
    b.add_argument("--no-progress", action="store_true", help="hide progress bars")
    b.set_defaults(func=_guard(_build))

    s = sub.add_parser("serve", help="serve an index with the Search-R1 /retrieve API")
    s.add_argument("--index", required=True, help="index directory from 'build'")
    s.add_argument("--parent-pid", type=int, default=0,
                   help="exit when this process (the one that started the server) is gone")
    s.add_argument("--corpus", default=None, help="corpus (default: the one used to build)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    s.add_argument(
        "--torch-threads",
        type=int,
        default=max(1, (os.cpu_count() or 2) - 1),
        help="dense: CPU threads for query encoding (default: cores - 1)",
    )
    s.add_argument("--default-topk", type=int, default=3)
    s.add_argument("--max-topk", type=int, default=100)
    s.add_argument("--max-queries", type=int, default=1024, help="queries per request")
    s.add_argument("--max-query-chars", type=int, default=2048)
    s.add_argument("--max-batch-queries", type=int, default=256, help="queries merged into one backend call")
    s.add_argument("--max-wait-ms", type=float, default=0.0)
    s.add_argument("--max-request-bytes", type=int, default=0,
                   help="largest request body, larger ones get 413 (default: 12 bytes per query character "
                        "x max queries x max query chars + 64 KiB)")
    s.add_argument("--token-file", default=None, metavar="F",
                   help="file holding the bearer token clients must send (Authorization: Bearer ...); "
                        "required for a non-loopback --host")
    s.add_argument("--log-level", default="warning")
    s.set_defaults(func=_guard(_serve))


def _guard(fn):
    """Turn expected user errors (bad corpus, wrong index, missing Java ...) into a one-line
    ``copc retriever: error: <Type>: <message>`` on stderr and exit code 2, not a traceback."""

    def run(args: argparse.Namespace) -> int:
        try:
            return fn(args)
        except (ValueError, FileNotFoundError, ImportError, RuntimeError) as exc:
            print(f"copc retriever: error: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 2

    return run


def _build(args: argparse.Namespace) -> int:
    from retriever.bm25 import BM25Config
    from retriever.dense import FaissConfig
    from retriever.encoder import EncoderConfig
    from retriever.index import BuildConfig, build_index

    cfg = BuildConfig(
        kind=args.kind,
        corpus=args.corpus or default_corpus(),
        out=args.out,
        bm25=BM25Config(k1=args.k1, b=args.b),
        encoder=EncoderConfig(
            model_path=args.model_path,
            query_prefix=args.query_prefix,
            passage_prefix=args.passage_prefix,
            batch_size=args.batch_size,
            passage_max_tokens=args.max_tokens,
            device=args.device,
        ),
        faiss=FaissConfig(
            index_type=args.faiss,
            nlist=args.nlist,
            nprobe=args.nprobe,
            hnsw_m=args.hnsw_m,
            ef_search=args.ef_search,
        ),
        lucene_index=args.lucene_index,
        threads=args.threads,
        overwrite=args.overwrite,
        show_progress=not args.no_progress,
    )
    meta = build_index(cfg)
    print(
        f"built {meta.kind} index of {meta.num_passages} passages in {meta.build_seconds:.1f} s "
        f"({meta.encoder}, dim {meta.dimension}) -> {args.out}",
        file=sys.stderr,
    )
    return 0


def _exit_with_parent(parent_pid: int, poll_s: float = 1.0) -> None:
    """Exit this process soon after ``parent_pid`` dies (even by SIGKILL): a daemon thread polls
    the parent pid (re-parenting changes ``os.getppid()``)."""
    import threading
    import time

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(poll_s)
        os._exit(0)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def _serve(args: argparse.Namespace) -> int:
    from retriever.access import check_bind, check_port, read_token_file
    from retriever.index import load_index
    from retriever.server import ServerConfig, serve

    if args.parent_pid:
        _exit_with_parent(args.parent_pid)
    token = read_token_file(args.token_file) if args.token_file else None
    check_bind(args.host, token)  # before the (slow) index load
    check_port(args.host, args.port)

    cfg = ServerConfig(
        default_topk=args.default_topk,
        max_topk=args.max_topk,
        max_queries=args.max_queries,
        max_query_chars=args.max_query_chars,
        max_batch_queries=args.max_batch_queries,
        max_wait_ms=args.max_wait_ms,
        max_request_bytes=args.max_request_bytes,
    )
    loaded = load_index(args.index, args.corpus, device=args.device, torch_threads=args.torch_threads)
    print(
        f"serving {loaded.meta.kind} index ({loaded.meta.num_passages} passages) "
        f"on http://{args.host}:{args.port}",
        file=sys.stderr,
        flush=True,
    )
    serve(loaded, args.host, args.port, cfg, log_level=args.log_level, token=token)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run ``retriever`` subcommands directly (``python -m retriever.cli build ...``)."""
    parser = argparse.ArgumentParser(prog="copc retriever")
    add_subcommands(parser.add_subparsers(dest="command", metavar="COMMAND", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
