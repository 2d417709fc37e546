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
   since the previous step), ``sync/probe_version`` (the newest of them) and ``sync/probe_checks``
   (how many: summed over the steps and the final collection, the number of syncs checked) are
   logged; a difference above ``train.sync_check_tolerance``, or an engine still on an older
   version than the sync's, stops the run with one line naming the version.

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

A reduced-precision engine (``model.dtype`` bfloat16 / float16) cannot meet a float32 tolerance:
its log-prob of a token depends on the batch the prompt was prefilled in (padding and masks change
the rounding; measured on SmolLM2-135M in bfloat16 at T = 0.6: 1e-5 nats for the probe prefilled
alone, up to 0.3 beside other requests, which is how it runs during training). So at the start of
the run, while engine and learner hold the same weights, :meth:`SyncAttestor.calibrate` measures
that gap: :data:`CALIBRATION_ROUNDS` rounds of the K probes, each prefilled beside partner requests
of other lengths, against the reference of the version the engine holds. The tolerance of the run
is then ``max(train.sync_check_tolerance, CALIBRATION_MARGIN × measured gap)``, stated in one log
line (a weaker check: a sync that moves the probe's log-probs by less is not detected; a sync that
did not happen is still caught by its version). A float32 engine keeps the configured tolerance.

Before any episode (and before the calibration) the engine itself is checked once
(:meth:`SyncAttestor.startup`): with the weights it started on, its log-probs, each probe prefilled
alone, must be the reference of the version it reports, within the configured tolerance (float32)
or :data:`STARTUP_REDUCED_TOLERANCE` (reduced precision). Otherwise an
engine serving other weights than the learner's from the start (a server attached by URL that holds
another run's weights, log-probs of another convention) would be caught only at the first sync,
after a step had trained on its episodes (and, since that sync loads the learner's weights, not at
all).

Ray rollout workers are each checked: their probe returns one result per worker, every one
compared with the reference (so a worker that missed a sync stops the run like a single engine),
and the Ray learner actor computes the reference.

Off (:attr:`SyncAttestor.enabled` False, logged once) when the rollouts cannot sample one request
directly (no ``probe``) or the learner cannot give its next-token distribution (no
``next_token_logprobs``: a distributed learner), or the vocabulary is smaller than the
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
#: Rounds of the start-up calibration of a reduced-precision engine (K probe tokens each).
CALIBRATION_ROUNDS = 8
#: A reduced-precision engine's tolerance: this many times the largest gap measured at start-up.
CALIBRATION_MARGIN = 2.0
#: Prompt lengths of the partner requests prefilled beside the probes while calibrating (the probes
#: then run padded, as beside the episodes of training).
PARTNER_LENGTHS = (9, 16, 32, 64, 128)
#: First sampling seed of the start-up check's probes (apart from the sync checks' ``version × K``).
STARTUP_SEED = 1 << 29
#: The start-up check's tolerance for a reduced-precision engine (nats), its probes prefilled one at a
#: time. It catches gross differences only: a server of another implementation in bf16 differs from a
#: bf16-autocast learner by up to 0.36 nats on SmolLM2 at T = 0.6 (vLLM, the search job's sync checks),
#: the embedded engine by ~1e-5; another log-prob convention (raw at T = 0.6) differs by ~1, other
#: weights by 0.7 to several nats. Smaller differences of weights are not separable from bf16 noise here.
STARTUP_REDUCED_TOLERANCE = 1.0


@dataclass(frozen=True)
class SyncCheck:
    """Settings of the attestation.

    Attributes:
        tolerance: the largest allowed ``|log π_learner − log π_engine|`` over the probe's
            sampled tokens (nats, > 0).
        temperature: the rollout sampling temperature (both sides score ``logits / T``).
        dtype: the engine's parameter dtype (``model.dtype``): other than ``float32``, the
            tolerance is calibrated at start-up (:meth:`SyncAttestor.calibrate`).

    Raises:
        ValueError: ``tolerance`` not > 0, naming ``train.sync_check_tolerance``.
    """

    tolerance: float
    temperature: float = 1.0
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if not self.tolerance > 0:
            raise ValueError(f"train.sync_check_tolerance={self.tolerance!r}: must be > 0 (or null: off)")


def failure(version: int, diff: float, tolerance: float, basis: str = "",
            startup: bool = False) -> TrainingError:
    """The one-line error of a failed check of the sync to ``version`` (``diff`` inf: the engine
    reported an older version), or with ``startup`` of the engine before any sync; ``basis``: how a
    calibrated tolerance was derived (empty: the configured one, ``tolerance``)."""
    limit = f"tolerance {basis}" if basis else f"train.sync_check_tolerance={tolerance:g}"
    if startup:
        return TrainingError(f"weight sync check failed at start-up: before any sync the engine's log-probs "
                             f"differ by {diff:.3g} nats from the learner's at policy version {version} "
                             f"({limit}): it does not serve the learner's weights (a server holding another "
                             "run's weights, or log-probs of another convention?), so COPC's ratios would "
                             "be wrong")
    what = "reported another policy version than" if diff == float("inf") else \
        f"log-probs differ by {diff:.3g} nats from the learner's at"
    return TrainingError(f"weight sync check failed: after the sync the engine {what} policy version "
                         f"{version} ({limit}); the behaviour "
                         "policy is not the recorded version, so COPC's ratios would be wrong")


