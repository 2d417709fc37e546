"""Search-R1 warm-start traces (trainer.tasks.search.traces) against the REAL SearchEnv and a
real BM25 retriever server over the shared Wikipedia corpus, and the search task's held-out split.

Hand-computed unit tests of the copy / title / reformulation helpers come first (no server); the
trace tests replay every trace through a fresh env, re-query the retriever for every
``<information>`` block and check that no held-out question was turned into a trace.
"""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

import pytest
from search_server import QA_DIR, retriever_url  # noqa: F401 - pytest fixture (tests/trainer on sys.path)

from environments.search.env import (
    ANSWER_PATTERN,
    INVALID_ACTION_REPLY,
    NO_RESULTS,
    SearchEnv,
    SearchTool,
    format_passages,
    information_block,
    load_qa,
)
from environments.search.reward import exact_match, f1_score, substring_match
from retriever.client import ClientConfig, RetrieverClient
from trainer.config import ConfigError, load_config
from trainer.config.specs import task_spec
from trainer.tasks import build_task
from trainer.tasks.search.drills import query_drills
from trainer.tasks.search.traces import (
    copied_answer,
    direct_guess,
    first_title,
    information_text,
    reformulated_query,
    search_r1_traces,
    yes_no,
)

CONFIGS = Path(__file__).parent.resolve().parents[2] / "configs"
CPU_TINY = CONFIGS / "search" / "cpu_tiny.yaml"
N_TASK_TRACES = 120  # traces made through SearchTask.warm_start_traces
N_ROWS = 40          # training rows for the second_search_fraction tests


def block(*passages: tuple[str, str]) -> str:
    """The env's observation for retrieved ``(title, text)`` passages (its own renderer)."""
    return information_block(format_passages(
        [{"document": {"id": str(i), "contents": f'"{t}"\n{x}'}} for i, (t, x) in enumerate(passages)]))


def _key(question: str) -> str:
    return " ".join(question.lower().split())


# -- helpers, hand-computed ----------------------------------------------------------------------

def test_block_rendering_used_below():
    assert block(("Abbey Road", "An album by The Beatles.")) == (
        "\n\n<information>Doc 1(Title: Abbey Road) An album by The Beatles.</information>\n\n")


def test_information_text_only_inside_the_blocks():
    obs = "before <information>one</information> between <information>two\nlines</information> after"
    assert information_text(obs) == "one\ntwo\nlines"
    assert information_text("no block here") == "" and information_text(INVALID_ACTION_REPLY) == ""


def test_copied_answer_keeps_the_spelling_of_the_block():
    obs = block(("Abbey Road", "Abbey Road is the eleventh studio album by The Beatles."))
    assert copied_answer(obs, ["the beatles"]) == "The Beatles"
    assert copied_answer(obs, ["ABBEY ROAD"]) == "Abbey Road"     # the title is retrieved text too
    assert copied_answer(obs, ["  the beatles  "]) == "The Beatles"  # the gold is stripped first


def test_copied_answer_matches_whole_words_only():
    assert copied_answer(block(("Cafe", "A Parisian cafe.")), ["Paris"]) is None
    # "Parisian" comes first, "Paris" (before a full stop) is the match
    obs = block(("Cafe", "A Parisian cafe in Paris."))
    assert copied_answer(obs, ["paris"]) == "Paris"
    assert information_text(obs) == "Doc 1(Title: Cafe) A Parisian cafe in Paris."
    assert copied_answer(block(("X", "born 1969a, died 1969")), ["1969"]) == "1969"
    assert copied_answer(block(("X", "the 1969a model")), ["1969"]) is None
    # regex characters in a golden answer are literal
    assert copied_answer(block(("X", "costs $5.00 (US) today")), ["$5.00 (US)"]) == "$5.00 (US)"
    assert copied_answer(block(("X", "costs $5a00 today")), ["$5.00"]) is None


def test_copied_answer_earliest_occurrence_wins():
    obs = block(("Move", "She was born in London and moved to Paris, then back to LONDON."))
    assert copied_answer(obs, ["Paris", "london"]) == "London"
    assert copied_answer(obs, ["paris"]) == "Paris"
    # across passages: the earliest in the block
    obs2 = block(("A", "nothing here"), ("B", "Rome then Paris"))
    assert copied_answer(obs2, ["paris", "rome"]) == "Rome"


