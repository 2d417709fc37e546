"""The driver side of a distributed learner: :class:`DistributedLearner` (a
:class:`~trainer.learner.base.Learner`) runs a registered rank learner on
``learner.backend_settings.world_size`` ranks (the backend's
:class:`~trainer.learner.backend_settings.DistributedSettings`) and looks like any other backend to
the loop, the Ray launcher and ``run.py``.

* ``step(batch)``: the same full batch goes to every rank; rank 0's metrics come back (and, when
  the run keeps per-step samples, rank 0's per-token step inputs: :attr:`last_step_inputs`).
* ``export_policy_weights()``: the ranks gather the actor's full tensors on rank 0, which
  sends them here (shared memory with ``spawn``, the object store with ``ray``).
* Checkpoints: :meth:`state_dict` is small (backend, layout, policy version); the sharded state
  is written by the ranks into a directory of the checkpoint being built (:meth:`save_dir`,
  called by :class:`~trainer.outputs.checkpoint.CheckpointManager` through
  :func:`~trainer.learner.base.learner_checkpoint_state`) and read back by :meth:`load_dir`.
* Failures: a rank that raises, dies or hangs longer than ``learner.backend_settings.timeout_s`` raises
  :class:`~.launch.RankError` here; the ranks are then stopped.
"""

from __future__ import annotations

import json
import os
import time
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ...errors import ConfigError
from ...rollout.batch import RolloutBatch
from ..algorithm import ActorCriticAlgorithm, StepInputs
from ..backend_settings import DistributedSettings
from ..spec import LearnerSpec
from .launch import RankGroup, start_ranks


def check_launch(settings: DistributedSettings, environ: dict[str, str] | None = None) -> None:
    """Refuse ``launch`` spawn / ray in a process that ``torchrun`` started with more than
    one process: each of them would run the whole experiment (engine, rollouts, its own learner
    ranks) into the same ``output_dir``.

    Args:
        settings: the backend's :class:`~trainer.learner.backend_settings.DistributedSettings`.
        environ: default ``os.environ``.

    Raises:
        ConfigError: naming ``learner.backend_settings.launch`` and torchrun's ``WORLD_SIZE``.
    """
    env = os.environ if environ is None else environ
    world = int(env.get("WORLD_SIZE", "1") or 1)
    if settings.launch != "torchrun" and "RANK" in env and world > 1:
        raise ConfigError(f"learner.backend_settings.launch={settings.launch!r}: this process is one of "
                          f"WORLD_SIZE={world} started by torchrun, and each would run the whole experiment; "
                          "with torchrun set learner.backend_settings.launch=torchrun (or run copc train "
                          "without torchrun)")


def check_model_parallel(settings: DistributedSettings, model_dir: str | Path) -> None:
    """Model-dependent checks of the parallel sizes, against ``model_dir/config.json``.

    ``tensor_parallel_size`` must divide the number of attention heads and of key/value heads
    (Megatron splits heads across tensor-parallel ranks); ``pipeline_parallel_size`` must not exceed
    the number of layers (``settings``: the backend's
    :class:`~trainer.learner.backend_settings.DistributedSettings`).

    Raises:
        ConfigError: naming the key, the value and the model's count.
    """
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        return
    cfg = json.loads(path.read_text())
    cfg = cfg.get("text_config", cfg)
    tp, pp = settings.tensor_parallel_size, settings.pipeline_parallel_size
    heads = int(cfg.get("num_attention_heads", 0) or 0)
    kv = int(cfg.get("num_key_value_heads", heads) or heads)
    layers = int(cfg.get("num_hidden_layers", 0) or 0)
    for count, what in ((heads, "attention heads"), (kv, "key/value heads")):
        if count and (tp > count or count % tp):
            raise ConfigError(f"learner.backend_settings.tensor_parallel_size={tp}: must divide the model's "
                              f"{count} {what} ({path})")
    if layers and pp > layers:
        raise ConfigError(f"learner.backend_settings.pipeline_parallel_size={pp}: more stages than the "
                          f"model's {layers} layers ({path})")


