"""The ``search`` task: Search-R1 question answering against a retriever server.

Data: ``task.train_data`` QA sets (default ``[nq, hotpotqa]``, ``<data dir>/qa/<name>.jsonl``);
evaluation on ``task.eval_data`` (default: the training sets): when those are among the
training sets, every ``task.settings.held_out_every``-th row of each is held out (deterministic,
disjoint), else the other sets are read; any training row with a held-out id or question text is
dropped. Service: a BM25 retriever server started on 127.0.0.1 (index of
``task.settings.retriever_corpus`` built on first use in ``task.settings.retriever_index_dir``,
reused after), unless ``task.settings.retriever_url`` names a running one; the Ray rollout workers
are handed its URL (:meth:`SearchTask.worker_settings`) and ``copc eval`` gets the
``--retriever-url`` option (:attr:`SearchTask.eval_options`). Warm start: ``search_r1`` traces.
"""

from __future__ import annotations

import itertools
import logging
import os
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import environments
from environments.data import data_root

from ..base import DrillPlan, EvalOption, Task
from .drills import query_drills, reading_drills, reservoir_sample
from .settings import SearchSettings
from .traces import search_r1_traces

if TYPE_CHECKING:
    import gymnasium

    from ...config import WarmStartConfig
    from ...config.specs import TaskSpec
    from ...warmstart.traces import Trace

log = logging.getLogger(__name__)

#: Corpus passages whose words make the query drills' pseudo-questions.
DRILL_PASSAGES = 4000
#: Corpus passages (a uniform sample of the whole corpus) the reading drills are made from.
READING_PASSAGES = 50_000
#: The corpus indexed when ``task.settings.retriever_corpus`` is empty, relative to the data directory.
DEFAULT_CORPUS = "wiki/corpus.jsonl"


def _question_key(question: str) -> str:
    """A question compared across rows: lowercased, whitespace collapsed."""
    return " ".join(str(question).lower().split())


def corpus_path(retriever_corpus: str, data_dir: str) -> Path:
    """The retriever corpus file: ``retriever_corpus`` (relative: to the current working
    directory), or, when empty, ``<data directory>/wiki/corpus.jsonl``.

    Args:
        retriever_corpus: ``task.settings.retriever_corpus``.
        data_dir: ``task.data_dir`` (see :func:`environments.data.data_root`).

    Returns:
        An absolute path (it need not exist).
    """
    if retriever_corpus:
        return Path(retriever_corpus).expanduser().resolve()
    return data_root(data_dir) / DEFAULT_CORPUS


