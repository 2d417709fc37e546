"""``RemoteEnv`` against ``copc env serve``: full ReTool episodes with the real sandbox and full
search episodes with the real retriever give exactly the in-process observations, rewards and
info; remote-side failures (server killed mid-episode, the served env's retriever down) raise
``InfrastructureError``; ``RemoteEnv`` also drives a server built with OpenEnv's own
``create_app``."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

import environments
from environments.errors import InfrastructureError
from environments.remote.launch import start_env_server
from environments.search import INVALID_ACTION_REPLY, load_qa
from retriever.launch import free_port

MATH = {"id": "m1", "problem": "What is 12 * 34?", "answer": "408"}
MATH_EPISODES = [
    # solved with two code calls, answered on the last allowed turn (terminated, reward 1)
    ["<code>\n```python\nx = 12 * 34\nprint(x)\n```\n</code>", "<code>\n408 // 2\n</code>",
     "It is \\boxed{408}."],
    # code on every turn: cut by max_turns=3 (truncated, reward 0)
    ["<code>\nprint(1)\n</code>", "<code>\nimport sys\nprint(sys.version_info[0])\n</code>",
     "<code>\nprint('again')\n</code>"],
    # a wrong answer at once; then an action with neither code nor answer (invalid, ends the episode)
    ["\\boxed{407}"],
    ["I am not sure."],
    # a failing call, then the answer
    ["<code>\nraise ValueError('bad')\n</code>", "\\boxed{408}"],
]


def play(env, sample: dict, turns: list[str]) -> list[tuple]:
    obs, info = env.reset(options={"sample": sample})
    out = [(obs, info)]
    for turn in turns:
        out.append(env.step(turn))
        if out[-1][2] or out[-1][3]:
            break
    return out


@pytest.fixture(scope="module")
def math_server():
    server = start_env_server("math_tool", "limits.max_turns=3")
    yield server
    server.stop()


def test_retool_episodes_match_in_process_env(math_server):
    remote = environments.make("remote", url=math_server.url, remote_env="math_tool")
    local = environments.make("math_tool", limits={"max_turns": 3})
    assert remote.stop_strings == local.stop_strings == ("</code>",)
    assert remote.action_space.max_length == local.action_space.max_length == 65536
    try:
        for turns in MATH_EPISODES:
            got, want = play(remote, MATH, turns), play(local, MATH, turns)
            assert got == want
            assert remote.session_id is None  # closed as soon as the episode ended
        # what the episodes were: a correct terminated one, a truncated one, wrong, invalid, error
        finals = [play(local, MATH, t)[-1] for t in MATH_EPISODES]
        assert [(f[1], f[2], f[3]) for f in finals] == [(1.0, True, False), (0.0, False, True),
                                                        (0.0, True, False), (0.0, True, False),
                                                        (1.0, True, False)]
        assert finals[3][4]["invalid"] is True
        with pytest.raises(RuntimeError, match="after the episode ended"):
            remote.step("more")
        with pytest.raises(ValueError, match="65537 characters, more than the remote env accepts"):
            remote.reset(options={"sample": MATH})
            remote.step("x" * 65537)
        refused = r"reset refused \(HTTP 422 VALIDATION_ERROR, field 'data.sample'\)"
        with pytest.raises(ValueError, match=refused):
            remote.reset(options={"sample": {"id": "q"}})
    finally:
        remote.close()
        local.close()
    assert httpx.get(f"{math_server.url}/sessions").json()["active_sessions"] == 0
    with pytest.raises(ValueError, match=r"RemoteEnvConfig.remote_env='search': the server .* serves "
                                         r"'math_tool'"):
        environments.make("remote", url=math_server.url, remote_env="search")


def test_search_episodes_match_in_process_env(retriever_url):
    rows = load_qa("hotpotqa", limit=3)
    server = start_env_server("search", f"retriever_url={retriever_url}")
    remote = environments.make("remote", url=server.url)
    local = environments.make("search", retriever_url=retriever_url)
    try:
        assert remote.server.env_id == "search"
        assert remote.stop_strings == local.stop_strings == ("</search>", "</answer>")
        for row in rows:
            gold = row["golden_answers"][0]
            turns = [f"<think>look it up</think>\n<search>{row['question']}</search>", "hmm",
                     f"<search>{gold}</search>", f"<answer>{gold}</answer>"]
            got, want = play(remote, row, turns), play(local, row, turns)
            assert got == want
            assert want[1][0].startswith("\n\n<information>Doc 1(Title: ")
            assert want[2][0] == INVALID_ACTION_REPLY
            assert want[-1][1:4] == (1.0, True, False) and want[-1][4]["reward_components"]["em"] == 1.0
    finally:
        remote.close()
        local.close()
        server.stop()


def test_remote_infrastructure_failure_is_raised_not_scored():
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    server = start_env_server("search", f"retriever_url={dead}")
    try:
        env = environments.make("remote", url=server.url)
        env.reset(options={"sample": {"id": "q", "question": "Who?", "golden_answers": ["x"]}})
        with pytest.raises(InfrastructureError, match=r"HTTP 503 INFRASTRUCTURE_ERROR.*retriever failed"):
            env.step("<search>who</search>")
        with pytest.raises(RuntimeError, match="before reset"):
            env.step("<answer>x</answer>")  # the session is gone
        assert httpx.get(f"{server.url}/health").status_code == 200
        assert httpx.get(f"{server.url}/sessions").json()["active_sessions"] == 0
        env.close()
    finally:
        server.stop()


def test_server_killed_mid_episode_raises_infrastructure_error():
    server = start_env_server("math_tool")
    env = environments.make("remote", url=server.url, retries=1, backoff_s=0.05, connect_timeout_s=2.0)
    env.reset(options={"sample": MATH})
    assert env.step("<code>print(7)</code>")[0] == "\n<interpreter>\n7\n</interpreter>\n"
    server.proc.kill()
    server.proc.wait()
    with pytest.raises(InfrastructureError, match=r"connection lost.*the session is gone"):
        env.step("<code>print(8)</code>")
    t = time.monotonic()
    with pytest.raises(InfrastructureError, match="reset failed after 2 attempts"):
        env.reset(options={"sample": MATH})
    assert time.monotonic() - t < 10
    with pytest.raises(InfrastructureError, match="GET /schema failed after 1 attempts"):
        environments.make("remote", url=server.url, retries=0)
    server.stop()


def test_remote_env_drives_an_openenv_create_app_server():
    """Any OpenEnv server: one built with OpenEnv's ``create_app`` whose action field is
    ``message`` and whose observation field is ``shouted``."""
    import uvicorn
    from openenv.core.env_server.http_server import create_app
    from openenv.core.env_server.interfaces import Environment
    from openenv.core.env_server.types import Action, Observation, State

    class ShoutAction(Action):
        message: str

    class ShoutObservation(Observation):
        shouted: str

    class ShoutEnv(Environment):
        def __init__(self) -> None:
            super().__init__()
            self.n = 0

        def reset(self, seed=None, episode_id=None, **kwargs):
            self.n = 0
            return ShoutObservation(shouted="ready", metadata={"seed": seed})

        def step(self, action, timeout_s=None, **kwargs):
            self.n += 1
            return ShoutObservation(shouted=action.message.upper(), done=self.n >= 2,
                                    reward=float(len(action.message)))

        @property
        def state(self):
            return State(step_count=self.n)

    port = free_port()
    app = create_app(ShoutEnv, ShoutAction, ShoutObservation)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        env = environments.make("remote", url=f"http://127.0.0.1:{port}", stop_strings=["</shout>"])
        assert (env.server.action_field, env.server.observation_field) == ("message", "shouted")
        assert env.stop_strings == ("</shout>",) and env.server.env_id == "ShoutEnv"
        assert env.reset(seed=5) == ("ready", {"seed": 5})
        assert env.step("hi") == ("HI", 2.0, False, False, {})
        assert env.step("abc") == ("ABC", 3.0, True, False, {})
        assert env.session_id is None
        env.close()
    finally:
        server.should_exit = True
        thread.join(10)
