"""Evaluation benchmarks (``trainer.evaluate.benchmarks``): the built-in registry on the real
shared data, user JSONL benchmarks, and the shared services (a real sandbox pool and a real BM25
retriever server on 127.0.0.1, one of each for the module)."""

from __future__ import annotations

import json
import textwrap
import urllib.request
from pathlib import Path

import pytest

from trainer.evaluate.benchmarks import (
    BENCHMARKS,
    BenchmarkServices,
    BenchmarkSpec,
    benchmark_names,
    infer_kind,
    load_rows,
    register_benchmark,
    resolve_benchmark,
    service_of,
)

SHARED_DATA = Path(__file__).parent.resolve().parents[2] / "data"  # the repository's data/
needs_shared = pytest.mark.skipif(not (SHARED_DATA / "wiki" / "corpus.jsonl").is_file()
                                  or not (SHARED_DATA / "aime2025.jsonl").is_file(),
                                  reason=f"data not found under {SHARED_DATA}")

EXPECTED_ROWS = {"nq": 500, "triviaqa": 500, "popqa": 500, "hotpotqa": 500,
                 "2wikimultihopqa": 200, "musique": 200, "bamboogle": 125,
                 "aime2024": 30, "aime2025": 30, "math500": 500}

MATH_ROWS = [{"id": "u1", "problem": "What is 6 times 7?", "answer": 42},
             {"id": "u2", "problem": "What is 1/2 + 1/4?", "answer": "\\frac{3}{4}"}]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def services(tmp_path_factory):
    """Services for nq + aime2024: a sandbox pool and a retriever server started by
    ``BenchmarkServices`` itself (index shared with ``search_server``'s, built once a session)."""
    if not (SHARED_DATA / "wiki" / "corpus.jsonl").is_file():
        pytest.skip(f"data not found under {SHARED_DATA}")
    index = tmp_path_factory.getbasetemp() / "trainer_bm25_index"
    svc = BenchmarkServices([resolve_benchmark("nq"), resolve_benchmark("aime2024")],
                            data_dir=str(SHARED_DATA),
                            settings={"search": {"retriever_index_dir": str(index)}})
    with svc:
        yield svc


# -- registry and rows ------------------------------------------------------------------------

def test_builtin_registry():
    assert set(EXPECTED_ROWS) <= set(benchmark_names()) and benchmark_names() == BENCHMARKS.names()
    for name in ("nq", "triviaqa", "popqa", "hotpotqa", "2wikimultihopqa", "musique", "bamboogle"):
        spec = resolve_benchmark(name)
        assert (spec.env, spec.data, spec.kind, spec.default_k, spec.default_temperature) == \
            ("search", name, "qa", 1, 0.0)
    for name, k in (("aime2024", 32), ("aime2025", 32), ("math500", 4)):
        spec = resolve_benchmark(name)
        assert (spec.env, spec.kind, spec.default_k, spec.default_temperature) == \
            ("math_tool", "math", k, 1.0)
        assert spec.env_kwargs == {"reward": {"mode": "math_verify"}}
    assert service_of("search") == "search" and service_of("math_tool") == "math_tool"


@needs_shared
@pytest.mark.parametrize("name", sorted(EXPECTED_ROWS))
def test_builtin_benchmarks_load_with_expected_row_counts(name):
    spec = resolve_benchmark(name)
    rows = load_rows(spec, str(SHARED_DATA))
    assert len(rows) == EXPECTED_ROWS[name]
    assert len({r["id"] for r in rows}) == len(rows) and all(isinstance(r["id"], str) for r in rows)
    if spec.kind == "qa":
        assert all(r["question"] and r["golden_answers"] for r in rows)
    else:
        assert all(r["problem"] and isinstance(r["answer"], str) for r in rows)


