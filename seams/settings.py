"""Build a plug-in's settings dataclass from a plain mapping, checking names and types.

A plug-in (an estimator, an engine, a task, a learner backend, ...) registers a dataclass of its
own knobs; the config holds them as a plain mapping (``rollout.engine_settings: {port: 30000}``)
and :func:`build_settings` turns it into an instance: unknown fields and wrong types are refused
with one line naming the full key and the value, then the dataclass's own ``__post_init__`` may
check ranges (its ``ValueError`` is prefixed with the key unless it names it already).

Supported field types: ``bool``, ``int``, ``float`` (an int is accepted and converted), ``str``,
``Any``, ``X | None`` / ``Optional[X]`` and other unions, ``Literal[...]``, ``list[X]`` /
``tuple[X, ...]``, ``dict[str, X]``, nested dataclasses, and any other class (an ``isinstance``
check). Pure Python: no dependency beyond the standard library.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any, Literal, Union

_NONE = type(None)


def _name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _check(tp: Any, v: Any, key: str) -> Any:
    """``v`` checked (and converted where lossless: int → float, list → tuple) against ``tp``."""
    if tp is Any or tp is object:
        return v
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is Union or (hasattr(types, "UnionType") and origin is types.UnionType):
        if v is None and _NONE in args:
            return None
        for arg in (a for a in args if a is not _NONE):
            try:
                return _check(arg, v, key)
            except ValueError:
                continue
        raise ValueError(f"{key}={v!r}: must be {' | '.join(_name(a) for a in args)}")
    if origin is Literal:
        if v not in args:
            raise ValueError(f"{key}={v!r}: must be one of {list(args)}")
        return v
    if origin in (list, tuple, Sequence) or tp in (list, tuple):
        if isinstance(v, str | bytes) or not isinstance(v, Sequence):
            raise ValueError(f"{key}={v!r}: must be a list")
        elem = args[0] if args and (origin is not tuple or (len(args) == 2 and args[1] is Ellipsis)) else Any
        out = [_check(elem, x, f"{key}[{i}]") for i, x in enumerate(v)]
        return tuple(out) if (origin is tuple or tp is tuple) else out
    if origin in (dict, Mapping) or tp in (dict, Mapping):
        if not isinstance(v, Mapping):
            raise ValueError(f"{key}={v!r}: must be a mapping")
        val = args[1] if len(args) == 2 else Any
        return {k: _check(val, x, f"{key}.{k}") for k, x in v.items()}
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return build_settings(tp, v, key)
    if tp is bool:
        if not isinstance(v, bool):
            raise ValueError(f"{key}={v!r}: must be a bool")
        return v
    if tp is int:
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"{key}={v!r}: must be an int")
        return v
    if tp is float:
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise ValueError(f"{key}={v!r}: must be a number")
        return float(v)
    if isinstance(tp, type):
        if not isinstance(v, tp):
            raise ValueError(f"{key}={v!r}: must be a {_name(tp)}")
        return v
    return v  # an annotation this checker does not understand: accepted as given


def _hints(cls: type) -> dict[str, Any]:
    try:
        return typing.get_type_hints(cls)
    except Exception:  # a string annotation naming something out of reach: check what resolves
        return {f.name: (f.type if not isinstance(f.type, str) else Any) for f in dataclasses.fields(cls)}


def build_settings(cls: type, raw: Mapping[str, Any] | Any | None, key: str) -> Any:
    """An instance of the dataclass ``cls`` from ``raw``.

    Args:
        cls: a dataclass type (the plug-in's settings).
        raw: a mapping of field values (missing fields take their defaults), None (all
            defaults), or an instance of ``cls`` (returned unchanged).
        key: the config key of ``raw`` (``"rollout.engine_settings"``), used in messages.

    Returns:
        The ``cls`` instance.

    Raises:
        ValueError: ``raw`` not a mapping; an unknown field (``"<key>.foo=1: unknown setting
            of Cls; known: [...]"``); a value of the wrong type (``"<key>.port='x': must be an
            int"``); a required field missing; or what ``cls`` itself raises (a message
            ``"port=0: ..."`` becomes ``"<key>.port=0: ..."``; others are prefixed by ``key``).
    """
    if isinstance(raw, cls):
        return raw
    if dataclasses.is_dataclass(raw) and not isinstance(raw, type):  # another plug-in's settings
        raw = {f.name: getattr(raw, f.name) for f in dataclasses.fields(raw)}
    raw = {} if raw is None else raw
    if not isinstance(raw, Mapping):
        raise ValueError(f"{key}={raw!r}: must be a mapping of {cls.__name__} fields")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(str(k) for k in raw if k not in fields)
    if unknown:
        raise ValueError(f"{key}.{unknown[0]}={raw[unknown[0]]!r}: unknown setting of {cls.__name__}; "
                         f"known: {sorted(fields)}")
    hints = _hints(cls)
    values = {n: _check(hints.get(n, Any), v, f"{key}.{n}") for n, v in raw.items()}
    missing = sorted(n for n, f in fields.items() if n not in values and f.default is dataclasses.MISSING
                     and f.default_factory is dataclasses.MISSING)
    if missing:
        raise ValueError(f"{key}.{missing[0]}: required setting of {cls.__name__} is missing")
    try:
        return cls(**values)
    except (TypeError, ValueError) as e:
        msg = str(e)
        head = msg.split("=", 1)[0]
        if msg.startswith(key):
            raise ValueError(msg) from None
        raise ValueError(f"{key}.{msg}" if head in fields else f"{key}: {msg}") from None
