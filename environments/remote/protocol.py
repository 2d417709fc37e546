"""The OpenEnv message types of COPC's text tool environments (needs the ``openenv`` extra).

An action is the model's text for one turn; an observation is the environment's reply text with
the gymnasium step's reward, ``terminated`` / ``truncated`` flags and ``info`` dict. They
subclass OpenEnv's ``Action`` / ``Observation`` / ``State`` (pydantic models, unknown fields
rejected), so any OpenEnv client can drive a served COPC environment by sending
``{"text": ...}`` actions. On the wire an observation is OpenEnv's
``serialize_observation`` layout: ``{"observation": {"text", "terminated", "truncated", "info",
"metadata"}, "reward": float | null, "done": bool}`` (``done = terminated or truncated``;
``reward`` is ``null`` after a reset, which gymnasium gives no reward).
"""

from __future__ import annotations

from typing import Any

from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

from .wire import X_ENV_ID, X_STOP_STRINGS


class TextAction(Action):
    """One model turn: ``text`` (the decoded completion; tool calls are found in it)."""

    text: str = Field(description="The model's text for this turn (tool calls and answers inside it)")


class TextObservation(Observation):
    """The environment's reply to a reset or a step.

    Attributes:
        text: the observation text (the prompt after a reset; a tool's rendered result, an
            invalid-action reply, or ``""`` at the end of an episode after a step).
        terminated / truncated: gymnasium's flags (``done`` = either).
        info: the gymnasium ``info`` dict (JSON values; see :func:`jsonable`).
        reward / done / metadata: OpenEnv's fields (``metadata.session_id`` names the session).
    """

    text: str = Field(default="", description="Observation text")
    terminated: bool = Field(default=False, description="The episode ended (gymnasium terminated)")
    truncated: bool = Field(default=False, description="The episode was cut by a limit (gymnasium truncated)")
    info: dict[str, Any] = Field(default_factory=dict, description="The gymnasium info dict")


class EpisodeState(State):
    """``GET /state`` / the ``state`` message: OpenEnv's ``episode_id`` and ``step_count`` plus
    the served ``env_id``, whether an episode is running (``active``) and whether it is over
    (``done``)."""

    env_id: str = Field(default="", description="The served environment's registered id")
    active: bool = Field(default=False, description="An episode was reset in this session")
    done: bool = Field(default=False, description="The current episode is over")


def jsonable(value: Any) -> Any:
    """``value`` made of JSON types only: mappings → ``dict`` with ``str`` keys, tuples / lists /
    sets → ``list``, numpy scalars and arrays → Python numbers / nested lists, ``None`` /
    ``bool`` / ``int`` / ``float`` / ``str`` unchanged (floats bit-exact, also NaN / inf, which
    Python's ``json`` writes as ``NaN`` / ``Infinity``), anything else → ``str(value)``.

    Args:
        value: an ``info`` value of a gymnasium step.

    Returns:
        The converted value (a new container; ``value`` is not modified).
    """
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, dict) or hasattr(value, "items"):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [jsonable(v) for v in value]
    tolist = getattr(value, "tolist", None)  # numpy scalars and arrays
    if callable(tolist):
        return jsonable(tolist())
    return str(value)


def action_schema(max_chars: int, stop_strings: tuple[str, ...], env_id: str) -> dict[str, Any]:
    """JSON schema of :class:`TextAction` with ``text.maxLength = max_chars`` and the
    :data:`~environments.remote.wire.X_STOP_STRINGS` / :data:`~environments.remote.wire.X_ENV_ID`
    extensions (``GET /schema``'s ``action``).

    Args:
        max_chars: the longest action accepted (characters). stop_strings: the environment's
            ``stop_strings``. env_id: the served environment's id.
    """
    schema = TextAction.model_json_schema()
    schema["properties"]["text"]["maxLength"] = int(max_chars)
    schema[X_STOP_STRINGS] = list(stop_strings)
    schema[X_ENV_ID] = env_id
    return schema


def observation_schema(max_chars: int) -> dict[str, Any]:
    """JSON schema of :class:`TextObservation` with ``text.maxLength = max_chars`` (the
    environment's ``observation_space`` bound, characters)."""
    schema = TextObservation.model_json_schema()
    schema["properties"]["text"]["maxLength"] = int(max_chars)
    return schema


__all__ = ["EpisodeState", "TextAction", "TextObservation", "action_schema", "jsonable",
           "observation_schema"]
