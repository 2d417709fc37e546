"""Evaluation benchmarks: a registry of named benchmarks (the Search-R1 QA sets, AIME, MATH-500),
user benchmarks given as ``"path/to/file.jsonl:env_id[:kind]"``, their rows, and the services
their environments need, started by the benchmarks' *tasks*.

A benchmark (:class:`BenchmarkSpec`) names an environment (``search``, ``math_tool``, or
``"file.py:id"``), a dataset its kind's loader understands (or a JSONL path), and a *kind*
(:mod:`trainer.evaluate.kinds`: ``qa``, ``math`` or a user's) that reads its rows, scores its
episodes and names its metrics. The environment's *task* (:func:`trainer.tasks.task_class`:
the task registered for that env id, or for an environment class it derives from) provides the
services: :class:`BenchmarkServices` calls :meth:`trainer.tasks.base.Task.start_services` once per
task (e.g. one sandbox pool for the math benchmarks, one retriever server for the search ones),
builds every environment with that task's ``make_env`` and plays its episodes with that task's
:meth:`~trainer.tasks.base.Task.episode`; each task is built with its own ``task.settings``.

Example::

    specs = [resolve_benchmark(n) for n in ("nq", "aime2024", "my_set.jsonl:math_tool")]
    with BenchmarkServices(specs) as services:
        for spec in specs:
            rows = load_rows(spec, max_samples=100)
            env = services.env_factory(spec)()
            obs, _ = env.reset(options={"sample": rows[0]})
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import environments
from environments.data import data_root
from seams.registry import Registry

from .kinds import BENCHMARK_KINDS, BenchmarkKind, infer_kind, kind_names, make_kind

if TYPE_CHECKING:
    import gymnasium

    from ..config.specs import TaskSpec
    from ..rollout.groups import EpisodeFn
    from ..tasks.base import Task

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BenchmarkSpec:
    """One evaluation benchmark (validated on creation).

    Attributes:
        name: the benchmark's name (what ``--benchmarks`` lists and results are keyed by).
        env: the environment: a registered id (``"search"``, ``"math_tool"``) or a reference
            :func:`environments.resolve` understands (``"pkg.mod:id"``, ``"file.py:id"``); its
            task provides the services.
        data: a dataset name the kind's loader understands (``"nq"``, ``"aime2024"``) or a
            JSONL path (absolute, or relative to the data directory).
        kind: a registered benchmark kind (:func:`trainer.evaluate.kinds.kind_names`).
        env_kwargs: constructor keyword arguments of the environment (e.g.
            ``{"reward": {"mode": "math_verify"}}``).
        kind_settings: the kind's settings for this benchmark (fields of its settings dataclass).
        default_k: samples per row when the caller does not say (``None``: the kind's
            ``default_k``); always an int >= 1 after creation.
        default_temperature: sampling temperature likewise (``None``: the kind's); always a
            float >= 0 after creation.

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
    kind_settings: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("name", "env", "data"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value.strip():
                raise ValueError(f"BenchmarkSpec.{name}={value!r}: must be a non-empty str")
        if self.kind not in BENCHMARK_KINDS:
            raise ValueError(f"BenchmarkSpec.kind={self.kind!r} (benchmark {self.name!r}): "
                             f"must be one of {kind_names()}")
        for name in ("env_kwargs", "kind_settings"):
            value = getattr(self, name)
            if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
                raise ValueError(f"BenchmarkSpec.{name}={value!r} (benchmark {self.name!r}): must be "
                                 "a mapping with str keys")
            object.__setattr__(self, name, dict(value))
        try:
            settings = self.benchmark_kind().settings
        except ValueError as e:
            raise ValueError(f"BenchmarkSpec.kind_settings={self.kind_settings!r} (benchmark "
                             f"{self.name!r}): {e}") from None
        k, temperature = settings.default_k, settings.default_temperature
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

    def benchmark_kind(self, overrides: Mapping[str, Any] | None = None) -> BenchmarkKind:
        """The kind with this benchmark's settings: the kind's defaults, then ``kind_settings``,
        then ``overrides`` (e.g. ``eval.kind_settings.<kind>``).

        Raises:
            ValueError: a setting the kind's dataclass does not have or rejects.
        """
        return make_kind(self.kind, {**self.kind_settings, **(overrides or {})})


#: The benchmark registry: name → :class:`BenchmarkSpec` (use :func:`register_benchmark`); a
#: :class:`seams.registry.Registry`.
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
        seams.registry.RegistryError: (a ``ValueError``) the name is taken and ``overwrite``
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


def resolve_benchmark(ref: str) -> BenchmarkSpec:
    """The benchmark named by ``ref``.

    Args:
        ref: a registered name (``"nq"``, ``"aime2024"``, see :func:`benchmark_names`), or a
            user benchmark ``"path/to/file.jsonl:env"`` / ``"path/to/file.jsonl:env:kind"``:
            ``env`` is an environment reference (``"math_tool"``, ``"envs/calc.py:calc"``), the
            path is relative to the current working directory unless absolute, and ``kind``
            (a registered kind) is inferred from the first row when omitted (see
            :func:`~trainer.evaluate.kinds.infer_kind`). A user benchmark is named by its file stem.

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
                         "benchmark 'path/to/file.jsonl:env_id[:kind]')")
    path += ".jsonl"
    env, kind = rest, ""
    head, colon, last = rest.rpartition(":")
    if colon and head and last in BENCHMARK_KINDS:
        env, kind = head, last
    if not env.strip():
        raise ValueError(f"benchmark reference {ref!r}: no environment after '{path}:' "
                         "(expected 'path/to/file.jsonl:env_id[:kind]')")
    file = Path(path).expanduser().resolve()
    if not file.is_file():
        raise FileNotFoundError(f"benchmark {ref!r}: file {str(file)!r} not found")
    return BenchmarkSpec(name=file.stem, env=env, data=str(file), kind=kind or infer_kind(file))


#: ``task.env_kwargs`` keys that choose rows, never applied to a benchmark (its rows are its own).
ROW_SOURCE_KEYS = ("dataset", "data_dir", "limit")


def _merged(base: Mapping[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``top`` over it; a mapping in both is merged key by key (recursively)."""
    out = dict(base)
    for key, value in top.items():
        old = out.get(key)
        out[key] = _merged(old, value) if isinstance(old, Mapping) and isinstance(value, Mapping) else value
    return out


def with_task_env_kwargs(spec: BenchmarkSpec, task_env: str, env_kwargs: Mapping[str, Any]) -> BenchmarkSpec:
    """``spec`` played with the experiment config's environment settings.

    A benchmark on the config's own environment (``task.env``, compared as registered ids) is
    built with ``task.env_kwargs`` (the prompt template, tool format, limits, top-k a model was
    trained or tuned with: ``configs/eval/*.yaml``), less the row-source keys
    :data:`ROW_SOURCE_KEYS`; the benchmark's own ``env_kwargs`` are merged over them (they define
    the benchmark: the math benchmarks' ``reward.mode: math_verify`` stays). A benchmark on another
    environment is returned unchanged.

    Args:
        spec: the benchmark. task_env: ``task.env``. env_kwargs: ``task.env_kwargs``.

    Returns:
        ``spec``, or a copy with the merged ``env_kwargs`` (so ``eval_settings.json`` records them).

    Raises:
        ValueError, FileNotFoundError, ImportError, KeyError: an environment does not resolve
            (see :func:`environments.resolve`).
    """
    if not task_env_applies(spec, task_env, env_kwargs):
        return spec
    kwargs = {k: v for k, v in env_kwargs.items() if k not in ROW_SOURCE_KEYS}
    return dataclasses.replace(spec, env_kwargs=_merged(kwargs, spec.env_kwargs))


def task_env_applies(spec: BenchmarkSpec, task_env: str, env_kwargs: Mapping[str, Any]) -> bool:
    """Whether :func:`with_task_env_kwargs` changes ``spec``: ``env_kwargs`` has a key besides
    :data:`ROW_SOURCE_KEYS` and ``spec.env`` is ``task_env`` (as registered ids).

    Raises:
        ValueError, FileNotFoundError, ImportError, KeyError: see :func:`environments.resolve`.
    """
    if not any(k not in ROW_SOURCE_KEYS for k in env_kwargs):
        return False
    return environments.resolve(spec.env) == environments.resolve(task_env)


def load_rows(spec: BenchmarkSpec, data_dir: str = "", max_samples: int = 0) -> list[dict[str, Any]]:
    """The benchmark's rows, read by its kind (:meth:`~trainer.evaluate.kinds.BenchmarkKind.load_rows`:
    ``qa`` with :func:`environments.search.env.load_qa`, ``math`` with
    :func:`environments.math_tool.load_math`, the environments' own loaders, so normalisation is
    the same as in training).

    Args:
        spec: the benchmark.
        data_dir: the data directory (see :func:`environments.data.data_root`; empty:
            ``$COPC_DATA_DIR``, else the repository's ``data/``).
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
    rows = spec.benchmark_kind().load_rows(spec.data, str(data_root(data_dir)), max_samples or None)
    seen: set[str] = set()
    for r in rows:
        r["id"] = str(r["id"])
        if r["id"] in seen:
            raise ValueError(f"benchmark {spec.name!r}: duplicate row id {r['id']!r} in {spec.data!r}")
        seen.add(r["id"])
    return rows


def service_of(env: str) -> str | None:
    """The task whose services an environment takes: the env id itself when a task class is
    registered for it (``"search"``, ``"math_tool"``, a user's), else the registered task of the
    nearest environment class it derives from (a ``SearchEnv`` subclass: ``"search"``), else
    None (no services).

    Args:
        env: an environment reference (imports its module, see :func:`environments.resolve`).

    Raises:
        ValueError, FileNotFoundError, ImportError, KeyError: see :func:`environments.resolve`.
    """
    from ..tasks import TASKS

    env_id = environments.resolve(env)
    served = TASKS.names()
    if env_id in served:
        return env_id
    entry = environments.DEFAULT_REGISTRY.spec(env_id).load()
    if not isinstance(entry, type):
        return None
    bases = []
    for other in served:
        if other in environments.names():
            base = environments.DEFAULT_REGISTRY.spec(other).load()
            if isinstance(base, type) and issubclass(entry, base):
                bases.append((len(base.__mro__), other))
    return max(bases)[1] if bases else None


class BenchmarkServices:
    """The services the benchmarks' environments share, started by their tasks: for each task
    some benchmark's environment takes its services from (:func:`service_of`), one task object
    whose :meth:`~trainer.tasks.base.Task.start_services` runs once (e.g. the math benchmarks share
    one sandbox pool, the search ones one retriever server), stopped by :meth:`close`.

    A context manager: ``with BenchmarkServices(specs) as s:`` starts them and closes them on
    exit. Environments resolve (their modules are imported) on creation, so a bad ``env``
    fails before anything starts.

    Args:
        specs: the benchmarks to serve.
        data_dir: the tasks' ``task.data_dir``.
        task: the run's task spec (:func:`trainer.config.specs.task_spec`) the tasks are built from
            (default: a :class:`~trainer.config.specs.TaskSpec` of the ``task`` section's defaults);
            ``data_dir`` overrides its ``task.data_dir``, and its ``task.settings`` go to the task
            of its ``task.env`` only (every other task gets its settings' defaults).
        settings: per task name, ``task.settings`` keys set on top of those (``copc eval``'s task
            options, :attr:`~trainer.tasks.base.Task.eval_options`; e.g. ``{"search":
            {"retriever_url": url}}``: a running server, none started).

    Attributes:
        info: after :meth:`start`: the started tasks' ``info`` merged (e.g. ``{"sandbox": <what it
            enforces>}`` for a math benchmark).

    Raises:
        ValueError, FileNotFoundError, ImportError, KeyError: a benchmark's ``env`` does not
            resolve (see :func:`environments.resolve`).
    """

    def __init__(self, specs: list[BenchmarkSpec] | tuple[BenchmarkSpec, ...], data_dir: str = "",
                 task: TaskSpec | None = None,
                 settings: Mapping[str, Mapping[str, Any]] | None = None) -> None:
        from ..config.specs import TaskSpec

        base = task if task is not None else TaskSpec()
        self._task = dataclasses.replace(base, task=dataclasses.replace(base.task, data_dir=data_dir,
                                                                        env_kwargs={}))
        self._settings = {name: dict(values) for name, values in (settings or {}).items()}
        self.specs = list(specs)
        self.info: dict[str, Any] = {}
        self._services = {spec.env: service_of(spec.env) for spec in self.specs}
        self._env_ids = {spec.env: environments.resolve(spec.env) for spec in self.specs}
        self._tasks: dict[str, Task] = {}

    @property
    def sandbox(self) -> Any:
        """The shared sandbox pool of a started task (``None`` when none runs one)."""
        pools = [t.sandbox for t in self._tasks.values() if getattr(t, "sandbox", None) is not None]
        return pools[0] if pools else None

    def running(self) -> list[str]:
        """The started tasks that run a service of their own (a server, a pool), sorted."""
        return sorted(name for name, t in self._tasks.items() if t._closers)

    def start(self) -> BenchmarkServices:
        """Start the services of every task the benchmarks need (once; later calls do nothing).

        Returns:
            ``self``.

        Raises:
            Whatever a task's ``start_services`` raises (SandboxUnavailableError, a retriever
            that does not become healthy, FileNotFoundError for a missing corpus); anything
            started before the failure is closed.
        """
        if self._tasks:
            return self
        from ..tasks import task_class

        try:
            for name in sorted({s for s in self._services.values() if s is not None}):
                task = task_class(name)(dataclasses.replace(self._task, task=dataclasses.replace(
                    self._task.task, env=name, settings=self._task_settings(name))), name)
                self._tasks[name] = task
                task.start_services()
                self.info.update(task.info)
        except BaseException:
            self.close()
            raise
        return self

    def _task_settings(self, name: str) -> dict[str, Any]:
        """``task.settings`` of task ``name``: the task spec's when its ``task.env`` is that task,
        then the ``settings`` given for it."""
        t = self._task.task
        own = dict(t.settings) if t.env.rpartition(":")[2] == name else {}
        return {**own, **self._settings.get(name, {})}

    def env_factory(self, spec: BenchmarkSpec) -> Callable[[], gymnasium.Env]:
        """A function building a fresh environment of ``spec``: its task's ``make_env`` (with the
        task's services: the sandbox pool, the retriever URL) for the env id of ``spec.env`` and
        ``spec.env_kwargs``; ``environments.make(env, **spec.env_kwargs)`` for an environment no
        task serves.

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
        task = self._started_task(spec)
        env_id, kwargs = self._env_ids[spec.env], dict(spec.env_kwargs)
        if task is None:
            return lambda: environments.make(env_id, **kwargs)
        view = copy.copy(task)  # the started task's services, this benchmark's env id and settings
        view.env_id, view.env_kwargs, view._closers = env_id, kwargs, []
        return view.make_env

    def episode(self, spec: BenchmarkSpec) -> EpisodeFn | None:
        """How an episode of ``spec`` is played on one of :meth:`env_factory`'s environments: its
        task's :meth:`~trainer.tasks.base.Task.episode` (None for an environment no task serves:
        the tool-environment loop).

        Raises:
            RuntimeError: as :meth:`env_factory`.
        """
        task = self._started_task(spec)
        return None if task is None else task.episode()

    def _started_task(self, spec: BenchmarkSpec) -> Task | None:
        """The started task serving ``spec``'s environment (None: no task serves it).

        Raises:
            RuntimeError: it needs a task that is not started.
        """
        if spec.env not in self._services:
            self._services[spec.env] = service_of(spec.env)
            self._env_ids[spec.env] = environments.resolve(spec.env)
        service = self._services[spec.env]
        if service is None:
            return None
        task = self._tasks.get(service)
        if task is None:
            from ..tasks import task_class

            what = task_class(service).service_names or f"the services of task {service!r}"
            raise RuntimeError(f"benchmark {spec.name!r} needs {what}: call BenchmarkServices.start() first "
                               "(with the benchmark in specs)")
        return task

    def close(self) -> None:
        """Stop the services the tasks started, last first (idempotent)."""
        tasks, self._tasks = self._tasks, {}
        for task in reversed(list(tasks.values())):
            task.close()
        self.info = {}

    def __enter__(self) -> BenchmarkServices:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["BENCHMARKS", "ROW_SOURCE_KEYS", "BenchmarkServices", "BenchmarkSpec",
           "benchmark_names", "infer_kind", "load_rows", "register_benchmark", "resolve_benchmark",
           "service_of", "task_env_applies", "with_task_env_kwargs"]
