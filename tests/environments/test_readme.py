"""The README's "Add your own tool environment" example runs as written."""

from __future__ import annotations

import re
from pathlib import Path

import environments

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_example_runs():
    text = README.read_text(encoding="utf-8")
    section = text.split("<!-- section: environments -->", 1)[1].split("<!-- section:", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.DOTALL)
    assert len(blocks) == 1
    try:
        exec(compile(blocks[0], "README.md[environments]", "exec"), {})
        assert "calc" in environments.list()
    finally:
        environments.DEFAULT_REGISTRY._specs.pop("calc", None)