def test_copied_answer_skips_golds_normalising_to_empty_and_needs_a_block():
    obs = block(("Dash", "the --- sign, then Paris"))
    assert copied_answer(obs, ["---", "the", "Paris"]) == "Paris"   # "---" and "the" occur first
    assert copied_answer(obs, ["---", "the", " "]) is None
    assert copied_answer("Paris is in France", ["Paris"]) is None   # no <information> block
    assert copied_answer("Paris <information>Doc 1(Title: X) Lyon</information>", ["Paris"]) is None
    assert copied_answer(block(("X", "Paris")), []) is None


def test_first_title():
    assert first_title(block(("Abbey Road", "An album."), ("Let It Be", "Another."))) == "Abbey Road"
    # a title with parentheses (in the corpus: "26th (Cameronian) Regiment of Foot")
    assert first_title(block(("26th (Cameronian) Regiment of Foot", "A regiment (infantry) of the army."))) \
        == "26th (Cameronian) Regiment of Foot"
    assert first_title(block(("Queen (band)", "A British rock band."))) == "Queen (band)"
    assert first_title(information_block(NO_RESULTS)) is None
    assert first_title("Doc 1(Title: Outside) a block") is None
    assert first_title(INVALID_ACTION_REPLY) is None


def test_reformulated_query_drops_the_title_words():
    obs = block(("Abbey Road", "An album by The Beatles."))
    assert reformulated_query("Who produced the album Abbey Road?", obs) == "Who produced the album"
    assert reformulated_query("who produced abbey road, the album", obs) == "who produced the album"
    # a word is dropped only when it normalises to a title word: "road's" -> "roads" stays
    assert reformulated_query("who produced abbey road's B side", obs) == "who produced road's B side"
    # normalised comparison: the title's article is not a title word, punctuation and case ignored
    beatles = block(("The Beatles", "An English rock band."))
    assert reformulated_query("who sang for The Beatles?", beatles) == "who sang for The"
    assert reformulated_query("  when did the BEATLES, split  ", beatles) == "when did the split"


def test_reformulated_query_falls_back_to_the_question():
    obs = block(("Abbey Road", "An album."))
    assert reformulated_query("Abbey road?", obs) == "Abbey road?"            # nothing would be left
    assert reformulated_query(" who won? ", information_block(NO_RESULTS)) == "who won?"   # no title
    assert reformulated_query("who won?", INVALID_ACTION_REPLY) == "who won?"


# -- config ----------------------------------------------------------------------------------------

@pytest.mark.parametrize(("override", "key"), [
    ("task.settings.second_search_fraction=2.0", "task.settings.second_search_fraction=2.0"),
    ("task.settings.second_search_fraction=-0.1", "task.settings.second_search_fraction=-0.1"),
    ("task.settings.held_out_every=1", "task.settings.held_out_every=1"),
    ("task.settings.held_out_every=0", "task.settings.held_out_every=0"),
    ("task.settings.reading_drill_fraction=1.5", "task.settings.reading_drill_fraction=1.5"),
    ("task.settings.keep_misses=maybe", "task.settings.keep_misses='maybe': must be a bool"),
    ("task.settings.drill_stepz=3", "task.settings.drill_stepz=3: unknown setting of SearchSettings"),
])
def test_config_errors_name_the_key(override, key):
    """The search task's own settings are checked by its settings dataclass when the task is
    constructed (cheap, nothing started), one line naming the key."""
    from trainer.tasks import SearchTask

    with pytest.raises(ConfigError) as ei:
        SearchTask(task_spec(load_config(CPU_TINY, [override])))
    assert key in str(ei.value)


@pytest.mark.parametrize("old", ["warm_start.second_search_fraction=0.3", "task.held_out_every=4",
                                 "warm_start.keep_misses=false", "warm_start.drill_steps=10",
                                 "warm_start.reading_drill_fraction=0.5", "warm_start.tool_use_fraction=0.5",
                                 "task.retriever_url=http://127.0.0.1:9", "task.retriever_index_dir=idx",
                                 "task.retriever_corpus=c.jsonl"])