class DistributedLearner:
    """A :class:`~trainer.learner.base.Learner` whose work runs on ``learner.backend_settings.world_size``
    ranks.

    Args:
        spec: the :class:`~trainer.learner.spec.LearnerSpec` (``spec.backend`` names a rank learner
            registered with :func:`~.registry.register_rank_learner`; the ranks get it pickled).
        model_dir: ``save_pretrained`` directory of the actor (every rank reads it; with Ray on
            several nodes it must be visible at the same path everywhere).

    Raises:
        ConfigError: model-dependent sizes (:func:`check_model_parallel`); spawn / ray ranks
            under a multi-process torchrun (:func:`check_launch`). (A launcher that cannot host
            a distributed learner, ``launcher.kind=ray``, is refused at config load by its
            ``distributed_learner`` capability, in :meth:`trainer.config.ExperimentConfig.validate`.)
        RankError: a rank failed to start.
    """

    def __init__(self, spec: LearnerSpec, model_dir: str | Path) -> None:
        from .base import RANK_LEARNERS

        RANK_LEARNERS.metadata(spec.backend)  # RegistryError naming learner.backend (imports nothing)
        #: the backend's rank layout, launch and timeout
        self.settings = spec.settings_as(DistributedSettings)
        check_launch(self.settings)
        check_model_parallel(self.settings, model_dir)
        self.spec, self.model_dir, self.backend = spec, Path(model_dir), spec.backend
        #: the channel intervals of the preset, for the run's samples (the ranks hold the algorithm
        #: that trains; this one computes nothing)
        self.algorithm = ActorCriticAlgorithm.from_config(spec.algorithm, spec.step_with(self.settings))
        #: rank 0's last step inputs (CPU; ``(B, T)`` log-probs and advantages), or None when the
        #: run keeps no per-step samples (``logging.samples_per_step: 0``: ``spec.keep_step_inputs``)
        self.last_step_inputs: StepInputs | None = None
        self._with_inputs = spec.keep_step_inputs
        self._group: RankGroup = start_ranks(spec, model_dir)
        self._finalizer = weakref.finalize(self, self._group.close)
        self._version = int(self._group.ready[0])

    @classmethod
    def from_spec(cls, spec: LearnerSpec, model_dir: str | Path) -> DistributedLearner:
        """The :data:`~trainer.learner.base.LearnerFactory` of every distributed backend."""
        return cls(spec, model_dir)

    # -- the Learner protocol -------------------------------------------------------------
    @property
    def policy_version(self) -> int:
        """Updates done (resumes included), as reported by rank 0."""
        return self._version

    def step(self, batch: RolloutBatch) -> dict[str, float]:
        """Train every rank on ``batch``; rank 0's metrics plus ``perf/learner_rpc_s`` (driver
        wall time of the call, transfers included).

        Raises:
            RankError: a rank raised, died or timed out.
        """
        t0 = time.perf_counter()
        out = self._group.call("step", batch, self._with_inputs)[0]
        self._version = int(out["policy_version"])
        self.last_step_inputs = out.get("step_inputs")
        metrics = dict(out["metrics"])
        metrics["perf/learner_rpc_s"] = time.perf_counter() - t0
        return metrics

    def export_policy_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The actor's full weights in Hugging Face names (CPU tensors gathered on rank 0).

        The gather runs when this is called (not lazily), so callers see a failure here.
        """
        pairs = self._group.call("export")[0]
        return iter(pairs)

    def state_dict(self) -> dict[str, Any]:
        """The small driver state: ``{"backend", "world_size", "tensor_parallel_size",
        "pipeline_parallel_size", "policy_version", "sharded": True}``; the weights and optimizer
        state are written by :meth:`save_dir`."""
        sec = self.settings
        return {"backend": self.backend, "world_size": sec.world_size,
                "tensor_parallel_size": sec.tensor_parallel_size,
                "pipeline_parallel_size": sec.pipeline_parallel_size,
                "policy_version": self._version, "sharded": True}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Check a :meth:`state_dict` against this learner (the sharded state comes through
        :meth:`load_dir`).

        Raises:
            ConfigError: ``state`` is another backend's (e.g. a ``torch`` checkpoint resumed with
                ``learner.backend=fsdp``), naming ``learner.backend``.
        """
        sharded = isinstance(state, dict) and bool(state.get("sharded"))
        if not sharded or state.get("backend") != self.backend:
            got = state.get("backend") if sharded else "torch"
            raise ConfigError(f"learner.backend={self.backend!r}: the checkpoint was written by backend "
                              f"{got!r}; resume with the same learner.backend")

    # -- sharded checkpoint hooks (trainer.learner.base.ShardedCheckpoint) ----------------
    def save_dir(self, path: Path) -> None:
        """Every rank writes its shard of the complete state into ``path`` (collective)."""
        Path(path).mkdir(parents=True, exist_ok=True)
        self._group.call("save", str(path))

    def load_dir(self, path: Path) -> None:
        """Every rank restores its state from ``path`` (written by :meth:`save_dir`, possibly by
        another data-parallel size). Its DCP metadata and every non-tensor value it lists are checked
        here first (:func:`~.safe_dcp.check_dcp_tree`: a crafted checkpoint is refused in one line before
        any rank reads it; FSDP ranks read it through :func:`~.safe_dcp.safe_dcp_load` again, Megatron's
        ``dist_checkpointing.load`` through torch's stock reader, which this check stands in front of).

        Raises:
            UnsafeCheckpointError: a metadata file or value would run code, or names a file outside
                ``path``.
        """
        from .safe_dcp import check_dcp_tree  # torch.distributed.checkpoint: only when a checkpoint is read

        check_dcp_tree(path)
        self._version = int(self._group.call("load", str(path))[0])

    # -- extras ---------------------------------------------------------------------------
    def named_gradients(self) -> dict[str, torch.Tensor]:
        """The gradients of the last update (``actor.<HF name>`` / ``critic.<name>``, full, float32);
        see :class:`~.base.GradientProbe` (tests)."""
        return self._group.call("gradients")[0]

    def rank_state_bytes(self) -> list[dict[str, int]]:
        """Per rank (rank order): bytes of parameters, gradients and optimizer state it holds
        (:class:`~.base.MemoryProbe`; ``torchrun``: rank 0 only)."""
        return self._group.call("state_bytes")

    @property
    def rank_pids(self) -> list[int]:
        """Process ids of the ranks (``spawn`` only; tests)."""
        return list(getattr(self._group, "pids", []))

    def close(self) -> None:
        """Stop the ranks (idempotent; also runs when the learner is garbage-collected or at exit)."""
        self._finalizer()

    def __enter__(self) -> DistributedLearner:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
