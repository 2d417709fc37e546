"""Errors an environment raises when its *infrastructure* fails (not the policy).

A policy that writes a wrong answer or broken code gets a reward; a sandbox that cannot
start, a retriever that does not answer or a reward checker that crashes is not the
policy's doing and must never be scored as a wrong answer (reward 0). Environments raise
:class:`InfrastructureError` for those; the rollout side ends the episode with
``finish_reason = "infra_error: ..."`` and the trainer excludes it from training,
counts it and re-queues its prompt (evaluation excludes it from the metrics).
"""

from __future__ import annotations


class InfrastructureError(RuntimeError):
    """A failure of the environment's machinery (sandbox, retriever, reward checker).

    Raised by ``reset`` / ``step`` (or by a tool or reward they call) after bounded
    retries have failed. The message says which service failed and how.
    """
