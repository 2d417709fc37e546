"""Warm-starts shared between runs (``warm_start.cache_dir``): same settings → one SFT, reused
bit for bit; any setting the warm-start depends on → another key."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from trainer.app.run import run_experiment
from trainer.config import load_config
from trainer.config.specs import task_spec, warm_start_cache_spec
from trainer.warmstart.cache import cache_key, lookup, restore, store

from ..app.test_run_e2e import overrides


def test_cache_key_ignores_rl_settings_and_follows_warm_start_ones():
    base = load_config(None, [])
    key = cache_key(warm_start_cache_spec(base))
    for rl in ("preset=ppo_async", "algorithm.estimator_settings.eta_a=0.25", "train.staleness.mode=fixed",
               "train.staleness.max=3",
               "train.actor_lr=1e-3", "train.total_steps=7", "eval.k=4", "output_dir=/tmp/elsewhere",
               "warm_start.cache_dir=/tmp/other_cache", "rollout.engine_max_batch_size=1",
               "rollout.concurrency=3", "rollout.temperature=0.5"):
        assert cache_key(warm_start_cache_spec(load_config(None, [rl]))) == key, rl
    for ws in ("warm_start.steps=301", "warm_start.seed=1", "model.tiny.hidden_size=64", "train.seed=1",
               "task.env_kwargs={prompt_template: 'Q {problem}'}", "rollout.max_total_tokens=999",
               "task.settings.arithmetic_kinds=[mul]", "learner.backend_settings.autocast_dtype=bfloat16",
               "warm_start.micro_batch_size=4"):  # accumulation rounds differently: another result
        assert cache_key(warm_start_cache_spec(load_config(None, [ws]))) != key, ws
    # a speed knob that does not change the result (the shared prefix is exact) keeps the key, as
    # does micro_batch_size 0 (the whole batch: keys written before the setting existed still match)
    assert cache_key(warm_start_cache_spec(load_config(None, ["warm_start.micro_batch_size=0"]))) == key
    assert cache_key(warm_start_cache_spec(load_config(
        None, ["learner.backend_settings.shared_prefix_tokens=64"]))) == key


def test_store_is_atomic_and_first_writer_wins(tmp_path):
    src_a, src_b = tmp_path / "a", tmp_path / "b"
    for d, tag in ((src_a, "a"), (src_b, "b")):
        d.mkdir()
        (d / "config.json").write_text(tag)
    cache = tmp_path / "cache"
    assert lookup(cache, "k") is None
    errors: list[BaseException] = []

    def put(src):
        try:
            store(cache, "k", src)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=put, args=(s,)) for s in (src_a, src_b) * 4]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert (cache / "k" / "config.json").read_text() in ("a", "b")
    assert sorted(p.name for p in cache.iterdir()) == ["k"]  # no temporary directory left
    dst = tmp_path / "run" / "warm_start_model"
    dst.parent.mkdir()
    assert restore(cache, "k", dst)
    assert (dst / "config.json").read_text() == (cache / "k" / "config.json").read_text()
    assert not restore(cache, "missing", tmp_path / "x")


def test_two_runs_share_one_warm_start(tmp_path):
    cache = tmp_path / "ws_cache"
    extra = {"warm_start.enabled": "true", "warm_start.steps": "5", "warm_start.num_examples": "20",
             "warm_start.kind": "retool_arithmetic", "warm_start.cache_dir": str(cache),
             "task.train_data": "[]", "logging.plots": "false"}
    first = run_experiment(load_config(None, overrides(tmp_path / "a", "copc", steps=1, **extra)))
    eta_a = {"algorithm.estimator_settings.eta_a": "0.25"}
    second = run_experiment(load_config(None, overrides(tmp_path / "b", "copc", steps=1, **extra, **eta_a)))
    assert "reused_from" not in first["warm_start"]
    assert Path(second["warm_start"]["reused_from"]) == lookup(cache, cache_key(warm_start_cache_spec(
        load_config(None, overrides(tmp_path / "b", "copc", steps=1, **extra)))))
    wa = load_file(tmp_path / "a" / "warm_start_model" / "model.safetensors")
    wb = load_file(tmp_path / "b" / "warm_start_model" / "model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    # the reused SFT's own metrics travel with it (its loss curve), its wall time is this run's (0)
    sft_a = json.loads((tmp_path / "a" / "warm_start_model" / "sft_metrics.json").read_text())
    assert second["warm_start"]["sft/loss_last"] == sft_a["sft/loss_last"]
    assert second["warm_start"]["wall_s"] == 0.0


def test_native_tool_format_with_tag_warm_start_is_a_config_error(tmp_path):
    """The built-in warm-start traces are tag-format: asking for them with ``tool_format: hermes``
    used to crash deep inside trace generation (TraceError traceback)."""
    from trainer.config import ConfigError
    from trainer.tasks import build_task

    cfg = load_config(None, overrides(tmp_path / "h", "copc", steps=1, **{
        "warm_start.enabled": "true", "task.train_data": "[]",
        "task.env_kwargs": "{prompt_template: 'Q: {problem}\n', tool_format: hermes}"}))
    task = build_task(task_spec(cfg))
    try:
        with pytest.raises(ConfigError, match=r"task\.env_kwargs\.tool_format='hermes': the "
                                              r"'retool_arithmetic' warm-start traces are written in "
                                              r"\['tags'\] format"):
            task.check_warm_start(cfg.warm_start)
    finally:
        task.close()


def test_infrastructure_failure_during_warm_start_stops_with_a_training_error(tmp_path, monkeypatch):
    """A sandbox / retriever failure while the warm-start traces are played is a TrainingError
    (``copc train: stopped: warm start: ...``, exit 1), not a traceback of an unexpected crash."""
    from environments.errors import InfrastructureError
    from trainer.orchestration.loop import TrainingError
    from trainer.tasks.math_tool import MathToolTask

    def broken(self, ws, *, progress=True):
        raise InfrastructureError("sandbox worker died")

    monkeypatch.setattr(MathToolTask, "warm_start_traces", broken)
    cfg = load_config(None, overrides(tmp_path / "w", "copc", steps=1, **{
        "warm_start.enabled": "true", "warm_start.steps": "2", "task.train_data": "[]"}))
    with pytest.raises(TrainingError, match=r"warm start: sandbox worker died \(nothing trained yet"):
        run_experiment(cfg)
