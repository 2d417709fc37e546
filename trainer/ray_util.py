"""Connecting to Ray: a leaf module (it imports nothing from ``trainer``), so the Ray rollout
launcher (``launcher.kind: ray``), the Ray-hosted learner ranks (``learner.backend_settings.launch:
ray``) and ``copc sweep``'s Ray pool all start or join Ray through the one :func:`connect_ray`
without importing each other."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RayClusterSettings:
    """Which Ray cluster a launcher runs on: the settings every launcher registered with the
    ``ray_cluster`` capability has (``copc sweep`` reads them to run its cells on that cluster).

    Attributes:
        address: an existing cluster (``HEAD:6379``); empty: start a local one.
        num_cpus: CPUs of a local cluster (ignored with ``address``), >= 1.

    Raises:
        ValueError: ``num_cpus < 1`` (one line naming the field).
    """

    address: str = ""
    num_cpus: int = 2

    def __post_init__(self) -> None:
        if isinstance(self.num_cpus, bool) or not isinstance(self.num_cpus, int) or self.num_cpus < 1:
            raise ValueError(f"num_cpus={self.num_cpus!r}: must be an int >= 1")


def connect_ray(address: str = "", num_cpus: int | None = None, *, log_to_driver: bool = True) -> bool:
    """Connect to the Ray cluster at ``address``, or start a local one with ``num_cpus`` CPUs; nothing
    when Ray is already initialised in this process (e.g. by a test, or the sweep that started it).

    Args:
        address: ``HOST:PORT`` of a running cluster; empty: a local cluster.
        num_cpus: CPUs of a local cluster (None: Ray's default, all cores; ignored with ``address``).
        log_to_driver: forward the actors' stdout/stderr to this process.

    Returns:
        ``True`` if this call started/connected Ray (the caller should ``ray.shutdown()`` when done),
        ``False`` if Ray was already initialised in this process.

    Raises:
        ConnectionError / RuntimeError: from ``ray.init`` (no cluster at ``address``).
    """
    import ray

    if ray.is_initialized():
        return False
    ray.init(address=address or None, num_cpus=None if address else num_cpus,
             include_dashboard=False, ignore_reinit_error=True, log_to_driver=log_to_driver)
    return True
