"""The one registry class of the house: :class:`Registry`, its error :class:`RegistryError` and
the :data:`REQUIRED` marker of its metadata schemas.

:class:`Registry` maps names to entries (functions, factories, classes, specs) with per-entry
capability metadata (checked against the registry's schema) and an optional *settings*
dataclass: the plug-in's own knobs, validated from the config's ``…_settings`` section by
:meth:`Registry.build_settings` (:func:`seams.settings.build_settings`). Every registry
(estimators, losses, engines, learner backends, rank learners, tasks, environments, launchers,
benchmark kinds, pullable models) is an instance of it, and all of them raise one error type,
:class:`RegistryError`. An entry (or a function in its metadata) may be a :class:`LazyRef`, a
``"package.module:attribute"`` reference imported on first use: a built-in is then registered
(its name, metadata and settings dataclass, which validation reads) without importing its
implementation (torch, transformers), so a config is validated on light modules only. Pure
standard library: every package of the house may import it.
"""

from __future__ import annotations

import dataclasses
import importlib
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


class LazyRef:
    """An entry, or a function in an entry's metadata, named by ``"package.module:attribute"``
    (the attribute may be dotted: ``"pkg.mod:Class.from_spec"``) and imported on first use.

    :meth:`Registry.get` returns the object it names (imported once, then kept in the registry);
    in metadata it stays a reference and calling it imports and calls the target, so a built-in's
    registration (name, capability metadata, settings dataclass) costs no import of its code.

    Args:
        ref: ``"package.module:attribute"``.

    Raises:
        RegistryError: ``ref`` is not of that form.
    """

    __slots__ = ("_target", "ref")

    def __init__(self, ref: str) -> None:
        module, sep, attr = ref.partition(":") if isinstance(ref, str) else ("", "", "")
        if not (module and sep and attr):
            raise RegistryError(f"LazyRef({ref!r}): must be 'package.module:attribute'")
        self.ref = ref
        self._target: Any = _MISSING

    def load(self) -> Any:
        """The object named by :attr:`ref` (its module imported on the first call).

        Raises:
            ImportError: the module cannot be imported. AttributeError: it has no such attribute.
        """
        if self._target is _MISSING:
            module, _, attr = self.ref.partition(":")
            obj: Any = importlib.import_module(module)
            for part in attr.split("."):
                obj = getattr(obj, part)
            self._target = obj
        return self._target

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Call the named object (imported on the first call) with the given arguments."""
        return self.load()(*args, **kwargs)

    def __repr__(self) -> str:
        return f"LazyRef({self.ref!r})"


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
        ENGINES.register("big", LazyRef("pkg.big:make"))  # imported when first fetched
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
            entry: the function / factory / class / spec, or a :class:`LazyRef` to it (imported
                by the first :meth:`get`); omitted: return a decorator.
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
        """Remove ``name`` (e.g. a test's temporary entry) and return its entry (a
        :class:`LazyRef` entry imported, as :meth:`get`).

        Raises:
            RegistryError: for an unknown name, listing the known ones.
        """
        entry = self.get(name)
        del self._entries[name]
        return entry

    def get(self, name: str) -> E:
        """Return the entry registered as ``name`` (a :class:`LazyRef` entry is imported now and
        kept: later calls return the same object).

        Raises:
            RegistryError: for an unknown name, listing the known ones; a :class:`LazyRef` entry
                that is not callable in a registry of callables.
            ImportError, AttributeError: a :class:`LazyRef` entry whose target cannot be imported.
        """
        e = self._get_entry(name)
        if not isinstance(e.entry, LazyRef):
            return e.entry
        obj = e.entry.load()
        if self.callable_entries and not callable(obj):
            raise RegistryError(f"{self.kind} {name!r}: {e.entry.ref} is {obj!r}, not callable")
        if self._entries.get(name) is e:  # loading may have re-registered it (overwrite): keep that
            self._entries[name] = dataclasses.replace(e, entry=obj)
        return obj

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