@needs_shared
def test_max_samples_takes_the_first_rows_and_data_dir_from_the_environment(monkeypatch):
    spec = resolve_benchmark("hotpotqa")
    full = load_rows(spec, str(SHARED_DATA))
    assert load_rows(spec, str(SHARED_DATA), max_samples=7) == full[:7]
    assert load_rows(spec, str(SHARED_DATA), max_samples=7) == full[:7]  # deterministic
    assert len(load_rows(spec, str(SHARED_DATA), max_samples=10_000)) == 500
    monkeypatch.setenv("COPC_DATA_DIR", str(SHARED_DATA))
    assert [r["id"] for r in load_rows(resolve_benchmark("aime2025"), max_samples=3)] == \
        [r["id"] for r in load_rows(resolve_benchmark("aime2025"), str(SHARED_DATA))[:3]]
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="max_samples"):
            load_rows(spec, str(SHARED_DATA), max_samples=bad)


def test_missing_dataset_names_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nq\.jsonl"):
        load_rows(resolve_benchmark("nq"), str(tmp_path))


# -- user benchmarks -------------------------------------------------------------------------

def test_user_jsonl_benchmark_resolves_kind_and_path(tmp_path, monkeypatch):
    math = write_jsonl(tmp_path / "my_math.jsonl", MATH_ROWS)
    qa = write_jsonl(tmp_path / "my_qa.jsonl",
                     [{"id": "q1", "question": "capital of France", "golden_answers": ["Paris"]}])
    spec = resolve_benchmark(f"{math}:math_tool")
    assert (spec.name, spec.env, spec.data, spec.kind) == ("my_math", "math_tool", str(math), "math")
    assert (spec.default_k, spec.default_temperature, spec.env_kwargs) == (4, 1.0, {})
    rows = load_rows(spec)
    assert [r["id"] for r in rows] == ["u1", "u2"] and rows[0]["answer"] == "42"  # load_math's str
    assert load_rows(spec, max_samples=1) == rows[:1]
    assert resolve_benchmark(f"{qa}:search").kind == "qa"
    assert load_rows(resolve_benchmark(f"{qa}:search"))[0]["golden_answers"] == ["Paris"]
    # explicit kind; env references with their own ':'; relative paths from the cwd
    assert resolve_benchmark(f"{math}:math_tool:math").kind == "math"
    monkeypatch.chdir(tmp_path)
    spec = resolve_benchmark("my_qa.jsonl:envs/other.py:search_like:qa")
    assert (spec.env, spec.kind, spec.data) == ("envs/other.py:search_like", "qa", str(qa))


def test_user_benchmark_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nope\.jsonl"):
        resolve_benchmark(f"{tmp_path}/nope.jsonl:math_tool")
    odd = write_jsonl(tmp_path / "odd.jsonl", [{"id": "1", "text": "?"}])
    with pytest.raises(ValueError, match=r"cannot infer the benchmark kind.*golden_answers"):
        resolve_benchmark(f"{odd}:math_tool")
    assert resolve_benchmark(f"{odd}:math_tool:math").kind == "math"  # explicit: no inference
    with pytest.raises(ValueError, match=r"missing field\(s\) \['problem', 'answer'\]"):
        load_rows(resolve_benchmark(f"{odd}:math_tool:math"))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="has no rows"):
        infer_kind(empty)
    with pytest.raises(ValueError, match="no environment"):
        resolve_benchmark(f"{odd}:")
    dup = write_jsonl(tmp_path / "dup.jsonl", [MATH_ROWS[0], MATH_ROWS[0]])
    with pytest.raises(ValueError, match=r"benchmark 'dup': duplicate row id 'u1'"):
        load_rows(resolve_benchmark(f"{dup}:math_tool"))


