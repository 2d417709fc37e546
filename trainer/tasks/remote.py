"""The ``remote`` task: train on an environment served elsewhere (``copc env serve``, any OpenEnv
server), with the data of the environment it serves.

``task.env: remote`` with ``task.env_kwargs: {url: http://host:port, token_file: ..., remote_env:
math_tool}`` builds :class:`~environments.remote.client.RemoteEnv` environments (every
``env_kwargs`` key is a :class:`~environments.remote.client.RemoteEnvConfig` field). The served
environment's id is ``remote_env``, else what the server reports (its ``/schema`` or
``/metadata``). The data splits and warm-start traces are those of that id's task class
(``math_tool``: datasets or generated arithmetic and ``retool_arithmetic`` traces; ``search``: QA
sets and ``search_r1`` traces; an environment not registered here: the JSONL rows of
``task.train_data``, as :class:`~trainer.tasks.generic.GenericTask`), with episodes (warm-start
traces included) played on the server. The delegate task starts none of its own services (its
:meth:`~trainer.tasks.base.Task.start_services` is skipped): the server's environment has them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import environments
from environments.errors import InfrastructureError

from ..config import ConfigError
from .base import DrillPlan, Task
from .generic import GenericTask

if TYPE_CHECKING:
    import gymnasium

    from ..config import WarmStartConfig
    from ..config.specs import TaskSpec
    from ..warmstart.traces import Trace


class RemoteTask(Task):
    """``remote``: a served environment, with the data of the environment it serves.

    ``info``: ``remote_url``, ``remote_env`` (the served id), ``remote_stop_strings``, plus the
    delegate task's ``info``.

    Attributes:
        served_env: the served environment's id (``""`` until :meth:`start`).
        delegate: the task of ``served_env`` that supplied the data (``None`` until :meth:`start`).
    """

    def __init__(self, spec: TaskSpec, env_id: str | None = None) -> None:
        super().__init__(spec, env_id)
        self.served_env = ""
        self.delegate: Task | None = None
        self._server_info: Any = None  # ServerInfo of the server, once started

    def start(self) -> None:
        """Ask the server what it serves, then load that environment's data splits.

        Raises:
            ConfigError: ``task.env_kwargs.url`` missing or bad, a server that does not answer or
                refuses the token, a ``remote_env`` other than the served one, or the delegate's
                data errors.
        """
        from environments.remote.client import RemoteEnvConfig, fetch_server_info

        from .registry import task_class

        kw = self.env_kwargs
        if not kw.get("url"):
            raise ConfigError("task.env_kwargs.url: required for task.env=remote (the OpenEnv server's base "
                              "URL, e.g. http://127.0.0.1:8100 from 'copc env serve --env math_tool')")
        try:
            rcfg = RemoteEnvConfig(**kw)
            server = fetch_server_info(rcfg, rcfg.bearer_token())
        except TypeError as e:
            key = str(e).rpartition("argument ")[2].strip("'") or "?"
            fields = [f.name for f in dataclasses.fields(RemoteEnvConfig)]
            raise ConfigError(f"task.env_kwargs.{key}: not a setting of env 'remote' "
                              f"(settings: {fields}); the served environment's own settings "
                              "(prompt_template, reward, limits, ...) go on the server's command line: "
                              "'copc env serve --env ID key=value ...' (docs/remote_envs.md)") from e
        except ValueError as e:
            raise ConfigError(f"task.env_kwargs: {e}") from e
        except InfrastructureError as e:
            raise ConfigError(f"task.env_kwargs.url={kw['url']!r}: no OpenEnv server answers ({e})") from e
        served = kw.get("remote_env") or server.env_id
        self.served_env, self._server_info = served, server
        known = served in environments.names() and served != self.env_id
        delegate_cls = task_class(served) if known else GenericTask
        if issubclass(delegate_cls, RemoteTask):  # a server serving a remote env: data as JSONL rows
            delegate_cls = GenericTask
        delegate = delegate_cls(self.spec, served or self.env_id)
        delegate.start_services = _no_services  # its data only: the episodes run on the server
        try:
            delegate.start()
        finally:
            delegate.close()
        delegate.make_env = self.make_env  # warm-start traces play on the server too
        self.delegate = delegate
        self.train_samples, self.eval_samples = delegate.train_samples, delegate.eval_samples
        self.info = {"remote_url": rcfg.http_url, "remote_env": served,
                     "remote_stop_strings": list(server.stop_strings), **delegate.info}

    @classmethod
    def parse_settings(cls, values: Mapping[str, Any] | None, env_id: str) -> Any:
        """``task.settings`` as given: they are the served environment's task's settings, parsed by
        that task (the delegate) in :meth:`start`, once the server said what it serves."""
        return dict(values or {})

    def make_env(self) -> gymnasium.Env:
        """A :class:`~environments.remote.client.RemoteEnv` with ``task.env_kwargs``.

        After :meth:`start` it is given the server's schema read there, so building it does no
        network I/O: environments are built lazily by the rollout's env pool, and a server that
        went down must fail the episode's ``reset`` (an infrastructure failure, re-queued) rather
        than the pool's construction (which would end the run with a traceback).
        """
        if self._server_info is None:
            return environments.make(self.env_id, **self.env_kwargs)
        return environments.make(self.env_id, server_info=self._server_info, **self.env_kwargs)

    def check_warm_start(self, ws: WarmStartConfig) -> None:
        """The served environment's task decides (see :meth:`Task.check_warm_start`).

        Raises:
            ConfigError: that task cannot generate ``ws.kind`` traces.
        """
        if self.delegate is None:
            super().check_warm_start(ws)
        else:
            self.delegate.check_warm_start(ws)

    def drill_plan(self) -> DrillPlan | None:
        """The served environment's task's copy drills (its settings), played on the server."""
        return None if self.delegate is None else self.delegate.drill_plan()

    def drill_traces(self, n: int, seed: int, reading_fraction: float | None = None) -> list[Trace]:
        """The served environment's task's drills, played on the server (see :meth:`Task.drill_traces`).

        Raises:
            ConfigError: that task has no drills.
        """
        if self.delegate is None:
            return super().drill_traces(n, seed, reading_fraction)
        return self.delegate.drill_traces(n, seed, reading_fraction)

    def warm_start_traces(self, ws: WarmStartConfig, *, progress: bool = True) -> list[Trace]:
        """The served environment's task's traces, played on the server.

        Raises:
            ConfigError: see :meth:`check_warm_start`.
            ConfigError: the served environment did not play a scripted trace as expected (its
                settings are not the ones the traces are written for: e.g. a ``tool_format``
                other than ``tags``, which the trace generators write).
            TrainingError: the server failed while the traces were played (an infrastructure
                failure: the message names the server and the failure; nothing was trained yet).
        """
        from ..warmstart.traces import TraceError

        if self.delegate is None:
            return super().warm_start_traces(ws, progress=progress)
        try:
            return self.delegate.warm_start_traces(ws, progress=progress)
        except TraceError as e:
            stops = self.info.get("remote_stop_strings")
            raise ConfigError(f"warm_start.kind={ws.kind!r}: the served environment did not play a scripted "
                              f"trace as expected ({e}); the traces are written in the tags tool-call format "
                              f"for the env's default settings: is it served with another tool_format "
                              f"(its stop strings: {stops})? Serve it with tool_format=tags, or set "
                              "warm_start.enabled=false") from e
        except InfrastructureError as e:
            from ..errors import TrainingError

            url = self.info.get("remote_url", self.env_kwargs.get("url"))
            raise TrainingError(f"warm start: the environment server at {url} failed while playing the "
                                f"warm-start traces (an infrastructure failure, not the model's): {e}; "
                                "nothing was trained; run again once the server is back") from e


def _no_services() -> None:
    """A remote task's delegate's :meth:`~trainer.tasks.base.Task.start_services`: nothing."""


__all__ = ["RemoteTask"]
