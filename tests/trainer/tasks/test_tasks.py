"""Tasks as plug-ins (``trainer.tasks``): the math / search / generic tasks' splits, services and
warm-start traces, ``register_task``, ``build_task``'s errors, and where data paths come from."""

from __future__ import annotations

import dataclasses
import json
import re
import sys
import textwrap
from pathlib import Path

import pytest
from search_server import retriever_url  # noqa: F401 - pytest fixture (tests/trainer on sys.path)

import environments
from environments import ToolEnv
from environments.data import DATA_DIR_ENV, FALLBACK_DATA_DIR, data_root, resolve_data_path
from trainer.config import ConfigError, load_config
from trainer.config.specs import task_spec
from trainer.tasks import (
    GenericTask,
    MathToolTask,
    SearchTask,
    Task,
    absolute_task_paths,
    build_task,
    check_env_settings,
    register_task,
    task_class,
    unregister_task,
)
from trainer.tasks.search import corpus_path

DATA = Path(__file__).parent.resolve().parents[2] / "data"  # the repository's data/


def cfg_of(*overrides: str, **task: str):
    """An ExperimentConfig from the schema defaults plus ``key=value`` overrides."""
    return load_config(None, [*overrides, *(f"task.{k}={v}" for k, v in task.items())])


class WordEnv(ToolEnv):
    """A tool-less env: the answer is the action itself (for the generic-task tests)."""

    def __init__(self, greeting: str = "say", **kw):
        if kw:
            raise TypeError(f"WordEnv.__init__() got an unexpected keyword argument '{next(iter(kw))}'")
        super().__init__([], invalid_action_reply=None)
        self.greeting = greeting

    def build_prompt(self, sample):
        return f"{self.greeting} {sample['word']}"

    def extract_answer(self, action):
        return action.strip()

    def score(self, sample, response, answer, tool_calls):
        return float(answer == sample["word"]), {}


@pytest.fixture
def word_env():
    environments.register("words", entry_point=WordEnv)
    yield "words"
    environments.unregister("words")
    unregister_task("words")


def write_jsonl(path: Path, rows: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


# -- where data comes from -----------------------------------------------------------------------

def test_data_root_order_config_then_env_var_then_the_repositorys_data(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(DATA_DIR_ENV, raising=False)
    assert str(DATA) == FALLBACK_DATA_DIR
    assert data_root() == DATA  # whatever the working directory
    monkeypatch.setenv(DATA_DIR_ENV, "envdata")
    assert data_root() == tmp_path / "envdata"
    assert data_root("") == tmp_path / "envdata"
    assert data_root("cfg/data") == tmp_path / "cfg" / "data"  # explicit wins over the variable
    assert data_root("/abs/data") == Path("/abs/data")
    assert resolve_data_path("x/y.jsonl") == tmp_path / "envdata" / "x" / "y.jsonl"
    assert resolve_data_path("/elsewhere/y.jsonl", "cfg") == Path("/elsewhere/y.jsonl")
    monkeypatch.setenv(DATA_DIR_ENV, "")
    assert data_root() == DATA


def test_retriever_corpus_default_follows_the_data_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path / "d"))
    assert corpus_path("", "") == tmp_path / "d" / "wiki" / "corpus.jsonl"
    assert corpus_path("", "other") == tmp_path / "other" / "wiki" / "corpus.jsonl"
    assert corpus_path("c/corpus.jsonl", "other") == tmp_path / "c" / "corpus.jsonl"  # cwd-relative