def test_user_benchmark_episode_in_a_real_math_env(tmp_path):
    spec = resolve_benchmark(f"{write_jsonl(tmp_path / 'mine.jsonl', MATH_ROWS)}:math_tool")
    rows = load_rows(spec)
    with BenchmarkServices([spec]) as svc:  # math only: a sandbox pool, no retriever
        assert svc.sandbox is not None and "retriever_url" not in svc.info and "sandbox" in svc.info
        env = svc.env_factory(spec)()
        try:
            obs, _ = env.reset(options={"sample": rows[0]})
            assert "What is 6 times 7?" in obs
            obs, reward, terminated, _, _ = env.step("<code>```python\nprint(6 * 7)\n```</code>")
            assert "42" in obs and reward == 0.0 and not terminated
            _, reward, terminated, _, _ = env.step("So the answer is \\boxed{42}.")
            assert terminated and reward == 1.0
            env.reset(options={"sample": rows[1]})
            _, reward, terminated, _, _ = env.step("\\boxed{0.75}")
            assert terminated and reward == 1.0
        finally:
            env.close()
    assert svc.sandbox is None


def test_user_benchmark_on_another_env_gets_only_its_env_kwargs(tmp_path):
    envfile = tmp_path / "bench_custom_env.py"
    envfile.write_text(textwrap.dedent("""
        import environments
        from environments.search.env import SearchEnv

        class Recorder:
            def __init__(self, **kwargs):
                self.kwargs = kwargs

        class MySearch(SearchEnv):
            pass

        environments.register("bench_recorder", Recorder, overwrite=True)
        environments.register("bench_my_search", MySearch, overwrite=True)
    """))
    data = write_jsonl(tmp_path / "rows.jsonl", MATH_ROWS)
    spec = BenchmarkSpec("custom", f"{envfile}:bench_recorder", str(data), "math",
                         env_kwargs={"x": 1})
    with BenchmarkServices([spec]) as svc:  # nothing to start
        assert svc.sandbox is None and svc.info == {}
        env = svc.env_factory(spec)()
        assert env.kwargs == {"x": 1}
        assert svc.env_factory(spec)() is not env  # a fresh env per call
    # a SearchEnv subclass takes the retriever like "search"; a given URL starts no server
    sub = BenchmarkSpec("sub", f"{envfile}:bench_my_search", "nq", "qa")
    assert service_of(sub.env) == "search"
    with BenchmarkServices([sub], settings={"search": {"retriever_url": "http://127.0.0.1:9"}}) as svc:
        assert svc.info == {"retriever_url": "http://127.0.0.1:9"} and svc.running() == []  # no server
        env = svc.env_factory(sub)()
        assert type(env).__name__ == "MySearch" and env.config.retriever_url == "http://127.0.0.1:9"
        env.close()


# -- errors ----------------------------------------------------------------------------------

