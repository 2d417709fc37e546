"""Search-R1 warm-start traces of the ``search`` task, played against the REAL search env and retriever.

Each trace is what a careful searcher would do with what the retriever actually returns
(Search-R1 format, Jin et al. 2025, arXiv:2503.09516):

1. ``<search> question </search>`` → the real ``<information>`` block;
2. a golden answer occurs in that block → ``<answer> A </answer>`` with ``A`` the answer **as written there**
   (copied span, original case; scored EM 1 by the env);
3. otherwise, for a ``second_search_fraction`` share of such misses, a second search whose
   query is the question without the words of the first passage's title
   (:func:`reformulated_query`: look elsewhere), then step 2 on the new block;
4. a yes/no golden answer (comparison questions) → ``<answer> yes|no</answer>``: no passage
   holds it, as in Search-R1's own traces;
5. still no golden answer in the retrieved text → ``<answer>`` + the title of the last passage
   read (copied from the retrieved text too; right only when the title is the answer).

Tags are written with spaces inside, as in Search-R1's prompt (``<search> query </search>``): the
first word of a copied question or span then has the same leading-space token as in the text it
is copied from (a byte-level BPE tokenises ``" who"`` and ``"who"`` differently).

So every answer is copied from retrieved text, never recalled from the golden answers; the
policy learns the format and to copy, and RL has real decisions left (search again or answer,
which span to copy). Traces are only ever made from training rows (the task passes them).
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from environments.data import DEFAULT_DATA_DIR

from ...warmstart.traces import Trace, TraceError, play_traces

#: A short search prompt template for tiny models (``SearchConfig.prompt_template``).
SHORT_SEARCH_PROMPT = "Search with <search>, answer in <answer>.\nQuestion: {question}\n"

_INFORMATION = re.compile(r"<information>(.*?)</information>", re.DOTALL)
# a title may hold balanced parentheses followed by a space ("26th (Cameronian) Regiment of Foot");
# an unbalanced one falls back to the shortest title
_TITLE = re.compile(r"Doc \d+\(Title: ((?:[^()\n]|\([^()\n]*\))*?|.*?)\) ")


def information_text(observation: str) -> str:
    """The text inside the observation's ``<information>`` block(s) (``""`` when there is none)."""
    return "\n".join(_INFORMATION.findall(observation))


def copied_answer(observation: str, golden_answers: Sequence[str]) -> str | None:
    """A golden answer as it is written in the retrieved text, or None when none occurs there.

    Every golden answer is looked for case-insensitively at word boundaries inside the
    ``<information>`` block; the earliest occurrence wins and is returned with the block's own
    spelling (so the env's exact match scores it 1: SQuAD normalisation lowercases).

    Args:
        observation: the env's observation after a search.
        golden_answers: the row's ``golden_answers``.

    Returns:
        The copied span, or None.
    """
    from environments.search.reward import normalize_answer

    text = information_text(observation)
    best: tuple[int, str] | None = None
    for gold in golden_answers:
        g = gold.strip()
        if not normalize_answer(g):
            continue
        m = re.search(rf"(?<!\w){re.escape(g)}(?!\w)", text, re.IGNORECASE)
        if m and (best is None or m.start() < best[0]):
            best = (m.start(), m.group(0))
    return None if best is None else best[1]


def first_title(observation: str) -> str | None:
    """The title of the first passage of the observation (``Doc 1(Title: T) ...``), or None."""
    m = _TITLE.search(information_text(observation))
    return m.group(1).strip() if m and m.group(1).strip() else None


def yes_no(golden_answers: Sequence[str]) -> str | None:
    """``"yes"`` / ``"no"`` when the first golden answer is one of them (a comparison question,
    e.g. HotpotQA's "Are both X and Y ...?"), else None."""
    first = golden_answers[0].strip().lower() if golden_answers else ""
    return first if first in ("yes", "no") else None


def reformulated_query(question: str, observation: str) -> str:
    """A second query after a miss: the question without the words of the first passage's title.

    Words are compared after SQuAD normalisation (lowercase, no punctuation or articles). When
    nothing would be left, or the observation has no title, the question is returned unchanged.
    """
    from environments.search.reward import normalize_answer

    title = first_title(observation)
    q = question.strip()
    if title is None:
        return q
    drop = set(normalize_answer(title).split())
    kept = [w for w in q.split() if normalize_answer(w) not in drop]
    return " ".join(kept) if kept else q


def direct_guess(question: str) -> str:
    """An answer "from the head" for traces that do not search: the question's last word
    (punctuation stripped; the whole question if none is left). Almost never right, as a model
    of this size answering without retrieval."""
    words = [w.strip(".,;:!?\"'()") for w in question.split()]
    words = [w for w in words if w]
    return words[-1] if words else question.strip()


