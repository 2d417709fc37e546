"""The registries of advantage estimators and policy losses (names → functions + metadata).

Only the :class:`Registry` class and the two empty registries live here, so that
:mod:`copc.presets` can validate names against them and :mod:`copc.registry` can fill them
with the built-in adapters without an import cycle. Users register their own with
``copc.ADVANTAGE_ESTIMATORS.register("name", needs_critic=...)(fn)``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, Generic, TypeVar

F = TypeVar("F", bound=Callable)

#: Marks a metadata key without a default in a :class:`Registry` schema: ``register`` must give it.
REQUIRED: Any = type("_Required", (), {"__repr__": lambda self: "REQUIRED"})()


class Registry(Generic[F]):
    """A name → function table with per-entry metadata, a decorator and clear errors.

    Args:
        kind: what is registered, used in error messages (e.g. ``"advantage estimator"``).
        metadata: the metadata schema, ``{key: (type, default)}``; a default of
            :data:`REQUIRED` makes the key mandatory at registration. Keys outside the schema
            are rejected (catches typos such as ``need_critic``). None: no metadata.
    """

    def __init__(self, kind: str, metadata: Mapping[str, tuple[type, Any]] | None = None) -> None:
        self.kind = kind
        self._schema: dict[str, tuple[type, Any]] = dict(metadata or {})
        self._entries: dict[str, F] = {}
        self._metadata: dict[str, Mapping[str, Any]] = {}

    def register(self, name: str, **metadata: Any) -> Callable[[F], F]:
        """Decorator registering ``fn`` under ``name`` with ``metadata``.

        Args:
            name: a non-empty string, not yet registered.
            **metadata: values for the schema's keys (defaults fill the rest).

        Returns:
            The decorator; it registers ``fn`` and returns it unchanged.

        Raises:
            ValueError: (when called) for an empty/non-string name, a metadata key outside the
                schema, a missing required key or a value of the wrong type; (when the decorator
                is applied) if ``name`` is already registered or ``fn`` is not callable.
        """
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.kind} name must be a non-empty string, got {name!r}")
        unknown = sorted(set(metadata) - set(self._schema))
        if unknown:
            raise ValueError(f"{self.kind} {name!r}: unknown metadata {unknown}; "
                             f"known: {sorted(self._schema)}")
        resolved: dict[str, Any] = {}
        for key, (typ, default) in self._schema.items():
            if key not in metadata and default is REQUIRED:
                raise ValueError(f"{self.kind} {name!r}: register() needs metadata "
                                 f"{key}=<{typ.__name__}>")
            value = metadata.get(key, default)
            if not isinstance(value, typ):
                raise ValueError(f"{self.kind} {name!r}: metadata {key} must be a {typ.__name__}, "
                                 f"got {value!r}")
            resolved[key] = value
        frozen = MappingProxyType(resolved)

        def deco(fn: F) -> F:
            if name in self._entries:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            if not callable(fn):
                raise ValueError(f"{self.kind} {name!r}: {fn!r} is not callable")
            self._entries[name] = fn
            self._metadata[name] = frozen
            return fn
        return deco

    def unregister(self, name: str) -> F:
        """Remove ``name`` (e.g. a test's temporary entry) and return its function.

        Raises:
            ValueError: for an unknown name, listing the known ones.
        """
        fn = self.get(name)
        del self._entries[name], self._metadata[name]
        return fn

    def get(self, name: str) -> F:
        """Return the function registered as ``name``.

        Raises:
            ValueError: for an unknown name, listing the known ones.
        """
        try:
            return self._entries[name]
        except (KeyError, TypeError):
            raise ValueError(f"unknown {self.kind} {name!r}; known: {self.names()}") from None

    def metadata(self, name: str) -> Mapping[str, Any]:
        """Read-only metadata of ``name`` (every schema key, defaults filled in).

        Raises:
            ValueError: for an unknown name, listing the known ones.
        """
        self.get(name)
        return self._metadata[name]

    def names(self) -> list[str]:
        """Registered names, sorted."""
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        try:
            return name in self._entries
        except TypeError:  # unhashable
            return False


#: Advantage estimators: ``fn(inputs: AdvantageInputs, cfg: AlgorithmConfig) -> (advantages,
#: returns)``; metadata ``needs_critic`` (required) and ``needs_groups`` (default False).
ADVANTAGE_ESTIMATORS: Registry[Callable[..., Any]] = Registry(
    "advantage estimator", metadata={"needs_critic": (bool, REQUIRED), "needs_groups": (bool, False)})
#: Policy losses: ``fn(logp, inputs: PolicyLossInputs, cfg: AlgorithmConfig) -> (loss, metrics)``.
POLICY_LOSSES: Registry[Callable[..., Any]] = Registry("policy loss")
