"""The ``vllm`` engine's preflight (issue 43): what the engine cannot serve exactly is refused in one
line before any work — greedy at a temperature other than 1 (vLLM would report temperature-1
log-probs; top_p / top_k are served: their processed log-probs are the truncated ones the learner
replays), a missing server virtualenv, too few adapters kept for a fixed lag — through the real config and
the real ``copc train`` command. No server is started."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from trainer.config import ConfigError, load_config
from trainer.config.specs import preflight_engine
from trainer.engines.vllm_factory import VLLMSettings, adapters_kept
from trainer.engines.vllm_launcher import DEFAULT_VLLM_PYTHON

ROOT = Path(__file__).resolve().parents[3]
CONFIG = str(ROOT / "configs" / "math_tool" / "cpu_tiny.yaml")
HAVE_VENV = Path(DEFAULT_VLLM_PYTHON).exists()
LORA = ["learner.lora.rank=4", "learner.lora.alpha=8"]


def _check(*overrides: str) -> None:
    preflight_engine(load_config(CONFIG, ["rollout.engine=vllm", *overrides]))


def test_top_p_and_top_k_pass_and_greedy_off_temperature_1_is_refused_naming_the_key():
    venv = [] if HAVE_VENV else ["rollout.engine_settings.url=http://127.0.0.1:9"]  # attach: no venv needed
    _check("rollout.top_p=0.9", "rollout.top_k=20", *venv)  # processed log-probs are the truncated ones
    with pytest.raises(ConfigError, match=r"^rollout\.top_k=1 \(greedy\) with rollout\.temperature=0\.6 "):
        _check("rollout.top_k=1", "rollout.temperature=0.6")


def test_a_missing_server_venv_names_the_setup_command(tmp_path):
    missing = tmp_path / "no-venv" / "bin" / "python"
    with pytest.raises(ConfigError) as ei:
        _check(f"rollout.engine_settings.python={missing}")
    assert str(ei.value) == (f"rollout.engine_settings.python={str(missing)!r}: no vLLM interpreter there "
                             "(the server's own virtualenv); create it with `bash scripts/setup.sh --vllm` "
                             "(~7 min, 3.5 GB)")


def test_a_server_to_attach_to_needs_no_venv_and_the_local_launcher(tmp_path):
    """``engine_settings.url``: nothing is launched, so a missing ``.venv-vllm`` is not refused; with
    the Ray launcher (each rollout worker launches its own server) it is, in one line."""
    missing = tmp_path / "no-venv" / "bin" / "python"
    url = "rollout.engine_settings.url=http://127.0.0.1:8000"
    _check(url, f"rollout.engine_settings.python={missing}")
    with pytest.raises(ConfigError) as ei:
        _check(url, f"rollout.engine_settings.python={missing}", "launcher.kind=ray")
    assert str(ei.value) == ("rollout.engine_settings.url=http://127.0.0.1:8000 with launcher.kind=ray: each "
                             "Ray rollout worker launches its own server; attach to a running server with "
                             "launcher.kind=local, or leave url empty")


def test_copc_train_attached_to_nothing_is_one_config_error_line(tmp_path):
    """The CLI a user runs: a url where nothing listens exits 2 with one ``config error`` line naming
    the key and the command that starts a suitable server, no traceback (before: exit 1 and a
    47-line traceback of VLLMLaunchError)."""
    res = subprocess.run([sys.executable, "-m", "trainer.cli", "train", "--config", CONFIG,
                          f"output_dir={tmp_path / 'run'}", "rollout.engine=vllm",
                          "rollout.engine_settings={url: 'http://127.0.0.1:9'}", "learner.lora.rank=4",
                          "warm_start.enabled=false", "eval.enabled=false", "logging.progress=false"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 2, (res.returncode, res.stderr[-2000:])
    assert "Traceback" not in res.stderr
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("copc train: config error: rollout.engine_settings.url=http://127.0.0.1:9: no "
                           "vLLM server answers (ConnectError"), last
    assert "; start one with: " in last and "--served-model-name policy" in last


@pytest.mark.skipif(not HAVE_VENV, reason=f"{DEFAULT_VLLM_PYTHON} missing: bash scripts/setup.sh --vllm")
def test_a_fixed_lag_needs_its_adapters_kept():
    with pytest.raises(ConfigError, match=r"^rollout\.engine_settings\.keep_adapters=2 with train\.staleness "
                                          r"fixed lag 2: the adapters of 3 policy versions must stay loaded; "
                                          r"set keep_adapters >= 3 \(or 0: derived\)$"):
        _check(*LORA, "train.staleness={mode: fixed, lag: 2}", "rollout.engine_settings.keep_adapters=2")
    with pytest.raises(ConfigError, match=r"^rollout\.engine_settings\.max_loras=2: must be >= the 5 "
                                          r"adapters kept \(keep_adapters\)$"):
        _check(*LORA, "train.staleness={mode: fixed, lag: 4}", "rollout.engine_settings.max_loras=2")
    _check(*LORA, "train.staleness={mode: fixed, lag: 2}", "rollout.engine_settings.keep_adapters=3")
    _check(*LORA, "train.staleness={mode: fixed, lag: 2}")  # the default (0) derives k + 1 = 3
    _check("train.staleness={mode: fixed, lag: 2}", "rollout.engine_settings.keep_adapters=1")  # full weights
    _check(*LORA, "train.staleness={mode: bounded, max: 4}")  # bounded staleness: the default keeps 2


def test_adapters_kept_are_derived_from_the_fixed_lag():
    assert adapters_kept(VLLMSettings(), 4) == (5, 5) and adapters_kept(VLLMSettings(), 0) == (1, 1)
    assert adapters_kept(VLLMSettings(), None) == (2, 2)  # bounded: the current and the previous one
    assert adapters_kept(VLLMSettings(keep_adapters=3, max_loras=4), 1) == (3, 4)
    assert adapters_kept(VLLMSettings(max_loras=8), 2) == (3, 8)


def test_copc_train_refuses_before_any_work(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "trainer.cli", "train", "--config", CONFIG,
                           f"output_dir={out}", "rollout.engine=vllm", "rollout.top_k=1",
                           "rollout.temperature=0.6"],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith(
        "copc train: config error: rollout.top_k=1 (greedy) with rollout.temperature=0.6 and "
        "rollout.engine=vllm: "), proc.stderr
    assert not (out / "init_model").exists() and not (out / "checkpoints").exists()  # nothing was built
