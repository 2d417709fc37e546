"""``task.env: harness``: an agent of your own, trained through an OpenAI-compatible endpoint.

The agent is an ordinary async function ``async def run(base_url, api_key, row) -> float | dict``
named by ``task.env_kwargs.agent: "pkg.module:run"`` (or ``"path/agent.py:run"``). Each episode
it gets the endpoint's ``base_url`` (``http://127.0.0.1:<port>/v1``), the episode's own
``api_key`` and the data row, drives as many calls and tool calls as it likes (with the
``openai`` client, say), and returns the reward: a number, or a dict of reward components whose
sum is the reward (kept in ``info["reward_components"]``).

:class:`HarnessEnv` is the object the episode pools hold (what ``environments.make("harness")``
builds; not a ``gymnasium.Env``: it has no ``step``, the agent drives the episode). Its episodes are
played by :func:`harness_episode` (the ``harness`` task's :meth:`~trainer.tasks.base.Task.episode`),
which the group runner (:func:`trainer.rollout.groups.run_group`) calls through the pool.

Failure semantics (as for environments): the agent raises → an env bug (``env_error: harness
agent raised: <the traceback's last line>``: stops training and evaluation); the agent runs past
``timeout_s``, or a call failed because the engine did → an infrastructure failure (excluded,
counted, the prompt re-queued); an edited history → ``history_edited`` (dropped:
:mod:`trainer.harness.episode`).
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import json
import math
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, ClassVar

from ..engines.base import InferenceEngine, SamplingParams
from ..rollout.agent_loop import AgentLoopConfig
from ..rollout.trajectory import LENGTH_CAPPED, FinishReason, Trajectory
from .episode import Episode
from .server import HarnessServer

#: The tool-call formats the endpoint parses completions in.
TOOL_FORMATS = ("hermes", "openai")


def load_agent(ref: str) -> Callable[..., Any]:
    """The agent function ``ref`` names: ``"pkg.module:function"`` or ``"path/file.py:function"``.

    Raises:
        ValueError: ``"HarnessEnv.agent=<ref>: <why>"`` (not ``module:function``, the module does
            not import, no such function, or it is not an ``async def``).
    """
    module, sep, name = str(ref).rpartition(":")
    if not sep or not module or not name:
        raise ValueError(f"HarnessEnv.agent={ref!r}: must be 'pkg.module:function' or 'file.py:function'")
    try:
        if module.endswith(".py"):
            path = Path(module).expanduser().resolve()
            spec = importlib.util.spec_from_file_location(f"copc_agent_{path.stem}", path)
            if spec is None or spec.loader is None:
                raise ImportError(f"cannot load {path}")
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
        else:
            mod = importlib.import_module(module)
    except (ImportError, OSError) as e:
        raise ValueError(f"HarnessEnv.agent={ref!r}: cannot import {module!r}: "
                         f"{type(e).__name__}: {e}") from e
    fn = getattr(mod, name, None)
    if fn is None or not asyncio.iscoroutinefunction(fn):
        raise ValueError(f"HarnessEnv.agent={ref!r}: {module!r} has no async function {name!r} "
                         "(async def run(base_url, api_key, row) -> float | dict)")
    return fn


def reward_of(value: Any) -> tuple[float, dict[str, float]]:
    """``(reward, components)`` of what the agent returned: a number (components ``{}``), or a dict
    of numbers (reward = their sum).

    Raises:
        ValueError: anything else, or a non-finite value.
    """
    comps = dict(value) if isinstance(value, Mapping) else None
    items = comps.items() if comps is not None else [("reward", value)]
    out = {}
    for k, v in items:
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
            raise ValueError(f"the agent returned {value!r:.120}: expected a finite number or a dict of them")
        out[str(k)] = float(v)
    return sum(out.values()), (out if comps is not None else {})


class HarnessEnv:
    """The ``harness`` environment: episodes played by a user agent against the endpoint (with
    :func:`harness_episode`; ``reset`` renders a row, there is no ``step``).

    Args:
        agent: ``"pkg.module:run"`` / ``"file.py:run"`` (see :func:`load_agent`).
        timeout_s: seconds an episode's agent may run (> 0); past it the episode is an
            infrastructure failure.
        tool_format: how completions' tool calls are parsed (``hermes`` | ``openai``).
        server: the endpoint to serve episodes on (the ``harness`` task's one); default: one of
            this environment's own, started on first use and stopped by :meth:`close`.

    Raises:
        ValueError: a bad setting, naming it (``HarnessEnv.timeout_s=0: must be > 0``).
    """

    metadata: ClassVar[dict[str, Any]] = {}

    def __init__(self, agent: str = "", timeout_s: float = 600.0, tool_format: str = "hermes",
                 server: HarnessServer | None = None) -> None:
        self.agent = load_agent(agent)
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) or not timeout_s > 0:
            raise ValueError(f"HarnessEnv.timeout_s={timeout_s!r}: must be a number > 0")
        if tool_format not in TOOL_FORMATS:
            raise ValueError(f"HarnessEnv.tool_format={tool_format!r}: must be one of {list(TOOL_FORMATS)}")
        self.timeout_s, self.tool_format = float(timeout_s), tool_format
        self._own = server is None
        self.server = server if server is not None else HarnessServer()

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[str, dict]:
        """The row as JSON text (what probes and a run-time tokenizer read; episodes are played by
        :meth:`play_episode`, the agent building its own messages).

        Raises:
            ValueError: ``options["sample"]`` is not a mapping.
        """
        sample = (options or {}).get("sample")
        if not isinstance(sample, Mapping):
            raise ValueError(f"harness: the row must be a JSON object, got {type(sample).__name__}")
        return json.dumps(dict(sample), ensure_ascii=False, default=str), {}

    async def play_episode(self, engine: InferenceEngine, tokenizer: Any, sample: Mapping[str, Any],
                           sampling: SamplingParams, cfg: AgentLoopConfig | None,
                           group_id: Any = None) -> Trajectory:
        """Run the agent on ``sample`` against the endpoint and return the episode's trajectory.

        Args: as :func:`trainer.rollout.agent_loop.run_episode` (the environment is this object).

        Returns:
            The trajectory (see the module docstring for how failures end it); a successful one
            ends ``terminated`` with the agent's reward on its last model token.
        """
        cfg = cfg or AgentLoopConfig()
        sid = sample.get("id")
        gid = sid if group_id is None else group_id
        await self.server.start()
        ep = Episode(engine, tokenizer, sampling, cfg, self.tool_format, sid, gid)
        key = self.server.open(ep)
        outcome: Any = None
        raised = ""
        try:
            run = self.agent(self.server.base_url, key, dict(sample))
            outcome = await asyncio.wait_for(run, self.timeout_s)
        except TimeoutError:
            raised = "timeout"
        except Exception as e:  # the agent's own error: reported by its traceback's last line
            raised = traceback.format_exception_only(type(e), e)[-1].strip()
        finally:
            self.server.finish(key)
        return _trajectory(ep, sid, gid, outcome, raised, self.timeout_s)

    def close(self) -> None:
        """Stop this environment's own endpoint (a shared one belongs to the task)."""
        if self._own:
            self.server.close()


async def harness_episode(engine: InferenceEngine, env: HarnessEnv, tokenizer: Any, sample: Mapping[str, Any],
                          sampling: SamplingParams, cfg: AgentLoopConfig | None = None,
                          group_id: Any = None) -> Trajectory:
    """One episode of the ``harness`` task (an :data:`~trainer.rollout.groups.EpisodeFn`):
    :meth:`HarnessEnv.play_episode` of ``env``.

    Args: as :func:`trainer.rollout.agent_loop.run_episode`; ``env`` must be a :class:`HarnessEnv`.

    Raises:
        TypeError: ``env`` is not a :class:`HarnessEnv` (a pool of another task's environments).
    """
    if not isinstance(env, HarnessEnv):
        raise TypeError(f"harness_episode: expected a HarnessEnv, got {type(env).__name__}")
    return await env.play_episode(engine, tokenizer, sample, sampling, cfg, group_id=group_id)


def _trajectory(ep: Episode, sid: Any, gid: Any, outcome: Any, raised: str, timeout_s: float) -> Trajectory:
    """The episode's trajectory from its recorded calls and the agent's outcome (the rules of the
    module docstring, first match wins: engine failure, timeout, used-up budget, the agent raised,
    edited history, no call, bad reward, success)."""
    tr = ep.trajectory
    if tr is None:
        tr = Trajectory(prompt_ids=[], sample_id=sid, group_id=gid)
    tr.info.update(harness_calls=ep.calls, harness_history_edits=ep.edits, tool_calls=ep.tool_calls)
    tr.info[LENGTH_CAPPED] = ep.length_capped
    ep.stamp_time(tr.info)
    failure = ep.failure
    if failure.startswith(FinishReason.ENGINE_ERROR.value):
        tr.finish_reason = failure
    elif raised == "timeout":
        tr.finish(FinishReason.INFRA_ERROR, f"harness agent timed out after {timeout_s:g} s")
    elif failure.startswith((FinishReason.MAX_TOTAL_TOKENS.value, FinishReason.MAX_TURNS.value)):
        tr.finish_reason = failure  # an overlong episode earns no reward, whatever the agent says
        return tr
    elif raised:
        tr.finish(FinishReason.ENV_ERROR, f"harness agent raised: {raised}")
    elif failure:
        tr.finish_reason = failure  # history_edited
    elif not ep.calls:
        tr.finish(FinishReason.ENV_ERROR, "harness agent returned without calling the model")
    else:
        try:
            reward, comps = reward_of(outcome)
            tr.add_reward(reward)
        except (TypeError, ValueError) as e:
            tr.finish(FinishReason.ENV_ERROR, f"bad reward: {e}")
        else:
            tr.info["reward_components"] = comps
            tr.finish(FinishReason.TERMINATED)
            return tr
    tr.clear_rewards()
    return tr


__all__ = ["TOOL_FORMATS", "HarnessEnv", "harness_episode", "load_agent", "reward_of"]
