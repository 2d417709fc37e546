"""A task with a service, added from one plug-in file and nothing else: its settings carry the
service's knobs, :meth:`Task.start_services` starts it, :meth:`Task.worker_spec` hands the Ray
rollout workers the started service instead of a second one, and :attr:`Task.eval_options` gives
``copc eval`` a flag to use a running one. The plug-in is written to ``tmp_path``; its service is a
real HTTP server on 127.0.0.1 whose answers reach the environments' prompts.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
import urllib.error
import urllib.request
from pathlib import Path

import pytest

import environments
from trainer.config import ConfigError, load_config

PLUGIN = """
    import threading
    import urllib.request
    from dataclasses import dataclass
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    import gymnasium
    import environments
    from trainer.tasks import EvalOption, register_task
    from trainer.tasks.generic import GenericTask


    class Shout(BaseHTTPRequestHandler):
        def do_GET(self):
            body = b"ok" if self.path == "/health" else self.path.rpartition("=")[2].upper().encode()
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass


    def start_shouter():
        server = ThreadingHTTPServer(("127.0.0.1", 0), Shout)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        def stop():
            server.shutdown()
            server.server_close()
        return f"http://127.0.0.1:{server.server_address[1]}", stop


    class LookupEnv(gymnasium.Env):
        def __init__(self, url=""):
            self.url = url

        def reset(self, *, seed=None, options=None):
            word = options["sample"]["word"]
            with urllib.request.urlopen(f"{self.url}/lookup?w={word}", timeout=10) as r:
                return f"{word}={r.read().decode()}", {}

        def step(self, action):
            return "", 0.0, True, False, {}


    @dataclass
    class LookupSettings:
        service_url: str = ""


    class LookupTask(GenericTask):
        settings_class = LookupSettings
        service_names = "the shouter"
        eval_options = (EvalOption("--shouter-url", "service_url", "lookup benchmarks: a running shouter",
                                   service_url=True),)

        def __init__(self, spec, env_id=None):
            super().__init__(spec, env_id)
            self.url = self.settings.service_url

        def start(self):
            super().start()
            self.start_services()

        def start_services(self):
            if not self.url:
                self.url, stop = start_shouter()
                self.add_closer(stop)

        def worker_settings(self):
            return {**super().worker_settings(), "service_url": self.url}

        def make_env(self):
            return environments.make(self.env_id, url=self.url, **self.env_kwargs)


    environments.register("lookup", LookupEnv)
    register_task("lookup", LookupTask)
"""


@pytest.fixture
def lookup(tmp_path):
    """``(plugin path, rows file)``; the plug-in's registrations are undone afterwards."""
    from trainer.tasks import TASKS

    path = tmp_path / "seam_lookup.py"
    path.write_text(textwrap.dedent(PLUGIN))
    rows = tmp_path / "words.jsonl"
    words = ["hi", "yo", "ok"]
    rows.write_text("".join(json.dumps({"id": str(i), "word": w}) + "\n" for i, w in enumerate(words)))
    yield path, rows
    for reg in (TASKS, environments.DEFAULT_REGISTRY):
        if "lookup" in reg:
            reg.unregister("lookup")
    sys.modules.pop("seam_lookup", None)


def _alive(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
            return r.read() == b"ok"
    except (urllib.error.URLError, OSError):
        return False


def _prompt(make_env, word: str) -> str:
    env = make_env()
    try:
        return env.reset(options={"sample": {"word": word}})[0]
    finally:
        env.close()


def test_workers_reuse_the_service_the_drivers_task_started(lookup, tmp_path, monkeypatch):
    from trainer.app.assemble import launch_spec
    from trainer.config.specs import task_spec
    from trainer.orchestration.ray_launcher import worker_spec
    from trainer.tasks import build_task

    path, rows = lookup
    cfg = load_config(None, [f"plugins=[{path}]", "task.env=lookup", f"task.train_data=[{rows}]"])
    with build_task(task_spec(cfg)) as driver:
        url = driver.url
        assert url.startswith("http://127.0.0.1:") and _alive(url) and len(driver._closers) == 1
        launch = launch_spec(cfg, learner=None, engine=None, task=driver, tokenizer=None, model_dir=tmp_path,
                             sampling=None)
        ws = worker_spec(launch)  # what RayRollouts gives each RolloutWorker
        assert ws.task.task.settings == {"service_url": url} and cfg.task.settings == {}
        assert ws.plugins == (str(path),) and Path(ws.task.task.data_dir).is_absolute()
        assert ws.engine_kind == cfg.rollout.engine and ws.engine.tokenizer is None
        monkeypatch.chdir(tmp_path)  # a worker elsewhere: its task is built from the worker's spec alone
        with build_task(ws.task) as worker:
            assert worker._closers == [] and worker.url == url  # no second server
            assert _prompt(worker.make_env, "hi") == "hi=HI"  # answered by the driver's service
    assert not _alive(url)  # the driver's task stopped it


def test_copc_eval_starts_the_service_or_takes_the_tasks_flag(lookup):
    from trainer.app.cli_eval import (
        add_benchmark_arguments,
        check_no_benchmark_options,
        task_option_settings,
    )
    from trainer.evaluate.benchmarks import BenchmarkServices, BenchmarkSpec
    from trainer.rollout.agent_loop import run_episode

    path, rows = lookup
    load_config(None, [f"plugins=[{path}]"])  # registers the task, as copc eval's plugins= does
    spec = BenchmarkSpec("words", "lookup", str(rows), "math")
    with BenchmarkServices([spec]) as svc:  # the task's start_services, once for its benchmarks
        assert svc.running() == ["lookup"]
        own = svc._tasks["lookup"].url
        assert _alive(own) and _prompt(svc.env_factory(spec), "yo") == "yo=YO"
        assert svc.episode(spec) is run_episode  # the task's episode(): the tool-environment loop
    assert not _alive(own)  # stopped with the services

    parser = argparse.ArgumentParser()
    add_benchmark_arguments(parser)  # the parser built once the plug-in is registered has its flag
    with BenchmarkServices([spec]) as running:
        url = running._tasks["lookup"].url
        args = parser.parse_args(["--benchmarks", "words", "--shouter-url", url])
        assert task_option_settings(args) == {"lookup": {"service_url": url}}
        with BenchmarkServices([spec], settings=task_option_settings(args)) as svc:
            assert svc.running() == []  # the given server is used, none started
            assert _prompt(svc.env_factory(spec), "hi") == "hi=HI"
    with pytest.raises(ConfigError, match=r"^--shouter-url='http://x': an option of the --benchmarks form; .*"
                                          r"task\.settings\.service_url=VALUE with task\.env=lookup"):
        check_no_benchmark_options(argparse.Namespace(**{**vars(args), "shouter_url": "http://x"}))
