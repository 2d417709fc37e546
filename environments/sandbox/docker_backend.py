"""``isolation="docker"``: one throw-away container per call through the Docker SDK.

Slower than the bwrap pool (container start per call) but usable where a Docker daemon is
the only isolation available. Needs the ``docker`` package (extra ``copc[docker]``) and a
reachable daemon; otherwise :class:`SandboxUnavailableError` is raised at construction.
"""

from __future__ import annotations

import time

from .config import (
    STATUS_ERROR,
    STATUS_MEMORY,
    STATUS_OK,
    STATUS_TIMEOUT,
    SandboxConfig,
    SandboxResult,
    SandboxUnavailableError,
)


class DockerBackend:
    """Runs code with ``docker run --network none --read-only --pids-limit --memory``.

    Raises:
        SandboxUnavailableError: the ``docker`` package is missing or no daemon answers.
    """

    def __init__(self, config: SandboxConfig) -> None:
        try:
            import docker
        except ImportError as e:
            raise SandboxUnavailableError(
                "isolation='docker' needs the Docker SDK: pip install 'copc[docker]'") from e
        try:
            self._client = docker.from_env(timeout=5)
            self._client.ping()
        except Exception as e:
            raise SandboxUnavailableError(
                f"isolation='docker' needs a reachable Docker daemon (DOCKER_HOST or "
                f"/var/run/docker.sock); connecting failed: {e}") from e
        self.config = config

    def run(self, code: str, timeout_s: float, memory_mb: int) -> SandboxResult:
        """Run ``code`` in a fresh container; same contract as ``Sandbox.run``."""
        t0 = time.perf_counter()
        c = self._client.containers.run(
            self.config.docker_image, ["python", "-c", code], detach=True,
            network_disabled=True, read_only=True, mem_limit=f"{memory_mb}m",
            pids_limit=self.config.max_processes, user="65534:65534",
            tmpfs={"/tmp": f"size={self.config.tmp_size_mb}m"}, environment=self.config.env,
            working_dir="/tmp", cap_drop=["ALL"], security_opt=["no-new-privileges"],
        )
        try:
            try:
                exit_code = int(c.wait(timeout=timeout_s)["StatusCode"])
                timed_out = False
            except Exception:
                c.kill()
                exit_code, timed_out = -9, True
            limit = self.config.max_output_bytes
            out = c.logs(stdout=True, stderr=False)
            err = c.logs(stdout=False, stderr=True)
        finally:
            c.remove(force=True)
        truncated = len(out) + len(err) > limit
        out, err = out[:limit], err[: max(0, limit - min(len(out), limit))]
        stderr = err.decode(errors="replace")
        if timed_out:
            status, reason = STATUS_TIMEOUT, f"wall-clock timeout after {timeout_s:g} s"
        elif exit_code == 0:
            status, reason = STATUS_OK, None
        elif exit_code == 137 or stderr.rstrip().endswith("MemoryError"):
            status, reason = STATUS_MEMORY, f"memory limit of {memory_mb} MiB reached"
        else:
            status, reason = STATUS_ERROR, f"exited with status {exit_code}"
        return SandboxResult(stdout=out.decode(errors="replace"), stderr=stderr,
                             exit_code=exit_code, status=status, reason=reason,
                             truncated=truncated, wall_s=time.perf_counter() - t0,
                             duration_s=time.perf_counter() - t0)

    def close(self) -> None:
        """Close the SDK client."""
        self._client.close()
