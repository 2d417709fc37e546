"""The agent loop: engine × environment × tokenizer × sample → :class:`Trajectory`.

Token-in/token-out: the context sent to the engine is always ``prompt_ids +
response_ids`` as accumulated so far; earlier turns are never re-tokenised. Each
observation is tokenised once, on its own, and appended with ``loss_mask = 0``.

With ``use_chat_template``, an environment in a native tool-call format (``hermes`` /
``openai``) gets its prompt rendered with its tools' schemas and its observations rendered as
chat turns (``info["observation_messages"]``) by :class:`~trainer.rollout.observation.ChatTurns`,
so the ids equal the template's rendering of the whole conversation.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from environments.errors import InfrastructureError

from ..engines.base import EngineClosedError, EngineError, InferenceEngine, SamplingParams
from .observation import ChatTurns, truncate_observation_ids
from .timing import EpisodeClock
from .trajectory import LENGTH_CAPPED, FinishReason, Trajectory, finish_text

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AgentLoopConfig:
    """Budgets of one episode (validated).

    Attributes:
        max_total_tokens: prompt + response tokens; generation stops when reached.
        max_turns: most model turns (the environment may end the episode earlier).
        max_observation_tokens: longer observations are cut to this many tokens in the middle,
            keeping the closing tag and a visible truncation marker
            (:func:`~trainer.rollout.observation.truncate_observation_ids`).
        engine_retries: retries of a failed ``generate`` call (then the episode ends
            with ``finish_reason = "engine_error: ..."``).
        retry_backoff_s: first retry delay in seconds (doubles each retry).
        use_chat_template: wrap the prompt with the tokenizer's chat template (real
            instruct models; tiny byte-level models have none); observations of native
            tool-call formats become chat turns too (:class:`~.observation.ChatTurns`).
        system_prompt: with ``use_chat_template``, a ``system`` message before the prompt.
        observation_role: with ``use_chat_template``, how the observations of a *tag*-format
            environment (``<search>`` → ``<information>``, ``<code>`` → ``<interpreter>``) are
            put: ``""`` inline, inside the model's turn (Search-R1 / ReTool style); ``"user"`` or
            ``"tool"`` as a chat turn of that role (the model's turn closed by the template's
            end-of-turn text, then the generation prompt), the turns the template defines.
        stop: extra strings that end every model turn, after the environment's own stop strings
            (``rollout.stop``; e.g. ``"\nProblem:"``, where a few-shot prompt's next example
            begins, so a small model stops after its answer instead of writing another problem).
    """

    max_total_tokens: int = 4096
    max_turns: int = 8
    max_observation_tokens: int = 1024
    engine_retries: int = 3
    retry_backoff_s: float = 0.05
    use_chat_template: bool = False
    system_prompt: str = ""
    observation_role: str = ""
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        """Validate."""
        if self.observation_role not in ("", "user", "tool"):
            raise ValueError(f"AgentLoopConfig.observation_role={self.observation_role!r}: must be '', "
                             "'user' or 'tool'")
        for k in ("max_total_tokens", "max_turns", "max_observation_tokens"):
            if getattr(self, k) < 1:
                raise ValueError(f"AgentLoopConfig.{k}={getattr(self, k)!r}: must be >= 1")
        if self.engine_retries < 0 or self.retry_backoff_s < 0:
            raise ValueError("AgentLoopConfig.engine_retries and retry_backoff_s must be >= 0")
        if not all(isinstance(x, str) and x for x in self.stop):
            raise ValueError(f"AgentLoopConfig.stop={self.stop!r}: must be non-empty strings")


def encode_prompt(tokenizer: Any, text: str, use_chat_template: bool, tools: Any = None,
                  system: str = "") -> list[int]:
    """Token ids of the prompt: plain, or through the chat template as a ``system`` message (if
    ``system``) and one ``user`` message with the generation prompt added and ``tools`` (OpenAI
    function schemas) given to the template.

    Raises:
        ValueError: ``use_chat_template`` and the tokenizer has no chat template.
    """
    if use_chat_template:
        return ChatTurns(tokenizer, tools, system).prompt_ids(text)
    return list(tokenizer.encode(text, add_special_tokens=False))


def observation_ids(tokenizer: Any, chat: ChatTurns | None, cfg: AgentLoopConfig, text: str,
                    messages: Any = None, after_token: int | None = None) -> list[int]:
    """The ids of one observation, as every producer of trajectories puts it (the agent loop and
    the warm-start traces).

    A native tool-call format's chat ``messages``, or with ``cfg.observation_role`` a tag-format
    observation ``text``, become a chat turn (:meth:`ChatTurns.observation_ids`, ``after_token`` =
    the model turn's last id); otherwise ``text`` inline, cut to ``cfg.max_observation_tokens``
    (:func:`truncate_observation_ids`). Tool output never spells special tokens in either way.

    Raises:
        ValueError: a chat template that cannot render the turn (:meth:`ChatTurns.observation_text`).
    """
    if chat is not None and not messages and cfg.observation_role and text:
        messages = [{"role": cfg.observation_role, "content": text}]
    if chat is not None and messages:
        return chat.observation_ids(list(messages), cfg.max_observation_tokens, after_token=after_token)
    return truncate_observation_ids(tokenizer, text, cfg.max_observation_tokens)


async def generate_with_retries(engine: InferenceEngine, ctx: list[int], params: SamplingParams,
                                cfg: AgentLoopConfig):
    """``engine.generate(ctx, params)``, retried ``cfg.engine_retries`` times on :class:`EngineError`
    (delays ``cfg.retry_backoff_s``, doubling). A closed engine is not retried: the run is stopping.

    Raises:
        EngineClosedError: at once, when the engine is closed.
        EngineError: the last failure, once the retries are spent.
    """
    delay = cfg.retry_backoff_s
    for attempt in range(cfg.engine_retries + 1):
        try:
            return await engine.generate(ctx, params)
        except EngineError as e:
            if attempt == cfg.engine_retries or isinstance(e, EngineClosedError):
                raise
            log.warning("generate failed (%s); retry %d/%d in %.2fs", e, attempt + 1,
                        cfg.engine_retries, delay)
            await asyncio.sleep(delay)
            delay *= 2
    raise AssertionError("unreachable")


async def run_episode(engine: InferenceEngine, env: Any, tokenizer: Any, sample: Mapping[str, Any],
                      sampling: SamplingParams, cfg: AgentLoopConfig | None = None,
                      group_id: Any = None) -> Trajectory:
    """Play one episode of ``env`` on ``sample`` with ``engine`` and return its trajectory.

    Each model turn generates until one of ``env.stop_strings``, EOS, the turn's token
    budget or the total budget. The decoded text of the turn's tokens is the action; the
    environment's reply is tokenised and appended as observation tokens. Environment
    steps run in a worker thread (tools may block).

    Every step's reward — non-terminal ones included — is recorded with
    :meth:`Trajectory.add_reward` right after the step, before its observation is appended,
    so it sits on the last model token of the turn it answered (the spec's fold rule);
    :attr:`Trajectory.reward` is the episode return, their sum.

    Args:
        engine: an :class:`~trainer.engines.base.InferenceEngine`.
        env: a text tool environment (``reset(options={"sample": ...})`` / ``step(text)``).
        tokenizer: the policy's tokenizer.
        sample: the data row.
        sampling: sampling parameters (``stop`` is extended with the env's stop strings).
        cfg: :class:`AgentLoopConfig`.
        group_id: prompt-group id (GRPO); default ``sample["id"]``.

    Returns:
        The trajectory. It is never dropped silently: an infrastructure failure ends the
        episode with ``finish_reason`` saying so and :attr:`Trajectory.infra_failed` set —
        ``"infra_error: ..."`` when ``reset``/``step`` raised
        :class:`~environments.errors.InfrastructureError`, ``"engine_error: ..."`` when
        generation failed after retries; such an episode has its rewards cleared (reward 0,
        no step rewards) but must not be trained on or scored as wrong. Any other exception of
        ``step`` (a bug in the environment), or a step reward that cannot be recorded (not a
        finite number, or non-zero with no model token yet), ends it with
        ``"env_error: ..."`` (:attr:`Trajectory.env_failed`, rewards cleared), which the
        training loop and evaluation treat as fatal.
        A turn cut by ``max_total_tokens`` is not passed to the environment (it is incomplete):
        ``finish_reason = "max_total_tokens"``; it earns no reward, the rewards of earlier
        steps are kept.
        An episode the environment stepped has ``info[LENGTH_CAPPED]`` (``"length_capped"``): its
        latest turn was cut at ``rollout.max_new_tokens``.
        Every trajectory's ``info`` has ``llm_s`` / ``env_s`` / ``other_s``: the episode's wall
        time in generation (retries included), in ``env.reset`` / ``env.step``, and the rest
        (:class:`~trainer.rollout.timing.EpisodeClock`).
    """
    clock = EpisodeClock()
    traj = await _play(engine, env, tokenizer, sample, sampling, cfg or AgentLoopConfig(), group_id, clock)
    clock.stamp(traj.info)
    return traj


async def _play(engine: InferenceEngine, env: Any, tokenizer: Any, sample: Mapping[str, Any],
                sampling: SamplingParams, cfg: AgentLoopConfig, group_id: Any,
                clock: EpisodeClock) -> Trajectory:
    """The body of :func:`run_episode`, its engine and env calls timed by ``clock``."""
    sid = sample.get("id")
    try:
        with clock.env():
            prompt_text, reset_info = await asyncio.to_thread(env.reset, options={"sample": dict(sample)})
    except InfrastructureError as e:  # e.g. a remote env / service that cannot start the episode
        return Trajectory(prompt_ids=[], sample_id=sid, group_id=sid if group_id is None else group_id,
                          finish_reason=finish_text(FinishReason.INFRA_ERROR, str(e)))
    tools = reset_info.get("tools") if isinstance(reset_info, Mapping) else None
    chat = ChatTurns(tokenizer, tools, cfg.system_prompt) if cfg.use_chat_template else None
    prompt_ids = chat.prompt_ids(prompt_text) if chat else encode_prompt(tokenizer, prompt_text, False)
    traj = Trajectory(prompt_ids=prompt_ids, sample_id=sid,
                      group_id=sid if group_id is None else group_id)
    stop = tuple(dict.fromkeys((*sampling.stop, *getattr(env, "stop_strings", ()), *cfg.stop)))
    for _ in range(cfg.max_turns):
        budget = cfg.max_total_tokens - len(traj.prompt_ids) - len(traj.response_ids)
        if budget < 1:
            traj.finish(FinishReason.MAX_TOTAL_TOKENS)
            break
        params = replace(sampling, stop=stop, max_new_tokens=min(sampling.max_new_tokens, budget))
        try:
            with clock.llm():
                res = await generate_with_retries(engine, traj.prompt_ids + traj.response_ids, params, cfg)
        except EngineError as e:
            traj.finish(FinishReason.ENGINE_ERROR, str(e))
            break
        traj.append_model_tokens(res.token_ids, res.logprobs, res.versions)
        if res.finish_reason == "length" and len(res.token_ids) >= budget:
            # cut by the episode's token budget mid-turn: the action is incomplete, so the
            # environment is not stepped; reward stays 0 (an overlong response)
            traj.finish(FinishReason.MAX_TOTAL_TOKENS)
            break
        action = tokenizer.decode(res.token_ids, skip_special_tokens=True)
        try:
            with clock.env():
                obs, reward, terminated, truncated, info = await asyncio.to_thread(env.step, action)
        except InfrastructureError as e:  # the env's machinery failed, not the policy
            traj.finish(FinishReason.INFRA_ERROR, str(e))
            traj.clear_rewards()
            break
        except Exception as e:  # recorded on the trajectory, never dropped
            traj.finish(FinishReason.ENV_ERROR, f"{type(e).__name__}: {e}")
            traj.clear_rewards()
            break
        invalid = int(traj.info.get("invalid_actions", 0)) + int(bool(info.get("invalid")))
        traj.info = dict(info)
        traj.info["invalid_actions"] = invalid  # turns the env rejected as invalid, so far
        traj.info[LENGTH_CAPPED] = res.finish_reason == "length"  # this turn cut at rollout.max_new_tokens
        try:  # on this turn's last model token, before the observation (spec: fold)
            traj.add_reward(reward)
        except (TypeError, ValueError) as e:  # NaN / non-number reward: an env bug
            traj.finish(FinishReason.ENV_ERROR, f"bad reward: {e}")
            traj.clear_rewards()
            break
        if terminated or truncated:
            traj.finish(FinishReason.TERMINATED if terminated else FinishReason.TRUNCATED)
            break
        messages = info.get("observation_messages") if chat is not None else None
        try:  # a native tool-call format's messages, or a tag-format reply (observation_role)
            obs_ids = observation_ids(tokenizer, chat, cfg, obs, messages,
                                      after_token=res.token_ids[-1] if res.token_ids else None)
        except Exception as e:  # a template that cannot render tool turns: a setup bug
            traj.finish(FinishReason.ENV_ERROR, f"chat template: {type(e).__name__}: {e}")
            traj.clear_rewards()
            break
        traj.append_observation_tokens(obs_ids)
    else:
        if not traj.finish_reason:
            traj.finish(FinishReason.MAX_TURNS)
    return traj