def test_absolute_task_paths_pins_paths_for_other_processes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(DATA_DIR_ENV, "from_env")
    cfg = cfg_of("task.env=envs/calc_env.py:calc", data_dir="''")
    pinned = absolute_task_paths(task_spec(cfg))
    assert pinned.task.env == f"{tmp_path}/envs/calc_env.py:calc"
    assert pinned.task.data_dir == str(tmp_path / "from_env")
    # the search task's own paths are pinned by its worker hook (Task.worker_spec)
    search = cfg_of("task.env=search", "task.settings.retriever_corpus=c.jsonl",
                    "task.settings.retriever_index_dir=idx", data_dir="''")
    worker = SearchTask(task_spec(search)).worker_spec()
    assert worker.task.settings["retriever_corpus"] == str(tmp_path / "c.jsonl")
    assert worker.task.settings["retriever_index_dir"] == str(tmp_path / "idx")
    assert worker.task.data_dir == str(tmp_path / "from_env")
    assert cfg.task.data_dir == "" and cfg.task.env == "envs/calc_env.py:calc"  # the original is untouched
    assert search.task.settings["retriever_corpus"] == "c.jsonl"
    assert absolute_task_paths(task_spec(cfg_of("task.env=my_pkg.envs:calc"))).task.env == "my_pkg.envs:calc"
    plain = cfg_of("task.env=search", "task.settings.retriever_corpus=''")
    no_corpus = SearchTask(task_spec(plain)).worker_spec()
    assert no_corpus.task.settings["retriever_corpus"] == ""


def test_task_spec_holds_what_a_task_reads_and_the_worker_spec_keeps_it(tmp_path, monkeypatch):
    """The spec a task gets instead of the config: the task section, train.seed, eval.num_samples;
    the workers' copy differs only in the task section (absolute paths, worker settings)."""
    monkeypatch.chdir(tmp_path)
    cfg = cfg_of("train.seed=7", "eval.num_samples=9", "task.max_train_samples=3", data_dir="d")
    spec = task_spec(cfg)
    assert (spec.task, spec.seed, spec.eval_num_samples) == (cfg.task, 7, 9)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.seed = 1  # type: ignore[misc]
    task = Task(spec, "math_tool")
    assert task.spec is spec and task.cap_train(list(range(10))) == [0, 1, 2]
    assert task.cap_eval(list(range(20))) == list(range(9))  # eval.num_samples: no task cap set
    worker = task.worker_spec()
    assert (worker.seed, worker.eval_num_samples) == (7, 9) and worker.task.data_dir == str(tmp_path / "d")
    assert spec.task.data_dir == "d"  # the driver's spec is untouched


def test_math_datasets_from_copc_data_dir_in_another_directory(tmp_path, monkeypatch):
    import environments.data

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(DATA_DIR_ENV, str(DATA))
    cfg = cfg_of("task.data_dir=''", "task.env_kwargs={reward: {mode: dapo_strict}}",
                 train_data="[aime2024]", eval_data="[aime2025]")
    with build_task(task_spec(cfg)) as task:
        assert type(task) is MathToolTask
        assert len(task.train_samples) == 30 and len(task.eval_samples) == 30
        assert task.train_samples[0]["id"] != task.eval_samples[0]["id"]
        first = json.loads((DATA / "aime2024.jsonl").read_text().splitlines()[0])
        assert task.train_samples[0]["problem"] == first["problem"]
    monkeypatch.delenv(DATA_DIR_ENV)
    with build_task(task_spec(cfg)) as task:  # the fallback: the repository's data/, from any directory
        assert len(task.train_samples) == 30 and task.train_samples[0]["problem"] == first["problem"]
    # an installed copy has no data/ beside its packages: the error names the variable to set
    monkeypatch.setattr(environments.data, "FALLBACK_DATA_DIR", str(tmp_path / "no-data"))
    missing = tmp_path / "no-data" / "aime2024.jsonl"
    with pytest.raises(ConfigError, match=r"task.data_dir='': .*" + re.escape(str(missing)) +
                       r".*does not exist, as in an installed copy: set \$COPC_DATA_DIR"):
        build_task(task_spec(cfg))


# -- math_tool ---------------------------------------------------------------------------------

def test_math_task_generated_splits_services_and_close(tmp_path):
    from trainer.tasks.math_tool import arithmetic_splits

    cfg = cfg_of("train.seed=3", "eval.num_samples=5", "task.settings.arithmetic_kinds=[mul]",
                 max_train_samples="12")
    task = build_task(task_spec(cfg))
    try:
        train, evals = arithmetic_splits(12, 5, seed=3, kinds=("mul",))
        assert task.train_samples == train and task.eval_samples == evals
        assert len(train) == 12 and len(evals) == 5
        assert not {r["problem"] for r in train} & {r["problem"] for r in evals}
        assert task.info["sandbox"] == task.sandbox.enforced
        env = task.make_env()
        assert env._sandbox is task.sandbox  # one shared pool for every episode
        obs, _ = env.reset(options={"sample": evals[0]})
        assert evals[0]["problem"] in obs
        obs, *_ = env.step("<code>```python\nprint(6 * 7)\n```</code>")
        assert "42" in obs
        env.close()
        assert task.sandbox.run("print(1 + 1)").stdout.strip() == "2"  # the env did not close the pool
    finally:
        task.close()
    with pytest.raises(RuntimeError, match="Sandbox is closed"):
        task.sandbox.run("print(1)")
    task.close()  # idempotent
    assert task._closers == []


