"""``SearchEnv``: Search-R1-style multi-turn QA with a retriever tool."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from ..base import EnvLimits, RegexTool, ToolEnv, ToolSchema, check_prompt_template, with_overrides
from ..data import DEFAULT_DATA_DIR, load_jsonl, resolve_data_path
from ..errors import InfrastructureError
from ..tool_formats import call_format
from .reward import exact_match, f1_score, substring_match

PROMPT = (
    "Answer the given question. You must conduct reasoning inside <think> and </think> first "
    "every time you get new information. After reasoning, if you find you lack some "
    "knowledge, you can call a search engine by <search> query </search> and it will return "
    "the top searched results between <information> and </information>. You can search as "
    "many times as your want. If you find no further external knowledge needed, you can "
    "directly provide the answer inside <answer> and </answer>, without detailed "
    "illustrations. For example, <answer> Beijing </answer>. Question: {question}\n"
)
#: Default prompt in the native tool-call formats (the chat template shows the search tool's schema).
NATIVE_PROMPT = (
    "Answer the given question. You must conduct reasoning inside <think> and </think> first "
    "every time you get new information. After reasoning, if you find you lack some "
    "knowledge, you can call the search tool and it will return the top searched results. You "
    "can search as many times as your want. If you find no further external knowledge needed, "
    "you can directly provide the answer inside <answer> and </answer>, without detailed "
    "illustrations. For example, <answer> Beijing </answer>. Question: {question}\n"
)
#: Invalid-action reply in the native tool-call formats.
NATIVE_INVALID_ACTION_REPLY = (
    "\nMy previous action is invalid. If I want to search, I should call the search tool. If I "
    "want to give the final answer, I should put the answer between <answer> and </answer>. "
    "Let me try again.\n"
)
INVALID_ACTION_REPLY = (
    "\nMy previous action is invalid. If I want to search, I should put the query between "
    "<search> and </search>. If I want to give the final answer, I should put the answer "
    "between <answer> and </answer>. Let me try again.\n"
)
ANSWER_PATTERN = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
QA_DATASETS = ("nq", "triviaqa", "popqa", "bamboogle", "hotpotqa", "2wikimultihopqa", "musique")


@runtime_checkable
class Retriever(Protocol):
    """What the search tool needs: the retriever client's ``retrieve`` method.

    ``retrieve(queries, topk)`` returns, per query, up to ``topk`` hits (possibly none)
    ``{"document": {"id": str, "contents": '"Title"\\ntext'}, "score": float}``, best first
    (``retriever.client.RetrieverClient`` implements it).
    """

    def retrieve(self, queries: Sequence[str], topk: int | None = None
                 ) -> list[list[dict[str, Any]]]:
        """Hits per query."""


NO_RESULTS = "No results found for this query."
#: The search tool's JSON schema (native tool-call formats).
SEARCH_SCHEMA = ToolSchema(
    name="search",
    description=("Search a Wikipedia corpus and return the top passages for the query, as lines "
                 "'Doc i(Title: T) text'."),
    parameters={"type": "object",
                "properties": {"query": {"type": "string", "description": "The search query."}},
                "required": ["query"]})


def format_passages(hits: Sequence[Mapping[str, Any]]) -> str:
    """Search-R1 rendering: ``Doc i(Title: T) text`` lines for hits with contents
    ``"Title"\\ntext``; :data:`NO_RESULTS` when ``hits`` is empty (the retriever found
    nothing, e.g. a BM25 query with no indexed term: stop words only, unknown words)."""
    if not hits:
        return NO_RESULTS
    lines = []
    for i, hit in enumerate(hits, 1):
        contents = str(hit["document"]["contents"])
        title, _, text = contents.partition("\n")
        lines.append(f"Doc {i}(Title: {title.strip().strip(chr(34))}) {text.strip()}")
    return "\n".join(lines)


def information_block(content: str) -> str:
    """The Search-R1 observation around ``content``: ``"\\n\\n<information>" + content +
    "</information>\\n\\n"``."""
    return f"\n\n<information>{content}</information>\n\n"


class SearchTool(RegexTool):
    """``<search>query</search>`` → ``<information>Doc 1(Title: …) …</information>``.

    A search with no hits renders ``<information>`` + :data:`NO_RESULTS` +
    ``</information>``. A query the retriever rejects (HTTP 4xx, e.g. too long: the policy's
    doing) is rendered as an observation and the episode goes on. A retriever that does not
    answer (connection errors, timeouts, 5xx after the client's retries) is an infrastructure
    failure: :class:`~environments.errors.InfrastructureError` is raised, so the episode is
    never trained on or scored as a wrong answer.

    Natively (:data:`SEARCH_SCHEMA`): ``search(query)``, answered with the passages without the
    ``<information>`` tags (:meth:`content`).
    """

    name = "search"
    pattern = re.compile(r"<search>(.*?)</search>", re.DOTALL)
    schema = SEARCH_SCHEMA
    payload_argument = "query"

    def __init__(self, retriever: Retriever, topk: int = 3) -> None:
        self.retriever, self.topk = retriever, topk

    def run(self, payload: str) -> list[dict[str, Any]] | str:
        """Hits for the stripped query, or an error string for a query the retriever rejects.

        Raises:
            InfrastructureError: the retriever failed (anything but a rejected request).
        """
        from retriever.client import RetrieverRequestError

        query = payload.strip()
        if not query:
            return "empty search query"
        try:
            return self.retriever.retrieve([query], topk=self.topk)[0]
        except RetrieverRequestError as e:  # a bad query: the model sees why
            return f"search failed: {e.message}"
        except Exception as e:
            raise InfrastructureError(f"retriever failed: {type(e).__name__}: {e}") from e

    def content(self, result: list[dict[str, Any]] | str) -> str:
        """The passages (:func:`format_passages`), :data:`NO_RESULTS` or the error text."""
        return result if isinstance(result, str) else format_passages(result)

    def render(self, result: list[dict[str, Any]] | str) -> str:
        """The Search-R1 ``<information>`` block (hits, :data:`NO_RESULTS` or the error)."""
        return information_block(self.content(result))


#: Largest ``topk`` a search may ask for (the retriever server's default ``max_topk``).
MAX_TOPK = 100


@dataclass(frozen=True)
class SearchConfig:
    """Settings of :class:`SearchEnv` (validated).

    Attributes:
        dataset: one of ``QA_DATASETS`` (file ``qa/<name>.jsonl``) or a JSONL path; rows
            ``{"id", "question", "golden_answers": [str, ...]}``; ``None`` for no dataset.
        data_dir: data root (empty: ``$COPC_DATA_DIR``, else the repository's ``data/``; relative
            paths: from the current working directory).
        limit: read at most this many rows.
        retriever_url: server URL used when no retriever object is passed.
        topk: passages per search (Search-R1 default 3).
        reward: ``"em"`` (exact match), ``"substring_em"`` or ``"f1"``.
        format_score: the reward floor of an episode that ends with a well-formed ``<answer>``,
            in ``[0, 1)``: reward ``= format_score + (1 − format_score) · metric`` when answered,
            0 when not (Search-R1's ``compute_score_em(format_score=…)``, ``qa_em.py``: a wrong
            answer in the format scores ``format_score``, a right one 1; here also for F1's
            partial credit). Default 0: the reward is the metric itself.
        limits: :class:`EnvLimits`; ``max_turns`` default 4 (Search-R1).
        prompt_template: ``str.format`` template with ``{question}`` (left at the default
            :data:`PROMPT`, the native formats use :data:`NATIVE_PROMPT`).
        tool_format: ``tags`` (Search-R1 ``<search>`` → ``<information>``) | ``hermes`` |
            ``openai`` (``search(query)`` in JSON calls; the answer stays ``<answer>...</answer>``).
    """

    dataset: str | None = None
    data_dir: str = DEFAULT_DATA_DIR
    limit: int | None = None
    retriever_url: str = "http://127.0.0.1:8000"
    topk: int = 3
    reward: str = "em"
    format_score: float = 0.0
    limits: EnvLimits = field(default_factory=lambda: EnvLimits(max_turns=4, max_tool_calls=4))
    prompt_template: str = PROMPT
    tool_format: str = "tags"

    def __post_init__(self) -> None:
        call_format(self.tool_format, "SearchConfig")
        if self.reward not in ("em", "substring_em", "f1"):
            raise ValueError(f"SearchConfig.reward={self.reward!r}: em | substring_em | f1")
        if isinstance(self.format_score, bool) or not isinstance(self.format_score, int | float) \
                or not 0.0 <= self.format_score < 1.0:
            raise ValueError(f"SearchConfig.format_score={self.format_score!r}: must be a number in [0, 1)")
        if isinstance(self.topk, bool) or not isinstance(self.topk, int) \
                or not 1 <= self.topk <= MAX_TOPK:
            raise ValueError(f"SearchConfig.topk={self.topk!r}: must be an int in [1, {MAX_TOPK}] "
                             "(the retriever server's default max_topk)")
        check_prompt_template("SearchConfig", self.prompt_template, "question")


def load_qa(dataset: str, data_dir: str = DEFAULT_DATA_DIR, limit: int | None = None
            ) -> list[dict[str, Any]]:
    """Load a QA set by name (``nq``, ``hotpotqa``, ...) or JSONL path.

    Raises:
        FileNotFoundError / ValueError: missing file, bad line, or ``golden_answers`` not a
            list of strings (message gives the line).
    """
    rel = f"qa/{dataset}.jsonl" if dataset in QA_DATASETS else dataset
    path = resolve_data_path(Path(rel), data_dir)
    rows = load_jsonl(path, ("id", "question", "golden_answers"), limit)
    for i, r in enumerate(rows, 1):
        ga = r["golden_answers"]
        if not isinstance(ga, list) or not all(isinstance(a, str) for a in ga):
            raise ValueError(f"{path}: row {i} ({r['id']!r}): golden_answers must be a list of "
                             f"str, got {ga!r}")
    return rows


class SearchEnv(ToolEnv):
    """Search-R1 env: ``<search>`` calls the retriever, ``<answer>`` ends the episode.

    An action with neither tag gets Search-R1's invalid-action reply. The reward (EM,
    substring EM or F1 against any golden answer) is computed on the final ``<answer>``,
    which is parsed from the model's text only. Keyword overrides are :class:`SearchConfig`
    fields. ``tool_format: hermes`` / ``openai``: ``search(query)`` is called in JSON
    (:data:`SEARCH_SCHEMA`), the answer is still ``<answer>...</answer>``.

    Args:
        config: :class:`SearchConfig`.
        retriever: object with ``retrieve(queries, topk)`` (e.g.
            ``retriever.client.RetrieverClient``); default: a client for
            ``config.retriever_url``.
        samples: rows instead of ``config.dataset``.
    """

    stop_strings = ("</search>", "</answer>")
    answer_stop_strings = ("</answer>",)

    def __init__(self, config: SearchConfig | None = None, retriever: Retriever | None = None,
                 samples: Sequence[Mapping[str, Any]] | None = None, **overrides: Any) -> None:
        cfg = config or SearchConfig()
        if overrides:
            cfg = with_overrides(cfg, overrides)
        self.config = cfg
        if samples is None and cfg.dataset is not None:
            samples = load_qa(cfg.dataset, cfg.data_dir, cfg.limit)
        self._own_retriever = retriever is None
        if retriever is None:
            from retriever.client import ClientConfig, RetrieverClient

            retriever = RetrieverClient(ClientConfig(url=cfg.retriever_url, topk=cfg.topk))
        if not isinstance(retriever, Retriever):
            raise TypeError(f"retriever must have a retrieve(queries, topk) method, got "
                            f"{type(retriever).__name__}")
        self.retriever = retriever
        self.search = SearchTool(retriever, cfg.topk)
        native = cfg.tool_format != "tags"
        super().__init__([self.search], cfg.limits, samples,
                         invalid_action_reply=NATIVE_INVALID_ACTION_REPLY if native else INVALID_ACTION_REPLY,
                         tool_format=cfg.tool_format)

    def build_prompt(self, sample: Mapping[str, Any]) -> str:
        """Search-R1 instruction with the question."""
        if "question" not in sample:
            raise ValueError(f"QA sample {sample.get('id')!r} has no 'question' field")
        q = str(sample["question"]).strip()
        if not q.endswith("?"):
            q += "?"
        template = self.config.prompt_template
        if self.tool_format != "tags" and template == PROMPT:
            template = NATIVE_PROMPT
        return template.format(question=q)

    def extract_answer(self, action: str) -> str | None:
        """Content of the last ``<answer>...</answer>`` in the action."""
        found = ANSWER_PATTERN.findall(action)
        return found[-1].strip() if found else None

    def score(self, sample: Mapping[str, Any], response: str, answer: str | None,
              tool_calls: int) -> tuple[float, dict[str, float]]:
        """EM / substring EM / F1 of ``answer`` against ``sample["golden_answers"]`` (the
        components; a missing answer scores 0 on each); the reward is the configured metric, lifted
        to ``format_score + (1 − format_score) · metric`` when there is an answer."""
        golden = sample.get("golden_answers")
        if not isinstance(golden, list | tuple):
            raise ValueError(f"QA sample {sample.get('id')!r}: golden_answers must be a list")
        if answer is None:
            comps = {"em": 0.0, "substring_em": 0.0, "f1": 0.0, "has_answer": 0.0}
        else:
            comps = {"em": exact_match(answer, golden),
                     "substring_em": substring_match(answer, golden),
                     "f1": f1_score(answer, golden), "has_answer": 1.0}
        floor = float(self.config.format_score)
        reward = comps[self.config.reward]
        return (floor + (1.0 - floor) * reward if answer is not None else reward), comps

    def close(self) -> None:
        """Close the retriever client if the env created it."""
        if self._own_retriever and hasattr(self.retriever, "close"):
            self.retriever.close()