def replicas(results: list) -> list[tuple[int, Any]]:
    """``(probe index, result)`` pairs of the probes' results, a probe that returned one result per
    engine replica (Ray rollout workers: a list) giving one pair per replica, so each is checked."""
    return [(i, r) for i, res in enumerate(results) for r in (res if isinstance(res, list) else [res])]


class SyncAttestor:
    """The loop's attestation of every weight sync (module docstring).

    Args:
        check: the settings, or None (off).
        rollouts: needs ``async probe(prompt_ids, SamplingParams) -> GenerationResult`` (or a list
            of them, one per engine replica: each is checked).
        learner: needs ``next_token_logprobs(prompt_ids (K, P) int64, temperature) -> (K, V)``.
        keep: references kept (versions; the staleness number + 2).

    Attributes:
        enabled: whether checks run.
        checked: ``version → max abs log-prob difference`` of every finished check (nats).
        tolerance: the tolerance checks use (nats): ``check.tolerance``, or the calibrated one of a
            reduced-precision engine (:meth:`calibrate`).
        calibrated_gap: the engine/learner gap measured by :meth:`calibrate` (nats), None before.
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
        self.tolerance = check.tolerance if check is not None else float("inf")
        self.calibrated_gap: float | None = None
        self._basis = ""  # how a calibrated tolerance was derived (failure messages)

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

    async def calibrate(self, version: int) -> float:
        """Measure a reduced-precision engine's gap to the learner at start-up and derive the run's
        tolerance from it (module docstring); a float32 engine keeps ``check.tolerance``.

        Call it while the engine holds ``version`` (whose reference is kept) and nothing else runs:
        :data:`CALIBRATION_ROUNDS` rounds of the K probes, each beside partner requests of
        :data:`PARTNER_LENGTHS` tokens. :attr:`tolerance` becomes ``max(check.tolerance,
        CALIBRATION_MARGIN × gap)``, logged (warning) with the gap. A probe that fails turns the
        attestation off (logged), as a failing reference does; an engine on another version, or no
        reference, leaves the tolerance as configured (logged).

        Returns:
            Seconds it took (0 when nothing was measured).
        """
        if not self.enabled or self.check.dtype == "float32":
            return 0.0
        ref = self._refs.get(version)
        if ref is None:
            log.warning("weight-sync attestation: no reference of policy version %d to calibrate the %s "
                        "engine's tolerance; train.sync_check_tolerance=%g applies", version,
                        self.check.dtype, self.check.tolerance)
            return 0.0
        loop = asyncio.get_running_loop()
        t0, k, gap = loop.time(), len(PROBE_PROMPTS), 0.0
        for r in range(CALIBRATION_ROUNDS):
            lengths = [PARTNER_LENGTHS[(r + j) % len(PARTNER_LENGTHS)] for j in range(1 + r % 3)]
            partners = [[PROBE_PROMPTS[j % k][-1 - (t % 8)] for t in range(n)] for j, n in enumerate(lengths)]
            seed = (1 << 30) + r * (k + 3)
            # every request queued in one go, so the engine prefills them together; a partner that
            # fails (a context shorter than its prompt) only leaves that round's probes less padded
            results = await asyncio.gather(*(
                self._probe(list(p), SamplingParams(temperature=self.check.temperature, max_new_tokens=1,
                                                    seed=seed + i))
                for i, p in enumerate([*PROBE_PROMPTS, *partners])), return_exceptions=True)
            failed = next((e for e in results[:k] if isinstance(e, BaseException)), None)
            if failed is not None:  # a secondary check: its own failure is logged, never the run's
                log.warning("weight-sync attestation off: its start-up calibration failed: %s: %s",
                            type(failed).__name__, failed)
                self.enabled = False
                return 0.0
            for i, res in replicas(results[:k]):
                if not res.token_ids:
                    continue
                if res.versions[0] != version:
                    log.warning("weight-sync attestation: the engine is at policy version %d, not %d, at "
                                "start-up; train.sync_check_tolerance=%g applies", res.versions[0], version,
                                self.check.tolerance)
                    return 0.0
                gap = max(gap, abs(float(ref[i, res.token_ids[0]]) - float(res.logprobs[0])))
        self.calibrated_gap = gap
        self.tolerance = max(self.check.tolerance, CALIBRATION_MARGIN * gap)
        self._basis = (f"{self.tolerance:.3g} nats: {CALIBRATION_MARGIN:g} x the {self.check.dtype} engine's "
                       f"gap of {gap:.3g} measured at start-up; train.sync_check_tolerance="
                       f"{self.check.tolerance:g}")
        log.warning("weight-sync attestation: model.dtype=%s: with the same weights the engine's log-probs "
                    "differ from the learner's by up to %.3g nats (%d probe tokens prefilled beside other "
                    "requests, as in training); checks use a tolerance of %.3g nats (%g x that; "
                    "train.sync_check_tolerance=%g holds for float32), so a sync that moves the probe's "
                    "log-probs by less is not detected", self.check.dtype, gap, CALIBRATION_ROUNDS * k,
                    self.tolerance, CALIBRATION_MARGIN, self.check.tolerance)
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
        task = asyncio.create_task(self._compare(version))
        task.add_done_callback(_mark_retrieved)  # a run stopped mid-check (SIGTERM) drops it quietly
        self._pending.append(task)
        return waited

    async def startup(self) -> float:
        """Check the engine before any sync, with the weights it started on: its log-probs must be
        the reference of the version it reports (call after :meth:`reference`, before
        :meth:`calibrate` and any episode). The probes are sent one at a time (each prefilled
        alone, where a reduced-precision engine is closest to the learner), and the tolerance is
        ``check.tolerance`` for a float32 engine, else at least :data:`STARTUP_REDUCED_TOLERANCE`:
        never the calibrated one, which is measured against whatever the engine holds and would
        absorb a difference of weights. A sync check would catch an engine serving other weights
        than the learner's (a server left with another run's weights, log-probs of another
        convention) only at the first sync, after a step trained on its episodes. An engine on a
        version without a reference (a resume's kept version) is not checked, nor is anything
        when the attestation is off.

        Returns:
            Seconds it took.

        Raises:
            TrainingError: the difference is above the tolerance (one line naming the version).
        """
        if not self.enabled or not self._refs:
            return 0.0
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        try:
            res = await self._compare(None, alone=True)
        except Exception as e:  # the probe's own request failed: no verdict (as in collect)
            log.warning("weight-sync check at start-up could not run: %s: %s", type(e).__name__, e)
            return loop.time() - t0
        if res is not None:
            version, diff = res
            limit, basis = self.check.tolerance, ""
            if self.check.dtype != "float32":
                limit = max(limit, STARTUP_REDUCED_TOLERANCE)
                basis = f"{limit:g} nats for a {self.check.dtype} engine's probe prefilled alone"
            if not diff <= limit:
                raise failure(version, diff, limit, basis, startup=True)
            log.info("engine checked at start-up: policy version %d, max |log-prob difference| %.3g nats",
                     version, diff)
        return loop.time() - t0

    async def _compare(self, version: int | None, alone: bool = False) -> tuple[int, float] | None:
        """Sample one token after each probe prompt; ``(version, max abs diff)`` against the
        reference of the version the engine reports; None when that one is no longer kept.
        ``version`` None (the start-up check): no version is expected. ``alone``: one probe at a
        time, else all queued at once."""
        k = len(PROBE_PROMPTS)
        seed0 = STARTUP_SEED if version is None else version * k
        probes = [(list(p), SamplingParams(temperature=self.check.temperature, max_new_tokens=1,
                                           seed=seed0 + i)) for i, p in enumerate(PROBE_PROMPTS)]
        if alone:
            results = [await self._probe(*p) for p in probes]
        else:
            results = await asyncio.gather(*(self._probe(*p) for p in probes))
        worst, at = 0.0, -1 if version is None else version
        for i, res in replicas(results):
            if not res.token_ids:
                continue
            got = res.versions[0]
            if version is not None and got < version:  # the engine did not take the sync
                return version, float("inf")
            ref = self._refs.get(got)
            if ref is None:  # a later sync overtook this check and its reference is gone
                return None
            worst = max(worst, abs(float(ref[i, res.token_ids[0]]) - float(res.logprobs[0])))
            at = max(at, got)
        return at, worst

    async def collect(self, wait: bool = False, timeout_s: float | None = None) -> dict[str, float]:
        """The finished checks' metrics (all outstanding ones with ``wait``, for at most
        ``timeout_s`` seconds): ``sync/probe_max_abs_logp_diff`` (max), ``sync/probe_version``
        (the newest checked) and ``sync/probe_checks`` (how many finished), ``{}`` when none.

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
            if not diff <= self.tolerance:
                raise failure(version, diff, self.tolerance, self._basis)
            out["sync/probe_max_abs_logp_diff"] = max(diff, out.get("sync/probe_max_abs_logp_diff", 0.0))
            out["sync/probe_version"] = max(float(version), out.get("sync/probe_version", 0.0))
            out["sync/probe_checks"] = out.get("sync/probe_checks", 0.0) + 1.0
        return out

    def cancel(self) -> None:
        """Cancel the outstanding checks (the run is failing)."""
        for t in self._pending:
            t.cancel()
        self._pending = []


def _mark_retrieved(task: asyncio.Task) -> None:
    """Read a finished check's exception, so that a check the run never collects (it stopped, or
    the engine closed under it) is not reported by asyncio as 'Task exception was never retrieved';
    :meth:`SyncAttestor.collect` still sees it through ``task.result()``."""
    if not task.cancelled():
        task.exception()
