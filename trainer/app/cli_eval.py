"""``copc eval --benchmarks ...``: evaluate a model, a training checkpoint or a served model.

Usage::

    copc eval --model DIR|NAME --benchmarks aime2025,nq [--k 32] [--temperature 1.0] [--max-samples N]
              [--out DIR] [--resume] [--engine embedded|sglang|vllm] [task options] [key=value ...]
    copc eval --checkpoint RUN/checkpoints/step_N --benchmarks nq
    copc eval --endpoint http://host:30000 --tokenizer DIR --benchmarks hotpotqa

The policy is loaded through the engine registry (``--engine``, default ``rollout.engine``), or
reached at ``--endpoint`` (an SGLang server already running: its native ``/generate`` with token
ids, as in training). The benchmarks' tasks start the services their environments need (e.g. one
sandbox pool for the math benchmarks, a retriever for the search ones); the *task options* are the
flags the registered tasks add (:attr:`trainer.tasks.base.Task.eval_options`, e.g. the search
task's ``--retriever-url``: a running server instead of starting one), each setting one of that
task's ``task.settings``. Outputs in ``--out``: ``results.jsonl`` (one line per episode),
``report.json``, ``report.md`` and ``report.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError
from .eval_identity import check_policy, policy_identity

if TYPE_CHECKING:
    from ..config import ExperimentConfig
    from ..tasks.base import EvalOption


def add_benchmark_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``--benchmarks`` form's options (added to the ``copc eval`` parser)."""
    parser.add_argument("--benchmarks", default=None, metavar="LIST",
                        help="comma-separated benchmarks (nq,hotpotqa,aime2025,... or "
                             "file.jsonl:env[:kind], kind = qa, math or a registered one)")
    parser.add_argument("--model", default=None, metavar="DIR|NAME",
                        help="save_pretrained directory to evaluate, or a pulled model's name "
                             "(copc model pull NAME)")
    parser.add_argument("--endpoint", default=None, metavar="URL", help="a running SGLang server to evaluate")
    parser.add_argument("--tokenizer", default=None, metavar="DIR",
                        help="tokenizer directory of the served model (with --endpoint)")
    parser.add_argument("--request-timeout-s", type=float, default=600.0, metavar="S",
                        help="with --endpoint: total seconds one generation may take, retries included")
    parser.add_argument("--k", type=int, default=None, help="episodes per question (default per benchmark)")
    parser.add_argument("--temperature", type=float, default=None, help="0 = greedy (default per benchmark)")
    parser.add_argument("--max-samples", type=int, default=0,
                        help="first N questions per benchmark (0 = all)")
    parser.add_argument("--out", default=None, metavar="DIR", help="output directory (default runs/eval)")
    parser.add_argument("--resume", action="store_true", help="re-run only missing or failed episodes")
    parser.add_argument("--engine", default=None, help="engine name (default rollout.engine)")
    for flag, owners in task_options().items():  # the tasks' own flags (--retriever-url, ...)
        parser.add_argument(flag, default="", help=owners[0][1].help)
    parser.add_argument("--seed", type=int, default=0, help="base sampling seed")


def task_options() -> dict[str, list[tuple[str, EvalOption]]]:
    """The ``copc eval`` flags the registered tasks add (:attr:`~trainer.tasks.base.Task.eval_options`):
    flag → ``(task name, option)`` of each task declaring it, in registry order."""
    from ..tasks import TASKS

    out: dict[str, list[tuple[str, EvalOption]]] = {}
    for name in TASKS.names():
        for opt in TASKS.get(name).eval_options:
            out.setdefault(opt.flag, []).append((name, opt))
    return out


