"""MCP sessions under a hostile or stuck server (issue 21, item 9), with a real MCP stdio server
subprocess (``mcp_big_server.py``):

* a result over ``max_result_bytes`` is a tool error naming the cap, answered at once, and the
  session serves the next call at once;
* a server that writes endlessly without a newline is cut off at the cap (the client's memory
  stays bounded) and the session is reconnected on the next ``ensure_connected`` (``reset``);
* after a call that timed out on a server that blocks, the session is reconnected on the next
  ``ensure_connected`` — never "alive" but wedged; a merely slow tool keeps its session;
* the reader is linear and holds at most the cap (:class:`LineReader`).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("mcp")

from environments.errors import InfrastructureError
from environments.mcp_tool import McpToolset, StdioServer
from environments.mcp_tool.stdio import LineReader, StreamState, message_id

SERVER = StdioServer(sys.executable, (str(Path(__file__).with_name("mcp_big_server.py")),))
CAP = 1 << 20


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def tool(ts: McpToolset, name: str):
    return next(t for t in ts.tools() if t.name == name)


def test_result_over_the_cap_is_a_tool_error_and_the_session_goes_on():
    with McpToolset(SERVER, max_result_bytes=CAP, timeout_s=30) as ts:
        s0 = ts.session
        # under the cap (FastMCP sends the text twice: content and structuredContent)
        ok = tool(ts, "big").run_arguments({"n": CAP // 4})
        assert ok == "x" * (CAP // 4)
        t0 = time.monotonic()
        out = tool(ts, "big").run_arguments({"n": 3 * CAP})
        assert out == ("Error: tool 'big': the tool's result is larger than the cap of 1048576 bytes "
                       "(max_result_bytes); it was not read")
        assert time.monotonic() - t0 < 10
        assert tool(ts, "add").run_arguments({"a": 2, "b": 3}) == "5"  # usable at once
        ts.ensure_connected()
        assert ts.session is s0 and s0.alive  # it answered the check's ping: kept


def test_endless_writer_is_cut_off_at_the_cap_and_reconnected():
    with McpToolset(SERVER, max_result_bytes=CAP, timeout_s=5) as ts:
        s0 = ts.session
        before = rss_bytes()
        out = tool(ts, "endless").run_arguments({})
        assert "larger than the cap of 1048576 bytes (max_result_bytes)" in out
        time.sleep(2.0)  # the server goes on writing (hundreds of MiB); the client discards it
        assert s0._stream.discarding and rss_bytes() - before < 64 << 20
        ts.ensure_connected()  # the next reset: the wedged session is replaced
        assert ts.session is not s0 and not s0.alive
        assert tool(ts, "add").run_arguments({"a": 1, "b": 2}) == "3"


def test_a_blocked_server_is_reconnected_after_a_timeout_a_slow_tool_is_not():
    with McpToolset(SERVER, timeout_s=1.0) as ts:
        s0 = ts.session
        with pytest.raises(InfrastructureError, match=r"tool 'slow': did not answer within 1.0 s"):
            tool(ts, "slow").run_arguments({"seconds": 3})
        ts.ensure_connected()
        assert ts.session is s0  # the server answered the ping: not wedged
        with pytest.raises(InfrastructureError, match=r"tool 'block': did not answer within 1.0 s"):
            tool(ts, "block").run_arguments({"seconds": 60})
        assert s0.alive  # the timeout alone does not condemn it ...
        ts.ensure_connected()  # ... the unanswered ping does
        assert ts.session is not s0 and not s0.alive
        assert tool(ts, "add").run_arguments({"a": 4, "b": 5}) == "9"


def test_env_setting_reaches_the_session():
    from environments.mcp_tool.env import McpToolEnv

    env = McpToolEnv(server=SERVER, max_result_bytes=4096)
    try:
        assert env.toolset.session.max_result_bytes == 4096
        assert "cap of 4096 bytes" in tool(env.toolset, "big").run_arguments({"n": 5000})
    finally:
        env.close()
    with pytest.raises(ValueError, match=r"McpEnvConfig.max_result_bytes=0: must be an int >= 1"):
        McpToolEnv(server=SERVER, max_result_bytes=0)


def test_line_reader_is_linear_and_bounded():
    state = StreamState()
    r = LineReader(100, state)
    assert r.feed(b'{"a":1}\n{"b"') == [("line", b'{"a":1}')]
    assert r.feed(b":2}\n") == [("line", b'{"b":2}')]
    events = r.feed(b'{"jsonrpc":"2.0","id":7,"result":"' + b"y" * 200)
    assert events == [("over", b'{"jsonrpc":"2.0","id":7,"result":"' + b"y" * 200)] and state.discarding
    assert message_id(events[0][1], b"") == 7
    t0 = time.monotonic()
    chunk = b"z" * 65536
    for _ in range(2048):  # 128 MiB without a newline: discarded as it comes, nothing kept
        assert r.feed(chunk) == []
    assert time.monotonic() - t0 < 5 and r._size == 0 and len(r._tail) <= 1024
    tail = (b"z" * 1024 + b'z","id":"q"}')[-1024:]
    assert r.feed(b'z","id":"q"}\nok\n') == [("end", tail), ("line", b"ok")]
    assert not state.discarding and state.oversized == 1
    assert message_id(b'{"result": "x", ', b'"x", "id": "q"}') == "q"
    assert message_id(b'{"result": {"id": 3, ', b"...") is None  # never an id inside the result
