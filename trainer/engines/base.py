"""The async inference-engine protocol shared by the embedded engine and SGLang.

Token-in/token-out: an engine receives token ids and returns new token ids with
the behavior log-prob of each and the policy version that produced it. The
log-prob convention is defined once in :mod:`trainer.logprobs` and used by the
learner too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

#: Why one generation request stopped (:attr:`GenerationResult.finish_reason`): a stop string, the
#: length budget, EOS, or an abort. Not :class:`trainer.rollout.trajectory.FinishReason`, which is
#: why a whole *episode* ended.
StopReason = Literal["stop", "length", "eos", "abort"]


@dataclass(frozen=True)
class SamplingParams:
    """Sampling parameters of one generation request (validated).

    Attributes:
        temperature: > 0; log-probs are reported under ``softmax(logits / temperature)``.
        top_p: nucleus mass in (0, 1]; 1 disables.
        top_k: keep the k most likely tokens; 0 or -1 disables.
        max_new_tokens: most tokens to generate (tokens), >= 1.
        stop: stop strings; generation ends after the token that completes one (it is kept),
            matched on the decoded text of the generated tokens, whatever tokens spell it.
        seed: per-request RNG seed (None: engine RNG).
        ignore_eos: keep generating after EOS (benchmarks).

    Raises:
        ValueError: naming the field and value, on construction.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 256
    stop: tuple[str, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        """Validate ranges."""
        if not self.temperature > 0:
            raise ValueError(f"SamplingParams.temperature={self.temperature!r}: must be > 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p={self.top_p!r}: must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"SamplingParams.top_k={self.top_k!r}: must be -1, 0 or a positive int")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens={self.max_new_tokens!r}: must be an int >= 1")
        if isinstance(self.stop, str) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"SamplingParams.stop={self.stop!r}: must be a tuple of non-empty strings")


@dataclass
class GenerationResult:
    """What an engine returns for one request.

    Attributes:
        token_ids: new token ids (``len == n``), EOS included when it ended the request.
        logprobs: behavior log-prob of each new token (floats, natural log, ``len == n``).
        versions: policy version that produced each new token (``len == n``; they differ
            only if the engine allows weight updates in the middle of a request).
        finish_reason: ``"stop"`` (stop string), ``"eos"``, ``"length"`` or ``"abort"``.
        text: decoded new text (for logging; the loop works on ``token_ids``).
    """

    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: StopReason
    text: str = ""
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        """Check that ids, log-probs and versions are aligned."""
        n = len(self.token_ids)
        if len(self.logprobs) != n or len(self.versions) != n:
            raise ValueError(
                f"GenerationResult misaligned: {n} token_ids, {len(self.logprobs)} logprobs, "
                f"{len(self.versions)} versions")


@runtime_checkable
class InferenceEngine(Protocol):
    """Async engine: generate from token ids; update weights to a new policy version.

    Implementations: :class:`trainer.engines.embedded.EmbeddedEngine` (in-process,
    CPU default) and :class:`trainer.engines.sglang.SGLangEngine` (GPU, HTTP).
    """

    @property
    def version(self) -> int:
        """Policy version currently used for new tokens."""

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> GenerationResult:
        """Generate a continuation of ``prompt_ids``.

        Raises:
            EngineError: when the engine fails (the agent loop retries).
        """

    async def update_weights(self, source: object, version: int) -> None:
        """Load new weights (a state dict or a checkpoint path) as policy ``version``."""

    async def pause(self) -> None:
        """Stop admitting new work and wait for in-flight requests to finish."""

    async def resume(self) -> None:
        """Admit work again after :meth:`pause`."""

    async def close(self) -> None:
        """Release resources (threads, subprocesses)."""


class EngineError(RuntimeError):
    """A generation request failed inside an engine (retryable by the caller)."""


class EngineClosedError(EngineError):
    """A generation request met an engine that was closed (the run is stopping): never retried."""
