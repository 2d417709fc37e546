"""Index metadata (``meta.json``) written next to every index, and the corpus check on load."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from retriever.corpus import corpus_checksum

META_FILE = "meta.json"
FORMAT_VERSION = 1
KINDS = ("bm25", "dense", "pyserini")


class IndexMismatchError(ValueError):
    """An index does not belong to the given corpus (checksum or passage count differ)."""


@dataclass(frozen=True)
class IndexMeta:
    """What an index was built from; stored as ``DIR/meta.json``.

    Attributes:
        kind: ``"bm25"``, ``"dense"`` or ``"pyserini"``.
        corpus_path: absolute path of the corpus at build time (default corpus when serving).
        corpus_sha256: SHA-256 of the corpus file bytes (see :func:`corpus_checksum`).
        num_passages: number of passages indexed (rows of the corpus).
        encoder: encoder name (dense), ``"bm25s"`` or ``"lucene"`` (sparse).
        dimension: embedding dimension (dense) or 0 (sparse).
        params: backend parameters (k1/b, FAISS index type, pooling, prefixes ...).
        build_seconds: wall-clock build time in seconds.
        format_version: layout version of the index directory.
    """

    kind: str
    corpus_path: str
    corpus_sha256: str
    num_passages: int
    encoder: str
    dimension: int
    params: dict[str, Any] = field(default_factory=dict)
    build_seconds: float = 0.0
    format_version: int = FORMAT_VERSION

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"meta.kind must be one of {KINDS}, got {self.kind!r}")
        if self.num_passages <= 0:
            raise ValueError(f"meta.num_passages must be > 0, got {self.num_passages}")
        if self.dimension < 0:
            raise ValueError(f"meta.dimension must be >= 0, got {self.dimension}")

    def save(self, index_dir: str | Path) -> Path:
        """Write ``index_dir/meta.json`` (pretty JSON) and return its path."""
        path = Path(index_dir) / META_FILE
        path.write_text(json.dumps(asdict(self), indent=2, sort_keys=True) + "\n")
        return path

    @classmethod
    def load(cls, index_dir: str | Path) -> IndexMeta:
        """Read ``index_dir/meta.json``.

        Raises:
            FileNotFoundError: ``meta.json`` is missing (not an index directory).
            ValueError: the file is not valid metadata (message names the field).
        """
        path = Path(index_dir) / META_FILE
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: {index_dir} is not a copc index directory")
        raw = json.loads(path.read_text())
        if raw.get("format_version") != FORMAT_VERSION:
            raise ValueError(
                f"{path}: format_version {raw.get('format_version')!r} unsupported "
                f"(expected {FORMAT_VERSION}); rebuild the index"
            )
        try:
            return cls(**raw)
        except TypeError as exc:
            raise ValueError(f"{path}: bad metadata: {exc}") from exc

    def check_corpus(self, corpus_path: str | Path, num_passages: int | None = None) -> None:
        """Refuse a corpus other than the one this index was built for.

        Args:
            corpus_path: corpus file to be served with this index.
            num_passages: passages read from it, if already loaded (checked too).

        Raises:
            IndexMismatchError: checksum or passage count differ (message gives both values).
        """
        digest = corpus_checksum(corpus_path)
        if digest != self.corpus_sha256:
            raise IndexMismatchError(
                f"index was built for corpus {self.corpus_path} "
                f"(sha256 {self.corpus_sha256[:12]}…, "
                f"{self.num_passages} passages) but {corpus_path} has sha256 {digest[:12]}…; "
                "rebuild the index for this corpus"
            )
        if num_passages is not None and num_passages != self.num_passages:
            raise IndexMismatchError(
                f"index has {self.num_passages} passages but corpus {corpus_path} has {num_passages}"
            )
