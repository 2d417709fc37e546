"""The learner as a Ray actor (:class:`LearnerActor`) and its driver-side proxy (:class:`RayLearner`,
a :class:`~trainer.learner.base.Learner` whose methods call the actor), for the ``ray`` launcher
(:mod:`.ray_launcher`)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from ..learner.allocator import release_free_heap
from ..learner.spec import LearnerSpec
from ..models.lora import adapter_of


class LearnerActor:
    """The learner as a Ray actor: any backend of ``learner.backend``, started from a state.

    Args:
        spec: the backend's :class:`~trainer.learner.spec.LearnerSpec`
            (:func:`trainer.config.specs.learner_spec`; its plug-ins are imported in this process
            when Ray unpickles it).
        model_dir: ``save_pretrained`` directory of the actor (architecture, initial weights).
        state: :meth:`Learner.state_dict` output to start from (models, optimizers, counters).
    """

    def __init__(self, spec: LearnerSpec, model_dir: str, state: dict) -> None:
        from ..learner import make_learner
        from ..plugins import import_plugins

        import_plugins(spec.plugins)  # the user's registrations, in this process too
        self.learner = make_learner(spec, model_dir)
        self.learner.load_state_dict(state)
        self.malloc_trim = spec.malloc_trim

    def step(self, batch: Any, with_inputs: bool = False) -> tuple[dict, Any]:
        """:meth:`Learner.step`: ``(metrics, step inputs)`` in one reply, the step inputs the
        learner's ``last_step_inputs`` on the CPU (``(B, T)`` log-probs and advantages, for the
        run's training samples) when ``with_inputs``, else None. With ``learner.malloc_trim`` this
        process's free C heap is then returned to the OS
        (:func:`~trainer.learner.allocator.release_free_heap`), as the local loop and every
        distributed rank do, and ``perf/learner_malloc_trim_s`` is added."""
        metrics = self.learner.step(batch)
        if self.malloc_trim:
            t0 = time.perf_counter()
            release_free_heap()
            metrics["perf/learner_malloc_trim_s"] = time.perf_counter() - t0
        x = getattr(self.learner, "last_step_inputs", None) if with_inputs else None
        return metrics, None if x is None else x.to(torch.device("cpu"))

    def state_dict(self) -> dict:
        """:meth:`Learner.state_dict` (everything needed to resume)."""
        return self.learner.state_dict()

    def policy_weights(self) -> dict[str, torch.Tensor]:
        """:meth:`Learner.export_policy_weights` as a dict (what the rollout workers need)."""
        return dict(self.learner.export_policy_weights())

    def adapter(self) -> Any:
        """The learner's LoRA adapter (a copy; :func:`~trainer.models.lora.adapter_of`), or None."""
        a = adapter_of(self.learner)
        return None if a is None else a.copy("cpu")

    def load_state_dict(self, state: dict) -> None:
        """:meth:`Learner.load_state_dict`."""
        self.learner.load_state_dict(state)

    def policy_version(self) -> int:
        """:attr:`Learner.policy_version`."""
        return self.learner.policy_version

    def scores_probes(self) -> bool:
        """Whether the backend gives its next-token distribution (the weight-sync attestation's
        reference: ``next_token_logprobs``)."""
        return callable(getattr(self.learner, "next_token_logprobs", None))

    def next_token_logprobs(self, prompt_ids: torch.Tensor, temperature: float) -> torch.Tensor:
        """The backend's ``next_token_logprobs``: ``(K, P)`` int64 prompts → ``(K, V)`` float32 on
        the CPU (:mod:`trainer.orchestration.attestation`)."""
        return self.learner.next_token_logprobs(prompt_ids, temperature)


class RayLearner:
    """A :class:`~trainer.learner.base.Learner` hosted in a Ray actor: every method calls it.

    Args:
        actor: a :class:`LearnerActor` handle (:meth:`start` makes one).
    """

    def __init__(self, actor: Any, algorithm: Any = None, with_inputs: bool = False) -> None:
        self.actor = actor
        #: the preset's algorithm (its channel intervals, for the run's samples; it trains nothing
        #: here), or None
        self.algorithm = algorithm
        #: the last step's per-token inputs fetched from the actor (``logging.samples_per_step > 0``)
        self.last_step_inputs: Any = None
        self._with_inputs = with_inputs
        self._scores_probes = False  # whether the actor's backend gives next_token_logprobs (start)

    @classmethod
    def start(cls, spec: LearnerSpec, model_dir: str | Path, state: dict,
              options: dict | None = None) -> RayLearner:
        """Start a :class:`LearnerActor` of the backend of ``spec`` (its
        :class:`~trainer.learner.spec.LearnerSpec`, :func:`trainer.config.specs.learner_spec`) from
        ``state`` (``Learner.state_dict`` output); ``options``: Ray actor options (``num_gpus``, ...).
        Ray must be initialised. With ``spec.keep_step_inputs`` (``logging.samples_per_step > 0``)
        each step also fetches the actor's step inputs, so the run writes its training samples as
        the local launcher does."""
        import ray

        from ..learner.algorithm import ActorCriticAlgorithm

        actor_cls = ray.remote(LearnerActor).options(**dict(options or {}))
        algorithm = ActorCriticAlgorithm.from_config(spec.algorithm, spec.step)
        proxy = cls(actor_cls.remote(spec, str(model_dir), state), algorithm, spec.keep_step_inputs)
        proxy._scores_probes = bool(ray.get(proxy.actor.scores_probes.remote()))
        return proxy

    @property
    def next_token_logprobs(self) -> Callable[[torch.Tensor, float], torch.Tensor] | None:
        """The actor's ``next_token_logprobs`` (``(K, P)`` int64 prompts, temperature → ``(K, V)``
        float32 on the CPU: the weight-sync attestation's reference, :mod:`.attestation`), called in
        the actor; None when its backend has none (the attestation is then off)."""
        if not self._scores_probes:
            return None
        import ray

        def score(prompt_ids: torch.Tensor, temperature: float) -> torch.Tensor:
            return ray.get(self.actor.next_token_logprobs.remote(prompt_ids, temperature))
        return score

    @property
    def policy_version(self) -> int:
        """The actor's policy version."""
        import ray

        return int(ray.get(self.actor.policy_version.remote()))

    def step(self, batch: Any) -> dict[str, float]:
        """:meth:`Learner.step` on the actor (blocks until it is done; the loop calls it in a thread)."""
        import ray

        metrics, inputs = ray.get(self.actor.step.remote(batch, self._with_inputs))
        if self._with_inputs:
            self.last_step_inputs = inputs
        return metrics

    def policy_weights_ref(self) -> Any:
        """An object reference to the actor's policy weights (produced once, pulled by each worker)."""
        return self.actor.policy_weights.remote()

    def export_policy_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The actor's policy weights, fetched to this process."""
        import ray

        yield from ray.get(self.policy_weights_ref()).items()

    def export_adapter(self) -> Any:
        """The actor's LoRA adapter, fetched to this process (None without LoRA)."""
        import ray

        return ray.get(self.actor.adapter.remote())

    def state_dict(self) -> dict[str, Any]:
        """The actor's :meth:`Learner.state_dict` (everything needed to resume)."""
        import ray

        return ray.get(self.actor.state_dict.remote())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """:meth:`Learner.load_state_dict` on the actor."""
        import ray

        ray.get(self.actor.load_state_dict.remote(state))

    def close(self) -> None:
        """Kill the actor (idempotent)."""
        import ray

        if self.actor is not None:
            ray.kill(self.actor)
            self.actor = None
