"""The ``search`` task in one folder: Search-R1 question answering against a retriever server.

* :mod:`.task` — :class:`SearchTask` (QA splits, the BM25 retriever server, the env factory).
* :mod:`.traces` — ``search_r1`` warm-start traces (answers copied from the real
  ``<information>`` block).
* :mod:`.drills` — copy drills for ``warm_start.drill_steps``: query drills and reading drills
  (cloze questions about corpus passages).
"""

from .drills import query_drills, reading_drills, reservoir_sample
from .task import DEFAULT_CORPUS, SearchTask, corpus_path, start_retriever
from .traces import (
    SHORT_SEARCH_PROMPT,
    copied_answer,
    reformulated_query,
    search_r1_samples,
    search_r1_traces,
)

__all__ = [
    "DEFAULT_CORPUS",
    "SHORT_SEARCH_PROMPT",
    "SearchTask",
    "copied_answer",
    "corpus_path",
    "query_drills",
    "reading_drills",
    "reformulated_query",
    "reservoir_sample",
    "search_r1_samples",
    "search_r1_traces",
    "start_retriever",
]
