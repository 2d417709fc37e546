"""Registry, gymnasium ids and Gymnasium's env_checker on the text environments."""

from __future__ import annotations

import sys
import textwrap

import gymnasium
import pytest
from gymnasium.utils.env_checker import check_env

import environments
from environments import Registry
from environments.math_tool import MathToolEnv
from environments.search import SearchEnv


class FixedRetriever:
    """A deterministic in-process retriever (for registry/checker tests only)."""

    def retrieve(self, queries, topk=None):
        return [[{"document": {"id": "0", "contents": '"Paris"\nParis is in France.'},
                  "score": 1.0}] for _ in queries]


def test_register_make_override_unknown():
    reg = Registry()
    reg.register("m", "environments.math_tool.env:MathToolEnv", code_timeout_s=3.0)
    env = reg.make("m")
    assert isinstance(env, MathToolEnv) and env.config.code_timeout_s == 3.0
    env2 = reg.make("m", code_timeout_s=7.0)
    assert env2.config.code_timeout_s == 7.0
    assert reg.names() == ["m"]
    assert not hasattr(reg, "list")  # renamed: it shadowed the builtin
    with pytest.raises(KeyError, match="unknown env id 'zzz'; registered: \\['m'\\]"):
        reg.make("zzz")
    with pytest.raises(ValueError, match="already registered"):
        reg.register("m", "x:y")
    reg.register("bad", "no_colon_here")
    with pytest.raises(ValueError, match=r"expected 'package\.module:ClassName'"):
        reg.make("bad")
    env.close()
    env2.close()


def test_default_registry_and_gymnasium_make():
    assert {"math_tool", "search"} <= set(environments.names())
    assert environments.names() == sorted(environments.names())
    assert not hasattr(environments, "list")
    env = gymnasium.make("copc/MathTool-v0")
    assert isinstance(env.unwrapped, MathToolEnv)
    _obs, _ = env.reset(options={"sample": {"id": "x", "problem": "1+1?", "answer": "2"}})
    _, r, term, _, _ = env.step("\\boxed{2}")
    assert (r, term) == (1.0, True)
    env.close()
    s = gymnasium.make("copc/Search-v0", retriever=FixedRetriever())
    assert isinstance(s.unwrapped, SearchEnv)
    s.close()


def test_env_checker_math(sandbox):
    env = MathToolEnv(sandbox=sandbox, dataset="aime2025")
    check_env(env, skip_render_check=True)
    env.close()


def test_env_checker_search():
    env = SearchEnv(retriever=FixedRetriever(), dataset="nq")
    check_env(env, skip_render_check=True)
    obs, _ = env.reset(seed=0)
    assert env.observation_space.contains(obs)


ECHO_ENV = textwrap.dedent("""
    import environments
    from environments import ToolEnv

    class EchoEnv(ToolEnv):
        def __init__(self, **kw):
            super().__init__([], invalid_action_reply=None)
        def build_prompt(self, sample):
            return "say " + sample["word"]
        def extract_answer(self, action):
            return action.strip()
        def score(self, sample, response, answer, tool_calls):
            return float(answer == sample["word"]), {}

    environments.register("{id}", entry_point=EchoEnv)
    LOADS = globals().get("LOADS", 0) + 1
""")


def test_resolve_plain_module_and_file_refs(tmp_path, monkeypatch):
    reg = environments.DEFAULT_REGISTRY
    assert environments.resolve("math_tool") == "math_tool"
    # a dotted module on sys.path
    (tmp_path / "echo_pkg_mod.py").write_text(ECHO_ENV.replace("{id}", "echo_mod"))
    monkeypatch.syspath_prepend(str(tmp_path))
    # a .py file relative to the working directory (not on sys.path)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "echo_file_env.py").write_text(ECHO_ENV.replace("{id}", "echo_file"))
    monkeypatch.chdir(tmp_path)
    try:
        assert environments.resolve("echo_pkg_mod:echo_mod") == "echo_mod"
        assert environments.resolve("sub/echo_file_env.py:echo_file") == "echo_file"
        # loaded once per process: a second resolve does not re-execute (re-registering would raise)
        assert environments.resolve("sub/echo_file_env.py:echo_file") == "echo_file"
        mod = sys.modules["echo_file_env"]
        assert mod.LOADS == 1 and mod.__file__ == str(tmp_path / "sub" / "echo_file_env.py")
        env = environments.make("echo_file")
        obs, _ = env.reset(options={"sample": {"word": "hi"}})
        assert obs == "say hi"
        assert env.step("hi")[1:3] == (1.0, True)
        with pytest.raises(KeyError, match=r"unknown env id 'nope' after importing 'echo_pkg_mod'; "
                                           r"registered: \["):
            environments.resolve("echo_pkg_mod:nope")
        with pytest.raises(FileNotFoundError, match=r"environment module file 'missing\.py' not found"):
            environments.resolve("missing.py:x")
        with pytest.raises(ModuleNotFoundError, match="no_such_module_xyz"):
            environments.resolve("no_such_module_xyz:x")
        with pytest.raises(ValueError, match=r"expected 'id', 'package\.module:id' or 'file\.py:id'"):
            environments.resolve(":calc")
        with pytest.raises(KeyError, match="unknown env id 'zzz'"):
            environments.resolve("zzz")
        # a file whose stem is another module's name is refused, not silently shadowed
        (tmp_path / "json.py").write_text("")
        with pytest.raises(ValueError, match="a different module named 'json' is already imported"):
            environments.resolve("json.py:x")
    finally:
        for name in ("echo_mod", "echo_file"):
            if name in reg:
                reg.unregister(name)
        for name in ("echo_pkg_mod", "echo_file_env"):
            sys.modules.pop(name, None)
