"""The launcher seam: ``launcher.kind`` names a registered launcher; nothing else branches on it.

A launcher turns a :class:`LaunchSpec` (the driver's restored learner, its started engine, the
task, the launcher's settings and the typed specs a launcher that starts processes elsewhere
needs; built from the experiment config by :func:`trainer.app.assemble.launch_spec`) into the two
objects the training loop needs — the :class:`~trainer.learner.base.Learner` to train and the
:class:`~.rollouts.Rollouts` to play episodes through — as an async context manager:
``async with launcher(spec) as (learner, rollouts): ...``. On a clean exit the driver's learner
must hold the final state and the driver's engine its weights (``copc train`` evaluates with
them); on any exit what it started is released.

Built in: ``local`` (:func:`launch_local`: the driver's learner, the driver's engine and a pool of
the task's environments in this process) and ``ray`` (:func:`~.ray_launcher.launch_ray`: a
Ray-hosted learner and rollout worker actors). Adding one = a function like these + one
``LAUNCHERS.register(name, settings=MySettings)(fn)`` call in a plugin file (``plugins:``); its
settings dataclass is filled from ``launcher.settings`` (validated at load through
:data:`trainer.plugins.SEAMS`) and handed over as ``spec.settings`` (None without settings).

Capability metadata: ``distributed_learner`` (default True) — whether the launcher can train a
distributed learner backend (``fsdp``, ``megatron``); ``ray`` cannot (its learner actor copies
learner state through ``state_dict``, which for a distributed learner holds no weights);
``ray_cluster`` (default False) — whether it runs on the Ray cluster of its settings' ``address``
(its settings are then a :class:`~trainer.ray_util.RayClusterSettings`; ``copc sweep`` runs its cells
as Ray tasks on that cluster); ``ray`` does.

The ``ray`` launcher's settings (``launcher: {kind: ray, settings: {...}}``) are
:class:`RayLauncherSettings`: ``address`` / ``num_cpus`` of the cluster (joined or started through
:func:`trainer.ray_util.connect_ray`) and ``num_rollout_workers``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from seams.registry import Registry

from ..errors import ConfigError
from ..ray_util import RayClusterSettings

if TYPE_CHECKING:
    from ..engines.registry import EngineSpec
    from ..learner.spec import LearnerSpec
    from ..rollout.agent_loop import AgentLoopConfig


@dataclass(frozen=True)
class LaunchSpec:
    """What a launcher gets (built by :func:`trainer.app.assemble.launch_spec`; never the config).

    Attributes:
        kind: the launcher's registered name (``launcher.kind``).
        settings: the launcher's settings (its registered dataclass, from ``launcher.settings``;
            None for a launcher registered without settings).
        learner: the driver's :class:`~trainer.learner.base.Learner` (restored on resume).
        engine: the driver's started :class:`~trainer.engines.registry.EngineHandle`.
        task: the started task (``make_env``, ``episode()``, ``worker_spec()``, ``info``).
        tokenizer: the policy tokenizer.
        model_dir: ``save_pretrained`` directory of the policy's architecture.
        sampling: rollout sampling parameters. agent_cfg: episode budgets.
        concurrency: episodes in flight at once per engine (``rollout.concurrency``).
        engine_kind: the registered engine (``rollout.engine``) a launcher starts elsewhere.
        engine_spec: that engine's :class:`~trainer.engines.registry.EngineSpec` without the
            per-process fields (``tokenizer`` None, version 0, no weights / adapter / work_dir):
            a process that starts its own engine fills those in.
        learner_spec: the learner backend's :class:`~trainer.learner.spec.LearnerSpec`, for a
            launcher that hosts the learner elsewhere.
        plugins: the user's plug-in files / modules, absolute (``plugins``), for a process
            elsewhere to import before it builds anything.
    """

    kind: str
    settings: Any
    learner: Any
    engine: Any
    task: Any
    tokenizer: Any
    model_dir: Path
    sampling: Any
    agent_cfg: AgentLoopConfig
    concurrency: int
    engine_kind: str
    engine_spec: EngineSpec
    learner_spec: LearnerSpec
    plugins: tuple[str, ...] = ()

    @property
    def cfg(self) -> None:
        """The former field holding the experiment config: refused in one line.

        Raises:
            ConfigError: always, naming the fields to read instead.
        """
        raise ConfigError(f"launcher {self.kind!r} read spec.cfg: a launcher gets a LaunchSpec without the "
                          "experiment config; read spec.concurrency, spec.engine_kind / spec.engine_spec, "
                          "spec.learner_spec, spec.plugins, its own spec.settings (docs/seams.md, Launchers)")


@dataclass
class RayLauncherSettings(RayClusterSettings):
    """The ``ray`` launcher's settings (``launcher.settings`` with ``launcher.kind: ray``).

    Attributes:
        address: an existing Ray cluster (``HEAD:6379``); empty: start a local one (stopped at the end).
        num_cpus: CPUs of a local cluster (ignored with ``address``), >= 1.
        num_rollout_workers: rollout worker actors, >= 1.

    Raises:
        ValueError: ``num_cpus`` or ``num_rollout_workers`` < 1 (one line naming the field).
    """

    num_rollout_workers: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        n = self.num_rollout_workers
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"num_rollout_workers={n!r}: must be an int >= 1")


#: ``launcher(spec) -> async context manager of (learner, rollouts)``.
Launcher = Callable[[LaunchSpec], AbstractAsyncContextManager[tuple[Any, Any]]]

#: The launchers (``launcher.kind``; a seam of :data:`trainer.plugins.SEAMS`, settings from
#: ``launcher.settings``); capability metadata ``distributed_learner`` (bool, default True),
#: ``ray_cluster`` (bool, default False: it runs on the Ray cluster of its settings' ``address``, a
#: :class:`~trainer.ray_util.RayClusterSettings`, so ``copc sweep`` runs its cells as Ray tasks on one
#: cluster) and ``rollout_workers`` (bool, default False: rollouts run in worker processes of its
#: own, each making its own engine, as many as its settings' ``num_rollout_workers``).
LAUNCHERS: Registry[Launcher] = Registry("launcher", {"distributed_learner": (bool, True),
                                                      "ray_cluster": (bool, False),
                                                      "rollout_workers": (bool, False)}, key="launcher.kind")


@LAUNCHERS.register("local")
@asynccontextmanager
async def launch_local(spec: LaunchSpec) -> AsyncIterator[tuple[Any, Any]]:
    """The ``local`` launcher: the driver's learner and :class:`~.rollouts.LocalRollouts` on the
    driver's engine with ``rollout.concurrency`` pooled environments of the task."""
    from .rollouts import LocalRollouts

    rollouts = LocalRollouts(spec.engine, spec.task.make_env, spec.tokenizer, spec.sampling, spec.agent_cfg,
                             spec.concurrency, spec.task.episode())
    try:
        yield spec.learner, rollouts
    finally:
        await rollouts.close()


@LAUNCHERS.register("ray", distributed_learner=False, ray_cluster=True, rollout_workers=True,
                    settings=RayLauncherSettings)
def launch_ray(spec: LaunchSpec) -> AbstractAsyncContextManager[tuple[Any, Any]]:
    """The ``ray`` launcher (:func:`trainer.orchestration.ray_launcher.launch_ray`; Ray is imported
    only when it is used)."""
    from .ray_launcher import launch_ray as launch

    return launch(spec)


def launch(spec: LaunchSpec) -> AbstractAsyncContextManager[tuple[Any, Any]]:
    """Start the launcher ``spec.kind`` (see the module docstring).

    Raises:
        RegistryError: an unregistered launcher (the config's validation refuses it at load).
    """
    return LAUNCHERS.get(spec.kind)(spec)
