"""Connecting to Ray: a leaf module (it imports nothing from ``trainer``), so the Ray rollout
launcher, the Ray-hosted learner ranks and sweeps all start Ray the same way without importing
each other."""

from __future__ import annotations


def init_ray(address: str = "", num_cpus: int | None = None) -> bool:
    """Connect to a Ray cluster (``address``) or start a local one with ``num_cpus`` CPUs.

    Returns:
        ``True`` if this call started/connected Ray (the caller should shut it down),
        ``False`` if Ray was already initialised in this process (e.g. by a test).
    """
    import ray

    if ray.is_initialized():
        return False
    ray.init(address=address or None, num_cpus=None if address else num_cpus,
             include_dashboard=False, ignore_reinit_error=True, log_to_driver=True)
    return True
