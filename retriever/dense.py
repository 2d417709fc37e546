"""Dense retrieval: FAISS inner-product index over L2-normalised embeddings (= cosine).

Index types: ``flat`` (exact, ``IndexFlatIP``, default), ``hnsw`` (``IndexHNSWFlat``, graph,
``hnsw_m`` links, ``ef_search`` at query time) and ``ivf`` (``IndexIVFFlat``, ``nlist``
k-means cells, ``nprobe`` probed at query time) for large corpora.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from retriever.encoder import Encoder

FAISS_FILE = "faiss.index"
INDEX_TYPES = ("flat", "hnsw", "ivf")


@dataclass(frozen=True)
class FaissConfig:
    """FAISS index choice.

    Attributes:
        index_type: ``flat`` | ``hnsw`` | ``ivf``.
        hnsw_m: HNSW neighbours per node.
        ef_construction / ef_search: HNSW beam widths at build / query time.
        nlist: IVF cells (clamped to the number of passages); ``nprobe``: cells probed.
    """

    index_type: str = "flat"
    hnsw_m: int = 32
    ef_construction: int = 200
    ef_search: int = 128
    nlist: int = 1024
    nprobe: int = 32

    def __post_init__(self) -> None:
        if self.index_type not in INDEX_TYPES:
            raise ValueError(f"faiss.index_type must be one of {INDEX_TYPES}, got {self.index_type!r}")
        for name in ("hnsw_m", "ef_construction", "ef_search", "nlist", "nprobe"):
            if getattr(self, name) <= 0:
                raise ValueError(f"faiss.{name} must be > 0, got {getattr(self, name)}")

    def to_dict(self) -> dict[str, Any]:
        """The config as a JSON-serialisable dict (stored in index metadata)."""
        return asdict(self)


def build_faiss(emb: np.ndarray, cfg: FaissConfig):
    """Build a FAISS inner-product index over ``emb`` (float32 ``(n, d)``, rows = passages).

    Raises:
        ValueError: ``emb`` is not a non-empty 2-D array.
    """
    import faiss

    if emb.ndim != 2 or emb.shape[0] == 0:
        raise ValueError(f"embeddings must be a non-empty (n, d) array, got shape {emb.shape}")
    emb = np.ascontiguousarray(emb, dtype=np.float32)
    n, d = emb.shape
    if cfg.index_type == "flat":
        index = faiss.IndexFlatIP(d)
    elif cfg.index_type == "hnsw":
        index = faiss.IndexHNSWFlat(d, cfg.hnsw_m, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = cfg.ef_construction
    else:
        nlist = max(1, min(cfg.nlist, n // 39 if n >= 39 else 1))  # FAISS wants >= 39 pts/cell
        quantizer = faiss.IndexFlatIP(d)
        index = faiss.IndexIVFFlat(quantizer, d, nlist, faiss.METRIC_INNER_PRODUCT)
        index.train(emb)
    index.add(emb)
    _set_search_params(index, cfg)
    return index


def _set_search_params(index, cfg: FaissConfig) -> None:
    if cfg.index_type == "hnsw":
        index.hnsw.efSearch = cfg.ef_search
    elif cfg.index_type == "ivf":
        index.nprobe = cfg.nprobe


class DenseSearcher:
    """Encoder + FAISS index; :meth:`search` encodes queries and searches in one call."""

    def __init__(self, encoder: Encoder, index, cfg: FaissConfig) -> None:
        self.encoder = encoder
        self.index = index
        self.cfg = cfg
        self.num_passages = int(index.ntotal)

    def save(self, index_dir: str | Path) -> None:
        """Write the FAISS index to ``index_dir/faiss.index``."""
        import faiss

        faiss.write_index(self.index, str(Path(index_dir) / FAISS_FILE))

    @classmethod
    def load(cls, index_dir: str | Path, encoder: Encoder, cfg: FaissConfig) -> DenseSearcher:
        """Read ``index_dir/faiss.index``.

        Raises:
            ValueError: the index dimension differs from the encoder's.
        """
        import faiss

        index = faiss.read_index(str(Path(index_dir) / FAISS_FILE))
        if index.d != encoder.dimension:
            raise ValueError(
                f"FAISS index dimension {index.d} != encoder {encoder.name} dimension "
                f"{encoder.dimension}; build and serve with the same encoder"
            )
        _set_search_params(index, cfg)
        return cls(encoder, index, cfg)

    def search(self, queries: Sequence[str], k: int) -> tuple[np.ndarray, np.ndarray]:
        """Top-``k`` passages per query by cosine similarity.

        Returns:
            ``(indices, scores)``: int64 and float32 arrays ``(n, min(k, num_passages))``,
            scores (cosine in [-1, 1]) descending. Approximate indexes may return -1 rows
            when fewer than ``k`` candidates are found; callers must drop them.

        Unlike BM25 there is no "no term matched" case (every passage has a cosine), so an
        exact (``flat``) index always returns ``k`` hits, even for a query unrelated to the
        corpus (e.g. ``"the of and a to"``); no score threshold is applied.
        """
        k = min(k, self.num_passages)
        q = self.encoder.encode_queries(queries)
        scores, idx = self.index.search(q, k)
        return idx.astype(np.int64, copy=False), scores.astype(np.float32, copy=False)
