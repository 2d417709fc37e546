"""Corpus reading: JSONL passages ``{"id", "contents"}`` (Search-R1 / wiki-18 convention).

``contents`` is ``"Title"\\ntext`` (title in double quotes, a newline, then the passage).
The reader streams the file line by line, validates every record and raises
:class:`CorpusFormatError` naming the file, the 1-based line number and the field at fault.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

_CHUNK_BYTES = 1 << 20


class CorpusFormatError(ValueError):
    """A corpus line is not a valid passage record.

    Attributes:
        path: the corpus file.
        line: 1-based line number of the bad record.
    """

    def __init__(self, path: str | Path, line: int, message: str) -> None:
        self.path = str(path)
        self.line = line
        super().__init__(f"{path}:{line}: {message}")


@dataclass(frozen=True)
class Passage:
    """One corpus passage.

    Attributes:
        id: the passage id as a string (integers in the source are converted with ``str``).
        contents: ``"Title"\\ntext`` as stored in the corpus.
    """

    id: str
    contents: str

    @property
    def title(self) -> str:
        """The title: the first line of ``contents`` with surrounding double quotes removed."""
        first = self.contents.split("\n", 1)[0]
        return first[1:-1] if len(first) >= 2 and first[0] == first[-1] == '"' else first

    @property
    def text(self) -> str:
        """The passage body: ``contents`` after the first newline (empty if there is none)."""
        parts = self.contents.split("\n", 1)
        return parts[1] if len(parts) == 2 else ""


def _parse_line(path: Path, lineno: int, raw: str) -> Passage:
    try:
        rec = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise CorpusFormatError(path, lineno, f"invalid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(rec, dict):
        raise CorpusFormatError(path, lineno, f"expected a JSON object, got {type(rec).__name__}")
    if "id" not in rec:
        raise CorpusFormatError(path, lineno, "missing field 'id'")
    if "contents" not in rec:
        raise CorpusFormatError(path, lineno, "missing field 'contents'")
    pid, contents = rec["id"], rec["contents"]
    if isinstance(pid, bool) or not isinstance(pid, str | int):
        raise CorpusFormatError(path, lineno, f"field 'id' must be a string, got {pid!r}")
    if not isinstance(contents, str):
        raise CorpusFormatError(
            path, lineno, f"field 'contents' must be a string, got {type(contents).__name__}"
        )
    if not contents.strip():
        raise CorpusFormatError(path, lineno, f"field 'contents' is empty (id {pid!r})")
    return Passage(id=str(pid), contents=contents)


def iter_corpus(path: str | Path) -> Iterator[Passage]:
    """Stream validated passages from a JSONL corpus, one per non-blank line.

    Args:
        path: corpus file (UTF-8 JSONL, one ``{"id", "contents"}`` object per line).

    Yields:
        :class:`Passage` objects in file order.

    Raises:
        FileNotFoundError: the file does not exist.
        CorpusFormatError: a line is not valid JSON, is not an object, lacks ``id`` or
            ``contents``, has a non-string ``contents`` or an empty one, or repeats an id.
            The message names the file and the 1-based line number.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"corpus file not found: {path}")
    seen: set[str] = set()
    with path.open("r", encoding="utf-8") as fh:
        for lineno, raw in enumerate(fh, start=1):
            if not raw.strip():
                continue
            passage = _parse_line(path, lineno, raw)
            if passage.id in seen:
                raise CorpusFormatError(path, lineno, f"duplicate id {passage.id!r}")
            seen.add(passage.id)
            yield passage


def load_corpus(path: str | Path) -> list[Passage]:
    """Read a whole corpus into memory (see :func:`iter_corpus` for validation and errors).

    Raises:
        CorpusFormatError: as :func:`iter_corpus`, or if the file holds no passage.
    """
    passages = list(iter_corpus(path))
    if not passages:
        raise CorpusFormatError(path, 0, "corpus holds no passages")
    return passages


def corpus_checksum(path: str | Path) -> str:
    """SHA-256 hex digest of the corpus file's bytes (64 hex characters).

    Used in index metadata to refuse loading an index built for another corpus.
    """
    h = hashlib.sha256()
    with Path(path).open("rb") as fh:
        while chunk := fh.read(_CHUNK_BYTES):
            h.update(chunk)
    return h.hexdigest()
