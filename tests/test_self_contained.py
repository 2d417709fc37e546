"""A fresh clone is self-contained: with no data folder beside it and ``COPC_DATA_DIR`` unset, the
loaders read the repository's own ``data/`` (issue 42, item 1).

The repository is cloned (``git clone``: committed files only) into a temporary folder with
nothing beside it; this interpreter then imports the clone's packages (``PYTHONPATH`` = the clone,
ahead of the editable install's finder) from the clone's root and loads datasets by name. Row
counts and answers were checked by hand (``wc -l``; the first and last rows).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

READ = """
import json
import environments, retriever.cli
from environments.data import data_root
from environments.math_tool.data import load_math
from environments.search.env import load_qa
gsm8k, aime = load_math("gsm8k_test.jsonl"), load_math("aime2024")
print(json.dumps({
    "package": environments.__file__, "data_root": str(data_root()),
    "corpus": retriever.cli.default_corpus(),
    "gsm8k": [len(gsm8k), gsm8k[0]["id"], gsm8k[0]["answer"], gsm8k[-1]["id"], gsm8k[-1]["answer"]],
    "aime2024": [len(aime), aime[0]["id"], aime[0]["answer"], aime[-1]["id"], aime[-1]["answer"]],
    "nq": len(load_qa("nq")),
}))
"""


def test_a_fresh_clone_reads_its_own_data_without_copc_data_dir(tmp_path):
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("needs git and a git checkout")
    clone = tmp_path / "clone"
    res = subprocess.run(["git", "clone", "--quiet", str(REPO), str(clone)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["clone"]  # no ../shared beside it
    env = {k: v for k, v in os.environ.items() if k not in ("COPC_DATA_DIR", "PYTHONPATH")}
    env["PYTHONPATH"] = str(clone)
    res = subprocess.run([sys.executable, "-c", READ], cwd=clone, env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout)
    assert Path(got["package"]).is_relative_to(clone), got["package"]  # the clone's code, not REPO's
    assert got["data_root"] == str(clone / "data")
    assert got["corpus"] == str(clone / "data" / "wiki" / "corpus.jsonl")
    assert got["gsm8k"] == [1319, "gsm8k-test-0", "18", "gsm8k-test-1318", "14"]
    assert got["aime2024"] == [30, "aime2024-I-1", "204", "aime2024-II-15", "315"]
    assert got["nq"] == 500