def test_old_spellings_are_refused_with_the_new_one(old):
    key, _, _ = old.partition("=")
    name = key.rpartition(".")[2]
    with pytest.raises(ConfigError) as ei:
        load_config(CPU_TINY, [old])
    msg = str(ei.value)
    assert msg.startswith(f"{key}: moved to task.settings.{name} ") and "'search'" in msg and "\n" not in msg


@pytest.mark.parametrize("name", ["retriever_url", "retriever_index_dir", "retriever_corpus"])
def test_old_retriever_keys_in_yaml_are_refused_and_the_new_ones_reach_the_task(tmp_path, name):
    from trainer.tasks import SearchTask

    old = tmp_path / "old.yaml"
    old.write_text(f"defaults: [{CPU_TINY}]\ntask:\n  {name}: x\n")
    with pytest.raises(ConfigError) as ei:
        load_config(old)
    assert str(ei.value) == (f"task.{name}: moved to task.settings.{name} (a setting of the task 'search'; "
                             f"write task: {{settings: {{{name}: ...}}}})")
    new = tmp_path / "new.yaml"
    new.write_text(f"defaults: [{CPU_TINY}]\ntask:\n  settings:\n    {name}: x\n")
    assert getattr(SearchTask(task_spec(load_config(new))).settings, name) == "x"
    with pytest.raises(ConfigError, match=rf"^task\.settings\.{name}='x': unknown setting of MathTool"):
        load_config(None, [f"task.settings.{name}=x"])  # the default task (math_tool) has no retriever


def test_cpu_tiny_config_values():
    from trainer.tasks import SearchTask

    cfg = load_config(CPU_TINY)
    settings = SearchTask(task_spec(cfg)).settings
    assert settings.held_out_every == 3 and settings.second_search_fraction == 0.5
    assert (settings.drill_steps, settings.drill_batch_size, settings.tool_use_fraction) == (1500, 32, 1.0)
    assert cfg.warm_start.kind == "search_r1" and cfg.eval.num_samples == 334


# -- the real task, env and retriever ---------------------------------------------------------------

@pytest.fixture(scope="module")
def task(retriever_url):  # noqa: F811
    """The cpu_tiny search task, connected to the test's retriever (it starts none itself)."""
    cfg = load_config(CPU_TINY, [f"task.settings.retriever_url={retriever_url}", f"task.data_dir={QA_DIR}"])
    with build_task(task_spec(cfg)) as t:
        assert t._closers == [] and t.retriever_url == retriever_url
        yield t


@pytest.fixture(scope="module")
def task_traces(task):
    ws = dataclasses.replace(load_config(CPU_TINY).warm_start, num_examples=N_TASK_TRACES)
    return task.warm_start_traces(ws, progress=False)


@pytest.fixture(scope="module")
def client(retriever_url):  # noqa: F811
    c = RetrieverClient(ClientConfig(url=retriever_url))
    yield c
    c.close()


def test_held_out_split_every_third_row_interleaved(task):
    nq, hq = load_qa("nq", str(QA_DIR)), load_qa("hotpotqa", str(QA_DIR))
    evals, train = task.eval_samples, task.train_samples
    assert len(evals) == 334 >= 256
    # every 3rd row of each set (rows 0, 3, 6, ...), interleaved nq, hotpotqa, nq, ...
    assert [r["id"] for r in evals[0::2]] == [f"nq:{r['id']}" for r in nq[::3]]
    assert [r["id"] for r in evals[1::2]] == [f"hotpotqa:{r['id']}" for r in hq[::3]]
    assert [r["dataset"] for r in evals] == ["nq", "hotpotqa"] * 167
    # disjoint by id and by question text; the training rows are all the others minus repeats
    assert not {r["id"] for r in train} & {r["id"] for r in evals}
    held_q = {_key(r["question"]) for r in evals}
    assert not {_key(r["question"]) for r in train} & held_q
    sets = {n: load_qa(n, str(QA_DIR)) for n in task.spec.task.train_data}
    others = [f"{n}:{r['id']}" for n, rows in sets.items()
              for i, r in enumerate(rows) if (i % 3 or n not in ("nq", "hotpotqa"))
              and _key(r["question"]) not in held_q]
    assert [r["id"] for r in train] == others and len(train) == 2191


