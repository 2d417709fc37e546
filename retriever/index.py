"""Build an index directory (index files + ``meta.json``) and load it back for serving.

Every backend exposes ``search(queries, k) -> (indices, scores)`` with int64 / float32
arrays of shape ``(n_queries, k')`` holding corpus row numbers (``-1`` = no hit) and
scores in descending order; see :class:`Searcher`.

What counts as a hit: BM25 (``bm25``, ``pyserini``) returns only passages containing at
least one query term, so a query of stop words, unknown words or punctuation gets no hit
and others may get fewer than ``k``. Dense scores are cosine similarities: every passage
has one and there is no "no term matched" state, so an exact (``flat``) dense index always
fills all ``k`` places, however unrelated the passages (approximate ones may leave ``-1``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np

from retriever.bm25 import BM25Config, BM25Searcher
from retriever.corpus import Passage, corpus_checksum, load_corpus
from retriever.dense import FaissConfig
from retriever.encoder import EncoderConfig
from retriever.meta import KINDS, IndexMeta


class Searcher(Protocol):
    """What the server needs from a backend."""

    num_passages: int

    def search(self, queries: Sequence[str], k: int) -> tuple[np.ndarray, np.ndarray]:
        """Return ``(indices int64 (n, k'), scores float32 (n, k'))``, best first.

        ``k' = min(k, num_passages)``; places without a hit hold row ``-1`` (after every
        real hit of the row), which callers must drop.
        """
        ...


@dataclass(frozen=True)
class BuildConfig:
    """Everything ``copc retriever build`` needs.

    Attributes:
        kind: ``bm25`` | ``dense`` | ``pyserini``.
        corpus: JSONL corpus path.
        out: output index directory (created; must be empty or absent unless ``overwrite``).
        bm25 / encoder / faiss: backend parameters.
        lucene_index: (pyserini) an existing Lucene index to reuse instead of building one.
        threads: (pyserini) indexing / search threads.
        overwrite: allow writing into a non-empty ``out``.
        show_progress: progress bars during the build.
    """

    kind: str
    corpus: str
    out: str
    bm25: BM25Config = field(default_factory=BM25Config)
    encoder: EncoderConfig = field(default_factory=EncoderConfig)
    faiss: FaissConfig = field(default_factory=FaissConfig)
    lucene_index: str | None = None
    threads: int = 1
    overwrite: bool = False
    show_progress: bool = True

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"build.kind must be one of {KINDS}, got {self.kind!r}")
        if not Path(self.corpus).is_file():
            raise ValueError(f"build.corpus {self.corpus!r} is not a file")
        if self.threads <= 0:
            raise ValueError(f"build.threads must be > 0, got {self.threads}")
        out = Path(self.out)
        if out.exists() and any(out.iterdir()) and not self.overwrite:
            raise ValueError(f"build.out {self.out!r} is not empty (pass --overwrite)")


def build_index(cfg: BuildConfig) -> IndexMeta:
    """Build the index described by ``cfg`` and write ``cfg.out/meta.json``.

    Returns:
        The written metadata (``build_seconds`` = wall-clock build time, seconds).

    Raises:
        CorpusFormatError: a corpus line is invalid (file and line number given).
        ValueError / ImportError / RuntimeError: backend-specific problems (named).
    """
    passages = load_corpus(cfg.corpus)
    digest = corpus_checksum(cfg.corpus)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    texts = [p.contents for p in passages]
    t0 = time.perf_counter()
    if cfg.kind == "bm25":
        BM25Searcher.build(texts, cfg.bm25, show_progress=cfg.show_progress).save(out)
        encoder, dim, params = "bm25s", 0, {"bm25": asdict(cfg.bm25)}
    elif cfg.kind == "dense":
        from retriever.dense import DenseSearcher, build_faiss
        from retriever.encoder import Encoder

        enc = Encoder(cfg.encoder)
        emb = enc.encode_passages(texts, show_progress=cfg.show_progress)
        DenseSearcher(enc, build_faiss(emb, cfg.faiss), cfg.faiss).save(out)
        enc_params = asdict(cfg.encoder)
        enc_params.update(query_prefix=enc.query_prefix, passage_prefix=enc.passage_prefix)
        encoder, dim = enc.name, enc.dimension
        params = {"encoder": enc_params, "faiss": cfg.faiss.to_dict()}
    else:
        from retriever.pyserini_backend import build_lucene

        lucene = build_lucene(cfg.corpus, out, cfg.lucene_index, cfg.threads)
        encoder, dim = "lucene", 0
        params = {"bm25": asdict(cfg.bm25), "lucene_index": str(lucene), "threads": cfg.threads}
    meta = IndexMeta(
        kind=cfg.kind,
        corpus_path=str(Path(cfg.corpus).resolve()),
        corpus_sha256=digest,
        num_passages=len(passages),
        encoder=encoder,
        dimension=dim,
        params=params,
        build_seconds=round(time.perf_counter() - t0, 3),
    )
    meta.save(out)
    return meta


@dataclass
class LoadedIndex:
    """An index ready to serve: backend, the passages it returns and its metadata."""

    searcher: Searcher
    passages: list[Passage]
    meta: IndexMeta


def load_index(
    index_dir: str | Path,
    corpus: str | Path | None = None,
    device: str = "auto",
    torch_threads: int = 0,
) -> LoadedIndex:
    """Load an index directory and its corpus, refusing a corpus it was not built for.

    Args:
        index_dir: directory written by :func:`build_index`.
        corpus: corpus file (default: the path recorded at build time).
        device: (dense) ``cpu`` | ``cuda`` | ``auto`` for the query encoder.
        torch_threads: (dense) CPU threads for the query encoder, 0 = torch default.

    Raises:
        FileNotFoundError: no ``meta.json`` or corpus file.
        IndexMismatchError: the corpus checksum or passage count differ from the metadata.
    """
    meta = IndexMeta.load(index_dir)
    corpus_path = Path(corpus) if corpus is not None else Path(meta.corpus_path)
    if not corpus_path.is_file():
        raise FileNotFoundError(
            f"corpus {corpus_path} not found (index {index_dir} was built from "
            f"{meta.corpus_path}); "
            "pass --corpus"
        )
    meta.check_corpus(corpus_path)
    passages = load_corpus(corpus_path)
    meta.check_corpus(corpus_path, len(passages))
    searcher: Searcher
    if meta.kind == "bm25":
        searcher = BM25Searcher.load(index_dir, BM25Config(**meta.params["bm25"]), len(passages))
    elif meta.kind == "dense":
        from retriever.dense import DenseSearcher
        from retriever.encoder import Encoder

        enc_cfg = EncoderConfig(
            **{**meta.params["encoder"], "device": device, "torch_threads": torch_threads}
        )
        searcher = DenseSearcher.load(index_dir, Encoder(enc_cfg), FaissConfig(**meta.params["faiss"]))
    else:
        from retriever.pyserini_backend import PyseriniSearcher

        lucene = Path(meta.params["lucene_index"])
        searcher = PyseriniSearcher(
            lucene if lucene.is_absolute() else Path(index_dir) / lucene,
            [p.id for p in passages],
            BM25Config(**meta.params["bm25"]),
            threads=int(meta.params.get("threads", 1)),
        )
    return LoadedIndex(searcher=searcher, passages=passages, meta=meta)
