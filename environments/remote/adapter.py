"""A gymnasium text environment as an OpenEnv ``Environment`` (needs the ``openenv`` extra).

:class:`GymTextEnvironment` wraps one environment built by ``environments.make`` (any
:class:`~environments.base.ToolEnv`, or any ``gymnasium.Env`` with ``str`` observations and
actions) in OpenEnv's ``Environment`` interface: ``reset(seed, episode_id, sample=..., options=...)
-> TextObservation``, ``step(TextAction) -> TextObservation``, ``state -> EpisodeState``. COPC's
server (:mod:`environments.remote.server`) drives it; it can also be handed to OpenEnv's own
``create_app`` (``SUPPORTS_CONCURRENT_SESSIONS``: each instance owns its environment).
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any

import gymnasium
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import EnvironmentMetadata

from .protocol import EpisodeState, TextAction, TextObservation, jsonable
from .wire import EPISODE_OVER, PAYLOAD_TOO_LARGE, VALIDATION_ERROR, RequestError


def space_max_length(space: Any, default: int) -> int:
    """``space.max_length`` of a ``gymnasium.spaces.Text`` (characters), else ``default``."""
    n = getattr(space, "max_length", None)
    return int(n) if isinstance(n, int) and n > 0 else default


class GymTextEnvironment(Environment[TextAction, TextObservation, EpisodeState]):
    """OpenEnv view of one gymnasium text environment (one per session).

    Args:
        env: the environment (``reset(options={"sample": row})`` / ``step(text)``).
        env_id: its registered id (reported in :attr:`state` and the metadata).
        max_action_chars: longest action accepted (default: ``env.action_space.max_length``).

    Attributes:
        env: the wrapped environment. stop_strings: ``env.stop_strings`` (tuple of str).
    """

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self, env: gymnasium.Env, env_id: str, max_action_chars: int | None = None) -> None:
        super().__init__()
        self.env, self.env_id = env, env_id
        self.max_action_chars = max_action_chars or space_max_length(env.action_space, 1 << 20)
        self.stop_strings: tuple[str, ...] = tuple(getattr(env, "stop_strings", ()) or ())
        self._episode_id: str | None = None
        self._steps = 0
        self._done = False

    def detach(self) -> None:
        """Forget the current episode (a new session must reset before stepping)."""
        self._episode_id, self._steps, self._done = None, 0, False

    # -- OpenEnv Environment API ----------------------------------------------------------------
    def reset(self, seed: int | None = None, episode_id: str | None = None,
              sample: Any = None, options: Any = None, **kwargs: Any) -> TextObservation:
        """Start an episode: ``env.reset(seed=seed, options={**options, "sample": sample})``.

        Args:
            seed: passed to ``env.reset``. episode_id: names the episode (default: a new uuid).
            sample: the data row (a JSON object), as the trainer's ``options["sample"]``.
            options: gymnasium reset options (a JSON object); ``sample`` overrides its
                ``"sample"``.

        Returns:
            The prompt as :class:`TextObservation` (``reward=None``, ``info`` of the reset).

        Raises:
            RequestError: ``VALIDATION_ERROR`` (422) for an unknown argument, a ``sample`` /
                ``options`` that is not an object, or a row the environment rejects (its
                ``ValueError`` / ``TypeError`` / ``KeyError``, field ``data.sample``).
            InfrastructureError: raised by the environment (propagates).
        """
        if kwargs:
            name = sorted(kwargs)[0]
            raise RequestError(VALIDATION_ERROR, f"data.{name}", f"reset: unknown argument {name!r}; "
                               "accepted: seed, episode_id, sample, options")
        for name, value in (("sample", sample), ("options", options)):
            if value is not None and not isinstance(value, Mapping):
                raise RequestError(VALIDATION_ERROR, f"data.{name}",
                                   f"reset: {name} must be a JSON object, got {type(value).__name__}")
        opts = dict(options or {})
        if sample is not None:
            opts["sample"] = dict(sample)
        self.detach()
        try:
            text, info = self.env.reset(seed=seed, options=opts or None)
        except (ValueError, TypeError, KeyError) as e:
            raise RequestError(VALIDATION_ERROR, "data.sample",
                               f"reset: the environment rejected the sample: {type(e).__name__}: {e}") from e
        self._episode_id = episode_id or uuid.uuid4().hex
        return TextObservation(text=text, info=jsonable(info), reward=None, done=False)

    def step(self, action: TextAction, timeout_s: float | None = None, **kwargs: Any) -> TextObservation:
        """Apply one model turn: ``env.step(action.text)``.

        Args:
            action: the turn's text. timeout_s: ignored (the environment's tools have their own
                per-call limits).

        Returns:
            :class:`TextObservation` with the step's reward, flags and ``info``.

        Raises:
            RequestError: ``EPISODE_OVER`` (409, field ``data.text``) before a reset or after the
                episode ended; ``PAYLOAD_TOO_LARGE`` (413, field ``data.text``) for an action
                longer than ``max_action_chars``; ``VALIDATION_ERROR`` (422, field ``data.text``)
                for an action that is not valid Unicode (a lone surrogate, which JSON's
                ``\\uD800`` escapes can carry); the episode goes on.
            InfrastructureError: raised by the environment (propagates; the episode is over).
        """
        if self._episode_id is None or self._done:
            why = "the episode is over" if self._done else "no episode was started in this session"
            raise RequestError(EPISODE_OVER, "data.text", f"step: {why}; send a reset first")
        if len(action.text) > self.max_action_chars:
            raise RequestError(PAYLOAD_TOO_LARGE, "data.text",
                               f"step: the action text has {len(action.text)} characters, more than the "
                               f"environment's limit of {self.max_action_chars} (action_space.max_length)")
        try:
            action.text.encode("utf-8")
        except UnicodeEncodeError as e:  # a JSON "\\ud800" escape: not text any tool can take
            bad = action.text[e.start]
            raise RequestError(VALIDATION_ERROR, "data.text", f"step: the action text has a lone UTF-16 "
                               f"surrogate ({bad!r}) at character {e.start}; send valid Unicode") from None
        self._steps += 1
        self._done = True  # stays over if env.step raises (its state is unknown then)
        text, reward, terminated, truncated, info = self.env.step(action.text)
        self._done = bool(terminated or truncated)
        return TextObservation(text=text, reward=float(reward), done=self._done, terminated=bool(terminated),
                               truncated=bool(truncated), info=jsonable(info))

    @property
    def state(self) -> EpisodeState:
        """The session's episode: id, steps taken, served env id, active / done."""
        return EpisodeState(episode_id=self._episode_id, step_count=self._steps, env_id=self.env_id,
                            active=self._episode_id is not None, done=self._done)

    def get_metadata(self) -> EnvironmentMetadata:
        """OpenEnv metadata: ``name`` = the env id, a description naming the class."""
        from environments.remote import server_version

        return EnvironmentMetadata(name=self.env_id, version=server_version(),
                                   description=f"COPC text tool environment {self.env_id!r} "
                                               f"({type(self.env).__name__}) served over OpenEnv")

    def close(self) -> None:
        """Close the wrapped environment."""
        self.env.close()


__all__ = ["GymTextEnvironment", "space_max_length"]