def test_unknown_benchmark_names_it_and_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown benchmark 'nqq'; known: \[.*'aime2024'.*'nq'"):
        resolve_benchmark("nqq")
    with pytest.raises(ValueError, match="non-empty"):
        resolve_benchmark("")


@pytest.mark.parametrize("kwargs, field", [
    ({"name": ""}, "name"), ({"env": None}, "env"), ({"data": "  "}, "data"),
    ({"kind": "mcq"}, "kind"), ({"env_kwargs": [1]}, "env_kwargs"),
    ({"default_k": 0}, "default_k"), ({"default_k": True}, "default_k"),
    ({"default_k": 2.0}, "default_k"), ({"default_temperature": -0.1}, "default_temperature"),
    ({"default_temperature": "1"}, "default_temperature"),
])
def test_bad_spec_names_the_field(kwargs, field):
    good = {"name": "b", "env": "math_tool", "data": "aime2024", "kind": "math"}
    with pytest.raises(ValueError, match=rf"BenchmarkSpec\.{field}="):
        BenchmarkSpec(**{**good, **kwargs})


def test_register_benchmark():
    spec = BenchmarkSpec("aime2024_greedy", "math_tool", "aime2024", "math", default_k=1,
                         default_temperature=0)
    try:
        assert register_benchmark(spec) is spec and resolve_benchmark("aime2024_greedy") is spec
        assert spec.default_temperature == 0.0 and isinstance(spec.default_temperature, float)
        with pytest.raises(ValueError, match="already registered"):
            register_benchmark(spec)
        register_benchmark(spec, overwrite=True)
        with pytest.raises(TypeError, match="BenchmarkSpec"):
            register_benchmark({"name": "x"})
    finally:
        if "aime2024_greedy" in BENCHMARKS:
            BENCHMARKS.unregister("aime2024_greedy")


def test_services_errors(tmp_path):
    nq = resolve_benchmark("nq")
    svc = BenchmarkServices([nq, resolve_benchmark("math500")])
    with pytest.raises(RuntimeError, match=r"'nq' needs the retriever: call BenchmarkServices\.start"):
        svc.env_factory(nq)
    with pytest.raises(RuntimeError, match="'math500' needs the sandbox pool"):
        svc.env_factory(resolve_benchmark("math500"))
    with pytest.raises(KeyError, match="unknown env id 'nope'"):
        BenchmarkServices([BenchmarkSpec("b", "nope", "x.jsonl", "qa")])
    missing = BenchmarkServices([nq], data_dir=str(tmp_path),
                                settings={"search": {"retriever_index_dir": str(tmp_path / "idx")}})
    with pytest.raises(FileNotFoundError, match=r"retriever corpus .*wiki/corpus\.jsonl"):
        missing.start()
    missing.close()


# -- shared services (real retriever, real sandbox) -----------------------------------------

@needs_shared
def test_search_env_from_the_factory_queries_the_real_retriever(services):
    url = services.info["retriever_url"]
    assert url.startswith("http://127.0.0.1:")
    spec = resolve_benchmark("nq")
    row = load_rows(spec, str(SHARED_DATA), max_samples=1)[0]
    env = services.env_factory(spec)()
    try:
        assert env.config.retriever_url == url
        obs, _ = env.reset(options={"sample": row})
        assert row["question"] in obs
        action = f"<think>look it up</think><search>{row['question']}</search>"
        obs, reward, terminated, _, _ = env.step(action)
        assert "<information>Doc 1(Title:" in obs and not terminated and reward == 0.0
        _, reward, terminated, _, _ = env.step(f"<answer>{row['golden_answers'][0]}</answer>")
        assert terminated and reward == 1.0
    finally:
        env.close()


@needs_shared
def test_math_env_from_the_factory_runs_code_in_the_shared_sandbox(services):
    spec = resolve_benchmark("aime2024")
    row = load_rows(spec, str(SHARED_DATA), max_samples=1)[0]
    make = services.env_factory(spec)
    envs = [make(), make()]
    try:
        assert all(e._sandbox is services.sandbox for e in envs)  # one pool for every env
        assert envs[0].config.reward.mode == "math_verify"
        obs, _ = envs[0].reset(options={"sample": row})
        assert row["problem"][:40] in obs
        obs, *_ = envs[0].step("<code>```python\nprint(6 * 7)\n```</code>")
        assert "<interpreter>" in obs and "42" in obs
        _, reward, terminated, _, _ = envs[0].step(f"\\boxed{{{row['answer']}}}")
        assert terminated and reward == 1.0
    finally:
        for e in envs:
            e.close()
    assert services.sandbox.run("print(1 + 1)").stdout.strip() == "2"  # envs did not close it


@needs_shared
def test_close_is_idempotent_and_stops_the_services(services):
    url, sandbox = services.info["retriever_url"], services.sandbox
    assert services.start() is services  # started once
    with urllib.request.urlopen(f"{url}/health", timeout=10) as r:
        assert r.status == 200
    services.close()
    services.close()
    assert services.sandbox is None
    with pytest.raises(RuntimeError, match="Sandbox is closed"):
        sandbox.run("print(1)")
    with pytest.raises(OSError):
        urllib.request.urlopen(f"{url}/health", timeout=5)
