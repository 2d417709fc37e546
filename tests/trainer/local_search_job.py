"""The search main job's YAML (configs/search/cpu_smollm.yaml) with the ``local`` launcher, for tests that
run it in-process (the bf16 real-model test, the vLLM engine's search test)."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
JOB = REPO / "configs" / "search" / "cpu_smollm.yaml"


def local_search_job(tmp_path: Path, name: str = "cpu_smollm_local.yaml") -> Path:
    """The committed job's YAML with ``launcher: {kind: local}`` (an override cannot drop the Ray
    launcher's settings: ``launcher.kind=local`` is refused as 'takes no settings') and its
    ``defaults`` made absolute, written to ``tmp_path / name``; its path."""
    text = JOB.read_text()
    start, end = text.index("\nlauncher:"), text.index("\nwarm_start:")
    text = text[:start] + "\nlauncher:\n  kind: local" + text[end:]
    tasks = REPO / "configs" / "tasks" / "search.yaml"
    text = text.replace("defaults: [../tasks/search.yaml]", f"defaults: [{tasks}]")
    path = tmp_path / name
    path.write_text(text)
    return path
