"""Project-wide pytest configuration: the ``gpu`` marker skips cleanly without CUDA."""

from __future__ import annotations

import pytest


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a hard dependency
        return False
    return bool(torch.cuda.is_available())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip every test marked ``gpu`` when no CUDA device is visible."""
    if _has_cuda():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (marker 'gpu'); none visible")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