def test_math_warm_start_traces_mix_tool_and_direct_answers_never_eval(tmp_path):
    from trainer.config import WarmStartConfig

    cfg = cfg_of("train.seed=0", "eval.num_samples=4",
                 "task.env_kwargs={reward: {mode: dapo_strict}}", max_train_samples="8",
                 settings="{arithmetic_kinds: [mul], tool_use_fraction: 0.5}")
    with build_task(task_spec(cfg)) as task:
        ws = WarmStartConfig(enabled=True, num_examples=6, seed=1)
        traces = task.warm_start_traces(ws, progress=False)
        again = task.warm_start_traces(ws, progress=False)
        assert traces == again  # seeded
        assert len(traces) == 6
        kinds = sorted(len(t.pieces) for t in traces)
        assert kinds == [1, 1, 1, 3, 3, 3]  # 3 with a <code> call + <interpreter> + answer, 3 direct
        held = {s["problem"] for s in task.eval_samples}
        assert not any(p in t.prompt for t in traces for p in held)
        tool = next(t for t in traces if len(t.pieces) == 3)
        assert tool.pieces[0][1].count("<code>") == 1 and tool.pieces[1][0] == "observation"
        with pytest.raises(ConfigError, match=r"warm_start.kind='search_r1': the task of env 'math_tool' "
                                              r"generates \['retool_arithmetic', 'gsm8k_solutions'\]"):
            task.warm_start_traces(WarmStartConfig(enabled=True, kind="search_r1"), progress=False)


# -- search ------------------------------------------------------------------------------------

def test_search_task_splits_are_disjoint_every_fifth_row_held_out():
    from environments.search.env import load_qa

    cfg = cfg_of("task.env=search", "task.settings.retriever_url=http://127.0.0.1:9", "eval.num_samples=1000")
    with build_task(task_spec(cfg)) as task:  # an existing server: nothing started
        assert type(task) is SearchTask and task._closers == []
        assert task.info == {"retriever_url": "http://127.0.0.1:9"}
        nq, hq = load_qa("nq", str(DATA)), load_qa("hotpotqa", str(DATA))
        assert len(task.eval_samples) == 200 and len(task.train_samples) == 800
        assert task.eval_samples[0]["id"] == f"nq:{nq[0]['id']}"
        # interleaved nq / hotpotqa, so that a cap (eval.num_samples) keeps both sets
        assert task.eval_samples[1]["id"] == f"hotpotqa:{hq[0]['id']}"
        assert task.eval_samples[100]["id"] == f"nq:{nq[250]['id']}"
        assert [r["dataset"] for r in task.eval_samples] == ["nq", "hotpotqa"] * 100
        assert task.train_samples[0]["id"] == f"nq:{nq[1]['id']}"
        assert not {r["id"] for r in task.train_samples} & {r["id"] for r in task.eval_samples}
        env = task.make_env()
        assert env.config.retriever_url == "http://127.0.0.1:9"
        env.close()


@pytest.mark.slow
def test_search_warm_start_traces_real_retriever(retriever_url):  # noqa: F811
    from trainer.config import WarmStartConfig

    cfg = cfg_of("task.env=search", f"task.settings.retriever_url={retriever_url}", "eval.num_samples=10",
                 max_train_samples="5")
    with build_task(task_spec(cfg)) as task:
        traces = task.warm_start_traces(WarmStartConfig(enabled=True, kind="search_r1", num_examples=3),
                                        progress=False)
        assert len(traces) == 3
        for t, s in zip(traces, task.train_samples[:3], strict=True):
            assert t.pieces[0] == ("action", f"<search> {s['question'].strip()}</search>")
            assert "<information>" in t.pieces[1][1] and t.pieces[-1][1].startswith("<answer> ")


