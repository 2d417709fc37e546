"""The ``remote`` task when its server goes away, and the README's ``task.env=remote`` command
(found by trying to break issue 15 as a user):

* the rollout's env pool builds environments lazily; ``RemoteEnv`` used to ask the server for its
  schema in its constructor, so a server that died mid-run made the pool's construction raise
  ``InfrastructureError`` out of evaluation / the training loop (a traceback, rc 1) instead of an
  infrastructure failure of the episode. The task now hands its environments the schema it read
  at start: building one does no I/O and ``reset`` raises ``InfrastructureError`` (the agent loop
  records ``infra_error``, the loop re-queues the prompt and stops cleanly when too many fail);
* a server dying while warm-start traces are played stops the run with a ``TrainingError``
  naming the server, not a traceback; a server whose environment cannot play the (tags-format)
  traces, e.g. served with ``tool_format=hermes``, is a ``ConfigError`` saying so;
* the README's command loads and starts (its config must not carry the served env's settings in
  ``task.env_kwargs``: those are refused with a hint to put them on the server's command line).
"""

from __future__ import annotations

import dataclasses
import re
import shlex
from pathlib import Path

import pytest

from environments.errors import InfrastructureError
from environments.remote.launch import start_env_server
from trainer.config import ConfigError, load_config
from trainer.config.specs import task_spec
from trainer.orchestration.loop import TrainingError
from trainer.tasks import build_task

REPO = Path(__file__).parent.resolve().parents[2]
SAMPLE = {"id": "q", "problem": "What is 12 * 34?", "answer": "408"}


def readme_train_command() -> list[str]:
    """The ``copc train`` command of the README's network section, as argv words."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    section = text.split("<!-- section: network -->", 1)[1].split("<!-- section:", 1)[0]
    [bash] = re.findall(r"```bash\n(.*?)```", section, re.DOTALL)
    line = next(x for x in bash.replace("\\\n", " ").splitlines() if x.startswith("copc train"))
    return shlex.split(line.split("#", 1)[0])


def test_envs_build_without_the_server_and_a_dead_server_fails_the_reset(tmp_path):
    server = start_env_server("math_tool", "reward.mode=dapo_strict")
    try:
        cfg = load_config(None, ["task.env=remote", f"task.env_kwargs={{url: '{server.url}', retries: 0}}",
                                 "task.max_train_samples=4", "task.max_eval_samples=2"])
        task = build_task(task_spec(cfg))
        env = task.make_env()
        assert env.reset(options={"sample": SAMPLE})[0].startswith("Solve the following problem")
        env.close()
    finally:
        server.stop()
    try:
        env = task.make_env()  # the server is gone: building the env needs no request
        assert env.stop_strings == ("</code>",) and env.action_space.max_length == 65536
        with pytest.raises(InfrastructureError, match=r"reset failed after 1 attempts: .*Connection refused"):
            env.reset(options={"sample": SAMPLE})
        env.close()
        ws = dataclasses.replace(cfg.warm_start, enabled=True, kind="retool_arithmetic", num_examples=2)
        with pytest.raises(TrainingError, match=rf"^warm start: the environment server at {server.url} "
                                                r"failed while playing the warm-start traces .*refused"):
            task.warm_start_traces(ws, progress=False)
    finally:
        task.close()


def test_the_readme_train_command_loads_and_starts():
    argv = readme_train_command()
    assert argv[:2] == ["copc", "train"] and argv[2] == "--config"
    server = start_env_server("math_tool")
    try:
        overrides = [o.replace("http://127.0.0.1:8100", server.url) for o in argv[4:]]
        assert any(server.url in o for o in overrides)
        task = build_task(task_spec(load_config(REPO / argv[3], overrides)))
        try:
            assert (task.served_env, type(task.delegate).__name__) == ("math_tool", "MathToolTask")
            assert task.info["remote_url"] == server.url and len(task.train_samples) > 0
        finally:
            task.close()
        # a config holding the served env's own settings in task.env_kwargs is refused, with a hint
        with pytest.raises(ConfigError, match=r"task.env_kwargs.prompt_template: not a setting of env "
                                              r"'remote'.*go on the server's command line: 'copc env serve"):
            build_task(task_spec(load_config(REPO / "configs/math_tool/cpu_tiny.yaml", overrides)))
    finally:
        server.stop()


def test_warm_start_traces_on_a_server_in_another_tool_format_is_a_config_error():
    server = start_env_server("math_tool", "tool_format=hermes", "reward.mode=dapo_strict")
    try:
        cfg = load_config(None, ["task.env=remote", f"task.env_kwargs={{url: '{server.url}'}}",
                                 "task.max_train_samples=4", "task.max_eval_samples=2"])
        task = build_task(task_spec(cfg))
        try:
            assert task.info["remote_stop_strings"] == ["</tool_call>"]
            ws = dataclasses.replace(cfg.warm_start, enabled=True, kind="retool_arithmetic", num_examples=2)
            expected = (r"^warm_start.kind='retool_arithmetic': the served environment did not play a "
                        r"scripted trace as expected \(sample .*the tool call was not executed.*"
                        r"its stop strings: \['</tool_call>'\]\)")
            with pytest.raises(ConfigError, match=expected):
                task.warm_start_traces(ws, progress=False)
        finally:
            task.close()
    finally:
        server.stop()
