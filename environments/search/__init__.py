"""Search-R1-style QA environment: ``<search>`` → retriever → ``<information>``; EM/F1."""

from .env import (
    INVALID_ACTION_REPLY,
    NO_RESULTS,
    QA_DATASETS,
    Retriever,
    SearchConfig,
    SearchEnv,
    SearchTool,
    format_passages,
    load_qa,
)
from .reward import exact_match, f1_score, normalize_answer, substring_match

__all__ = ["INVALID_ACTION_REPLY", "NO_RESULTS", "QA_DATASETS", "Retriever", "SearchConfig",
           "SearchEnv", "SearchTool", "exact_match", "f1_score", "format_passages", "load_qa",
           "normalize_answer", "substring_match"]
