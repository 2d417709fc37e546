"""The house's plug-in machinery, below every other package (pure standard library).

* :mod:`seams.registry` — the one registry class (:class:`~seams.registry.Registry`), its error
  :class:`~seams.registry.RegistryError`, the :data:`~seams.registry.REQUIRED` metadata marker and
  :class:`~seams.registry.LazyRef` (an entry imported on first use);
* :mod:`seams.settings` — :func:`~seams.settings.build_settings`, a plug-in's settings dataclass
  built from a plain mapping with its names and types checked;
* :mod:`seams.lazy` — :func:`~seams.lazy.lazy_exports`, a package's heavy public names imported on
  first access (a config is validated without torch).

How the seams use them: ``docs/seams.md``.
"""
