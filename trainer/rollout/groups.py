"""One episode-group runner, used by the local training loop, the Ray rollout workers and evaluation.

A *group* is the ``n`` episodes of one prompt draw (GRPO/DAPO groups; ``n = 1`` for COPC
and PPO). The seed rule is the same everywhere (:func:`episode_seed`), so a seeded run
samples the same streams whichever launcher plays it and evaluation is reproducible.

Environments come from an :class:`EnvPool`: at most ``size`` environments are created, each
``reset`` per episode and reused (reward helper processes and tool clients start once per
environment), and all are closed by :meth:`EnvPool.close`. The pool also names how an episode is
played on its environments (:attr:`EnvPool.episode`, an :data:`EpisodeFn`: the tool-environment
loop :func:`~trainer.rollout.agent_loop.run_episode` unless the task says otherwise, see
:meth:`trainer.tasks.base.Task.episode`).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from ..engines.base import InferenceEngine, SamplingParams
from .agent_loop import AgentLoopConfig, run_episode
from .trajectory import Trajectory

#: How one episode is played on one environment of a pool:
#: ``episode(engine, env, tokenizer, sample, sampling, agent_cfg, group_id=...) -> Trajectory``
#: (awaited), the signature of :func:`~trainer.rollout.agent_loop.run_episode` (the default). A task
#: whose environments are not stepped by the agent loop supplies its own
#: (:meth:`trainer.tasks.base.Task.episode`; the ``harness`` task: the user's agent drives it).
EpisodeFn = Callable[..., Awaitable[Trajectory]]

#: Multiplier of the prompt draw in the seed rule (a prime, so draws do not collide for k < 7919).
SEED_STRIDE = 7919


def episode_seed(seed: int | None, uid: int, k: int) -> int | None:
    """Sampling seed of episode ``k`` of prompt draw ``uid``: ``seed + 7919·uid + k`` (None stays None)."""
    return None if seed is None else seed + SEED_STRIDE * uid + k


def episode_sampling(sampling: SamplingParams, uid: int, k: int) -> SamplingParams:
    """``sampling`` with the seed of episode ``k`` of draw ``uid`` (:func:`episode_seed`)."""
    if sampling.seed is None:
        return sampling
    return dataclasses.replace(sampling, seed=episode_seed(sampling.seed, uid, k))


class EnvPool:
    """A bounded pool of reusable environments, and how an episode is played on them.

    Args:
        make_env: zero-argument factory (one env per pooled slot).
        size: most environments alive at once (also the most episodes in flight through
            this pool).
        episode: how :func:`run_group` plays one episode on an environment of the pool (an
            :data:`EpisodeFn`); None: :func:`~trainer.rollout.agent_loop.run_episode`.

    Raises:
        ValueError: ``size < 1``.
    """

    def __init__(self, make_env: Callable[[], Any], size: int, episode: EpisodeFn | None = None) -> None:
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"EnvPool: size={size!r} must be an int >= 1")
        self.make_env, self.size = make_env, size
        self.episode: EpisodeFn = run_episode if episode is None else episode
        self._free: list[Any] = []
        self._all: list[Any] = []
        self._sem = asyncio.Semaphore(size)

    async def acquire(self) -> Any:
        """An idle environment (created on first need); waits while ``size`` are in use."""
        await self._sem.acquire()
        if self._free:
            return self._free.pop()
        try:
            env = await asyncio.to_thread(self.make_env)
        except BaseException:
            self._sem.release()
            raise
        self._all.append(env)
        return env

    def release(self, env: Any) -> None:
        """Give ``env`` back for reuse."""
        self._free.append(env)
        self._sem.release()

    async def close(self) -> None:
        """Close every environment created (idempotent)."""
        envs, self._all, self._free = self._all, [], []
        for env in envs:
            close = getattr(env, "close", None)
            if close is not None:
                await asyncio.to_thread(close)


async def run_group(engine: InferenceEngine, pool: EnvPool, tokenizer: Any, sample: Mapping[str, Any],
                    n: int, sampling: SamplingParams, agent_cfg: AgentLoopConfig | None, *, uid: int,
                    group_id: Any = None, episodes: Sequence[int] | None = None) -> list[Trajectory]:
    """Play the ``n`` episodes of prompt draw ``uid`` on ``sample`` concurrently (or only the
    episode indices ``episodes`` of them: a resumed evaluation re-plays what is missing, with the
    same seeds).

    Episode ``k`` samples with :func:`episode_sampling` (``seed + 7919·uid + k``), takes an
    environment from ``pool``, is played by the pool's :attr:`EnvPool.episode` (the tool
    environment's agent loop, or the task's own episode: the ``harness`` task's agent) and returns
    the environment afterwards. Each trajectory gets ``info["uid"] = uid`` and ``group_id``
    (default ``uid``).

    Returns:
        The trajectories in episode order (infrastructure failures included, marked by
        :attr:`Trajectory.infra_failed`); ``info["episode"]`` is the episode index.

    Raises:
        ValueError: ``n < 1``. Exceptions of ``env.reset`` other than an infrastructure
        failure propagate (a bug).
    """
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"run_group: n={n!r} must be an int >= 1")

    async def one(k: int) -> Trajectory:
        env = await pool.acquire()
        try:
            gid = uid if group_id is None else group_id
            sampling_k = episode_sampling(sampling, uid, k)
            tr = await pool.episode(engine, env, tokenizer, sample, sampling_k, agent_cfg, group_id=gid)
        finally:
            pool.release(env)
        tr.info["uid"] = uid
        tr.info["episode"] = k
        return tr

    ks = range(n) if episodes is None else list(episodes)
    if any(not 0 <= k < n for k in ks):
        raise ValueError(f"run_group: episodes={list(ks)!r} must be in [0, {n})")
    return list(await asyncio.gather(*(one(k) for k in ks)))


async def run_groups(engine: InferenceEngine, pool: EnvPool, tokenizer: Any, samples: list[Mapping[str, Any]],
                     n: int, sampling: SamplingParams, agent_cfg: AgentLoopConfig | None
                     ) -> list[Trajectory]:
    """:func:`run_group` for every sample at once (draw ``uid`` = the sample's index; the pool
    bounds the episodes in flight); ``group_id`` = the sample's ``id`` (else its index).

    Returns:
        Trajectories ordered ``(sample 0, episode 0), (sample 0, episode 1), ...``.
    """
    groups = await asyncio.gather(*(run_group(engine, pool, tokenizer, s, n, sampling, agent_cfg, uid=i,
                                              group_id=s.get("id", i)) for i, s in enumerate(samples)))
    return [t for g in groups for t in g]