def task_option_settings(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """The ``task.settings`` the given task options set, per task name (``{"search": {"retriever_url":
    url}}`` for ``--retriever-url url``); options left at their default set nothing."""
    out: dict[str, dict[str, Any]] = {}
    for owners in task_options().values():
        for name, opt in owners:
            value = getattr(args, opt.dest, "")
            if value:
                out.setdefault(name, {})[opt.setting] = value
    return out


def check_no_benchmark_options(args: argparse.Namespace) -> None:
    """Refuse a ``--benchmarks``-form option given to ``copc eval --config`` (which would ignore it):
    any option of :func:`add_benchmark_arguments` whose value is not its default.

    Raises:
        ConfigError: naming the first such flag, its value and the config key to use instead.
    """
    form = argparse.ArgumentParser(add_help=False)
    add_benchmark_arguments(form)
    for attr, default in vars(form.parse_args([])).items():
        value = getattr(args, attr, default)
        if attr != "benchmarks" and value != default:
            flag = "--" + attr.replace("_", "-")
            owners = task_options().get(flag, [])
            hint = " or ".join(f"task.settings.{o.setting}=VALUE with task.env={name}" for name, o in owners)
            hint = hint or _CONFIG_FORM_HINTS.get(flag, "eval.num_samples=N, eval.temperature=T, eval.k=K")
            raise _fail(flag, value, f"an option of the --benchmarks form; copc eval --config takes "
                                     f"config overrides instead ({hint}; results go to <output_dir>/eval)")


#: What ``copc eval --config`` takes instead of a ``--benchmarks``-form option (default: eval.*).
_CONFIG_FORM_HINTS = {"--model": "--checkpoint DIR or model.path=DIR", "--engine": "rollout.engine=NAME",
                      "--out": "output_dir=RUN_DIR, the run to evaluate",
                      "--resume": "nothing: a run's evaluation is re-done whole"}


def _fail(flag: str, value: Any, why: str) -> ConfigError:
    return ConfigError(f"{flag}={value!r}: {why}")


def _model_dir(args: argparse.Namespace, cfg: ExperimentConfig) -> Path:
    """The directory whose config and tokenizer ``--model`` / ``--checkpoint`` is evaluated with."""
    if args.model:
        path = Path(args.model)
        if not (path / "config.json").is_file():
            raise _fail("--model", args.model, "not a save_pretrained directory (no config.json)")
        return path
    ckpt = Path(args.checkpoint)
    if not ckpt.is_dir():
        raise _fail("--checkpoint", args.checkpoint, "no such directory")
    if (ckpt / "config.json").is_file():
        return ckpt
    run_dir = ckpt.parent.parent
    model_dir = next((d for d in (run_dir / "warm_start_model", run_dir / "init_model")
                      if (d / "config.json").is_file()), None)
    if model_dir is None and cfg.model.path:
        model_dir = Path(cfg.model.path)
    if model_dir is None:
        raise _fail("--checkpoint", args.checkpoint, f"no model architecture next to it ({run_dir}/"
                    "warm_start_model or init_model) and no model.path")
    return model_dir


def _policy(args: argparse.Namespace, cfg: ExperimentConfig) -> tuple[Path, Any]:
    """``(model_dir, weights or None)`` of ``--model`` / ``--checkpoint``."""
    model_dir = _model_dir(args, cfg)
    if args.model or model_dir == Path(args.checkpoint):
        return model_dir, None
    from ..config.specs import learner_spec
    from ..evaluate.policy import checkpoint_policy_weights

    return model_dir, checkpoint_policy_weights(learner_spec(cfg), Path(args.checkpoint), model_dir)


def _experiment_config(args: argparse.Namespace) -> Any:
    from ..config import load_config

    base = args.config
    if base is None and args.checkpoint and (Path(args.checkpoint).parent.parent / "config.yaml").is_file():
        base = str(Path(args.checkpoint).parent.parent / "config.yaml")  # the run's own settings
    overrides = list(args.overrides)
    if args.engine:
        overrides.append(f"rollout.engine={args.engine}")
    return load_config(base, overrides)


async def _open_engine(args: argparse.Namespace, cfg: ExperimentConfig, out: Path) -> tuple[Any, Any, dict]:
    """``(engine, close, description)``."""
    from ..models.loading import load_tokenizer

    if args.endpoint:
        from ..engines.sglang import SGLangEngine, SGLangEngineConfig

        tok_dir = args.tokenizer
        if not tok_dir:
            raise _fail("--endpoint", args.endpoint, "needs --tokenizer DIR (the served model's tokenizer)")
        await _check_health("--endpoint", args.endpoint)
        tok = load_tokenizer(tok_dir)
        from ..rollout.observation import check_chat_template

        check_chat_template(tok, cfg.rollout.use_chat_template, tok_dir)
        timeout = getattr(args, "request_timeout_s", 600.0)
        engine = SGLangEngine(SGLangEngineConfig(base_url=args.endpoint, vocab_size=len(tok),
                                                 request_timeout_s=timeout))
        return engine, engine.close, {"endpoint": args.endpoint, "tokenizer": str(tok_dir), "_tokenizer": tok}
    from ..config.specs import engine_spec, preflight_engine
    from ..engines import make_engine

    preflight_engine(cfg, evaluation=True)  # ConfigError naming rollout.engine
    model_dir, weights = await asyncio.to_thread(_policy, args, cfg)
    tok = load_tokenizer(model_dir)
    from ..rollout.observation import check_chat_template

    check_chat_template(tok, cfg.rollout.use_chat_template, model_dir)
    spec = engine_spec(cfg, model_dir, tok, weights=None if weights is None else weights.items(),
                       work_dir=out)
    handle = await asyncio.to_thread(make_engine, cfg.rollout.engine, spec)
    what = {"model": str(args.model or args.checkpoint), "engine": cfg.rollout.engine, "_tokenizer": tok}
    return handle.engine, handle.close, what


SETTINGS_FILE = "eval_settings.json"


def _specs(args: argparse.Namespace, cfg: ExperimentConfig, max_samples: int
           ) -> list[tuple[Any, Any, list[dict]]]:
    """Resolve ``--benchmarks``, their kinds (with ``eval.kind_settings``) and load each one's
    rows, before any model is loaded.

    Returns:
        ``(spec, kind, rows)`` per benchmark, in ``--benchmarks`` order.

    Raises:
        ConfigError: naming ``--benchmarks`` (unknown, duplicate name, missing file, rows the
            kind cannot read) or ``eval.kind_settings.<kind>.<key>`` (a setting the kind rejects).
    """
    from ..evaluate.benchmarks import load_rows, resolve_benchmark, with_task_env_kwargs

    out: list[tuple[Any, Any, list[dict]]] = []
    names: set[str] = set()
    for ref in [b.strip() for b in args.benchmarks.split(",") if b.strip()]:
        try:
            spec = with_task_env_kwargs(resolve_benchmark(ref), cfg.task.env, cfg.task.env_kwargs)
            if spec.name in names:
                raise ValueError(f"a benchmark named {spec.name!r} is already in the list (each name once; "
                                 "rename a user file whose stem clashes)")
            rows = load_rows(spec, cfg.task.data_dir, max_samples)
        except (ValueError, KeyError, OSError) as e:
            raise _fail("--benchmarks", ref, str(e.args[0] if isinstance(e, KeyError) else e)) from None
        try:
            kind = spec.benchmark_kind(cfg.eval.kind_settings.get(spec.kind))
        except ValueError as e:
            raise ConfigError(str(e)) from None
        names.add(spec.name)
        out.append((spec, kind, rows))
    if not out:
        raise _fail("--benchmarks", args.benchmarks, "names no benchmark")
    return out


def _preflight_policy(args: argparse.Namespace) -> None:
    """Check ``--model`` / ``--checkpoint`` / ``--endpoint`` before anything is written.

    Raises:
        ConfigError: naming the flag.
    """
    if args.model and not (Path(args.model) / "config.json").is_file():
        raise _fail("--model", args.model, "not a save_pretrained directory (no config.json)")
    if args.checkpoint and not Path(args.checkpoint).is_dir():
        raise _fail("--checkpoint", args.checkpoint, "no such directory")
    if args.endpoint:
        if not args.tokenizer:
            raise _fail("--endpoint", args.endpoint, "needs --tokenizer DIR (the served model's tokenizer)")
        if not getattr(args, "request_timeout_s", 600.0) > 0:
            raise _fail("--request-timeout-s", args.request_timeout_s, "must be > 0 (seconds)")
        asyncio.run(_check_health("--endpoint", args.endpoint))


def _check_resume(out: Path, settings: dict, resume: bool) -> dict:
    """Refuse ``--resume`` with settings that change what the episodes mean (seed, temperature,
    k, budgets, benchmark definitions); return the settings to record for the run."""
    path = out / SETTINGS_FILE
    if resume and path.exists():
        before = json.loads(path.read_text())
        new = settings["policy"]
        check_policy(out, before.get("policy"), new,
                     settings.get("_shown", new.get("url") or new.get("path")), settings.get("_tokenizer"))
        for key in ("seed", "temperature", "k", "max_new_tokens", "agent", "benchmarks"):
            old, new = before.get(key), settings.get(key)
            if key == "benchmarks":  # a resumed run may evaluate fewer or more benchmarks
                clash = [n for n in set(old or {}) & set(new) if old[n] != new[n]]
                if clash:
                    raise _fail("--benchmarks", clash[0], f"defined differently in the run being resumed "
                                f"({old[clash[0]]} vs {new[clash[0]]})")
            elif old != new:
                flag = {"agent": "rollout budgets",
                        "max_new_tokens": "rollout.max_new_tokens"}.get(key, f"--{key}")
                raise _fail(flag, new, f"the run in {out} used {old!r}; --resume must use the same settings")
        settings = {**settings, "benchmarks": {**before.get("benchmarks", {}), **settings["benchmarks"]}}
    return {k: v for k, v in settings.items() if not k.startswith("_")}


async def _run(args: argparse.Namespace, cfg: ExperimentConfig, out: Path, settings: Any,
               benchmarks: list[tuple[Any, Any, list[dict]]], record: dict) -> dict:
    """Start the benchmarks' services and the engine, play every benchmark, write the report."""
    from ..config.specs import task_spec
    from ..evaluate.benchmarks import BenchmarkServices, task_env_applies
    from ..evaluate.records import RESULTS_FILE, RecordWriter, latest_records, read_results
    from ..tasks.base import check_env_settings

    done = latest_records(read_results(out / RESULTS_FILE)) if args.resume else {}
    specs = [spec for spec, _, _ in benchmarks]
    try:
        services = BenchmarkServices(specs, data_dir=cfg.task.data_dir, task=task_spec(cfg),
                                     settings=task_option_settings(args))
    except (KeyError, ImportError, OSError, ValueError) as e:
        raise _fail("--benchmarks", args.benchmarks, f"{type(e).__name__}: {e}") from None
    for flag, owners in task_options().items():  # a given service URL must answer before anything starts
        value = getattr(args, owners[0][1].dest, "")
        if value and any(o.service_url for _, o in owners):
            await _check_health(flag, value)
    engine, close, what = await _open_engine(args, cfg, out)
    tok = what.pop("_tokenizer")
    writer = None
    try:
        await asyncio.to_thread(services.start)
        for spec, _, rows in benchmarks:  # before anything is written: rows the env cannot read
            if task_env_applies(spec, cfg.task.env, cfg.task.env_kwargs):  # bad task.env_kwargs, named
                await asyncio.to_thread(check_env_settings, services.env_factory(spec), spec.env,
                                        cfg.task.env_kwargs)
            await asyncio.to_thread(_probe, services.env_factory(spec), spec, rows)
        (out / SETTINGS_FILE).write_text(json.dumps(record, indent=1, sort_keys=True))
        writer = RecordWriter(out / RESULTS_FILE, append=True)
        per_benchmark = await _play_all(engine, tok, cfg, settings, benchmarks, services, writer, done)
    finally:
        if writer is not None:
            writer.close()
        await asyncio.to_thread(services.close)
        await close()
    header = {**what, "benchmarks": [s.name for s in specs],
              "k": args.k if args.k is not None else _each(per_benchmark, "k"),
              "temperature": args.temperature if args.temperature is not None else _each(per_benchmark,
                                                                                          "temperature"),
              "max_samples": args.max_samples, "seed": args.seed,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    from ..evaluate.report import write_report

    write_report(out, header, per_benchmark)
    return {"header": header, "benchmarks": per_benchmark}


def _each(per_benchmark: dict[str, dict], key: str) -> Any:
    """The benchmarks' common value of ``key``, or ``"nq 1, math500 4"`` when they differ."""
    values = [s.get(key) for s in per_benchmark.values()]
    if len(set(map(str, values))) == 1:
        return values[0]
    return ", ".join(f"{name} {s.get(key)}" for name, s in per_benchmark.items())


async def _play_all(engine: Any, tok: Any, cfg: ExperimentConfig, settings: Any,
                    benchmarks: list[tuple[Any, Any, list[dict]]], services: Any, writer: Any,
                    done: dict) -> dict[str, dict]:
    """Play each benchmark through the evaluation core; its metrics, with what produced them: ``k``,
    ``temperature``, ``seed`` and ``config`` (the benchmark's env, data, kind and their settings)."""
    from ..evaluate.metrics import summarize_benchmark
    from ..evaluate.runner import BenchmarkJob, run_benchmark_with_bar

    per_benchmark: dict[str, dict] = {}
    for spec, kind, rows in benchmarks:
        n = settings.k or spec.default_k
        temp = spec.default_temperature if settings.temperature is None else settings.temperature
        job = BenchmarkJob(spec.name, kind, rows, services.env_factory(spec), n, temp, services.episode(spec))
        recs = await run_benchmark_with_bar(engine, tok, job, settings, show=cfg.logging.progress,
                                            writer=writer, done=done)
        config = {"env": spec.env, "data": spec.data, "kind": spec.kind, "env_kwargs": spec.env_kwargs,
                  "kind_settings": spec.kind_settings}
        per_benchmark[spec.name] = {**summarize_benchmark(recs, kind), "k": n, "temperature": temp,
                                    "seed": settings.seed, "config": config}
    return per_benchmark


def _probe(make_env: Any, spec: Any, rows: list[dict]) -> None:
    """Reset one environment on the first row: rows the env cannot read fail here, named.

    Raises:
        ConfigError: naming ``--benchmarks``.
    """
    env = make_env()
    try:
        env.reset(options={"sample": dict(rows[0])})
    except (ValueError, KeyError, TypeError) as e:
        raise _fail("--benchmarks", spec.name, f"env {spec.env!r} cannot read its rows: {type(e).__name__}: "
                    f"{e}") from None
    finally:
        close = getattr(env, "close", None)
        if close is not None:
            close()


async def _check_health(flag: str, url: str) -> None:
    import httpx

    try:
        async with httpx.AsyncClient(timeout=10.0) as client:
            (await client.get(url.rstrip("/") + "/health")).raise_for_status()
    except httpx.HTTPError as e:
        raise _fail(flag, url, f"does not answer /health ({type(e).__name__}: {e})") from None


def benchmarks_command(args: argparse.Namespace) -> dict:
    """Run the ``--benchmarks`` form of ``copc eval``; return the report (also written to ``--out``).

    Raises:
        ConfigError: a bad flag (the message names it): no or several model sources, an unknown
            benchmark, ``--k < 1``, a missing directory, an endpoint that does not answer.
    """
    sources = [f for f in ("model", "checkpoint", "endpoint") if getattr(args, f)]
    if len(sources) != 1:
        raise ConfigError(f"--model / --checkpoint / --endpoint: give exactly one (got {sources or 'none'})")
    if args.model:  # a pulled model's name -> its directory (checked against its manifest)
        from ..models.pull.store import resolve_model_path

        args = argparse.Namespace(**{**vars(args), "model": resolve_model_path(args.model, "--model")})
    cfg = _experiment_config(args)
    if cfg.train.torch_threads:  # as copc train: 1 on a busy 2-core machine (docs/evaluation.md)
        import torch

        torch.set_num_threads(cfg.train.torch_threads)
    from ..config.specs import agent_loop_config
    from ..evaluate.records import RESULTS_FILE
    from ..evaluate.runner import EvalSettings

    try:
        settings = EvalSettings(k=args.k, temperature=args.temperature, max_samples=args.max_samples,
                                seed=args.seed, max_new_tokens=cfg.rollout.max_new_tokens,
                                agent=agent_loop_config(cfg), concurrency=cfg.rollout.concurrency)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    benchmarks = _specs(args, cfg, settings.max_samples)
    _preflight_policy(args)
    out = Path(args.out or "runs/eval")
    from ..outputs.lock import lock_output_dir

    lock = lock_output_dir(out, "--out")  # one writer per directory, held until the report is written
    results = out / RESULTS_FILE
    if results.exists() and results.stat().st_size and not args.resume:
        raise _fail("--out", str(out), f"already has {RESULTS_FILE}; pass --resume to continue it or "
                    "choose another --out")
    policy = policy_identity(args, None if args.endpoint else _model_dir(args, cfg))
    record = _check_resume(out, {"seed": settings.seed, "temperature": settings.temperature, "k": settings.k,
                                 "max_new_tokens": settings.max_new_tokens, "agent": repr(settings.agent),
                                 "benchmarks": {s.name: f"{s!r} {k.settings!r}" for s, k, _ in benchmarks},
                                 "policy": policy,
                                 "_shown": str(args.endpoint or args.model or args.checkpoint),
                                 "_tokenizer": args.tokenizer},
                           args.resume)
    out.mkdir(parents=True, exist_ok=True)
    try:
        report = asyncio.run(_run(args, cfg, out, settings, benchmarks, record))
    finally:
        lock.close()
    print(json.dumps({b: {k: v for k, v in m.items() if not isinstance(v, dict)}
                      for b, m in report["benchmarks"].items()}, indent=1))
    print(f"copc eval: report in {out / 'report.md'}")
    return report
