"""Evaluation benchmarks: a registry of named benchmarks (the Search-R1 QA sets, AIME, MATH-500),
user benchmarks given as ``"path/to/file.jsonl:env_id[:kind]"``, their rows, and the services
their environments need (one shared sandbox pool, one BM25 retriever server).

A benchmark (:class:`BenchmarkSpec`) names an environment (``search``, ``math_tool``, or
``"file.py:id"``), a dataset that environment's loader understands (or a JSONL path), and a
*kind* that decides its metrics: ``qa`` (greedy exact match / F1 / cover-EM, one sample per
question) or ``math`` (avg@k / pass@k over ``k`` samples at temperature 1).

Example::

    specs = [resolve_benchmark(n) for n in ("nq", "aime2024", "my_set.jsonl:math_tool")]
    with BenchmarkServices(specs) as services:
        for spec in specs:
            rows = load_rows(spec, max_samples=100)
            make_env = services.env_factory(spec)
            env = make_env()
            obs, _ = env.reset(options={"sample": rows[0]})
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import environments
from copc.registries import Registry
from environments.data import data_root, iter_jsonl

if TYPE_CHECKING:
    import gymnasium

    from environments.sandbox import Sandbox

log = logging.getLogger(__name__)

#: Benchmark kinds: ``qa`` (greedy EM / F1 / cover-EM) and ``math`` (avg@k / pass@k).
KINDS = ("qa", "math")
#: Per-kind ``(default_k, default_temperature)`` when a spec does not give them.
KIND_DEFAULTS: dict[str, tuple[int, float]] = {"qa": (1, 0.0), "math": (4, 1.0)}
#: Where :class:`BenchmarkServices` keeps the BM25 index when none is given (relative: to the
#: current working directory).
DEFAULT_INDEX_DIR = "runs/retriever_index/bm25"
#: Workers of the shared sandbox pool.
DEFAULT_SANDBOX_WORKERS = 2


@dataclass(frozen=True)
class BenchmarkSpec:
    """One evaluation benchmark (validated on creation).

    Attributes:
        name: the benchmark's name (what ``--benchmarks`` lists and results are keyed by).
        env: the environment: a registered id (``"search"``, ``"math_tool"``) or a reference
            :func:`environments.resolve` understands (``"pkg.mod:id"``, ``"file.py:id"``).
        data: a dataset name the environment's loader understands (``"nq"``, ``"aime2024"``)
            or a JSONL path (absolute, or relative to the data directory).
        kind: ``"qa"`` or ``"math"`` (see :data:`KINDS`); decides how rows are loaded and
            which metrics are computed.
        env_kwargs: constructor keyword arguments of the environment (e.g.
            ``{"reward": {"mode": "math_verify"}}``).
        default_k: samples per row when the caller does not say (``None``: 1 for ``qa``, 4 for
            ``math``); always an int >= 1 after creation.
        default_temperature: sampling temperature when the caller does not say (``None``: 0.0
            for ``qa``, greedy; 1.0 for ``math``); always a float >= 0 after creation.

    Raises:
        ValueError: a field is invalid; the message names it (``"BenchmarkSpec.kind='x': ..."``).
    """

    name: str
    env: str
    data: str
    kind: str
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    default_k: int | None = None
    default_temperature: float | None = None

    def __post_init__(self) -> None:
        for name in ("name", "env", "data"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value.strip():
                raise ValueError(f"BenchmarkSpec.{name}={value!r}: must be a non-empty str")
        if self.kind not in KINDS:
            raise ValueError(f"BenchmarkSpec.kind={self.kind!r} (benchmark {self.name!r}): "
                             f"must be one of {list(KINDS)}")
        if not isinstance(self.env_kwargs, Mapping) \
                or not all(isinstance(k, str) for k in self.env_kwargs):
            raise ValueError(f"BenchmarkSpec.env_kwargs={self.env_kwargs!r} (benchmark "
                             f"{self.name!r}): must be a mapping with str keys")
        object.__setattr__(self, "env_kwargs", dict(self.env_kwargs))
        k, temperature = KIND_DEFAULTS[self.kind]
        if self.default_k is not None:
            k = self.default_k
            if isinstance(k, bool) or not isinstance(k, int) or k < 1:
                raise ValueError(f"BenchmarkSpec.default_k={k!r} (benchmark {self.name!r}): "
                                 "must be an int >= 1")
        if self.default_temperature is not None:
            temperature = self.default_temperature
            if isinstance(temperature, bool) or not isinstance(temperature, int | float) \
                    or not temperature >= 0:
                raise ValueError(f"BenchmarkSpec.default_temperature={temperature!r} (benchmark "
                                 f"{self.name!r}): must be a number >= 0")
        object.__setattr__(self, "default_k", k)
        object.__setattr__(self, "default_temperature", float(temperature))


#: The benchmark registry: name → :class:`BenchmarkSpec` (use :func:`register_benchmark`); a
#: :class:`copc.Registry`.
BENCHMARKS: Registry[BenchmarkSpec] = Registry("benchmark", callable_entries=False)


def register_benchmark(spec: BenchmarkSpec, overwrite: bool = False) -> BenchmarkSpec:
    """Add ``spec`` to :data:`BENCHMARKS` under ``spec.name``.

    Args:
        spec: the benchmark.
        overwrite: replace a benchmark already registered under that name.

    Returns:
        ``spec``.

    Raises:
        TypeError: ``spec`` is not a :class:`BenchmarkSpec`.
        copc.registries.RegistryError: (a ``ValueError``) the name is taken and ``overwrite``
            is False.
    """
    if not isinstance(spec, BenchmarkSpec):
        raise TypeError(f"register_benchmark: expected a BenchmarkSpec, got {type(spec).__name__}")
    return BENCHMARKS.register(spec.name, spec, overwrite=overwrite)


def benchmark_names() -> list[str]:
    """The registered benchmark names, sorted."""
    return BENCHMARKS.names()


_QA_BUILTINS = ("nq", "triviaqa", "popqa", "hotpotqa", "2wikimultihopqa", "musique", "bamboogle")
_MATH_BUILTINS = {"aime2024": 32, "aime2025": 32, "math500": 4}
for _name in _QA_BUILTINS:
    register_benchmark(BenchmarkSpec(_name, "search", _name, "qa", default_k=1,
                                     default_temperature=0.0))
for _name, _k in _MATH_BUILTINS.items():
    register_benchmark(BenchmarkSpec(_name, "math_tool", _name, "math",
                                     {"reward": {"mode": "math_verify"}}, default_k=_k,
                                     default_temperature=1.0))


def infer_kind(path: str | Path) -> str:
    """The kind of a JSONL benchmark file, from its first row: ``"qa"`` if it has
    ``golden_answers``, ``"math"`` if it has ``problem`` and ``answer``.

    Raises:
        FileNotFoundError: no such file.
        ValueError: the file is empty, its first row is not a JSON object, or has neither shape.
    """
    first = iter_jsonl(path, limit=1)  # the project's JSONL reader: same errors everywhere
    if not first:
        raise ValueError(f"benchmark file {str(Path(path))!r} has no rows")
    lineno, row = first[0]
    if "golden_answers" in row:
        return "qa"
    if "problem" in row and "answer" in row:
        return "math"
    raise ValueError(f"{Path(path)}:{lineno}: cannot infer the benchmark kind: rows need "
                     "'golden_answers' (qa) or 'problem' and 'answer' (math); or name it: "
                     f"'{path}:<env>:qa|math'")


def resolve_benchmark(ref: str) -> BenchmarkSpec:
    """The benchmark named by ``ref``.

    Args:
        ref: a registered name (``"nq"``, ``"aime2024"``, see :func:`benchmark_names`), or a
            user benchmark ``"path/to/file.jsonl:env"`` / ``"path/to/file.jsonl:env:kind"``:
            ``env`` is an environment reference (``"math_tool"``, ``"envs/calc.py:calc"``), the
            path is relative to the current working directory unless absolute, and ``kind``
            (``qa`` | ``math``) is inferred from the first row when omitted (see
            :func:`infer_kind`). A user benchmark is named by its file stem.

    Returns:
        The :class:`BenchmarkSpec` (a user benchmark gets its kind's defaults and no
        ``env_kwargs``).

    Raises:
        ValueError: unknown benchmark (the message names it and lists the known ones), a
            malformed reference, or a file whose kind cannot be inferred.
        FileNotFoundError: the JSONL file does not exist.
    """
    if not isinstance(ref, str) or not ref.strip():
        raise ValueError(f"benchmark reference {ref!r}: must be a non-empty str")
    if ref in BENCHMARKS:
        return BENCHMARKS.get(ref)
    path, sep, rest = ref.partition(".jsonl:")
    if not sep:
        raise ValueError(f"unknown benchmark {ref!r}; known: {benchmark_names()} (or a user "
                         "benchmark 'path/to/file.jsonl:env_id[:qa|math]')")
    path += ".jsonl"
    env, kind = rest, ""
    head, colon, last = rest.rpartition(":")
    if colon and head and last in KINDS:
        env, kind = head, last
    if not env.strip():
        raise ValueError(f"benchmark reference {ref!r}: no environment after '{path}:' "
                         "(expected 'path/to/file.jsonl:env_id[:qa|math]')")
    file = Path(path).expanduser().resolve()
    if not file.is_file():
        raise FileNotFoundError(f"benchmark {ref!r}: file {str(file)!r} not found")
    return BenchmarkSpec(name=file.stem, env=env, data=str(file), kind=kind or infer_kind(file))


def load_rows(spec: BenchmarkSpec, data_dir: str = "", max_samples: int = 0) -> list[dict[str, Any]]:
    """The benchmark's rows, read with the environments' own loaders (so normalisation is the
    same as in training): ``qa`` with :func:`environments.search.env.load_qa` (``id``,
    ``question``, ``golden_answers``), ``math`` with :func:`environments.math_tool.load_math`
    (``id``, ``problem``, ``answer`` as str).

    Args:
        spec: the benchmark.
        data_dir: the data directory (see :func:`environments.data.data_root`; empty:
            ``$COPC_DATA_DIR``, else ``../shared/data``).
        max_samples: when > 0, only the first ``max_samples`` rows (file order, deterministic).

    Returns:
        The rows, in file order; every row has a unique str ``id``.

    Raises:
        ValueError: ``max_samples`` is negative or not an int, a row is malformed, or two rows
            share an id (the message names the benchmark).
        FileNotFoundError: the dataset file does not exist.
    """
    if isinstance(max_samples, bool) or not isinstance(max_samples, int) or max_samples < 0:
        raise ValueError(f"max_samples={max_samples!r}: must be an int >= 0 (0: all rows)")
    limit = max_samples or None
    root = str(data_root(data_dir))
    if spec.kind == "qa":
        from environments.search.env import load_qa

        rows = load_qa(spec.data, root, limit)
    else:
        from environments.math_tool import load_math

        rows = load_math(spec.data, root, limit)
    seen: set[str] = set()
    for r in rows:
        r["id"] = str(r["id"])
        if r["id"] in seen:
            raise ValueError(f"benchmark {spec.name!r}: duplicate row id {r['id']!r} in {spec.data!r}")
        seen.add(r["id"])
    return rows


def service_of(env: str) -> str | None:
    """Which shared service an environment takes: ``"search"`` (a retriever URL) for
    ``SearchEnv`` and its subclasses, ``"math_tool"`` (a sandbox pool) for ``MathToolEnv`` and
    its subclasses, ``None`` for any other environment.

    Args:
        env: an environment reference (imports its module, see :func:`environments.resolve`).

    Raises:
        ValueError, FileNotFoundError, ImportError, KeyError: see :func:`environments.resolve`.
    """
    from environments.math_tool.env import MathToolEnv
    from environments.search.env import SearchEnv

    env_id = environments.resolve(env)
    if env_id in ("search", "math_tool"):
        return env_id
    entry = environments.DEFAULT_REGISTRY.spec(env_id).load()
    if isinstance(entry, type):
        if issubclass(entry, SearchEnv):
            return "search"
        if issubclass(entry, MathToolEnv):
            return "math_tool"
    return None


class BenchmarkServices:
    """The services the benchmarks' environments share: one sandbox pool (when any benchmark
    runs ``math_tool``) and one BM25 retriever server on 127.0.0.1 (when any runs ``search``
    and no ``retriever_url`` is given, or a search benchmark pins none in its ``env_kwargs``).

    A context manager: ``with BenchmarkServices(specs) as s:`` starts them and closes them on
    exit. Environments resolve (their modules are imported) on creation, so a bad ``env``
    fails before anything starts.

    Args:
        specs: the benchmarks to serve.
        data_dir: the data directory (its ``wiki/corpus.jsonl`` is the retriever's corpus).
        retriever_url: a running retriever server to use instead of starting one.
        index_dir: the BM25 index directory (built on first use, reused after; relative: to
            the current working directory).
        corpus: the retriever corpus (empty: ``<data directory>/wiki/corpus.jsonl``).
        sandbox_workers: workers of the shared sandbox pool.

    Attributes:
        info: after :meth:`start`: ``{"retriever_url": url}`` when a search benchmark is served,
            ``{"sandbox": <what the sandbox enforces>}`` when a math one is.

    Raises:
        ValueError, FileNotFoundError, ImportError, KeyError: a benchmark's ``env`` does not
            resolve (see :func:`environments.resolve`).
    """

    def __init__(self, specs: list[BenchmarkSpec] | tuple[BenchmarkSpec, ...], data_dir: str = "",
                 retriever_url: str = "", index_dir: str = DEFAULT_INDEX_DIR, corpus: str = "",
                 sandbox_workers: int = DEFAULT_SANDBOX_WORKERS) -> None:
        self.specs = list(specs)
        self.data_dir = data_dir
        self.retriever_url = retriever_url
        self.index_dir = index_dir
        self.corpus = corpus
        self.sandbox_workers = sandbox_workers
        self.info: dict[str, Any] = {}
        self.sandbox: Sandbox | None = None
        self._given_url = retriever_url
        self._services = {spec.env: service_of(spec.env) for spec in self.specs}
        self._env_ids = {spec.env: environments.resolve(spec.env) for spec in self.specs}
        self._stop_retriever: Callable[[], None] | None = None
        self._started = False

    def _needs(self, service: str) -> list[BenchmarkSpec]:
        return [s for s in self.specs if self._services[s.env] == service]

    def start(self) -> BenchmarkServices:
        """Start the sandbox pool and the retriever server the benchmarks need (once; later
        calls do nothing).

        Returns:
            ``self``.

        Raises:
            SandboxUnavailableError: the sandbox cannot start.
            RuntimeError / TimeoutError: the retriever server did not become healthy.
            FileNotFoundError: the retriever corpus does not exist.
            (Anything started before the failure is closed.)
        """
        if self._started:
            return self
        try:
            if self._needs("math_tool"):
                from environments.sandbox import Sandbox, SandboxConfig

                self.sandbox = Sandbox(SandboxConfig(workers=self.sandbox_workers))
                self.info["sandbox"] = self.sandbox.enforced
            searches = self._needs("search")
            if searches and not self.retriever_url \
                    and any("retriever_url" not in s.env_kwargs for s in searches):
                from ..tasks.search import corpus_path, start_retriever

                corpus = corpus_path(self.corpus, self.data_dir)
                if not corpus.is_file():
                    raise FileNotFoundError(f"retriever corpus {str(corpus)!r} not found (search "
                                            f"benchmarks {[s.name for s in searches]})")
                url, stop = start_retriever(corpus, Path(self.index_dir).expanduser().resolve())
                self.retriever_url, self._stop_retriever = url, stop
            if searches and self.retriever_url:
                self.info["retriever_url"] = self.retriever_url
        except BaseException:
            self.close()
            raise
        self._started = True
        return self

    def env_factory(self, spec: BenchmarkSpec) -> Callable[[], gymnasium.Env]:
        """A function building a fresh environment of ``spec``: ``environments.make(env,
        **spec.env_kwargs)`` plus ``sandbox=<the shared pool>`` for a ``math_tool`` env or
        ``retriever_url=<the server>`` for a ``search`` env (unless ``env_kwargs`` pins one).

        Args:
            spec: a benchmark (one of ``specs``, or any on an environment needing no service
                this object does not run).

        Returns:
            A zero-argument factory; each call returns a new environment (close it after use;
            closing it never closes the shared services).

        Raises:
            RuntimeError: the benchmark needs a service that is not started (call
                :meth:`start` first, or include the benchmark in ``specs``).
        """
        if spec.env not in self._services:
            self._services[spec.env] = service_of(spec.env)
            self._env_ids[spec.env] = environments.resolve(spec.env)
        service, env_id = self._services[spec.env], self._env_ids[spec.env]
        kwargs = dict(spec.env_kwargs)
        if service == "math_tool":
            if self.sandbox is None:
                raise RuntimeError(f"benchmark {spec.name!r} needs the sandbox pool: call "
                                   "BenchmarkServices.start() first (with the benchmark in specs)")
            kwargs["sandbox"] = self.sandbox
        elif service == "search" and "retriever_url" not in kwargs:
            if not (self._started and self.retriever_url):
                raise RuntimeError(f"benchmark {spec.name!r} needs the retriever: call "
                                   "BenchmarkServices.start() first (with the benchmark in specs)")
            kwargs["retriever_url"] = self.retriever_url

        def make() -> gymnasium.Env:
            return environments.make(env_id, **kwargs)

        return make

    def close(self) -> None:
        """Stop the retriever server and the sandbox pool this object started (idempotent)."""
        stop, self._stop_retriever = self._stop_retriever, None
        sandbox, self.sandbox = self.sandbox, None
        try:
            if stop is not None:
                stop()
        finally:
            if sandbox is not None:
                sandbox.close()
            self.retriever_url = self._given_url
            self._started = False

    def __enter__(self) -> BenchmarkServices:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["BENCHMARKS", "DEFAULT_INDEX_DIR", "KINDS", "KIND_DEFAULTS", "BenchmarkServices",
           "BenchmarkSpec", "benchmark_names", "infer_kind", "load_rows", "register_benchmark",
           "resolve_benchmark", "service_of"]