# -- generic ---------------------------------------------------------------------------------------

def test_generic_task_reads_jsonl_adds_ids_drops_overlap(tmp_path, word_env):
    write_jsonl(tmp_path / "d/train.jsonl", [{"word": "a"}, {"word": "b", "id": "mine"}, "",
                                             {"word": "c"}, {"word": "held"}])
    write_jsonl(tmp_path / "d/heldout.jsonl", [{"word": "held"}, {"word": "z"}])
    cfg = cfg_of("task.env=words", "task.env_kwargs={greeting: hello}", "eval.num_samples=10",
                 data_dir=str(tmp_path / "d"), train_data="[train.jsonl]", eval_data="[heldout.jsonl]")
    with build_task(task_spec(cfg)) as task:
        assert type(task) is GenericTask and task.env_id == "words"
        assert task.train_samples == [{"word": "a", "id": "train:1"}, {"word": "b", "id": "mine"},
                                      {"word": "c", "id": "train:4"}]
        assert task.eval_samples == [{"word": "held", "id": "heldout:1"}, {"word": "z", "id": "heldout:2"}]
        assert task.info == {"train_files": [str(tmp_path / "d/train.jsonl")],
                             "eval_files": [str(tmp_path / "d/heldout.jsonl")],
                             "held_out": "task.eval_data", "dropped_train_rows": 1}
        env = task.make_env()
        obs, _ = env.reset(options={"sample": task.train_samples[0]})
        assert obs == "hello a"  # task.env_kwargs reach the constructor
        assert env.step("a")[1:3] == (1.0, True)
        with pytest.raises(ConfigError, match=r"warm_start.enabled=True: the task of env 'words' has no "
                                              r"warm-start trace generator"):
            task.check_warm_start(cfg.warm_start.__class__(enabled=True))
        task.check_warm_start(cfg.warm_start.__class__(enabled=False))


def test_generic_task_without_eval_data_holds_out_every_fifth_row_and_caps(tmp_path, word_env):
    write_jsonl(tmp_path / "t.jsonl", [{"word": f"w{i}"} for i in range(12)])
    cfg = cfg_of("task.env=words", "eval.num_samples=2", train_data=f"[{tmp_path / 't.jsonl'}]",
                 max_train_samples="5")
    with build_task(task_spec(cfg)) as task:
        assert [r["word"] for r in task.eval_samples] == ["w0", "w5"]  # rows 0, 5, 10 capped to 2
        assert [r["word"] for r in task.train_samples] == ["w1", "w2", "w3", "w4", "w6"]
        assert task.info["held_out"] == "every 5th training row" and task.info["eval_files"] == []


def test_generic_task_errors_name_key_file_and_line(tmp_path, word_env):
    good = write_jsonl(tmp_path / "good.jsonl", [{"word": "a"}, {"word": "b"}])
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"word": "a"}, "{not json", {"word": "c"}])
    arr = write_jsonl(tmp_path / "arr.jsonl", [[1, 2]])
    empty = write_jsonl(tmp_path / "empty.jsonl", [""])
    d = str(tmp_path)
    cases = [
        ({"train_data": "[]"}, r"task.train_data=\[\]: env 'words' has no built-in data; list JSONL files"),
        ({"train_data": "[good.jsonl, bad.jsonl]"},
         rf"task.train_data\[1\]='bad.jsonl': {re.escape(str(bad))}:2: invalid JSON \(Expecting property "
         r"name enclosed in double quotes\)"),
        ({"train_data": "[good.jsonl]", "eval_data": "[arr.jsonl]"},
         rf"task.eval_data\[0\]='arr.jsonl': {re.escape(str(arr))}:1: expected a JSON object, got list"),
        ({"train_data": "[empty.jsonl]"},
         rf"task.train_data\[0\]='empty.jsonl': '{re.escape(str(empty))}' has no rows"),
        ({"train_data": "[nope.jsonl]"},
         rf"task.train_data\[0\]='nope.jsonl': no such file '{re.escape(str(tmp_path / 'nope.jsonl'))}'"),
        ({"train_data": "[good.jsonl]", "eval_data": "[good.jsonl]"},
         r"task.train_data=\['good.jsonl'\]: no training rows left"),
    ]
    closed: list[str] = []
    for task_kw, needle in cases:
        with pytest.raises(ConfigError, match=needle):
            build_task(task_spec(cfg_of("task.env=words", data_dir=d, **task_kw)))
    # env settings the env rejects are named under task.env_kwargs, and the task is closed
    class Tracked(GenericTask):
        def start(self):
            super().start()
            self.add_closer(lambda: closed.append("stopped"))

    register_task("words", Tracked)
    with pytest.raises(ConfigError, match=r"task.env_kwargs.colour: not a setting of env 'words'"):
        build_task(task_spec(cfg_of("task.env=words", "task.env_kwargs={colour: red}", data_dir=d,
                          train_data=f"[{good}]")))
    assert closed == ["stopped"]


