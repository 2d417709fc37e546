"""What the training loop plays episodes through (:class:`Rollouts`) and reports to (:class:`LoopHooks`).

:class:`Rollouts` is the loop's view of whatever generates episodes: play the ``n`` episodes of
one prompt draw, take new policy weights, release what it started. :class:`LocalRollouts` plays
them in this process on one engine and a pool of environments; the Ray launcher's
:class:`~trainer.orchestration.ray_launcher.RayRollouts` sends them to rollout worker actors.
Launchers (:mod:`trainer.orchestration.launchers`) build one of them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol, runtime_checkable

import torch

from ..engines.base import GenerationResult, InferenceEngine, SamplingParams
from ..engines.registry import EngineHandle
from ..models.lora import adapter_of
from ..rollout.agent_loop import AgentLoopConfig
from ..rollout.groups import EnvPool, EpisodeFn, run_group
from ..rollout.trajectory import Trajectory


@runtime_checkable
class WeightSource(Protocol):
    """Anything with the learner's export interface: a :class:`~trainer.learner.base.Learner` or a
    kept :class:`~trainer.orchestration.lag.WeightSnapshot` (a LoRA one also has
    ``export_adapter()``: :func:`~trainer.models.lora.adapter_of`)."""

    def export_policy_weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` pairs in Hugging Face names."""


async def push_weights(handle: EngineHandle, source: WeightSource, version: int) -> None:
    """Make ``handle``'s engine generate with ``source``'s policy as ``version``: a LoRA source's
    adapter only when the engine takes adapters (``handle.sync_adapter``), else the full (for LoRA:
    merged) weights through ``handle.sync``."""
    adapter = adapter_of(source)
    if adapter is not None and handle.sync_adapter is not None:
        await handle.sync_adapter(adapter, version)
    else:
        await handle.sync(source.export_policy_weights(), version)


@runtime_checkable
class Rollouts(Protocol):
    """Plays prompt groups for the training loop."""

    async def run_group(self, uid: int, sample: Mapping[str, Any], n: int) -> list[Trajectory]:
        """Play the ``n`` episodes of prompt draw ``uid`` (row ``sample``); every model token
        carries the policy version that produced it."""

    async def sync(self, source: WeightSource, version: int) -> None:
        """Generate with ``source.export_policy_weights()`` as policy ``version`` from now on
        (returns when new requests use them)."""

    async def close(self) -> None:
        """Release what these rollouts started (environments, workers); idempotent."""


class LoopHooks:
    """What the loop reports after each step and when a checkpoint is due (no-ops here).

    Subclass it: ``copc train`` logs metrics and writes checkpoints (:mod:`trainer.app.run`); tests
    record what they see.
    """

    def on_step(self, step: int, metrics: dict, uids: list[int]) -> None:
        """Called after step ``step`` with its metrics and the prompt draws it trained."""

    def on_trained(self, step: int, trajs: list[Trajectory], learner: Any) -> None:
        """Called right after the learner trained step ``step`` on ``trajs`` (batch order), before
        :meth:`on_step`; ``copc train`` writes the step's training samples here."""

    async def evaluate(self, step: int) -> dict[str, float]:
        """Evaluate the policy the engine holds after step ``step`` (``eval.every_steps``); the
        ``eval/*`` metrics go into that step's row. The base class evaluates nothing."""
        return {}

    def save_checkpoint(self, step: int, loop_state: dict) -> bool:
        """Write a checkpoint of step ``step`` (``loop_state``: :meth:`LoopState.checkpoint
        <trainer.orchestration.state.LoopState.checkpoint>` output); return whether one was
        written (the base class writes none, so the loop never claims a checkpoint exists)."""
        return False


def engine_handle(engine: InferenceEngine) -> EngineHandle:
    """An :class:`EngineHandle` for an engine built by hand whose ``update_weights`` takes a dict
    (e.g. an :class:`~trainer.engines.embedded.EmbeddedEngine` in a test); adapter sync through its
    ``update_adapter`` when it has one."""

    async def sync(weights: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        await engine.update_weights(dict(weights), version)

    return EngineHandle(engine, sync, engine.close, sync_adapter=getattr(engine, "update_adapter", None))


class LocalRollouts:
    """Episodes played in this process: one engine, a pool of reusable environments.

    Args:
        engine: the started engine (its ``sync`` receives the weights); the caller closes it.
        make_env: environment factory; episodes take environments from an
            :class:`~trainer.rollout.groups.EnvPool` of ``concurrency`` reusable ones.
        tokenizer: the policy tokenizer.
        sampling: rollout sampling parameters.
        agent_cfg: episode budgets.
        concurrency: episodes in flight at once.
        episode: how an episode is played on one environment (the task's
            :meth:`~trainer.tasks.base.Task.episode`); None: the tool-environment loop.
    """

    def __init__(self, engine: EngineHandle, make_env: Callable[[], Any], tokenizer: Any,
                 sampling: SamplingParams, agent_cfg: AgentLoopConfig, concurrency: int,
                 episode: EpisodeFn | None = None) -> None:
        self.handle, self.tok, self.sampling, self.agent_cfg = engine, tokenizer, sampling, agent_cfg
        self.pool = EnvPool(make_env, concurrency, episode)

    @property
    def engine(self) -> InferenceEngine:
        """The engine episodes are generated with."""
        return self.handle.engine

    async def run_group(self, uid: int, sample: Mapping[str, Any], n: int) -> list[Trajectory]:
        """:func:`trainer.rollout.groups.run_group` on the engine and the pool."""
        return await run_group(self.engine, self.pool, self.tok, sample, n, self.sampling, self.agent_cfg,
                               uid=uid)

    async def sync(self, source: WeightSource, version: int) -> None:
        """Push ``source``'s weights (a LoRA source's adapter) to the engine as ``version``
        (:func:`push_weights`)."""
        await push_weights(self.handle, source, version)

    async def probe(self, prompt_ids: list[int], params: SamplingParams) -> GenerationResult:
        """One request straight to the engine (the weight-sync attestation's probe,
        :mod:`.attestation`)."""
        return await self.engine.generate(prompt_ids, params)

    async def close(self) -> None:
        """Close the pooled environments (not the engine: it belongs to the caller)."""
        await self.pool.close()
