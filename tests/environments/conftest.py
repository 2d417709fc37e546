"""Fixtures for the environments tests: one real bwrap sandbox pool per test session."""

from __future__ import annotations

import os

import pytest

from environments.sandbox import Sandbox, SandboxConfig

SECRET = "copc-test-secret-4f1e9a"


@pytest.fixture(scope="session")
def sandbox():
    """A 2-worker bwrap pool started while the host holds a secret environment variable."""
    os.environ["COPC_TEST_SECRET"] = SECRET
    try:
        sb = Sandbox(SandboxConfig(workers=2, timeout_s=5.0, memory_mb=512,
                                   max_output_bytes=8192, max_processes=16))
    finally:
        del os.environ["COPC_TEST_SECRET"]
    yield sb
    sb.close()