# -- plug-ins ----------------------------------------------------------------------------------------

def test_register_task_overrides_the_generic_task(word_env):
    events: list[str] = []

    class Words(Task):
        warm_start_kinds = ("retool_arithmetic",)

        def start(self):
            self.train_samples = [{"id": str(i), "word": w} for i, w in enumerate(["x", "y", "z"])]
            self.eval_samples = [{"id": "e", "word": "q"}]
            self.add_closer(lambda: events.append("server stopped"))
            self.add_closer(lambda: events.append("pool stopped"))
            self.info = {"server": "up"}

        def warm_start_traces(self, ws, *, progress=True):
            self.check_warm_start(ws)
            return [("trace", ws.num_examples)]

    assert task_class("words") is GenericTask
    register_task("words", Words)
    assert task_class("words") is Words
    with pytest.raises(ValueError, match=r"already registered for env 'words' .*overwrite=True"):
        register_task("words", GenericTask)
    with pytest.raises(TypeError, match="expected a Task subclass"):
        register_task("words", dict)
    cfg = cfg_of("task.env=words")  # no task.train_data needed: the task brings its own data
    task = build_task(task_spec(cfg))
    assert isinstance(task, Words) and task.info == {"server": "up"}
    assert [r["word"] for r in task.train_samples] == ["x", "y", "z"]
    assert task.warm_start_traces(cfg.warm_start.__class__(enabled=True, num_examples=7)) == [("trace", 7)]
    task.close()
    task.close()
    assert events == ["pool stopped", "server stopped"]  # last started, first stopped; once


def test_build_task_resolves_an_env_file_that_registers_env_and_task(tmp_path, monkeypatch):
    (tmp_path / "my_words.py").write_text(textwrap.dedent('''
        import environments
        from environments import ToolEnv
        from trainer.tasks import Task, register_task

        class Env(ToolEnv):
            def __init__(self, **kw):
                super().__init__([], invalid_action_reply=None)
            def build_prompt(self, s):
                return s["w"]
            def extract_answer(self, a):
                return a
            def score(self, s, r, a, n):
                return 0.0, {}

        class Words(Task):
            def start(self):
                self.train_samples = [{"id": "1", "w": "x"}]

        environments.register("file_words", entry_point=Env)
        register_task("file_words", Words)
    '''))
    monkeypatch.chdir(tmp_path)
    try:
        with build_task(task_spec(cfg_of("task.env=my_words.py:file_words"))) as task:
            assert type(task).__name__ == "Words" and task.env_id == "file_words"
            assert task.make_env().reset(options={"sample": {"w": "hey"}})[0] == "hey"
    finally:
        environments.unregister("file_words")
        unregister_task("file_words")
        sys.modules.pop("my_words", None)


