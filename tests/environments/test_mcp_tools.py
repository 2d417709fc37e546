"""MCP servers' tools as environment tools, against a real MCP server (``mcp_calc_server.py``)
spawned over stdio (and once served over streamable HTTP on 127.0.0.1)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("mcp")

import environments
from environments.errors import InfrastructureError
from environments.mcp_tool import (
    HttpServer,
    McpSession,
    McpToolset,
    StdioServer,
    server_from_kwargs,
)
from environments.mcp_tool.env import McpEnvConfig, McpToolEnv

SERVER_FILE = Path(__file__).with_name("mcp_calc_server.py")
SERVER = StdioServer(sys.executable, (str(SERVER_FILE),))
SAMPLE = {"id": "q1", "question": "What is 2 + 3?", "answer": "5"}
HANG = "import time; time.sleep(60)"  # a "server" that never answers
ADD_2_3 = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'


def server_children() -> dict[int, str]:
    """``{pid: state}`` of this process's children running a test server (the calc server or the
    hanging one), zombies included."""
    out = {}
    me = os.getpid()
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = Path(f"/proc/{d}/stat").read_text()
            cmd = Path(f"/proc/{d}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if int(ppid) == me and (SERVER_FILE.name in cmd or HANG in cmd or state == "Z"):
            out[int(d)] = state
    return out


@pytest.fixture(scope="module")
def toolset():
    """One calc server shared by the tests that do not kill it."""
    ts = McpToolset(SERVER, timeout_s=10.0)
    yield ts
    ts.close()


def test_episode_hermes_tool_call_then_answer(toolset):
    env = McpToolEnv(toolset=toolset, tool_format="hermes")
    prompt, info = env.reset(options={"sample": SAMPLE})
    assert "What is 2 + 3?" in prompt
    assert [t["function"]["name"] for t in info["tools"]] == ["add", "slow", "fail", "pid"]
    obs, reward, term, trunc, info = env.step(ADD_2_3)
    assert obs == "\n<tool_response>\n5\n</tool_response>\n"
    assert (reward, term, trunc, info["tool"], info["tool_calls"]) == (0.0, False, False, "add", 1)
    assert info["observation_messages"] == [{"role": "tool", "tool_call_id": "call_0", "name": "add",
                                             "content": "5"}]
    obs, reward, term, trunc, info = env.step("The sum is <answer>5</answer>")
    assert (reward, term, trunc) == (1.0, True, False)
    assert info["reward_components"] == {"exact_match": 1.0, "tool_calls": 1.0}
    env.reset(options={"sample": SAMPLE})
    assert env.step("<answer>6</answer>")[1:3] == (0.0, True)
    env.close()  # shared toolset: left open
    assert toolset.session.alive


def test_schemas_equal_the_servers_declarations(toolset):
    sys.path.insert(0, str(SERVER_FILE.parent))
    try:
        import mcp_calc_server
    finally:
        sys.path.remove(str(SERVER_FILE.parent))
    declared = asyncio.run(mcp_calc_server.server.list_tools())  # the server's own declarations
    got = toolset.schemas()
    assert [(s.name, s.description, s.parameters) for s in got] == \
        [(t.name, t.description, t.inputSchema) for t in declared]
    add = got[0]
    assert add.parameters["required"] == ["a", "b"]
    assert add.parameters["properties"]["a"]["type"] == "integer"
    assert add.to_openai()["function"]["name"] == "add"
    assert [t.name for t in toolset.tools()] == ["add", "slow", "fail", "pid"]


def test_tool_error_is_an_observation_and_the_episode_continues(toolset):
    env = McpToolEnv(toolset=toolset)
    env.reset(options={"sample": SAMPLE})
    obs, reward, term, _, info = env.step('<tool_call>{"name": "fail", "arguments": {"message": "boom"}}'
                                          '</tool_call>')
    assert not term and reward == 0.0
    assert "<tool_response>\nError executing tool fail: boom\n</tool_response>" in obs
    # arguments that do not fit the declared schema: rejected before the call (env's schema check)
    bad = '<tool_call>{"name": "add", "arguments": {"a": "x", "b": 1}}</tool_call>'
    obs, _, term, _, info = env.step(bad)
    assert not term and info["tool_error"] and "error: add: argument 'a'" in obs
    assert env.step(ADD_2_3)[0] == "\n<tool_response>\n5\n</tool_response>\n"
    assert env.step("<answer>5</answer>")[1] == 1.0
    # the server's own rejection of bad arguments (schema check bypassed) is error text, not a raise
    out = toolset.tools()[0].run_arguments({"a": "x", "b": 1})
    assert out.startswith("Error executing tool add") and "valid integer" in out


def test_per_call_timeout_is_infrastructure_error_and_session_survives():
    with McpToolset(SERVER, timeout_s=0.5) as ts:
        slow, add = ts.tools()[1], ts.tools()[0]
        t0 = time.monotonic()
        with pytest.raises(InfrastructureError, match=r"tool 'slow': did not answer within 0.5 s"):
            slow.run_arguments({"seconds": 5})
        assert 0.5 <= time.monotonic() - t0 < 2.0
        assert add.run_arguments({"a": 40, "b": 2}) == "42"  # the late reply is dropped


def test_killed_server_mid_episode_is_infrastructure_error_and_reset_respawns_it():
    before = server_children()
    env = McpToolEnv(server=SERVER, call_timeout_s=20.0)
    try:
        env.reset(options={"sample": SAMPLE})
        assert "5" in env.step(ADD_2_3)[0]
        pid = int(env.toolset.tools()[3].run_arguments({}))
        assert pid in server_children()
        result = {}

        def in_flight():
            try:
                env.toolset.tools()[1].run_arguments({"seconds": 15})
            except InfrastructureError as e:
                result["error"], result["t"] = e, time.monotonic()

        th = threading.Thread(target=in_flight)
        th.start()
        time.sleep(0.3)
        t_kill = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        th.join(10)
        assert "connection was lost" in str(result["error"]) and result["t"] - t_kill < 3.0
        with pytest.raises(InfrastructureError, match="server closed the connection"):
            env.step(ADD_2_3)
        env.reset(options={"sample": SAMPLE})  # respawns the server
        new_pid = int(env.toolset.tools()[3].run_arguments({}))
        assert new_pid != pid and set(server_children()) - set(before) == {new_pid}
        assert env.step(ADD_2_3)[0] == "\n<tool_response>\n5\n</tool_response>\n"
        assert env.step("<answer>5</answer>")[1] == 1.0
    finally:
        env.close()
    assert server_children() == before


def test_close_leaves_no_child_process_even_with_a_call_in_flight():
    before = server_children()
    ts = McpToolset(SERVER)
    spawned = set(server_children()) - set(before)
    assert len(spawned) == 1
    errors: list[BaseException] = []

    def in_flight():
        try:
            ts.tools()[1].run_arguments({"seconds": 30})
        except BaseException as e:  # checked below
            errors.append(e)

    th = threading.Thread(target=in_flight)
    th.start()
    time.sleep(0.3)
    t0 = time.monotonic()
    ts.close()
    assert time.monotonic() - t0 < 8.0
    th.join(5)
    assert not th.is_alive() and len(errors) == 1 and isinstance(errors[0], InfrastructureError)
    assert server_children() == before
    with pytest.raises(InfrastructureError, match="session closed"):
        ts.tools()[0].run_arguments({"a": 1, "b": 1})
    ts.close()  # idempotent


def test_concurrent_calls_from_8_threads(toolset):
    add = toolset.tools()[0]
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda i: add.run_arguments({"a": i, "b": 1000 * i}), range(64)))
    assert got == [str(1001 * i) for i in range(64)]
    # 8 envs sharing the server, stepped from 8 threads; calls overlap on the server
    envs = [McpToolEnv(toolset=toolset) for _ in range(8)]

    def episode(k: int) -> tuple[str, float]:
        env = envs[k]
        env.reset(options={"sample": {"question": "?", "answer": str(k * k + 7)}})
        obs = env.step(f'<tool_call>{{"name": "add", "arguments": {{"a": {k * k}, "b": 7}}}}</tool_call>'
                       f'<tool_call>{{"name": "slow", "arguments": {{"seconds": 1.0}}}}</tool_call>')[0]
        return obs, env.step(f"<answer>{k * k + 7}</answer>")[1]

    t0 = time.monotonic()
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(episode, range(8)))
    assert time.monotonic() - t0 < 4.0  # 8 one-second calls ran concurrently, not one after another
    for k, (obs, reward) in enumerate(results):
        assert obs == (f"\n<tool_response>\n{k * k + 7}\n</tool_response>\n"
                       "<tool_response>\nslept\n</tool_response>\n")
        assert reward == 1.0


def test_registered_env_from_config_kwargs_openai_format():
    before = server_children()
    env = environments.make("mcp", command=[sys.executable, str(SERVER_FILE)], tool_format="openai",
                            tools=["add"], limits={"max_turns": 3})
    try:
        _, info = env.reset(options={"sample": SAMPLE})
        assert [t["function"]["name"] for t in info["tools"]] == ["add"]
        obs = env.step('{"name": "add", "arguments": {"a": 2, "b": 3}}')[0]
        assert json.loads(obs) == {"role": "tool", "tool_call_id": "call_0", "name": "add", "content": "5"}
        assert env.step("<answer> 5 </answer>")[1] == 1.0
    finally:
        env.close()
    assert server_children() == before
    with pytest.raises(InfrastructureError, match="the toolset is closed"):
        env.reset(options={"sample": SAMPLE})  # a closed env does not respawn its server
    assert server_children() == before


def test_streamable_http_transport():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, str(SERVER_FILE), "--http", str(port)])
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), 0.2).close()
                break
            except OSError:
                assert time.monotonic() < deadline and proc.poll() is None, "HTTP MCP server did not start"
                time.sleep(0.1)
        env = McpToolEnv(url=f"http://127.0.0.1:{port}/mcp")
        env.reset(options={"sample": SAMPLE})
        assert env.step(ADD_2_3)[0] == "\n<tool_response>\n5\n</tool_response>\n"
        assert env.step("<answer>5</answer>")[1] == 1.0
        env.reset(options={"sample": SAMPLE})
        proc.kill()
        proc.wait(10)
        with pytest.raises(InfrastructureError):
            env.step(ADD_2_3)
        env.close()
    finally:
        proc.kill()
        proc.wait(10)


def test_dying_server_is_infrastructure_error_missing_command_is_value_error():
    before = server_children()
    t0 = time.monotonic()
    with pytest.raises(InfrastructureError, match="could not connect"):
        McpSession(StdioServer(sys.executable, ("-c", "pass")), connect_timeout_s=20)
    assert time.monotonic() - t0 < 10  # noticed the exit, did not wait for the timeout
    t0 = time.monotonic()  # a server that never answers `initialize`: timeout, and it is reaped
    with pytest.raises(InfrastructureError, match=r"could not connect within 1 s \(timed out\)"):
        McpSession(StdioServer(sys.executable, ("-c", HANG)), connect_timeout_s=1)
    assert time.monotonic() - t0 < 8
    assert server_children() == before
    with pytest.raises(ValueError, match=r"StdioServer\.command='/nonexistent/mcp-server': cannot be run"):
        McpSession(StdioServer("/nonexistent/mcp-server"))
    assert server_children() == before


def test_bad_settings_name_the_field():
    before = server_children()
    with pytest.raises(ValueError, match="tool_format='tags'"):
        McpEnvConfig(tool_format="tags")
    with pytest.raises(ValueError, match="call_timeout_s=0"):
        McpEnvConfig(call_timeout_s=0)
    with pytest.raises(ValueError, match=r"exactly one of command= .* or url="):
        server_from_kwargs()
    assert server_from_kwargs(command="python 'my server.py' -v") == \
        StdioServer("python", ("my server.py", "-v"))
    with pytest.raises(ValueError, match=r"HttpServer\.url='localhost:1'"):
        HttpServer("localhost:1")
    with pytest.raises(ValueError, match=r"StdioServer\.command=''"):
        StdioServer("")
    with pytest.raises(ValueError, match=r"has no tool\(s\) \['mul'\]; it has \['add', 'slow'"):
        McpToolset(SERVER, include=["add", "mul"])
    assert server_children() == before


def test_content_text_renders_every_content_kind():
    from mcp import types

    from environments.mcp_tool.servers import content_text

    result = types.CallToolResult(content=[
        types.TextContent(type="text", text="first"),
        types.ImageContent(type="image", data="aGk=", mimeType="image/png"),
        types.EmbeddedResource(type="resource", resource=types.TextResourceContents(
            uri="file:///a.txt", text="file text")),
        types.EmbeddedResource(type="resource", resource=types.BlobResourceContents(
            uri="file:///b.bin", blob="aGk=")),
    ], isError=False)
    got = content_text(result)
    assert got.text == "first\n[image image/png]\nfile text\n[resource file:///b.bin]"
    assert not got.is_error and got.structured is None
    only_structured = content_text(types.CallToolResult(content=[], structuredContent={"x": [1, 2]},
                                                        isError=True))
    assert (only_structured.text, only_structured.is_error) == ('{"x": [1, 2]}', True)
