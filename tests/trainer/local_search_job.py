"""The search main job's YAML (configs/search/cpu_smollm.yaml) with the ``local`` launcher, for tests that
run it in-process (the bf16 real-model test, the vLLM engine's search test)."""

from __future__ import annotations

from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
JOB = REPO / "configs" / "search" / "cpu_smollm.yaml"


def local_search_job(tmp_path: Path, name: str = "cpu_smollm_local.yaml") -> Path:
    """The committed job's YAML with ``launcher: {kind: local}`` (an override cannot drop the Ray
    launcher's settings: ``launcher.kind=local`` is refused as 'takes no settings') and its
    ``defaults`` made absolute, written to ``tmp_path / name``; its path. Read and written as YAML
    data, so the layout of the file (which keys come from its defaults) does not matter."""
    job = yaml.safe_load(JOB.read_text())
    job["launcher"] = {"kind": "local"}
    job["defaults"] = [str((JOB.parent / d).resolve()) for d in job.get("defaults", [])]
    path = tmp_path / name
    path.write_text(yaml.safe_dump(job, sort_keys=False, allow_unicode=True))
    return path
