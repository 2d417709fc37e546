"""``pip install .`` (not editable) gives a working ``copc``: nothing is read from the source tree.

A copy of the project (what ``git`` would ship: no ``.venv``, ``runs``, ``tests``) is built into a
wheel and installed into a fresh virtualenv. The dependencies come from this interpreter's
site-packages through a ``.pth`` line, which adds that directory to ``sys.path`` without running
the ``.pth`` files there, so the development install's editable finder (which maps ``trainer``
etc. to this checkout) is not active. Then, from an unrelated working directory, the installed
modules must come from the new environment and ``copc train`` must finish a few steps of the
CPU-tiny math config (its path passed absolutely).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("seams", "copc", "environments", "retriever", "trainer")

CHECK = """
import json, os, sys
from pathlib import Path
import seams, copc, environments, retriever, trainer, trainer.cli, trainer.tasks, trainer.tasks.generic
from environments.data import data_root
print(json.dumps({
    "files": {m.__name__: m.__file__ for m in (seams, copc, environments, retriever, trainer, trainer.tasks)},
    "path": sys.path, "meta_path": [repr(f) for f in sys.meta_path],
    "data_root": str(data_root()), "cwd": os.getcwd(),
}))
"""

#: An installed copy has no data/ beside its packages: a dataset read without COPC_DATA_DIR fails
#: with a message naming the variable.
NO_DATA = """
from environments.math_tool.data import load_math
try:
    load_math("aime2024")
except FileNotFoundError as e:
    print(e)
"""


def _run(argv: list[str], **kw) -> subprocess.CompletedProcess:
    res = subprocess.run(argv, capture_output=True, text=True, **kw)
    assert res.returncode == 0, (f"{argv[:4]} failed ({res.returncode}):\n"
                                 f"{res.stdout[-2000:]}\n{res.stderr[-4000:]}")
    return res


@pytest.mark.slow
def test_non_editable_install_trains_from_another_directory(tmp_path):
    src = tmp_path / "src"
    anywhere = shutil.ignore_patterns("*.egg-info", "__pycache__")
    top = {".git", ".venv", "runs", "outputs", "build", "dist", ".pytest_cache", ".ruff_cache", ".hypothesis",
           "tests", "benchmarks"}  # run artefacts at the root only: trainer/outputs/ is a package

    def ignore(folder: str, names: list[str]) -> set[str]:
        skip = anywhere(folder, names)
        return skip | (top & set(names)) if Path(folder) == REPO else skip

    shutil.copytree(REPO, src, ignore=ignore)
    wheels = tmp_path / "wheels"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
          "--quiet", "-w", str(wheels), str(src)], timeout=300)
    (wheel,) = wheels.glob("copc-*.whl")

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], timeout=120)
    py = venv / "bin" / "python"
    _run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "--no-index",
          "--quiet", str(wheel)], timeout=300)
    site = Path(_run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]
                     ).stdout.strip())
    (site / "_dev_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")

    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["COPC_DATA_DIR"] = str(tmp_path / "data")
    info = json.loads(_run([str(py), "-c", CHECK], cwd=work, env=env, timeout=120).stdout)
    for name, file in info["files"].items():
        assert Path(file).is_relative_to(site), f"{name} imported from {file}, not the install at {site}"
    assert not any("__editable__" in f for f in info["meta_path"]), info["meta_path"]
    assert not any(Path(p).resolve() == REPO for p in info["path"] if p), info["path"]
    assert info["data_root"] == str(tmp_path / "data")  # COPC_DATA_DIR, not the source tree
    no_var = {k: v for k, v in env.items() if k != "COPC_DATA_DIR"}
    message = _run([str(py), "-c", NO_DATA], cwd=work, env=no_var, timeout=120).stdout.strip()
    assert message == (f"data file '{site / 'data' / 'aime2024.jsonl'}' not found (the default data "
                       f"directory '{site / 'data'}' does not exist, as in an installed copy: set "
                       "$COPC_DATA_DIR to the folder holding the data)")

    copc_script = venv / "bin" / "copc"
    assert copc_script.read_text().splitlines()[0] == f"#!{py}"
    out = tmp_path / "run"
    _run([str(copc_script), "train", "--config", str(REPO / "configs/math_tool/cpu_tiny.yaml"),
          "train.total_steps=2", "warm_start.enabled=false", "eval.enabled=false", f"output_dir={out}",
          "logging.progress=false", "logging.plots=false", "logging.tensorboard=false"],
         cwd=work, env=env, timeout=900)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["task"] == "math_tool"
    assert summary["trained_uids"] == 32  # 2 steps x 16 prompts
    assert summary["infra_failed"] == 0
    assert not (work / "runs").exists()