def test_held_out_rule_on_hand_made_sets(tmp_path):
    """Every 3rd row of each set held out, interleaved with zip_longest (a, b, a, a); a training
    row asking a held-out question under another id (other case and spacing) is dropped too."""
    import json

    a = [{"id": f"a{i}", "question": f"question {i}", "golden_answers": [str(i)]} for i in range(7)]
    a[4]["question"] = "  QUESTION   0 "
    b = [{"id": f"b{i}", "question": f"other {i}", "golden_answers": ["x"]} for i in range(2)]
    for name, rows in (("a", a), ("b", b)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config(CPU_TINY, ["task.settings.retriever_url=http://127.0.0.1:9",
                                 f"task.data_dir={tmp_path}",
                                 "task.train_data=[a.jsonl, b.jsonl]", "task.eval_data=[a.jsonl, b.jsonl]",
                                 "eval.num_samples=100"])
    with build_task(task_spec(cfg)) as t:
        assert [r["id"] for r in t.eval_samples] == ["a.jsonl:a0", "b.jsonl:b0", "a.jsonl:a3", "a.jsonl:a6"]
        assert [r["id"] for r in t.train_samples] == ["a.jsonl:a1", "a.jsonl:a2", "a.jsonl:a5", "b.jsonl:b1"]


def test_task_traces_contain_no_held_out_question(task, task_traces):
    assert len(task_traces) == N_TASK_TRACES  # the first training rows all have usable golds
    env = task.make_env()
    try:
        held_prompts = {env.build_prompt(r) for r in task.eval_samples}
        # the traces are made from the first training rows, in order
        expected = [env.build_prompt(r) for r in task.train_samples[:N_TASK_TRACES]]
    finally:
        env.close()
    assert [t.prompt for t in task_traces] == expected
    held_q = [r["question"].strip() for r in task.eval_samples]
    for t in task_traces:
        assert t.prompt not in held_prompts
        question = t.prompt.partition("Question: ")[2].removesuffix("\n").removesuffix("?")
        assert not any(_key(question) == _key(q.removesuffix("?")) for q in held_q)
        for kind, text in t.pieces:
            if kind == "action":
                assert not any(_key(f"<search>{q}</search>") == _key(text) for q in held_q)


def _rows_of(task, traces):
    """The training rows the traces were made from (in order: the first usable ones)."""
    rows = task.train_samples[:len(traces)]
    env = task.make_env()
    try:
        assert [env.build_prompt(r) for r in rows] == [t.prompt for t in traces]
    finally:
        env.close()
    return rows


def check_trace(env, client, row, trace):
    """A trace is well formed for ``row``: it parses with the env's own parsers, its blocks are
    the retriever's answers, and replayed through the fresh ``env`` it ends with the same
    reward (1 when the answer was copied). Returns the number of searches."""
    pieces, golds, question = trace.pieces, row["golden_answers"], row["question"].strip()
    kinds = [k for k, _ in pieces]
    assert kinds in (["action", "observation", "action"],
                     ["action", "observation", "action", "observation", "action"])
    searches = [a for k, a in pieces[:-1] if k == "action"]
    observations = [o for k, o in pieces if k == "observation"]
    topk = env.config.topk
    for i, (action, obs) in enumerate(zip(searches, observations, strict=True)):
        m = SearchTool.pattern.fullmatch(action)
        assert m is not None and ANSWER_PATTERN.search(action) is None and env.extract_answer(action) is None
        query = m.group(1)
        assert query.startswith(" ")  # "<search> q</search>": the copied first word keeps its space
        query = query.strip()
        expected_query = question if i == 0 else reformulated_query(question, observations[0])
        assert query == expected_query
        assert obs == information_block(format_passages(client.retrieve([query.strip()], topk=topk)[0]))
    if len(searches) == 2:  # searched again only after a miss
        assert copied_answer(observations[0], golds) is None
    final = pieces[-1][1]
    assert ANSWER_PATTERN.fullmatch(final) and SearchTool.pattern.search(final) is None
    answer = env.extract_answer(final)
    copied = copied_answer(observations[-1], golds)
    metric = {"em": exact_match, "f1": f1_score, "substring_em": substring_match}[env.config.reward]
    if copied is not None:
        assert answer == copied and copied in information_text(observations[-1])
        expected_reward = 1.0
    elif yes_no(golds):  # a comparison question: answered yes / no, no passage holds it
        assert answer == yes_no(golds)
        expected_reward = 1.0
    else:
        assert answer == (first_title(observations[-1]) or question)
        expected_reward = metric(answer, golds)
    # replay through the fresh env
    prompt, _ = env.reset(options={"sample": dict(row)})
    assert prompt == trace.prompt
    for action, obs in zip(searches, observations, strict=True):
        got, reward, term, trunc, info = env.step(action)
        assert (got, reward, term, trunc, info["tool"]) == (obs, 0.0, False, False, "search")
    _, reward, term, trunc, info = env.step(final)
    assert term and not trunc and not info["invalid"] and info["final_answer"] == answer
    assert info["tool_calls"] == len(searches) and reward == expected_reward
    return len(searches)


def test_task_traces_are_well_formed_and_replay(task, task_traces, client):
    rows = _rows_of(task, task_traces)
    env = task.make_env()
    try:
        assert env.config.topk == 1
        n_searches = [check_trace(env, client, r, t) for r, t in zip(rows, task_traces, strict=True)]
    finally:
        env.close()
    copied = [copied_answer(t.pieces[-2][1], r["golden_answers"]) is not None
              for r, t in zip(rows, task_traces, strict=True)]
    # not vacuous: some answers are copied golds, some first searches missed
    assert 0 < sum(copied) < len(copied) and 1 in n_searches


@pytest.fixture(scope="module")
def rows(task):
    return task.train_samples[:N_ROWS]


def test_second_search_fraction_zero_and_one(task, rows, client):
    none = search_r1_traces(rows, task.make_env, second_search_fraction=0.0, seed=0)
    every = search_r1_traces(rows, task.make_env, second_search_fraction=1.0, seed=0)
    assert len(none) == len(every) == N_ROWS
    assert all(len(t.pieces) == 3 for t in none)
    misses = 0
    for row, t0, t1 in zip(rows, none, every, strict=True):
        first = t0.pieces[1][1]
        assert t1.pieces[:2] == t0.pieces[:2]       # the same first search and block
        if copied_answer(first, row["golden_answers"]) is None:
            misses += 1
            assert len(t1.pieces) == 5
            query = reformulated_query(row["question"].strip(), first)
            assert t1.pieces[2][1] == f"<search> {query}</search>"
        else:
            assert t1.pieces == t0.pieces
    assert 0 < misses < N_ROWS
    env = task.make_env()
    try:
        for row, t in itertools.chain(zip(rows, none, strict=True), zip(rows, every, strict=True)):
            check_trace(env, client, row, t)
    finally:
        env.close()


def test_second_search_fraction_half_seeded(task, rows):
    a = search_r1_traces(rows, task.make_env, second_search_fraction=0.5, seed=7)
    assert a == search_r1_traces(rows, task.make_env, second_search_fraction=0.5, seed=7)
    twice = [len(t.pieces) == 5 for t in a]
    misses = [copied_answer(t.pieces[1][1], r["golden_answers"]) is None
              for r, t in zip(rows, a, strict=True)]
    assert all(m for m, t in zip(misses, twice, strict=True) if t)   # only misses search again


def test_second_search_fraction_out_of_range(task, rows):
    for bad in (1.5, -0.5):
        with pytest.raises(ValueError, match=f"second_search_fraction={bad}"):
            search_r1_traces(rows, task.make_env, second_search_fraction=bad)


def test_rows_without_a_usable_golden_answer_give_no_trace(task, rows):
    unusable = dict(rows[0], id="x", golden_answers=["---", "the"])
    traces = search_r1_traces([unusable, rows[1]], task.make_env, second_search_fraction=0.0)
    assert len(traces) == 1 and rows[1]["question"].strip() in traces[0].prompt


def test_yes_no_and_direct_guess_by_hand():
    assert yes_no(["No"]) == "no" and yes_no([" yes "]) == "yes"
    assert yes_no(["Nobody"]) is None and yes_no([]) is None and yes_no(["Paris", "no"]) is None
    assert direct_guess("who wrote the book thief?") == "thief"
    assert direct_guess("When did 'Rent' open (on Broadway)?") == "Broadway"
    assert direct_guess("  ?! ") == "?!"


def test_query_drills_copy_pseudo_questions_never_repeat():
    words = ["alpha", "Beta", "gamma", "délta", "1969", "x-ray"]

    def env():
        return SearchEnv(retriever_url="http://127.0.0.1:9", prompt_template="Q: {question}\n")

    drills = query_drills(words, 200, env, seed=3)
    assert drills == query_drills(words, 200, env, seed=3) and drills != query_drills(words, 200, env, seed=4)
    assert len({d.prompt for d in drills}) == 200  # never-repeating sequences
    for d in drills:
        (kind, action), = d.pieces
        q = d.prompt[len("Q: "):-1]
        assert kind == "action" and action == f"<search> {q}</search>" and q.endswith("?")
        assert 4 <= len(q[:-1].split()) <= 18 and set(q[:-1].split()) <= set(words)
        assert SearchTool.pattern.fullmatch(action).group(1).strip() == q
    with pytest.raises(ValueError, match="need words"):
        query_drills([], 3, env)
    with pytest.raises(ValueError, match="min_words"):
        query_drills(words, 3, env, min_words=5, max_words=4)


def test_tool_use_fraction_zero_answers_directly_one_always_searches(task):
    rows = task.train_samples[:12]
    direct = search_r1_traces(rows, task.make_env, tool_use_fraction=0.0)
    guesses = [direct_guess(r["question"].strip()) for r in rows]
    assert [t.pieces for t in direct] == [[("action", f"<answer> {g}</answer>")] for g in guesses]
    searched = search_r1_traces(rows, task.make_env, tool_use_fraction=1.0)
    assert all(t.pieces[0][1].startswith("<search> ") for t in searched)
    mixed = search_r1_traces(task.train_samples[:200], task.make_env, tool_use_fraction=0.4, seed=1)
    share = sum(t.pieces[0][1].startswith("<search>") for t in mixed) / len(mixed)
    assert 0.3 < share < 0.5
    with pytest.raises(ValueError, match="tool_use_fraction"):
        search_r1_traces(rows, task.make_env, tool_use_fraction=1.5)


def test_search_task_drills_use_corpus_words_never_questions(task):
    drills = task.drill_traces(50, seed=0)
    assert len(drills) == 50 and drills == task.drill_traces(50, seed=0)
    questions = {_key(r["question"]) for r in task.train_samples + task.eval_samples}
    env = task.make_env()
    try:
        for d in drills:
            q = SearchTool.pattern.fullmatch(d.pieces[0][1]).group(1).strip()
            assert _key(q) not in questions
            sample = {"id": "x", "question": q, "golden_answers": []}
            assert d.prompt == env.reset(options={"sample": sample})[0]
    finally:
        env.close()


def test_base_task_has_no_drills():
    from trainer.config import ConfigError
    from trainer.tasks.base import Task

    cfg = load_config(CPU_TINY)
    cfg = dataclasses.replace(cfg, task=dataclasses.replace(cfg.task, settings={}))  # no search settings
    with pytest.raises(ConfigError, match=r"no copy drills \(task\.settings\.drill_steps"):
        Task(task_spec(cfg)).drill_traces(3, 0)
    assert Task(task_spec(cfg)).drill_plan() is None


def test_keep_misses_false_drops_title_answers_only(task):
    rows = task.train_samples[:N_ROWS]
    golden = {r["question"].strip().rstrip("?"): r["golden_answers"] for r in rows}

    def answered_gold(t) -> bool:  # the prompt ends with "Question: <question>" (cpu_tiny template)
        answer = ANSWER_PATTERN.search(t.pieces[-1][1]).group(1)
        return exact_match(answer, golden[t.prompt.rsplit("Question: ", 1)[1].strip().rstrip("?")]) == 1.0

    for tool_use in (1.0, 0.5):
        kept = search_r1_traces(rows, task.make_env, second_search_fraction=0.0, tool_use_fraction=tool_use)
        dropped = search_r1_traces(rows, task.make_env, second_search_fraction=0.0,
                                   tool_use_fraction=tool_use, keep_misses=False)
        searched = [t for t in dropped if t.pieces[0][1].startswith("<search>")]
        assert searched and all(answered_gold(t) for t in searched)
        # the same traces, searching misses removed; traces that answer at once stay
        assert [t for t in kept if answered_gold(t) or not t.pieces[0][1].startswith("<search>")] == dropped
        assert 0 < len(dropped) < len(kept)
        if tool_use < 1.0:
            assert len(searched) < len(dropped)