def search_r1_traces(samples: Sequence[Mapping[str, Any]], env_factory: Callable[[], Any], *,
                     second_search_fraction: float = 0.5, tool_use_fraction: float = 1.0, seed: int = 0,
                     keep_misses: bool = True, progress: bool = False) -> list[Trace]:
    """Search-R1 traces of ``samples`` played through a real ``SearchEnv`` (module docstring).

    Args:
        samples: training rows ``{"id", "question", "golden_answers"}`` (never held-out rows).
        env_factory: ``() -> SearchEnv``; one env serves all samples and is closed at the end.
        second_search_fraction: share in [0, 1] of first-search misses that search again.
        tool_use_fraction: share in [0, 1] of traces that search at all; the others answer at
            once with :func:`direct_guess` (ReTool's point: RL then has the decision to use the
            tool left to learn).
        seed: seeds the choice of which misses search again.
        keep_misses: keep the traces of rows whose retrieved text never held a golden answer
            (answered with a title, step 5); False drops them, so every searching trace answers
            with a golden answer (copied, or yes/no).
        progress: show a tqdm bar.

    Returns:
        One :class:`Trace` per sample with a usable golden answer (rows whose golden answers
        all normalise to ``""`` are skipped; misses too unless ``keep_misses``), in order;
        actions and observations alternate and the last piece is the ``<answer>`` action.

    Raises:
        ValueError: ``second_search_fraction`` outside [0, 1].
        TraceError: the env did not run a search, did not end the episode on the answer, or
            scored a copied golden answer below 1.
        KeyError: a sample lacks ``question`` / ``golden_answers``.
    """
    from environments.search.reward import normalize_answer

    for name, share in (("tool_use_fraction", tool_use_fraction),
                        ("second_search_fraction", second_search_fraction)):
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"search_r1_traces: {name}={share!r} must be in [0, 1]")
    rng = random.Random(seed)

    def search(env: Any, sid: Any, query: str, pieces: list[tuple[str, str]]) -> str:
        action = f"<search> {query}</search>"
        obs, _, term, trunc, info = env.step(action)
        if term or trunc or not info.get("tool"):
            raise TraceError(f"sample {sid!r}: the search {action!r} was not executed (info={info})")
        pieces += [("action", action), ("observation", obs)]
        return obs

    def play(env: Any, s: Mapping[str, Any]) -> Trace | None:
        sid, question, golden = s.get("id"), str(s["question"]).strip(), list(s["golden_answers"])
        prompt, _ = env.reset(options={"sample": dict(s)})
        if rng.random() >= tool_use_fraction:  # answer from the head, without searching
            final = f"<answer> {direct_guess(question)}</answer>"
            _, _, term, _, _ = env.step(final)
            if not term:
                raise TraceError(f"sample {sid!r}: the direct answer {final!r} did not end the episode")
            return Trace(prompt, [("action", final)])
        pieces: list[tuple[str, str]] = []
        obs = search(env, sid, question, pieces)
        answer = copied_answer(obs, golden)
        if answer is None and rng.random() < second_search_fraction:
            obs = search(env, sid, reformulated_query(question, obs), pieces)
            answer = copied_answer(obs, golden)
        copied = answer is not None
        if answer is None and yes_no(golden):  # a comparison question: no text holds its answer
            answer, copied = yes_no(golden), True
        if answer is None and not keep_misses:
            return None
        if answer is None:
            answer = first_title(obs) or question
        final = f"<answer> {answer}</answer>"
        _, reward, term, _, info = env.step(final)
        if not term:
            raise TraceError(f"sample {sid!r}: the answer {final!r} did not end the episode")
        if copied and reward < 1.0:
            raise TraceError(f"sample {sid!r}: copied golden answer {answer!r} scored {reward} "
                             f"(components {info.get('reward_components')})")
        return Trace(prompt, [*pieces, ("action", final)])

    # a row whose golden answers all normalise to "" (e.g. NQ test_1420: "---") can never be
    # answered correctly (environments/search/reward.py), so it gives no trace
    usable = [s for s in samples if any(normalize_answer(g) for g in s["golden_answers"])]
    return play_traces(usable, env_factory, play, progress=progress, desc="search-r1 traces")


def search_r1_samples(datasets: Iterable[str] = ("nq", "hotpotqa"), *, n: int | None = None,
                      seed: int = 0, offset: int = 0, data_dir: str = DEFAULT_DATA_DIR
                      ) -> list[dict[str, Any]]:
    """Questions of the shared QA sets (``<data_dir>/qa/<name>.jsonl``), shuffled with ``seed``.

    Rows of all ``datasets`` are pooled, ids are prefixed with the dataset name
    (``"nq/test_3283"``: ids of different sets may collide), the pool is shuffled with
    ``random.Random(seed)``, and rows ``[offset, offset + n)`` are returned (all from
    ``offset`` if ``n`` is None). Disjoint ranges give disjoint train / held-out splits.

    Returns:
        Dicts ``{"id", "question", "golden_answers": [str, ...], "data_source"}``.

    Raises:
        FileNotFoundError / ValueError: a missing or malformed data file (from
            :func:`environments.search.env.load_qa`); ValueError on negative ``n`` / ``offset``
            or a range past the end of the pool.
    """
    from environments.search.env import load_qa

    if offset < 0 or (n is not None and n < 0):
        raise ValueError(f"search_r1_samples: n={n!r} and offset={offset!r} must be >= 0")
    pool = []
    for name in datasets:
        for row in load_qa(name, data_dir):
            pool.append({**row, "id": f"{name}/{row['id']}", "data_source": name})
    random.Random(seed).shuffle(pool)
    end = len(pool) if n is None else offset + n
    if end > len(pool):
        raise ValueError(f"search_r1_samples: offset={offset} + n={n} exceeds the {len(pool)} "
                         f"questions of {tuple(datasets)}")
    return pool[offset:end]


__all__ = ["SHORT_SEARCH_PROMPT", "copied_answer", "direct_guess", "first_title", "information_text",
           "reformulated_query", "search_r1_samples", "search_r1_traces", "yes_no"]
