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
        # bm25s writes its vocabulary with orjson when that is installed (the openenv extra pulls it
        # in), and orjson rejects the int keys of an index built from token ids; json.dumps writes
        # them as strings, so string keys give the same file either way.
        ret, vocab = self._retriever, self._retriever.vocab_dict
        ret.vocab_dict = {str(k): v for k, v in vocab.items()}
        try:
            ret.save(str(out), show_progress=False)
        finally:
            ret.vocab_dict = vocab
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
            BM25 scores, ``k' = min(k, num_passages)``, sorted by descending score, ties by
            lower row (:func:`top_k_columns`). Only passages containing a query term are
            hits: the places left over (all of them for a query made only of stop words,
            unknown words or punctuation) hold row ``-1`` and score ``-inf``, at the end
            (:func:`drop_unmatched`).
        """
        q = self._tokenizer.tokenize(list(queries), update_vocab=False, return_as="ids", show_progress=False)
        return drop_unmatched(*top_k_columns(self._batch_scores(q), k))

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


def top_k_rows(scores: np.ndarray, k: int) -> np.ndarray:
    """Rows of the ``k`` best entries of a 1-D score vector, best first, ties by lower row.

    The order is the stable sort by ``(-score, row)``, so top-``k`` is always a prefix of
    top-``(k + 1)`` and the result depends on the scores only (not on how a partial
    selection happens to order equal values, as ``np.argpartition`` alone would). Cost
    O(N) plus O(k log k): ``np.partition`` finds the k-th best score ``t``; every row
    scoring above ``t`` (fewer than ``k``) is kept, then the lowest rows scoring exactly
    ``t`` fill the remaining places (``np.flatnonzero`` lists them in row order), and only
    those ``k`` candidates are sorted.

    Args:
        scores: float ``(N,)``, no NaN.
        k: how many rows (clamped to ``[0, N]``).

    Returns:
        int64 ``(min(k, N),)`` row numbers.
    """
    n_rows = scores.shape[0]
    k = max(0, min(k, n_rows))
    if k == 0:
        return np.empty(0, dtype=np.int64)
    if k < n_rows:
        kth = np.partition(scores, n_rows - k)[n_rows - k]  # k-th largest value
        above = np.flatnonzero(scores > kth)
        tied = np.flatnonzero(scores == kth)[: k - len(above)]
        cand = np.concatenate([above, tied])
    else:
        cand = np.arange(n_rows)
    order = np.lexsort((cand, -scores[cand]))
    return cand[order].astype(np.int64, copy=False)


def top_k_columns(scores: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Best ``k`` rows of each column of ``scores``, ties by lower row first.

    Per column, :func:`top_k_rows` (order of the stable sort by ``(-score, row)``; the
    tie rule promised in ``docs/retriever.md``).

    Args:
        scores: float ``(N, n)`` (passages x queries), no NaN.
        k: rows per column (clamped to ``N``).

    Returns:
        ``(indices int64 (n, k'), values float32 (n, k'))`` with ``k' = min(k, N)``,
        values descending per row.

    Raises:
        ValueError: ``scores`` is not 2-D or holds NaN (NaN has no place in the order).
    """
    if scores.ndim != 2:
        raise ValueError(f"scores must be a 2-D (N, n) array, got shape {scores.shape}")
    if np.isnan(scores).any():
        raise ValueError("scores hold NaN; cannot rank them")
    n_rows, n = scores.shape
    k = max(0, min(k, n_rows))
    cols = np.ascontiguousarray(scores.T)  # (n, N): one contiguous row per query
    idx = np.empty((n, k), dtype=np.int64)
    for j in range(n):
        idx[j] = top_k_rows(cols[j], k)
    val = np.take_along_axis(cols, idx, axis=1).astype(np.float32, copy=False)
    return idx, val


def drop_unmatched(idx: np.ndarray, scores: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Replace hits with score <= 0 by the no-hit marker (row ``-1``, score ``-inf``).

    A Lucene BM25 term contribution ``idf * tf / (tf + ...)`` is > 0 whenever the term
    occurs in the passage (``idf > 0``, ``tf >= 1``), so a score of 0 means that no query
    term occurs in the passage: it is not a result. Since rows are sorted by descending
    score, the markers are trailing. Lucene (the pyserini backend) likewise returns only
    passages matching a term.

    Args:
        idx: int64 ``(n, k)``; scores: float32 ``(n, k)`` from :func:`top_k_columns`.

    Returns:
        New ``(idx, scores)`` arrays of the same shapes.
    """
    miss = scores <= 0
    return np.where(miss, -1, idx), np.where(miss, np.float32(-np.inf), scores).astype(np.float32)
