"""The error type of ``copc model pull``."""

from __future__ import annotations


class PullError(RuntimeError):
    """A pull cannot finish (pip cannot fetch the wheel, the wheel lacks the GGUF, the converted
    model differs from the GGUF-loaded one); the message is one line saying what and where."""
