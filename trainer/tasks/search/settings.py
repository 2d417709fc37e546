"""Settings of the ``search`` task (``task.settings``; see :mod:`trainer.tasks.settings`)."""

from __future__ import annotations

from dataclasses import dataclass

from ..settings import require

#: Where the auto-started retriever keeps its BM25 index when ``retriever_index_dir`` is not set
#: (relative: to the current working directory).
DEFAULT_INDEX_DIR = "runs/retriever_index/bm25"


@dataclass
class SearchSettings:
    """The ``search`` task's own knobs.

    Attributes:
        held_out_every: when ``task.eval_data`` are among the ``task.train_data`` sets, every
            ``held_out_every``-th row of each set is held out for evaluation (deterministic,
            disjoint from training), >= 2.
        tool_use_fraction: share in [0, 1] of the ``search_r1`` warm-start traces that search; the
            others answer at once with a guess, so RL has the decision to search left to learn.
        second_search_fraction: share in [0, 1] of the traces whose first search missed (no golden
            answer in the retrieved text) that search again with a reformulated query.
        keep_misses: keep the searching traces whose retrieved text never held a golden answer
            (answered with the last passage's title); false drops them, so every searching trace
            answers with a golden answer (copied, or yes/no). Traces that answer without searching
            (``tool_use_fraction`` < 1) stay.
        drill_steps: optimizer steps of copy drills before the traces (0: none): one-action traces
            that copy a pseudo-question of random corpus words into ``<search>words</search>``. A
            model built from scratch cannot copy from its context, and a few thousand real
            questions are memorised rather than copied; drills of never-repeating word sequences
            teach copying (what a pretrained model brings). drill_batch_size: drills per step
            (>= 1). drill_lr: their peak LR (> 0; constant after 20 warm-up steps).
        reading_drill_fraction: share in [0, 1] of the drills that are reading drills (a cloze
            question about a corpus passage, searched for through the real retriever and answered
            with the span copied from the result; teaches finding the question's words in a
            passage and copying the span beside them).
        retriever_url: base URL of a running retriever server to use (``http://host:port``); empty:
            the task starts a BM25 one on 127.0.0.1 (and hands its URL to the Ray rollout workers).
        retriever_index_dir: directory of the auto-started server's BM25 index (built on first
            use, reused after; relative: to the current working directory).
        retriever_corpus: the JSONL passage corpus it indexes (empty: ``<data dir>/wiki/corpus.jsonl``).
    """

    held_out_every: int = 5
    tool_use_fraction: float = 1.0
    second_search_fraction: float = 0.5
    keep_misses: bool = True
    drill_steps: int = 0
    drill_batch_size: int = 32
    drill_lr: float = 1e-3
    reading_drill_fraction: float = 0.0
    retriever_url: str = ""
    retriever_index_dir: str = DEFAULT_INDEX_DIR
    retriever_corpus: str = ""

    def __post_init__(self) -> None:
        """Raise :class:`~trainer.errors.ConfigError` naming ``task.settings.<key>`` on a bad value."""
        require(isinstance(self.held_out_every, int) and self.held_out_every >= 2, "held_out_every",
                self.held_out_every, "must be an int >= 2")
        for k in ("tool_use_fraction", "second_search_fraction", "reading_drill_fraction"):
            require(0.0 <= getattr(self, k) <= 1.0, k, getattr(self, k), "must be in [0, 1]")
        require(self.drill_steps >= 0, "drill_steps", self.drill_steps, "must be >= 0")
        require(self.drill_batch_size >= 1, "drill_batch_size", self.drill_batch_size, "must be >= 1")
        require(self.drill_lr > 0, "drill_lr", self.drill_lr, "must be > 0")


__all__ = ["DEFAULT_INDEX_DIR", "SearchSettings"]
