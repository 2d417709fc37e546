"""The Megatron-core learner backend (``learner.backend: megatron``): tensor + data parallel.

The backend is registered by :mod:`trainer.learner.registry` (by reference to
:func:`build_rank_learner`); importing this package imports nothing heavy: Megatron-core and
mbridge (~10 s of imports) load inside the rank processes, when the factory runs. Modules:
:mod:`.shims` (CPU/compat shims), :mod:`.bridge` (Hugging Face ↔ ``GPTModel`` through mbridge),
:mod:`.logprobs` (vocab-parallel log-probs), :mod:`.optim` (optimizers),
:mod:`.rank_learner` (:class:`~.rank_learner.MegatronRankLearner`). See ``docs/megatron.md``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ...spec import LearnerSpec


def build_rank_learner(spec: LearnerSpec, model_dir: Path, ctx: Any) -> Any:
    """The ``megatron`` rank-learner factory (imports Megatron-core inside the rank process)."""
    from .rank_learner import build_megatron_rank_learner

    return build_megatron_rank_learner(spec, model_dir, ctx)


__all__ = ["build_rank_learner"]