class SearchTask(Task):
    """``search``: QA splits and a (possibly self-started) retriever server.

    ``info``: ``{"retriever_url": <base URL>}``. Settings: :class:`SearchSettings`.
    """

    warm_start_kinds = ("search_r1",)
    settings_class = SearchSettings
    settings: SearchSettings
    service_names = "the retriever"
    tokenizer_tags = ("<search>", "</search>", "<information>", "</information>", "<answer>", "</answer>",
                      "<think>", "</think>")
    eval_options = (EvalOption("--retriever-url", "retriever_url", "search benchmarks: an existing retriever",
                               service_url=True),)

    def __init__(self, spec: TaskSpec, env_id: str | None = None) -> None:
        super().__init__(spec, env_id)
        #: base URL of the retriever server (``task.settings.retriever_url`` until :meth:`start` sets it)
        self.retriever_url: str = self.settings.retriever_url

    def start(self) -> None:
        """Load the QA splits and start (or connect to) the retriever.

        Raises:
            FileNotFoundError / ValueError: a QA set is missing or malformed.
            RuntimeError / TimeoutError: the retriever server did not become healthy.
        """
        from environments.search.env import load_qa

        t = self.spec.task
        data_dir = str(data_root(t.data_dir))
        names = t.train_data or ["nq", "hotpotqa"]
        per_set = {n: [dict(r, id=f"{n}:{r['id']}", dataset=n) for r in load_qa(n, data_dir)] for n in names}
        eval_names = t.eval_data or names
        if set(eval_names) <= set(names):
            # held-out rows of the training sets: every held_out_every-th row of each evaluated set
            # (deterministic, disjoint from training)
            k = self.settings.held_out_every
            held_sets = [[r for i, r in enumerate(per_set[n]) if i % k == 0] for n in eval_names]
            # interleaved (nq, hotpotqa, nq, ...) so that a cap (eval.num_samples) keeps every set
            evals = [r for group in itertools.zip_longest(*held_sets) for r in group if r is not None]
        else:
            evals = [dict(r, id=f"{n}:{r['id']}", dataset=n)
                     for n in eval_names for r in load_qa(n, data_dir)]
        held = {r["id"] for r in evals}
        held_questions = {_question_key(r["question"]) for r in evals}
        # a training row asking a held-out question (same text, another id) is dropped too
        train = [r for n in names for r in per_set[n]
                 if r["id"] not in held and _question_key(r["question"]) not in held_questions]
        self.train_samples = self.cap_train(train)
        self.eval_samples = self.cap_eval(evals)
        self.start_services()

    def start_services(self) -> None:
        """Connect to ``task.settings.retriever_url``, or start a BM25 retriever server on the
        corpus; ``info["retriever_url"]``: its base URL.

        Raises:
            FileNotFoundError: the corpus does not exist (the message names it).
            RuntimeError / TimeoutError: the retriever server did not become healthy.
        """
        s = self.settings
        url = s.retriever_url
        if not url:
            corpus = corpus_path(s.retriever_corpus, self.spec.task.data_dir)
            if not corpus.is_file():
                raise FileNotFoundError(f"retriever corpus {str(corpus)!r} not found")
            url, stop = start_retriever(corpus, Path(s.retriever_index_dir).expanduser().resolve())
            self.add_closer(stop)
        self.retriever_url = url
        self.info = {**self.info, "retriever_url": url}

    def worker_settings(self) -> dict[str, Any]:
        """``task.settings`` for a Ray worker's copy: the retriever this task uses (started or
        given: ``retriever_url``, so a worker starts none) and absolute ``retriever_index_dir`` /
        non-empty ``retriever_corpus`` (a worker may run in another working directory)."""
        s = self.settings
        out = super().worker_settings()
        if self.retriever_url:
            out["retriever_url"] = self.retriever_url
        out["retriever_index_dir"] = str(Path(s.retriever_index_dir).expanduser().resolve())
        corpus = s.retriever_corpus
        out["retriever_corpus"] = str(Path(corpus).expanduser().resolve()) if corpus else ""
        return out

    def tokenizer_texts(self) -> Iterator[str]:
        """The base texts (training prompts, invalid-action reply), then every corpus passage
        rendered as the search tool renders a one-passage result (``<information>Doc 1(Title:
        T) text</information>``), so observations tokenise as compactly as the corpus allows.

        Raises:
            FileNotFoundError / CorpusFormatError (a ValueError): the corpus is missing or a line
                is not a valid passage (:func:`retriever.corpus.iter_corpus`).
        """
        from environments.search.env import format_passages, information_block
        from retriever.corpus import iter_corpus

        yield from super().tokenizer_texts()
        for passage in iter_corpus(corpus_path(self.settings.retriever_corpus, self.spec.task.data_dir)):
            yield information_block(format_passages([{"document": {"contents": passage.contents}}]))

    def drill_plan(self) -> DrillPlan | None:
        """``task.settings.drill_steps`` steps of ``drill_batch_size`` drills at ``drill_lr``
        (None when ``drill_steps`` is 0)."""
        s = self.settings
        return DrillPlan(s.drill_steps, s.drill_batch_size, s.drill_lr) if s.drill_steps else None

    def drill_traces(self, n: int, seed: int, reading_fraction: float | None = None) -> list[Trace]:
        """``n`` drills: query drills (:func:`~trainer.tasks.search.drills.query_drills`) of
        pseudo-questions made of random words of the retriever corpus, and a ``reading_fraction``
        (None: ``task.settings.reading_drill_fraction``) share of reading drills
        (:func:`~trainer.tasks.search.drills.reading_drills`: cloze questions about a uniform sample
        of :data:`READING_PASSAGES` corpus passages, searched for through the real retriever and
        answered with the span copied from what it returned; fewer, with a warning, when the corpus
        yields too few). Never a dataset question.

        Raises:
            FileNotFoundError / CorpusFormatError: the corpus is missing or malformed.
            TraceError: the env did not play a drill as scripted.
        """
        from retriever.corpus import iter_corpus

        corpus = corpus_path(self.settings.retriever_corpus, self.spec.task.data_dir)
        if reading_fraction is None:
            reading_fraction = self.settings.reading_drill_fraction
        n_read = round(n * reading_fraction)
        words = [w for p in itertools.islice(iter_corpus(corpus), DRILL_PASSAGES) for w in p.contents.split()]
        drills = query_drills(words, n - n_read, self.make_env, seed=seed)
        if n_read:  # passages drawn from the whole corpus in one pass (a large corpus is never held)
            sample = reservoir_sample(iter_corpus(corpus), READING_PASSAGES, random.Random(seed))
            drills += reading_drills([(p.title, p.text) for p in sample], n_read, self.make_env, seed=seed)
        return drills

    def make_env(self) -> gymnasium.Env:
        """A ``SearchEnv`` querying the task's retriever, with ``task.env_kwargs``."""
        return environments.make(self.env_id, retriever_url=self.retriever_url, **self.env_kwargs)

    def warm_start_traces(self, ws: WarmStartConfig, *, progress: bool = True) -> list[Trace]:
        """``search_r1`` traces: the first ``ws.num_examples`` training questions not asked in
        ``eval_samples``, each searched for and answered with text copied from what the real
        retriever returned (:mod:`trainer.tasks.search.traces`).

        Args:
            ws: the ``warm_start`` section. progress: show a progress bar.

        Returns:
            At most ``ws.num_examples`` traces (rows with no usable golden answer give none).

        Raises:
            ConfigError: ``ws.kind`` is not ``search_r1``.
            TraceError: the environment did not score a scripted trace as expected.
        """
        self.check_warm_start(ws)
        held = {_question_key(s["question"]) for s in self.eval_samples}
        samples = [s for s in self.train_samples if _question_key(s["question"]) not in held]
        samples = samples[:ws.num_examples]
        s = self.settings
        return search_r1_traces(samples, self.make_env, second_search_fraction=s.second_search_fraction,
                                tool_use_fraction=s.tool_use_fraction, seed=ws.seed,
                                keep_misses=s.keep_misses, progress=progress)


def start_retriever(corpus: Path, index_dir: Path, timeout_s: float = 180.0
                    ) -> tuple[str, Callable[[], None]]:
    """Start a BM25 retriever server on 127.0.0.1 (building the index on first use).

    Args:
        corpus: JSONL corpus path.
        index_dir: index directory (built if it has no ``meta.json``; reused otherwise).
        timeout_s: how long to wait for ``/health`` (seconds).

    Returns:
        ``(url, stop)``: the base URL and a function that stops the server.

    Raises:
        RuntimeError / TimeoutError: if the server exits or is not healthy in time (the
            message includes the server's output, also kept in ``<index_dir>/../server-*.log``).
    """
    from retriever.launch import ensure_bm25_index, start_server

    log.info("retriever: BM25 index of %s in %s", corpus, index_dir)
    ensure_bm25_index(corpus, index_dir, show_progress=True)
    server = start_server(index_dir, timeout_s=timeout_s,
                          log_path=index_dir.parent / f"server-{os.getpid()}.log")
    return server.url, server.stop


__all__ = ["DEFAULT_CORPUS", "SearchTask", "corpus_path", "start_retriever"]
