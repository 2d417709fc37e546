"""Registry, gymnasium ids and Gymnasium's env_checker on the text environments."""

from __future__ import annotations

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
    assert reg.list() == ["m"]
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
    assert {"math_tool", "search"} <= set(environments.list())
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
