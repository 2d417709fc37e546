"""Secure, fast Python sandbox: ``Sandbox(SandboxConfig()).run(code, timeout_s, memory_mb)``.

Default isolation is bubblewrap (see docs/environments.md for exactly what is enforced);
warm fork-server workers make a call cost a ``fork`` instead of an interpreter start-up.
"""

from .config import SandboxConfig, SandboxResult, SandboxUnavailableError
from .pool import Sandbox, run

__all__ = ["Sandbox", "SandboxConfig", "SandboxResult", "SandboxUnavailableError", "run"]
