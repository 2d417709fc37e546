"""The :class:`Task` base class and :func:`check_env_settings`.

A task is what ``copc train`` needs from an environment besides the model: its data splits
(``train_samples`` / ``eval_samples``, disjoint lists of rows, each row passed to the env as
``reset(options={"sample": row})``), the services its environments use (a sandbox pool, a
retriever server) with their start and stop, an environment factory (``make_env``, one env per
episode), an ``info`` dict for the run's summary, and optionally a generator of supervised
warm-start traces.

A task's own knobs live in its settings dataclass (``settings_class``, filled from
``task.settings``: :mod:`trainer.tasks.settings`), never in the central config schema.

Services reach other processes through two hooks, so that a task with a service edits no central
file: :meth:`Task.worker_spec` (the spec a Ray rollout worker builds its own copy of the task
from: paths made absolute, the URLs of services this task started in :meth:`Task.worker_settings`)
and :attr:`Task.eval_options` (``copc eval`` flags setting the task's settings for the services its
benchmarks need, e.g. the search task's ``--retriever-url``).

A task never sees the experiment config: it is constructed from a
:class:`~trainer.config.specs.TaskSpec` (the ``task`` section, ``train.seed`` and
``eval.num_samples``), built once where the run is assembled by
:func:`trainer.config.specs.task_spec`.

Lifecycle: ``task = SomeTask(spec, env_id)`` (cheap, starts nothing; parses ``task.settings``),
``task.start()`` (loads the data, then :meth:`Task.start_services`: starts the services, each
registering its stop function with :meth:`Task.add_closer`), then ``task.close()`` (stops them in
reverse order; idempotent, also after a failed ``start``). ``copc eval`` calls
:meth:`Task.start_services` alone: a benchmark's environments get the services of their task,
without its training data.
:func:`trainer.tasks.build_task` does all of it and checks the env settings.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import environments
from environments.data import data_root

from ..errors import ConfigError
from .settings import parse_settings

if TYPE_CHECKING:
    import gymnasium

    from ..config import WarmStartConfig
    from ..config.specs import TaskSpec
    from ..rollout.groups import EpisodeFn
    from ..warmstart.traces import Trace

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DrillPlan:
    """The copy-drill phase of a task's warm start (SFT on :meth:`Task.drill_traces` before the
    traces; constant LR after 20 warm-up steps).

    Attributes:
        steps: optimizer steps (>= 1). batch_size: drills per step. lr: peak learning rate.
    """

    steps: int
    batch_size: int
    lr: float


@dataclass(frozen=True)
class EvalOption:
    """A ``copc eval`` command-line option a task adds (:attr:`Task.eval_options`): it sets one of the
    task's settings for the services its benchmarks need, as ``task.settings.<setting>`` would.

    Attributes:
        flag: the option, ``--`` and lowercase words joined by ``-`` (e.g. ``"--retriever-url"``).
        setting: the field of the task's settings dataclass it sets (e.g. ``"retriever_url"``).
        help: the ``--help`` text.
        service_url: the value is the base URL of a running server (``http://host:port``) whose
            ``/health`` must answer before anything starts (a dead one is refused up front).

    Raises:
        ValueError: ``flag`` is not ``--words-like-this`` or ``setting`` is empty.
    """

    flag: str
    setting: str
    help: str
    service_url: bool = False

    def __post_init__(self) -> None:
        """Check the spellings (see Raises)."""
        if not re.fullmatch(r"--[a-z][a-z0-9]*(-[a-z0-9]+)*", self.flag):
            raise ValueError(f"EvalOption.flag={self.flag!r}: must look like --words-like-this")
        if not self.setting:
            raise ValueError(f"EvalOption {self.flag}: setting must name a field of the task's settings")

    @property
    def dest(self) -> str:
        """The attribute of the parsed ``argparse.Namespace`` (``--retriever-url`` → ``retriever_url``)."""
        return self.flag[2:].replace("-", "_")


class Task:
    """A trainable task: data splits, services, an environment factory (subclass to customise).

    The base class serves any registered environment whose data comes ready-made: subclasses
    override :meth:`start` (fill ``train_samples`` / ``eval_samples`` / ``info``, start services
    and register their stop functions with :meth:`add_closer`), and where needed
    :meth:`make_env`, ``warm_start_kinds``, :meth:`warm_start_traces` and ``settings_class`` (the
    dataclass of the task's own knobs, read from ``task.settings`` into :attr:`settings`).
    Register a subclass for an env id with :func:`trainer.tasks.register_task`.

    A subclass that overrides ``__init__`` keeps this signature, ``__init__(self, spec, env_id=None)``,
    and calls ``super().__init__(spec, env_id)``: the task gets a
    :class:`~trainer.config.specs.TaskSpec`, never the experiment config. A class written for the
    former ``__init__(self, cfg, env_id)`` gets the spec as ``cfg``: ``cfg.task`` still reads the
    task section, but another section (``cfg.train.seed``: ``spec.seed`` now) or ``self.cfg``
    raises ``AttributeError``.

    Args:
        spec: the task's spec (:func:`trainer.config.specs.task_spec`): ``spec.task`` the ``task``
            config section, ``spec.seed`` ``train.seed``, ``spec.eval_num_samples``
            ``eval.num_samples``.
        env_id: the registered environment id (``spec.task.env`` with any ``module:`` prefix
            removed); default ``spec.task.env``.

    Attributes:
        spec: the task's :class:`~trainer.config.specs.TaskSpec`.
        env_id: registered environment id that :meth:`make_env` builds.
        env_kwargs: keyword overrides passed to ``environments.make`` (``task.env_kwargs``).
        train_samples: training rows (``list[dict]``), disjoint from ``eval_samples``.
        eval_samples: held-out rows for evaluation.
        info: facts about the task for logs and the summary (e.g. ``retriever_url``).
        settings: the task's own settings (an instance of ``settings_class`` made from
            ``task.settings``; None for a task without settings).
        warm_start_kinds: the ``warm_start.kind`` values :meth:`warm_start_traces` can generate
            (empty: none).
    """

    warm_start_kinds: ClassVar[tuple[str, ...]] = ()
    #: the dataclass of this task's own knobs (``task.settings``; :mod:`trainer.tasks.settings`);
    #: None: the task has none (any ``task.settings`` key is refused).
    settings_class: ClassVar[type | None] = None
    #: strings a run-time BPE tokenizer (``model.tiny.tokenizer: bpe``) must keep as single tokens:
    #: the environment's tool tags (e.g. ``<search>``, ``</information>``).
    tokenizer_tags: ClassVar[tuple[str, ...]] = ()
    #: ``task.env_kwargs.tool_format`` values the warm-start traces are written in (the built-in
    #: generators write the tag formats of ReTool / Search-R1).
    warm_start_tool_formats: ClassVar[tuple[str, ...]] = ("tags",)
    #: what :meth:`start_services` starts, in words (for messages; empty: nothing).
    service_names: ClassVar[str] = ""
    #: ``copc eval`` options setting this task's settings for its benchmarks' services (empty: none;
    #: the ``search`` task: ``--retriever-url``). Read when the ``copc eval`` parser is built.
    eval_options: ClassVar[tuple[EvalOption, ...]] = ()

    def __init__(self, spec: TaskSpec, env_id: str | None = None) -> None:
        self.spec = spec
        self.env_id = env_id or spec.task.env
        self.env_kwargs: dict[str, Any] = dict(spec.task.env_kwargs)
        self.train_samples: list[dict] = []
        self.eval_samples: list[dict] = []
        self.info: dict[str, Any] = {}
        self._closers: list[Callable[[], None]] = []
        self.settings: Any = self.parse_settings(spec.task.settings, self.env_id)

    @property
    def cfg(self) -> TaskSpec:
        """The former attribute holding the experiment config: refused in one line.

        Raises:
            ConfigError: always, saying what to read instead (:attr:`spec`).
        """
        raise ConfigError(f"task {self.env_id!r} ({type(self).__qualname__}) read self.cfg: a task has "
                          "self.spec, a TaskSpec (spec.task: the task section, spec.seed: train.seed, "
                          "spec.eval_num_samples: eval.num_samples), not the experiment config; "
                          "docs/seams.md, Tasks")

    @classmethod
    def parse_settings(cls, values: Mapping[str, Any] | None, env_id: str) -> Any:
        """This task class's settings from the ``task.settings`` mapping (also run at load, by
        :meth:`trainer.config.TaskConfig.validate`).

        Returns:
            An instance of :attr:`settings_class`, or None for a task without settings.

        Raises:
            ConfigError: see :func:`trainer.tasks.settings.parse_settings`.
        """
        return parse_settings(cls.settings_class, values, env_id)

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        """Load the data splits and start the services (the base class has none of either).

        Raises:
            ConfigError: bad data or service settings (the message names the key).
        """

    def start_services(self) -> None:
        """Start the services the task's environments use (no data is read), registering each
        stop function with :meth:`add_closer`; :meth:`start` calls it after loading the data.
        The base class has none.

        Raises:
            Whatever a service raises when it cannot start (the subclass documents it).
        """

    def worker_spec(self) -> TaskSpec:
        """The spec from which a process elsewhere (a Ray rollout worker, maybe in another working
        directory) builds its own copy of this started task with :func:`trainer.tasks.build_task`:
        :attr:`spec` with its paths absolute (:func:`trainer.tasks.absolute_task_paths`:
        ``task.data_dir``, a ``.py`` file in ``task.env``) and ``task.settings`` replaced by
        :meth:`worker_settings` (the services this task started, reused by the workers).

        Returns:
            A new :class:`~trainer.config.specs.TaskSpec` (:attr:`spec` is not modified).
        """
        spec = absolute_task_paths(self.spec)
        return dataclasses.replace(spec, task=dataclasses.replace(spec.task, settings=self.worker_settings()))

    def worker_settings(self) -> dict[str, Any]:
        """``task.settings`` for a worker's copy of this task (:meth:`worker_spec`): what it
        needs to use this task's started services instead of starting its own, and its paths
        absolute. Override it in a task with services.

        Returns:
            A new mapping; the base class: ``task.settings`` unchanged.
        """
        return dict(self.spec.task.settings)

    def add_closer(self, fn: Callable[[], None]) -> None:
        """Register ``fn`` (no arguments) to be called by :meth:`close`, last registered first."""
        self._closers.append(fn)

    def close(self) -> None:
        """Stop the task's services, last started first; idempotent, never raises (a failing
        stop function is logged and the others still run)."""
        while self._closers:
            fn = self._closers.pop()
            try:
                fn()
            except Exception:
                log.warning("task %r: a service failed to stop", self.env_id, exc_info=True)

    def __enter__(self) -> Task:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- environments ------------------------------------------------------------------------
    def make_env(self) -> gymnasium.Env:
        """A new environment for one episode (zero arguments: usable as an env factory).

        Returns:
            ``environments.make(self.env_id, **self.env_kwargs)``.

        Raises:
            Whatever the environment's constructor raises for bad settings (see
            :func:`check_env_settings`).
        """
        return environments.make(self.env_id, **self.env_kwargs)

    def episode(self) -> EpisodeFn:
        """How one episode is played on an environment of :meth:`make_env`: the function the
        episode pools of training and evaluation call (:attr:`trainer.rollout.groups.EnvPool.episode`).

        Returns:
            The base class: :func:`trainer.rollout.agent_loop.run_episode` (the tool-environment
            loop: the engine generates, ``env.step`` answers). A task whose environments are driven
            otherwise returns its own (the ``harness`` task: the user's agent drives the calls).
        """
        from ..rollout.agent_loop import run_episode

        return run_episode

    def tokenizer_texts(self) -> Iterator[str]:
        """Text a run-time BPE tokenizer is trained on (``model.tiny.tokenizer: bpe``): the prompt
        of every training row as the environment's ``reset`` renders it, then the environment's
        invalid-action reply. Held-out rows are never read. Subclasses add what their episodes
        contain (the search task: the retriever corpus rendered as observations).

        Yields:
            Strings (any Unicode).

        Raises:
            Whatever the environment raises for a malformed row.
        """
        env = self.make_env()
        try:
            for row in self.train_samples:
                prompt, _ = env.reset(options={"sample": dict(row)})
                yield str(prompt)
            reply = getattr(env, "invalid_action_reply", None)
            if isinstance(reply, str) and reply:
                yield reply
        finally:
            close = getattr(env, "close", None)
            if close is not None:
                close()

    # -- warm start --------------------------------------------------------------------------
    def check_warm_start(self, ws: WarmStartConfig) -> None:
        """Fail early if ``ws`` asks for warm-start traces this task cannot generate.

        Args:
            ws: the ``warm_start`` config section.

        Raises:
            ConfigError: ``ws.enabled`` and ``ws.kind`` not in :attr:`warm_start_kinds`, or the
                environment's ``tool_format`` is not one the traces are written in.
        """
        fmt = (self.spec.task.env_kwargs or {}).get("tool_format", "tags")
        if ws.enabled and ws.kind in self.warm_start_kinds and fmt not in self.warm_start_tool_formats:
            raise ConfigError(f"task.env_kwargs.tool_format={fmt!r}: the {ws.kind!r} warm-start traces are "
                              f"written in {list(self.warm_start_tool_formats)} format; set "
                              "warm_start.enabled=false (start from an instruct model) or tool_format=tags")
        if not ws.enabled or ws.kind in self.warm_start_kinds:
            return
        if not self.warm_start_kinds:
            raise ConfigError(f"warm_start.enabled=True: the task of env {self.env_id!r} has no warm-start "
                              "trace generator; set warm_start.enabled=false (or register a Task with "
                              "warm_start_traces, see trainer/tasks/base.py)")
        raise ConfigError(f"warm_start.kind={ws.kind!r}: the task of env {self.env_id!r} generates "
                          f"{list(self.warm_start_kinds)}")

    def drill_plan(self) -> DrillPlan | None:
        """The copy-drill phase of the warm start, or None for none (the base class: none; the
        ``search`` task: its ``drill_steps`` / ``drill_batch_size`` / ``drill_lr`` settings)."""
        return None

    def drill_traces(self, n: int, seed: int, reading_fraction: float | None = None) -> list[Trace]:
        """Copy drills for :meth:`drill_plan`: ``n`` traces whose first action copies text of the
        prompt into a tool call.

        Args:
            n: number of drills. seed: their generator's seed.
            reading_fraction: the share of drills that use the tool's result (None: the task's
                setting; a task without such drills rejects a share > 0).

        Raises:
            ConfigError: the task has none (the base class).
        """
        raise ConfigError(f"drills: the task of env {self.env_id!r} has no copy drills "
                          "(task.settings.drill_steps is a setting of the tasks that have them: search)")

    def warm_start_traces(self, ws: WarmStartConfig, *, progress: bool = True) -> list[Trace]:
        """Supervised warm-start traces played through this task's real environments, never of
        an ``eval_samples`` row.

        Args:
            ws: the ``warm_start`` config section (``kind``, ``num_examples``, ``seed``); the
                task's own knobs are in :attr:`settings`.
            progress: show a progress bar.

        Returns:
            The traces (:class:`~trainer.warmstart.traces.Trace`), in training order.

        Raises:
            ConfigError: this task cannot generate ``ws.kind`` traces (the base class: none).
        """
        self.check_warm_start(ws)
        raise ConfigError(f"warm_start.kind={ws.kind!r}: not implemented by the task of env {self.env_id!r}")

    # -- helpers for subclasses ---------------------------------------------------------------
    def cap_train(self, rows: Sequence[dict]) -> list[dict]:
        """``rows`` cut to ``task.max_train_samples`` (0: all)."""
        n = self.spec.task.max_train_samples
        return list(rows[:n] if n else rows)

    def cap_eval(self, rows: Sequence[dict]) -> list[dict]:
        """``rows`` cut to ``task.max_eval_samples``, else ``eval.num_samples``
        (:attr:`TaskSpec.eval_num_samples <trainer.config.specs.TaskSpec.eval_num_samples>`; 0: all)."""
        n = self.spec.task.max_eval_samples or self.spec.eval_num_samples
        return list(rows[:n] if n else rows)


def absolute_task_paths(spec: TaskSpec) -> TaskSpec:
    """``spec`` with the paths of its ``task`` section made absolute against the current working
    directory, for processes that may run elsewhere (e.g. Ray rollout workers building their own
    task): ``task.data_dir`` (resolved as :func:`environments.data.data_root` does, so
    ``COPC_DATA_DIR`` / the fallback are pinned too) and a ``.py`` file in ``task.env``. Paths in
    a task's own settings are the task's to pin (:meth:`Task.worker_settings`).

    Args:
        spec: a task's :class:`~trainer.config.specs.TaskSpec` (not modified).

    Returns:
        A copy of ``spec`` with the ``task`` section's paths absolute.
    """
    t = spec.task
    env = t.env
    module, sep, env_id = env.rpartition(":")
    if sep and module.endswith(".py"):
        env = f"{Path(module).expanduser().resolve()}:{env_id}"
    pinned = dataclasses.replace(t, env=env, data_dir=str(data_root(t.data_dir)))
    return dataclasses.replace(spec, task=pinned)


_UNEXPECTED_KW = re.compile(r"unexpected keyword argument '([^']+)'")
_FIELD_VALUE = re.compile(r"\b\w+\.(\w+)=(.+?): (.*)$", re.DOTALL)


def _find_key(tree: Any, key: str, value: Any = None, path: str = "") -> str | None:
    """Dotted path of ``key`` in nested mappings ``tree`` (whose value's repr is ``value``, if given)."""
    if not isinstance(tree, dict):
        return None
    for k, v in tree.items():
        here = f"{path}.{k}" if path else str(k)
        if k == key and (value is None or repr(v) == value):
            return here
        found = _find_key(v, key, value, here)
        if found:
            return found
    return None


def _nearest(name: str, env_id: str) -> str:
    """``"; did you mean prompt_template? (its settings: ...)"`` for a misspelt setting ``name`` of
    ``env_id`` (from the parameters its entry point declares), or ``""`` when none is known."""
    try:
        params = environments.DEFAULT_REGISTRY.spec(environments.resolve(env_id)).parameters()
    except Exception:  # an env id the registry cannot describe: the error alone then
        return ""
    if not params:
        return ""
    close = difflib.get_close_matches(name, params, n=1)
    return (f"; did you mean {close[0]}?" if close else "") + f" (its settings: {', '.join(params)})"


def check_env_settings(make_env: Callable[[], Any], env_id: str, env_kwargs: dict[str, Any]) -> None:
    """Build (and close) one environment so bad ``task.env_kwargs`` fail at load, not in rollouts.

    Environments validate their settings in their constructor (``TypeError`` for an unknown
    keyword, ``ValueError`` naming ``Config.field=value``, ``OSError`` for missing data); all become a
    :class:`ConfigError` naming the key under ``task.env_kwargs`` when it can be found in
    ``env_kwargs`` (e.g. ``task.env_kwargs.reward.mode='math-verify': must be one of ...``).

    Args:
        make_env: the task's environment factory.
        env_id: the environment id (for messages).
        env_kwargs: the ``task.env_kwargs`` mapping (to find the offending key).

    Raises:
        ConfigError: the environment rejected its settings.
    """
    try:
        env = make_env()
    except TypeError as e:
        m = _UNEXPECTED_KW.search(str(e))
        if m is None:
            raise ConfigError(f"task.env_kwargs: env {env_id!r} rejected its settings: {e}") from e
        path = _find_key(env_kwargs, m.group(1)) or m.group(1)
        hint = ("" if "." in path else _nearest(m.group(1), env_id)) or f" ({e})"
        raise ConfigError(f"task.env_kwargs.{path}: not a setting of env {env_id!r}{hint}") from e
    except OSError as e:  # e.g. task.env_kwargs.dataset naming a file that does not exist
        where = "task.env_kwargs.dataset" if "dataset" in env_kwargs else "task.env_kwargs"
        raise ConfigError(f"{where}: env {env_id!r} could not load its data: {type(e).__name__}: {e}") from e
    except ValueError as e:
        m = _FIELD_VALUE.search(str(e))
        path = _find_key(env_kwargs, m.group(1), m.group(2)) if m else None
        if path is None:
            raise ConfigError(f"task.env_kwargs: env {env_id!r} rejected its settings: {e}") from e
        raise ConfigError(f"task.env_kwargs.{path}={m.group(2)}: {m.group(3)}") from e
    close = getattr(env, "close", None)
    if close is not None:
        close()
