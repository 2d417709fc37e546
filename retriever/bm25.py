"""BM25 with ``bm25s`` (Lucene variant, k1 = 0.9, b = 0.4 by default, as Pyserini / Search-R1).

Tokenisation: lower-case, ``\\w\\w+`` tokens, English stop words removed, Snowball
English stemmer (PyStemmer). Scores follow Lucene (>= 8) BM25, summed over query terms:
``idf(t) * tf / (tf + k1 * (1 - b + b * dl / avgdl))`` with
``idf = ln(1 + (N - df + 0.5) / (df + 0.5))``, ``dl`` and ``avgdl`` in tokens (Lucene's
``BM25Similarity``, which drops the constant ``(k1 + 1)`` factor; bm25s ``method="lucene"``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import scipy.sparse

SUBDIR = "bm25s"


@dataclass(frozen=True)
class BM25Config:
    """BM25 parameters.

    Attributes:
        k1: term-frequency saturation (> 0).
        b: length normalisation in [0, 1].
        stemmer: PyStemmer algorithm name (e.g. ``"english"``, ``"porter"``) or ``""`` for none.
        stopwords: bm25s stop-word list name (``"en"``) or ``""`` for none.
    """

    k1: float = 0.9
    b: float = 0.4
    stemmer: str = "english"
    stopwords: str = "en"

    def __post_init__(self) -> None:
        if not self.k1 > 0:
            raise ValueError(f"bm25.k1 must be > 0, got {self.k1}")
        if not 0.0 <= self.b <= 1.0:
            raise ValueError(f"bm25.b must be in [0, 1], got {self.b}")


def _tokenizer(cfg: BM25Config):
    import Stemmer
    from bm25s.tokenization import Tokenizer

    stemmer = Stemmer.Stemmer(cfg.stemmer) if cfg.stemmer else None
    return Tokenizer(stemmer=stemmer, stopwords=cfg.stopwords or [])


class BM25Searcher:
    """A bm25s index ready to answer batches of queries.

    Thread-safe for concurrent :meth:`search` calls (read-only numpy arrays).
    """

    def __init__(self, retriever, tokenizer, num_passages: int) -> None:
        if getattr(retriever, "nonoccurrence_array", None) is not None:
            raise ValueError("only BM25 variants without a non-occurrence term are supported")
        self._retriever = retriever
        self._tokenizer = tokenizer
        self._matrix = None
        self.num_passages = num_passages

    @classmethod
    def build(cls, texts: Sequence[str], cfg: BM25Config, show_progress: bool = True) -> BM25Searcher:
        """Index ``texts`` (passage contents, row order = passage index).

        Raises:
            ValueError: ``texts`` is empty.
        """
        import bm25s

        if not texts:
            raise ValueError("cannot build a BM25 index over 0 passages")
        tok = _tokenizer(cfg)
        ids = tok.tokenize(list(texts), update_vocab=True, return_as="ids", show_progress=show_progress)
        ret = bm25s.BM25(method="lucene", k1=cfg.k1, b=cfg.b)
        ret.index(ids, show_progress=show_progress)
        return cls(ret, tok, len(texts))

    def save(self, index_dir: str | Path) -> None:
        """Write the sparse matrix and vocabulary under ``index_dir/bm25s/``."""
        out = Path(index_dir) / SUBDIR
        out.mkdir(parents=True, exist_ok=True)
        self._retriever.save(str(out), show_progress=False)
        self._tokenizer.save_vocab(str(out))
        self._tokenizer.save_stopwords(str(out))

    @classmethod
    def load(cls, index_dir: str | Path, cfg: BM25Config, num_passages: int) -> BM25Searcher:
        """Load an index written by :meth:`save` (memory-mapped arrays not used: small corpora)."""
        import bm25s

        src = Path(index_dir) / SUBDIR
        ret = bm25s.BM25.load(str(src), show_progress=False)
        tok = _tokenizer(cfg)
        tok.load_vocab(str(src))
        tok.load_stopwords(str(src))
        return cls(ret, tok, num_passages)

    def search(self, queries: Sequence[str], k: int) -> tuple[np.ndarray, np.ndarray]:
        """Top-``k`` passages for each query.

        Args:
            queries: ``n`` query strings (words not in the vocabulary are ignored).
            k: results per query; clamped to the number of passages.

        Returns:
            ``(indices, scores)``: int64 ``(n, k')`` passage rows and float32 ``(n, k')``
            BM25 scores, sorted by descending score, ``k' = min(k, num_passages)``.
        """
        q = self._tokenizer.tokenize(list(queries), update_vocab=False, return_as="ids", show_progress=False)
        return top_k_columns(self._batch_scores(q), k)

    def _batch_scores(self, query_ids: list[list[int]]) -> np.ndarray:
        """BM25 scores of every passage for every query with one sparse product.

        bm25s stores the precomputed per-(passage, term) scores as a CSC matrix ``S``
        (passages x vocabulary); a query's scores are the sum of its terms' columns
        (repeated terms count again, as in bm25s and Lucene), i.e. ``S @ Q`` with ``Q`` the
        (vocabulary x n) term-count matrix. Equals ``bm25s.BM25.retrieve`` (tested) but costs
        one sparse product per batch instead of one Python-level pass per query.

        Returns:
            float32 ``(num_passages, n)``.
        """
        if self._matrix is None:
            sc = self._retriever.scores
            vocab = len(sc["indptr"]) - 1
            self._matrix = scipy.sparse.csc_matrix(
                (sc["data"], sc["indices"], sc["indptr"]), shape=(sc["num_docs"], vocab)
            )
        rows = np.fromiter((t for ids in query_ids for t in ids), dtype=np.int64)
        cols = np.repeat(np.arange(len(query_ids)), [len(ids) for ids in query_ids])
        qm = scipy.sparse.csc_matrix(
            (np.ones(len(rows), dtype=np.float32), (rows, cols)),
            shape=(self._matrix.shape[1], len(query_ids)),
        )
        return np.asarray((self._matrix @ qm).toarray(), dtype=np.float32)


def top_k_columns(scores: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Best ``k`` rows of each column of ``scores`` (``(N, n)``), ties by lower row first.

    Returns:
        ``(indices int64 (n, k'), values float32 (n, k'))`` with ``k' = min(k, N)``,
        values descending per row.
    """
    n_rows, n = scores.shape
    k = min(k, n_rows)
    if k < n_rows:
        cand = np.argpartition(-scores, k - 1, axis=0)[:k]  # (k, n), unordered
    else:
        cand = np.broadcast_to(np.arange(n_rows)[:, None], (n_rows, n))
    idx = np.empty((n, k), dtype=np.int64)
    val = np.empty((n, k), dtype=np.float32)
    for j in range(n):
        c = cand[:, j]
        v = scores[c, j]
        order = np.lexsort((c, -v))
        idx[j], val[j] = c[order], v[order]
    return idx, val
