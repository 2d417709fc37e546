"""One harness episode: the chat-completion calls of one agent run, recorded token by token.

Token-in/token-out, as in the agent loop (:mod:`trainer.rollout.agent_loop`): the first call's
messages are rendered with the policy tokenizer's chat template (its ``tools`` given); every later
call must send back the history the endpoint knows — the previous call's messages, then the
assistant message it returned — followed by new messages (tool results, user turns). Those new
messages are rendered on their own as an observation turn
(:meth:`~trainer.rollout.observation.ChatTurns.observation_ids`) and appended to the ids actually
sampled, so what the model generated is never re-tokenised. The trajectory is built through
the one mask producer, :meth:`Trajectory.append_model_tokens` (model tokens: trainable, with their
behaviour log-probs and versions) / :meth:`Trajectory.append_observation_tokens` (everything else:
masked).

**Edited history** (the rule, ``docs/harness.md``): a call whose history is not the known one
extended by new messages (an earlier message changed, removed or reordered; an assistant turn the
agent rewrote; other ``tools``; a call that adds no message) is still answered — rendered from its
messages afresh — but the episode is *dropped*: its trajectory ends ``history_edited`` (excluded
from training and scoring like an infrastructure failure, counted in ``rollout/infra_failed`` /
evaluation's ``failed/history_edited``; :attr:`Episode.edits` counts the edited calls).

**Templates that drop ``tools``.** Some chat templates ignore the ``tools`` argument (SmolLM2's
renders only the messages): the model then never sees the tool schemas the agent sends. The first
call with ``tools`` checks it (:func:`template_shows_tools`) and warns once per model and process
(once per run; once per Ray rollout worker), naming the model.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import Mapping
from typing import Any

from ..engines.base import EngineError, InferenceEngine, SamplingParams
from ..rollout.agent_loop import AgentLoopConfig, generate_with_retries
from ..rollout.observation import ChatTurns
from ..rollout.timing import EpisodeClock
from ..rollout.trajectory import FinishReason, Trajectory, finish_text
from .wire import (
    RequestError,
    assistant_message,
    completion,
    normalize_message,
    stop_strings,
    template_message,
)

#: Seed stride between the calls of one episode (a prime).
CALL_SEED_STRIDE = 104729
#: The conversation :func:`template_shows_tools` renders with and without the tools.
TOOLS_PROBE = ({"role": "user", "content": "?"},)

log = logging.getLogger(__name__)
#: ``(model name, chat template) → whether the template renders tools``: one check (and warning) each.
_SHOWS_TOOLS: dict[tuple[str, str], bool] = {}


def template_shows_tools(tokenizer: Any, tools: Any) -> bool:
    """Whether ``tokenizer``'s chat template shows the model ``tools`` (OpenAI function schemas):
    :data:`TOOLS_PROBE` rendered with them differs from the same rendered without them.

    Checked once per model (``tokenizer.name_or_path``) and template in a process; the first time
    a template is found to drop them, one warning names the model (the schemas never reach it:
    describe the tools in the messages, as ``docs/harness.md``'s example does, or use a model whose
    template renders ``tools``).

    Args:
        tokenizer: the policy tokenizer (with a ``chat_template``). tools: non-empty schemas.

    Returns:
        True when the rendering changes with ``tools``.

    Raises:
        ConfigError: the tokenizer has no chat template (as :class:`ChatTurns`).
    """
    name = str(getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__)
    key = (name, str(getattr(tokenizer, "chat_template", "")))
    if key not in _SHOWS_TOOLS:
        probe = [dict(m) for m in TOOLS_PROBE]
        shown = ChatTurns(tokenizer, tools).render(probe, True) != ChatTurns(tokenizer).render(probe, True)
        _SHOWS_TOOLS[key] = shown
        if not shown:
            log.warning("harness: the chat template of %s ignores the requests' tools: the model never "
                        "sees their schemas (describe them in the messages, as docs/harness.md's example "
                        "does, or use a model whose template renders tools)", name)
    return _SHOWS_TOOLS[key]


class EpisodeInfraError(RuntimeError):
    """The engine failed this episode's call (after retries): answered ``503``."""


class EpisodeClosedError(RuntimeError):
    """A call reached an episode whose agent has returned (:meth:`Episode.close`): answered ``410``,
    and it changed nothing."""