def test_a_plugin_file_registers_a_task_with_its_own_settings(tmp_path, monkeypatch):
    """A user's task with its own knobs: a settings dataclass registered with the task from a plug-in
    file, filled from task.settings; no edit of trainer/config*.py. Bad keys, types and values are
    one-line ConfigErrors naming task.settings.<key>."""
    (tmp_path / "count_task.py").write_text(textwrap.dedent('''
        from dataclasses import dataclass

        import environments
        from environments import ToolEnv
        from trainer.tasks import Task, register_task

        class Env(ToolEnv):
            def __init__(self, **kw):
                super().__init__([], invalid_action_reply=None)
            def build_prompt(self, s):
                return s["w"]
            def extract_answer(self, a):
                return a
            def score(self, s, r, a, n):
                return 0.0, {}

        @dataclass
        class CountSettings:
            rows: int = 2
            word: str = "w"
            def __post_init__(self):
                if self.rows < 1:
                    raise ValueError(f"task.settings.rows={self.rows!r}: must be >= 1")

        class CountTask(Task):
            def start(self):
                s = self.settings
                self.train_samples = [{"id": str(i), "w": f"{s.word}{i}"} for i in range(s.rows)]
                self.eval_samples = [{"id": "e", "w": "held"}]

        environments.register("count_words", entry_point=Env)
        register_task("count_words", CountTask, settings=CountSettings)
    '''))
    monkeypatch.chdir(tmp_path)
    try:
        cfg = cfg_of("plugins=[count_task.py]", "task.env=count_words", "task.settings={rows: 3, word: z}")
        with build_task(task_spec(cfg)) as task:
            assert [r["w"] for r in task.train_samples] == ["z0", "z1", "z2"]
            assert type(task.settings).__name__ == "CountSettings" and task.settings.rows == 3
        from trainer.tasks import TASKS

        assert TASKS.settings_type("count_words") is type(task.settings)
        with build_task(task_spec(cfg_of("task.env=count_words"))) as task:  # defaults
            assert [r["w"] for r in task.train_samples] == ["w0", "w1"]
        for bad, msg in (("{rows: 0}", r"^task\.settings\.rows=0: must be >= 1$"),
                         ("{rows: many}", r"^task\.settings\.rows='many': must be an int$"),
                         ("{colour: red}", r"^task\.settings\.colour='red': unknown setting of "
                                           r"CountSettings; known: \['rows', 'word'\]$")):
            with pytest.raises(ConfigError, match=msg):
                build_task(task_spec(cfg_of("task.env=count_words", f"task.settings={bad}")))
        # at load: checked by the registered settings dataclass, before anything is built
        with pytest.raises(ConfigError, match=r"^task\.settings\.rows=0: must be >= 1$"):
            cfg_of("plugins=[count_task.py]", "task.env=count_words", "task.settings={rows: 0}")
        # a task class without settings refuses any
        plain = cfg_of("task.env=count_words")
        plain = dataclasses.replace(plain, task=dataclasses.replace(plain.task, settings={"rows": 1}))
        with pytest.raises(ConfigError, match=r"^task\.settings\.rows: the task of env 'count_words' has "):
            GenericTask(task_spec(plain), "count_words")
    finally:
        environments.unregister("count_words")
        unregister_task("count_words")
        sys.modules.pop("count_task", None)


def test_build_task_unknown_or_unloadable_env_names_the_key(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"task.env='calc': not registered; known: \[.*'math_tool', "
                                          r".*'search'.*\] \(register it with environments.register"):
        build_task(task_spec(cfg_of("task.env=calc")))
    with pytest.raises(ConfigError, match=r"task.env='calc_env.py:calc': cannot load the environment's "
                                          r"module: FileNotFoundError: environment module file"):
        build_task(task_spec(cfg_of("task.env=calc_env.py:calc")))
    with pytest.raises(ConfigError, match=r"task.env='no_such_pkg_q.envs:calc': cannot load the "
                                          r"environment's module: ModuleNotFoundError"):
        build_task(task_spec(cfg_of("task.env=no_such_pkg_q.envs:calc")))


def test_check_env_settings_names_nested_keys():
    def make(**kw):
        def factory():
            return environments.make("math_tool", **kw)
        return factory

    kw = {"reward": {"mode": "math-verify"}}
    with pytest.raises(ConfigError, match=r"task.env_kwargs.reward.mode='math-verify': must be one of"):
        check_env_settings(make(**kw), "math_tool", kw)
    kw = {"max_turn": 3}
    with pytest.raises(ConfigError, match=r"task.env_kwargs.max_turn: not a setting of env 'math_tool'"):
        check_env_settings(make(**kw), "math_tool", kw)
    check_env_settings(make(), "math_tool", {})  # fine settings: no error
