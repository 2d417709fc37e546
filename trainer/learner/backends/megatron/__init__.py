"""The Megatron-core learner backend (``learner.backend: megatron``): tensor + data parallel.

Importing this package registers the backend and imports nothing heavy: Megatron-core and
mbridge (~10 s of imports) load inside the rank processes, when the factory runs. Modules:
:mod:`.shims` (CPU/compat shims), :mod:`.bridge` (Hugging Face ↔ ``GPTModel`` through mbridge),
:mod:`.logprobs` (vocab-parallel log-probs), :mod:`.optim` (optimizers),
:mod:`.rank_learner` (:class:`~.rank_learner.MegatronRankLearner`). See ``docs/megatron.md``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ...backend_settings import DistributedSettings
from ...distributed.registry import RANK_LEARNERS, register_rank_learner
from ...spec import LearnerSpec


def build_rank_learner(spec: LearnerSpec, model_dir: Path, ctx: Any) -> Any:
    """The ``megatron`` rank-learner factory (imports Megatron-core inside the rank process)."""
    from .rank_learner import build_megatron_rank_learner

    return build_megatron_rank_learner(spec, model_dir, ctx)


if "megatron" not in RANK_LEARNERS:
    register_rank_learner("megatron", build_rank_learner, settings=DistributedSettings, tensor_parallel=True)

__all__ = ["build_rank_learner"]
