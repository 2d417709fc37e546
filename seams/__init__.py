"""The house's plug-in machinery, below every other package (pure standard library).

* :mod:`seams.registry` — the one registry class (:class:`~seams.registry.Registry`), its error
  :class:`~seams.registry.RegistryError` and the :data:`~seams.registry.REQUIRED` metadata marker;
* :mod:`seams.settings` — :func:`~seams.settings.build_settings`, a plug-in's settings dataclass
  built from a plain mapping with its names and types checked.

How the seams use them: ``docs/seams.md``.
"""
