"""The pieces of the remote-environment package without a server process: the OpenEnv adapter
(also served by OpenEnv's own ``create_app``), settings parsing and validation, loopback checks,
JSON conversion of ``info``."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

import environments
from environments.remote.adapter import GymTextEnvironment
from environments.remote.auth import check_bind, check_header, is_loopback, read_token_file
from environments.remote.cli import parse_env_kwargs
from environments.remote.client import RemoteEnvConfig
from environments.remote.protocol import TextAction, TextObservation, jsonable
from environments.remote.server import ServerConfig
from environments.remote.wire import RequestError

SAMPLE = {"id": "m1", "problem": "What is 12 * 34?", "answer": "408"}


def make_adapter() -> GymTextEnvironment:
    return GymTextEnvironment(environments.make("math_tool", reward={"mode": "dapo_strict"}), "math_tool")


def test_adapter_episode_and_refusals():
    env = make_adapter()
    try:
        with pytest.raises(RequestError) as e:
            env.step(TextAction(text="hi"))
        assert (e.value.code, e.value.status, e.value.field) == ("EPISODE_OVER", 409, "data.text")
        with pytest.raises(RequestError) as e:
            env.reset(sample=SAMPLE, colour="red")
        assert (e.value.status, e.value.field) == (422, "data.colour")
        with pytest.raises(RequestError) as e:
            env.reset(sample={"id": "x", "answer": "1"})
        assert e.value.field == "data.sample" and "no 'problem' field" in e.value.message
        obs = env.reset(sample=SAMPLE, episode_id="ep-1")
        assert obs.reward is None and obs.done is False and "12 * 34" in obs.text and obs.info["turn"] == 0
        with pytest.raises(RequestError) as e:
            env.step(TextAction(text="x" * 65537))
        assert (e.value.code, e.value.status) == ("PAYLOAD_TOO_LARGE", 413)
        obs = env.step(TextAction(text="\\boxed{408}"))
        assert (obs.text, obs.reward, obs.done, obs.terminated, obs.truncated) == ("", 1.0, True, True, False)
        assert obs.info["reward_components"]["correct"] == 1.0
        state = env.state
        assert (state.episode_id, state.step_count, state.active, state.done) == ("ep-1", 1, True, True)
        with pytest.raises(RequestError, match="the episode is over"):
            env.step(TextAction(text="again"))
        assert env.stop_strings == ("</code>",) and env.get_metadata().name == "math_tool"
    finally:
        env.close()


def test_adapter_served_by_openenvs_create_app():
    """OpenEnv's own server accepts the adapter for concurrent sessions and plays an episode."""
    from fastapi.testclient import TestClient
    from openenv.core.env_server.http_server import create_app

    app = create_app(make_adapter, TextAction, TextObservation, max_concurrent_envs=4)
    with TestClient(app) as client, client.websocket_connect("/ws") as ws:
        ws.send_text(json.dumps({"type": "reset", "data": {"sample": SAMPLE}}))
        reset = json.loads(ws.receive_text())["data"]
        ws.send_text(json.dumps({"type": "step", "data": {"text": "\\boxed{407}"}}))
        step = json.loads(ws.receive_text())["data"]
    assert "12 * 34" in reset["observation"]["text"] and reset["reward"] is None
    assert (step["reward"], step["done"], step["observation"]["info"]["final_answer"]) == (0.0, True, "407")


def test_jsonable_keeps_values_exact():
    info = {"a": (1, 2.5), "b": {3: np.float32(0.25), "n": None}, "c": np.arange(3), "d": math.nan,
            "e": {"x", }, "f": object.__name__}
    out = jsonable(info)
    assert out == {"a": [1, 2.5], "b": {"3": 0.25, "n": None}, "c": [0, 1, 2], "d": out["d"], "e": ["x"],
                   "f": "object"}
    assert math.isnan(out["d"]) and type(out["b"]["3"]) is float
    assert json.loads(json.dumps(out))["a"] == [1, 2.5]


def test_parse_env_kwargs():
    assert parse_env_kwargs(["limits.max_turns=4", "limits.max_tool_calls=2", "reward.mode=dapo_strict",
                             'prompt_template="Q: {problem}\\n"', "topk=3", "name="]) == {
        "limits": {"max_turns": 4, "max_tool_calls": 2}, "reward": {"mode": "dapo_strict"},
        "prompt_template": "Q: {problem}\n", "topk": 3, "name": ""}
    for bad, msg in (("noequals", "expected key=value"), ("a..b=1", "expected key=value"),
                     ("x=[1", "not YAML"), ("limits=3", None)):
        if msg is None:  # a value, then nested settings under the same key
            with pytest.raises(ValueError, match="'limits' was already given a value"):
                parse_env_kwargs([bad, "limits.max_turns=2"])
        else:
            with pytest.raises(ValueError, match=msg):
                parse_env_kwargs([bad])


def test_loopback_and_bind_rules(tmp_path):
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.9.8.7", "::1", "[::1]", "localhost", "LOCALHOST"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "10.1.2.3", "::", "example.com", ""))
    check_bind("127.0.0.1", None)
    check_bind("0.0.0.0", "tok")
    with pytest.raises(ValueError, match=r"--host='0.0.0.0': binding a non-loopback address requires"):
        check_bind("0.0.0.0", None)
    with pytest.raises(ValueError, match=r"ServerConfig|--host='10.0.0.2'"):
        ServerConfig(env="math_tool", host="10.0.0.2")
    f = tmp_path / "t"
    f.write_text(" abc123 \n")
    assert read_token_file(f) == "abc123"
    f.write_text("two words")
    with pytest.raises(ValueError, match="one word"):
        read_token_file(f)
    with pytest.raises(ValueError, match=r"--token-file=.*cannot read"):
        read_token_file(tmp_path / "missing")
    check_header([(b"authorization", b"Bearer abc123")], "abc123")
    for headers, status in (([], 401), ([(b"authorization", b"Token abc123")], 401),
                            ([(b"Authorization", b"Bearer abc124")], 403)):
        with pytest.raises(RequestError) as e:
            check_header(headers, "abc123")
        assert (e.value.status, e.value.field) == (status, "Authorization")


def test_settings_validation_names_the_field():
    for kwargs, msg in (({"port": 70000}, "ServerConfig.port=70000"), ({"max_sessions": 0}, "max_sessions=0"),
                        ({"idle_timeout_s": 0}, "idle_timeout_s=0"), ({"token": " "}, "token"),
                        ({"sandbox_isolation": "vm"}, "sandbox_isolation='vm'")):
        with pytest.raises(ValueError, match=msg):
            ServerConfig(env="math_tool", **kwargs)
    for kwargs, msg in (({"url": "ftp://x"}, "RemoteEnvConfig.url='ftp://x'"), ({"url": "http://"}, "url"),
                        ({"retries": -1}, "retries=-1"), ({"read_timeout_s": 0}, "read_timeout_s=0"),
                        ({"token": "a", "token_file": "f"}, "not both"),
                        ({"stop_strings": "</a>"}, "stop_strings")):
        with pytest.raises(ValueError, match=msg):
            RemoteEnvConfig(**{"url": "http://127.0.0.1:1", **kwargs})
    cfg = RemoteEnvConfig(url="wss://envs.example.org:9000/base/", stop_strings=["</a>"])
    assert (cfg.http_url, cfg.ws_url, cfg.stop_strings) == ("https://envs.example.org:9000/base",
                                                            "wss://envs.example.org:9000/base/ws", ("</a>",))
