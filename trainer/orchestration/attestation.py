"""Weight-sync attestation: after a sync the engine's log-probs must be the learner's.

COPC reweights every token by ``π_old / µ``, where µ is the policy version the engine reports.
If a weight sync silently did not happen (a failed load, a stale adapter, a wrong version
counter), µ is not that version and the run looks merely stale. So:

1. when the learner holds a new policy version ``v`` (right after its step, and at the start),
   it computes the *reference*: its next-token distribution ``log softmax(logits / T)``, shape
   ``(K, V)`` float32, after each of ``K = 8`` fixed 8-token probe prompts
   (:data:`PROBE_PROMPTS`; one small no-grad forward of ``K × 8`` tokens);
2. after every sync of the rollouts to a version ``v`` (bounded staleness: the learner's newest
   weights; fixed lag: the kept copy of ``n − k``) the engine samples one token after each
   probe prompt, and its reported log-prob of that token is compared with the reference of the
   version it reports, ``ref_v[i, token]``;
3. ``sync/probe_max_abs_logp_diff`` (nats, max over the K tokens and the checks that finished
   since the previous step) and ``sync/probe_version`` are logged; a difference above
   ``train.sync_check_tolerance``, or an engine still on an older version than the sync's, stops
   the run with one line naming the version.

Because the reference is taken before the sync, the engine's side runs entirely beside training
(nothing waits for it; the loop collects finished checks at each step and awaits the rest only
when more than :data:`MAX_PENDING` are outstanding and at the end of the run), and a fixed lag is
checked too: references of the last ``s + 2`` versions are kept, ``s`` the staleness number (bound
or lag): ``(s + 2) × K × V × 4`` bytes, 4.8 MB per version for a 151k vocabulary. A check
therefore reports a failure up to a few steps after the sync it concerns, not before the next
step.

After a resume the versions kept from before it (a fixed lag's ``n − k`` … ``n − 1``, restored from
the checkpoint) have no reference: one is taken only when the learner makes a version, and
recomputing it would need the learner to load each kept version's weights. Their syncs are not
attested, and :meth:`SyncAttestor.unreferenced` says so once at the start of the run, naming the
versions and the first one that will be checked.

Off (:attr:`SyncAttestor.enabled` False, logged once) when the rollouts cannot sample one request
directly (no ``probe``: Ray rollouts) or the learner cannot give its next-token distribution (no
``next_token_logprobs``: a distributed or remote learner), or the vocabulary is smaller than the
probe's ids.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

import torch

from ..engines.base import SamplingParams
from ..errors import TrainingError

log = logging.getLogger(__name__)

#: The K probe prompts: fixed token ids every vocabulary of >= 39 tokens has (no tokenizer needed).
PROBE_PROMPTS = tuple(tuple(range(10 + 3 * i, 18 + 3 * i)) for i in range(8))
#: Checks outstanding at most; a further sync first awaits the oldest (bounded memory and lag).
MAX_PENDING = 4


@dataclass(frozen=True)
class SyncCheck:
    """Settings of the attestation.

    Attributes:
        tolerance: the largest allowed ``|log π_learner − log π_engine|`` over the probe's
            sampled tokens (nats, > 0).
        temperature: the rollout sampling temperature (both sides score ``logits / T``).

    Raises:
        ValueError: ``tolerance`` not > 0, naming ``train.sync_check_tolerance``.
    """

    tolerance: float
    temperature: float = 1.0

    def __post_init__(self) -> None:
        if not self.tolerance > 0:
            raise ValueError(f"train.sync_check_tolerance={self.tolerance!r}: must be > 0 (or null: off)")


def failure(version: int, diff: float, tolerance: float) -> TrainingError:
    """The one-line error of a failed check of the sync to ``version`` (``diff`` inf: the engine
    reported an older version)."""
    what = "reported another policy version than" if diff == float("inf") else \
        f"log-probs differ by {diff:.3g} nats from the learner's at"
    return TrainingError(f"weight sync check failed: after the sync the engine {what} policy version "
                         f"{version} (train.sync_check_tolerance={tolerance:g}); the behaviour "
                         "policy is not the recorded version, so COPC's ratios would be wrong")


class SyncAttestor:
    """The loop's attestation of every weight sync (module docstring).

    Args:
        check: the settings, or None (off).
        rollouts: needs ``async probe(prompt_ids, SamplingParams) -> GenerationResult``.
        learner: needs ``next_token_logprobs(prompt_ids (K, P) int64, temperature) -> (K, V)``.
        keep: references kept (versions; the staleness number + 2).

    Attributes:
        enabled: whether checks run.
        checked: ``version → max abs log-prob difference`` of every finished check (nats).
    """

    def __init__(self, check: SyncCheck | None, rollouts: Any, learner: Any, keep: int) -> None:
        self.check, self.keep = check, max(keep, 2)
        self._probe = getattr(rollouts, "probe", None)
        self._score = getattr(learner, "next_token_logprobs", None)
        self.enabled = check is not None and self._probe is not None and self._score is not None
        if check is not None and not self.enabled:
            log.info("weight-sync attestation off: the %s cannot take part",
                     "rollouts (no probe)" if self._probe is None else "learner (no next_token_logprobs)")
        self._refs: dict[int, torch.Tensor] = {}
        self._pending: list[asyncio.Task] = []
        self.checked: dict[int, float] = {}

    async def reference(self, version: int) -> float:
        """Take the learner's reference for ``version`` (its current weights), in a worker thread;
        a reference that fails (or a vocabulary smaller than the probe's ids) turns the
        attestation off, logged once.

        Returns:
            Seconds it took (0 when off).
        """
        if not self.enabled:
            return 0.0
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        ids = torch.tensor(PROBE_PROMPTS, dtype=torch.long)
        try:
            ref = await asyncio.to_thread(self._score, ids, self.check.temperature)
        except Exception as e:  # a secondary check: its own failure is logged, never the run's
            log.warning("weight-sync attestation off: the learner's reference failed: %s: %s",
                        type(e).__name__, e)
            self.enabled = False
            return 0.0
        if ref.shape[-1] <= int(ids.max()):
            log.info("weight-sync attestation off: vocabulary of %d < the probe's ids", ref.shape[-1])
            self.enabled = False
            return 0.0
        self._refs[version] = ref.detach().to("cpu", torch.float32)
        for old in [v for v in self._refs if v <= version - self.keep]:
            del self._refs[old]
        return loop.time() - t0

    def unreferenced(self, kept: list[int], now: int) -> list[int]:
        """Log once (warning) that the syncs to the kept versions without a reference will not be
        attested: ``kept`` are the versions a fixed lag may still sync to (restored by a resume),
        ``now`` the learner's version, the first one checked. Nothing when off or when every kept
        version has a reference (a fresh run).

        Returns:
            The kept versions without a reference, sorted.
        """
        missing = sorted(v for v in kept if v not in self._refs)
        if self.enabled and missing:
            log.warning("weight-sync attestation: the syncs to policy versions %s (kept from before the "
                        "resume) are not attested: their references were not kept; checks start with "
                        "version %d", missing, now)
        return missing

    async def synced(self, version: int) -> float:
        """The rollouts now generate with ``version``: start its check (when its reference is
        kept). Awaits the oldest check first when :data:`MAX_PENDING` are outstanding.

        Returns:
            Seconds waited for an older check.

        Raises:
            TrainingError: an older check that had to be awaited failed.
        """
        waited = 0.0
        if not self.enabled or version not in self._refs:
            return waited
        if len(self._pending) >= MAX_PENDING:
            t0 = asyncio.get_running_loop().time()
            await asyncio.wait([self._pending[0]])
            waited = asyncio.get_running_loop().time() - t0
        self._pending.append(asyncio.create_task(self._compare(version)))
        return waited

    async def _compare(self, version: int) -> tuple[int, float] | None:
        """Sample one token after each probe prompt; ``(version, max abs diff)`` against the
        reference of the version the engine reports; None when that one is no longer kept."""
        k = len(PROBE_PROMPTS)
        results = await asyncio.gather(*(
            self._probe(list(p), SamplingParams(temperature=self.check.temperature, max_new_tokens=1,
                                                seed=version * k + i)) for i, p in enumerate(PROBE_PROMPTS)))
        worst, at = 0.0, version
        for i, res in enumerate(results):
            if not res.token_ids:
                continue
            got = res.versions[0]
            if got < version:  # the engine did not take the sync
                return version, float("inf")
            ref = self._refs.get(got)
            if ref is None:  # a later sync overtook this check and its reference is gone
                return None
            worst, at = max(worst, abs(float(ref[i, res.token_ids[0]]) - float(res.logprobs[0]))), got
        return at, worst

    async def collect(self, wait: bool = False, timeout_s: float | None = None) -> dict[str, float]:
        """The finished checks' metrics (all outstanding ones with ``wait``, for at most
        ``timeout_s`` seconds): ``sync/probe_max_abs_logp_diff`` (max) and ``sync/probe_version``
        (the newest checked), ``{}`` when none.

        Raises:
            TrainingError: a check failed (module docstring).
        """
        if wait and self._pending:
            await asyncio.wait(self._pending, timeout=timeout_s)
        done = [t for t in self._pending if t.done()]
        self._pending = [t for t in self._pending if not t.done()]
        out: dict[str, float] = {}
        for task in done:
            try:
                res = task.result()
            except TrainingError:
                raise
            except Exception as e:  # the probe's own request failed: no verdict, not a training failure
                log.warning("weight-sync check could not run: %s: %s", type(e).__name__, e)
                continue
            if res is None:
                continue
            version, diff = res
            self.checked[version] = diff
            if not diff <= self.check.tolerance:
                raise failure(version, diff, self.check.tolerance)
            out["sync/probe_max_abs_logp_diff"] = max(diff, out.get("sync/probe_max_abs_logp_diff", 0.0))
            out["sync/probe_version"] = max(float(version), out.get("sync/probe_version", 0.0))
        return out

    def cancel(self) -> None:
        """Cancel the outstanding checks (the run is failing)."""
        for t in self._pending:
            t.cancel()
        self._pending = []