class Episode:
    """The state of one agent run behind one API key (used on the engine's event loop only).

    Args:
        engine: the rollout engine (``generate`` only). tokenizer: the policy tokenizer (with a
            ``chat_template``). sampling: the episode's sampling parameters (temperature, top-p/k
            and seed are the run's; a request's ``max_tokens`` / ``stop`` apply within them).
        cfg: the episode budgets (``max_total_tokens``, ``max_turns``, ``max_observation_tokens``,
            engine retries). tool_format: ``hermes`` | ``openai`` (the parser of tool calls).
        sample_id, group_id: the trajectory's ids.

    Attributes:
        trajectory: the tokens so far (``None`` before the first call).
        calls: calls answered. edits: calls whose history was edited. tool_calls: tool calls
            returned to the agent (parsed from the completions).
        failure: the ``finish_reason`` that ends the episode regardless of the agent's outcome
            (an engine failure, a budget the agent ran into, an edited history), or ``""``.
        closed: set by :meth:`close` once the agent has returned: the trajectory is frozen.
    """

    def __init__(self, engine: InferenceEngine, tokenizer: Any, sampling: SamplingParams,
                 cfg: AgentLoopConfig, tool_format: str, sample_id: Any, group_id: Any) -> None:
        self.engine, self.tok, self.sampling, self.cfg = engine, tokenizer, sampling, cfg
        self.tool_format, self.sample_id, self.group_id = tool_format, sample_id, group_id
        self.trajectory: Trajectory | None = None
        self.calls = self.edits = self.tool_calls = 0
        self.length_capped = False  # the latest call was cut at rollout.max_new_tokens
        self.failure = ""
        self._chat: ChatTurns | None = None
        self._known: list[tuple] = []
        self._tools = ""
        self._pending: list[int] = []
        self._last_token: int | None = None
        self.clock = EpisodeClock()
        self._inside_s = 0.0  # seconds inside complete() (the endpoint's own time, generation included)
        self._lock = asyncio.Lock()
        self.closed = False

    def close(self) -> None:
        """Freeze the episode (its agent has returned): a call still waiting for its turn or for
        the engine raises :class:`EpisodeClosedError` and adds nothing to the trajectory."""
        self.closed = True

    async def complete(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """Answer one ``/v1/chat/completions`` request body.

        Returns:
            The ``chat.completion`` body (:func:`~trainer.harness.wire.completion`).

        Raises:
            RequestError: a malformed request, or a budget the episode has used up (``400``).
            EpisodeInfraError: the engine failed (``503``); the episode ends ``engine_error``.
            EpisodeClosedError: the episode was closed before or while this call ran (``410``).
        """
        async with self._lock:  # calls of one episode are answered one at a time
            if self.closed:
                raise EpisodeClosedError("this episode has finished; its trajectory takes no more calls")
            t0 = time.perf_counter()
            try:
                return await self._complete(body)
            finally:
                self._inside_s += time.perf_counter() - t0

    def stamp_time(self, info: dict[str, Any]) -> None:
        """Write the episode's time split into ``info`` (:class:`~trainer.rollout.timing.EpisodeClock`):
        ``llm_s`` the engine's calls, ``other_s`` the endpoint's own work (rendering, parsing), ``env_s``
        everything else of the episode's wall time: the agent's side (its tools, its logic, the HTTP
        round trips)."""
        wall = sum(self.clock.split()[k] for k in ("llm_s", "env_s", "other_s"))
        self.clock.env_s = max(0.0, wall - self._inside_s)
        self.clock.stamp(info)

    async def _complete(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """:meth:`complete` under the episode's lock."""
        if self.failure.startswith(FinishReason.ENGINE_ERROR.value):
            raise EpisodeInfraError(self.failure)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError("messages: must be a non-empty list")
        norm = [normalize_message(m) for m in messages]
        tools = body.get("tools") or None
        ctx = self._context(messages, norm, tools)
        if self.calls >= self.cfg.max_turns:
            self._limit(FinishReason.MAX_TURNS)
            raise RequestError(f"the episode's max_turns={self.cfg.max_turns} calls are used up")
        budget = self.cfg.max_total_tokens - len(ctx)
        if budget < 1:
            self._limit(FinishReason.MAX_TOTAL_TOKENS)
            raise RequestError(f"context_length_exceeded: {len(ctx)} tokens, the episode's "
                               f"max_total_tokens is {self.cfg.max_total_tokens}")
        params = self._params(body, budget)
        try:
            with self.clock.llm():
                res = await generate_with_retries(self.engine, ctx, params, self.cfg)
        except EngineError as e:
            self.failure = finish_text(FinishReason.ENGINE_ERROR, str(e))
            raise EpisodeInfraError(self.failure) from e
        if self.closed:  # the agent returned while the engine generated: the trajectory is frozen
            raise EpisodeClosedError("this episode finished while the call was generated; not recorded")
        if self._chat is not None and self.trajectory is not None and not self.edits:
            if self.calls:
                self.trajectory.append_observation_tokens(self._pending)
            self.trajectory.append_model_tokens(res.token_ids, res.logprobs, res.versions)
        self.calls += 1
        # the run's cap (not the agent's max_tokens, not the budget) cut this call
        self.length_capped = res.finish_reason == "length" and params.max_new_tokens == \
            self.sampling.max_new_tokens < budget
        if res.finish_reason == "length" and len(res.token_ids) >= budget:
            self._limit(FinishReason.MAX_TOTAL_TOKENS)  # cut by the episode's budget: no reward
        text = self.tok.decode(res.token_ids, skip_special_tokens=True)
        msg = assistant_message(text, self.tool_format, f"call_{self.calls}")
        self.tool_calls += len(msg.get("tool_calls") or ())
        self._known = [*norm, normalize_message(msg)]
        self._last_token = res.token_ids[-1] if res.token_ids else None
        return completion(msg, res.finish_reason, str(body.get("model") or "copc-policy"),
                          f"chatcmpl-{self.calls}", len(ctx), len(res.token_ids))

    def _context(self, messages: list, norm: list[tuple], tools: Any) -> list[int]:
        """The ids to generate from: the first call's rendering, the known ids extended by the new
        messages' observation turn, or (an edited history) the messages rendered afresh."""
        tools_key = json.dumps(tools, sort_keys=True)
        fresh = [template_message(m) for m in messages]
        if self.trajectory is None:
            self._chat, self._tools = ChatTurns(self.tok, tools), tools_key
            if tools:
                template_shows_tools(self.tok, tools)
            ids = self._chat.conversation_ids(fresh)  # tool messages' text stays plain
            self.trajectory = Trajectory(prompt_ids=ids, sample_id=self.sample_id, group_id=self.group_id)
            return list(ids)
        n = len(self._known)
        if not self.edits and tools_key == self._tools and len(norm) > n and norm[:n] == self._known:
            self._pending = self._chat.observation_ids(fresh[n:], self.cfg.max_observation_tokens,
                                                       after_token=self._last_token)
            return self.trajectory.prompt_ids + self.trajectory.response_ids + self._pending
        self.edits += 1
        if not self.failure:
            self.failure = finish_text(FinishReason.HISTORY_EDITED, f"call {self.calls + 1}: "
                                       f"{_what_changed(self._known, norm, tools_key != self._tools)}")
        return ChatTurns(self.tok, tools).conversation_ids(fresh)

    def _params(self, body: Mapping[str, Any], budget: int) -> SamplingParams:
        """The run's sampling with the request's ``max_tokens`` / ``stop`` and this call's seed."""
        raw = body.get("max_completion_tokens", body.get("max_tokens"))
        if raw is not None and (isinstance(raw, bool) or not isinstance(raw, int) or raw < 1):
            raise RequestError(f"max_tokens={raw!r}: must be an int >= 1")
        most = min(self.sampling.max_new_tokens, budget, raw or budget)
        seed = self.sampling.seed
        seed = None if seed is None else seed + CALL_SEED_STRIDE * self.calls
        stop = tuple(dict.fromkeys((*self.sampling.stop, *stop_strings(body.get("stop")))))
        return dataclasses.replace(self.sampling, max_new_tokens=most, stop=stop, seed=seed)

    def _limit(self, reason: FinishReason) -> None:
        """End the episode by a budget (the first one hit is kept)."""
        if not self.failure:
            self.failure = finish_text(reason)


def _what_changed(known: list[tuple], got: list[tuple], tools_changed: bool) -> str:
    """A few words on how ``got`` departs from the ``known`` history."""
    if tools_changed:
        return "the tools changed"
    for i, (a, b) in enumerate(zip(known, got, strict=False)):
        if a != b:
            return f"message {i} ({a[0]}) differs from the one the endpoint knows"
    if len(got) <= len(known):
        return f"{len(got)} messages, the history has {len(known)} (nothing new after the last reply)"
    return "the history changed"
