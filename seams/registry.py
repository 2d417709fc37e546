"""The one registry class of the house: :class:`Registry`, its error :class:`RegistryError` and
the :data:`REQUIRED` marker of its metadata schemas.

:class:`Registry` maps names to entries (functions, factories, classes, specs) with per-entry
capability metadata (checked against the registry's schema) and an optional *settings*
dataclass: the plug-in's own knobs, validated from the config's ``…_settings`` section by
:meth:`Registry.build_settings` (:func:`seams.settings.build_settings`). Every registry
(estimators, losses, engines, learner backends, rank learners, tasks, environments, launchers,
benchmark kinds, pullable models) is an instance of it, and all of them raise one error type,
:class:`RegistryError`. Pure standard library: every package of the house may import it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Generic, TypeVar

from seams.settings import build_settings

E = TypeVar("E")

#: Marks a metadata key without a default in a :class:`Registry` schema: ``register`` must give it.
REQUIRED: Any = type("_Required", (), {"__repr__": lambda self: "REQUIRED"})()
_MISSING: Any = object()


class RegistryError(ValueError, KeyError):
    """A registry refused a name or a registration (unknown name, name taken, bad metadata or
    settings). The message is one line naming the registry kind (or config key) and the value.

    It is both a :class:`ValueError` and a :class:`KeyError` (a lookup that failed), so callers
    written against either keep working; new code catches :class:`RegistryError`.
    """

    __str__ = BaseException.__str__  # the plain message, not KeyError's quoted repr


def _type_name(typ: type | tuple[type, ...]) -> str:
    if isinstance(typ, tuple):
        return " | ".join(getattr(t, "__name__", repr(t)) for t in typ)
    return getattr(typ, "__name__", repr(typ))


@dataclasses.dataclass(frozen=True)
class _Entry(Generic[E]):
    entry: E
    metadata: Mapping[str, Any]
    settings: type | None


class Registry(Generic[E]):
    """A name → entry table with capability metadata, an optional settings dataclass per entry,
    a decorator form and one error type.

    Args:
        kind: what is registered, used in error messages (e.g. ``"advantage estimator"``).
        metadata: the capability-metadata schema, ``{key: (type or tuple of types, default)}``;
            a default of :data:`REQUIRED` makes the key mandatory at registration. Keys outside
            the schema are rejected (catches typos such as ``need_critic``). None: no metadata.
        key: the config key that names an entry (e.g. ``"rollout.engine"``), used in messages.
        callable_entries: entries must be callable (False for e.g. environment specs).

    Example::

        ENGINES = Registry("engine", {"needs_gpu": (bool, False)}, key="rollout.engine")

        @ENGINES.register("mine", settings=MySettings, needs_gpu=True)
        def make_mine(spec): ...

        ENGINES.register("other", make_other)            # the call form
    """

    def __init__(self, kind: str, metadata: Mapping[str, tuple[Any, Any]] | None = None, *,
                 key: str = "", callable_entries: bool = True) -> None:
        self.kind = kind
        self.key = key
        self.callable_entries = callable_entries
        self._schema: dict[str, tuple[Any, Any]] = dict(metadata or {})
        self._entries: dict[str, _Entry[E]] = {}

    @property
    def schema(self) -> Mapping[str, tuple[Any, Any]]:
        """The metadata schema ``{key: (type, default)}`` (read-only)."""
        return MappingProxyType(self._schema)

    def _resolve_metadata(self, name: str, metadata: Mapping[str, Any]) -> Mapping[str, Any]:
        unknown = sorted(set(metadata) - set(self._schema))
        if unknown:
            raise RegistryError(f"{self.kind} {name!r}: unknown metadata {unknown}; "
                                f"known: {sorted(self._schema)}")
        resolved: dict[str, Any] = {}
        for k, (typ, default) in self._schema.items():
            if k not in metadata and default is REQUIRED:
                raise RegistryError(f"{self.kind} {name!r}: register() needs metadata "
                                    f"{k}=<{_type_name(typ)}>")
            value = metadata.get(k, default)
            if not isinstance(value, typ) or (typ in (int, float) and isinstance(value, bool)):
                raise RegistryError(f"{self.kind} {name!r}: metadata {k} must be a {_type_name(typ)}, "
                                    f"got {value!r}")
            resolved[k] = value
        return MappingProxyType(resolved)

    def register(self, name: str, entry: Any = _MISSING, *, settings: type | None = None,
                 overwrite: bool = False, **metadata: Any) -> Any:
        """Register ``entry`` under ``name`` (call form), or return a decorator that does.

        Args:
            name: a non-empty string, not yet registered (unless ``overwrite``).
            entry: the function / factory / class / spec; omitted: return a decorator.
            settings: the plug-in's settings dataclass type (its own knobs, validated from the
                config's ``…_settings`` section by :meth:`build_settings`), or None (no knobs).
            overwrite: replace an existing registration instead of raising.
            **metadata: values for the schema's keys (defaults fill the rest).

        Returns:
            ``entry`` (call form) or the decorator (which registers and returns its argument).

        Raises:
            RegistryError: an empty/non-string name, a metadata key outside the schema, a
                missing required key, a value of the wrong type or a settings type that is not
                a dataclass (at once); ``name`` already registered without ``overwrite`` or a
                non-callable entry (when the entry is given / the decorator applied).
        """
        if not isinstance(name, str) or not name:
            raise RegistryError(f"{self.kind} name must be a non-empty string, got {name!r}")
        frozen = self._resolve_metadata(name, metadata)
        if settings is not None and not (isinstance(settings, type) and dataclasses.is_dataclass(settings)):
            raise RegistryError(f"{self.kind} {name!r}: settings must be a dataclass type or None, "
                                f"got {settings!r}")

        def add(obj: E) -> E:
            if name in self._entries and not overwrite:
                raise RegistryError(f"{self.kind} {name!r} is already registered (pass overwrite=True)")
            if self.callable_entries and not callable(obj):
                raise RegistryError(f"{self.kind} {name!r}: {obj!r} is not callable")
            self._entries[name] = _Entry(obj, frozen, settings)
            return obj
        return add if entry is _MISSING else add(entry)

    def _get_entry(self, name: str) -> _Entry[E]:
        try:
            return self._entries[name]
        except (KeyError, TypeError):
            where = f"{self.key}={name!r}: " if self.key else ""
            raise RegistryError(f"{where}unknown {self.kind} {name!r}; known: {self.names()}") from None

    def unregister(self, name: str) -> E:
        """Remove ``name`` (e.g. a test's temporary entry) and return its entry.

        Raises:
            RegistryError: for an unknown name, listing the known ones.
        """
        entry = self._get_entry(name).entry
        del self._entries[name]
        return entry

    def get(self, name: str) -> E:
        """Return the entry registered as ``name``.

        Raises:
            RegistryError: for an unknown name, listing the known ones.
        """
        return self._get_entry(name).entry

    def metadata(self, name: str) -> Mapping[str, Any]:
        """Read-only capability metadata of ``name`` (every schema key, defaults filled in).

        Raises:
            RegistryError: for an unknown name, listing the known ones.
        """
        return self._get_entry(name).metadata

    def settings_type(self, name: str) -> type | None:
        """The settings dataclass type ``name`` was registered with (None: it takes no settings).

        Raises:
            RegistryError: for an unknown name, listing the known ones.
        """
        return self._get_entry(name).settings

    def build_settings(self, name: str, raw: Mapping[str, Any] | Any | None, key: str) -> Any:
        """The validated settings of ``name`` built from ``raw`` (a config's ``…_settings`` mapping).

        Args:
            name: a registered name.
            raw: a mapping of field values (missing fields take their defaults), an instance of
                the settings type (returned as is), or None/empty.
            key: the config key of ``raw`` (e.g. ``"rollout.engine_settings"``) for messages.

        Returns:
            An instance of :meth:`settings_type`, or None when ``name`` takes no settings.

        Raises:
            RegistryError: unknown ``name``; settings given to an entry that takes none; an
                unknown field, a wrong type or a value its dataclass rejects (one line naming
                ``key.field`` and the value).
        """
        cls = self.settings_type(name)
        if cls is None:
            if raw:
                raise RegistryError(f"{key}={dict(raw) if isinstance(raw, Mapping) else raw!r}: "
                                    f"{self.kind} {name!r} takes no settings")
            return None
        try:
            return build_settings(cls, raw, key)
        except (TypeError, ValueError) as e:
            raise RegistryError(str(e)) from None

    def names(self, **where: Any) -> list[str]:
        """Registered names, sorted; with ``where`` (``needs_gpu=True``), only those whose
        metadata has those values."""
        return sorted(n for n, e in self._entries.items()
                      if all(e.metadata.get(k, _MISSING) == v for k, v in where.items()))

    def __contains__(self, name: object) -> bool:
        try:
            return name in self._entries
        except TypeError:  # unhashable
            return False

    def __iter__(self):
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._entries)
