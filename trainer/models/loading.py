"""Load a causal LM and its tokenizer from a local directory (``model.path``)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast


def load_model_and_tokenizer(path: str | Path, *, dtype: torch.dtype = torch.float32,
                             attn_implementation: str = "eager"
                             ) -> tuple[torch.nn.Module, PreTrainedTokenizerBase]:
    """Load a ``transformers`` causal LM + tokenizer saved with ``save_pretrained``.

    The same path serves tiny offline checkpoints (:func:`trainer.models.tiny.save_tiny_checkpoint`)
    and real ones (e.g. a local Qwen3-4B directory). Nothing is downloaded
    (``local_files_only``).

    Args:
        path: local checkpoint directory.
        dtype: parameter dtype (float32 on CPU).
        attn_implementation: ``"eager"`` (default, exact on CPU) or ``"sdpa"``.

    Returns:
        ``(model, tokenizer)``; the model is in eval mode; the tokenizer has a pad token
        (EOS is used when the checkpoint defines none).

    Raises:
        FileNotFoundError: if ``path`` is not a directory with a ``config.json``.
    """
    p = Path(path)
    tok = load_tokenizer(p)  # checks the directory
    model = AutoModelForCausalLM.from_pretrained(p, local_files_only=True, dtype=dtype,
                                                 attn_implementation=attn_implementation)
    return model.eval(), tok


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer of a ``save_pretrained`` directory (pad token = EOS when it has none).

    A tiny model's (``copc_tiny`` in ``config.json``: :mod:`trainer.models.tiny`) is its
    ``tokenizer.json`` verbatim: ``AutoTokenizer`` of ``transformers`` 5 maps model type
    ``qwen2`` to ``Qwen2Tokenizer``, which adds an NFC normalizer, so ``"e\u0301"`` would come
    back as ``"\u00e9"`` and the byte / BPE tokenizers would no longer be lossless.

    Raises:
        FileNotFoundError: if ``path`` is not a directory with a ``config.json``.
    """
    p = Path(path)
    if not (p / "config.json").is_file():
        raise FileNotFoundError(f"model.path={str(path)!r}: no config.json there (a checkpoint "
                                "directory saved with save_pretrained is expected)")
    if "copc_tiny" in json.loads((p / "config.json").read_text()):
        tok = PreTrainedTokenizerFast.from_pretrained(p, local_files_only=True)
    else:
        tok = AutoTokenizer.from_pretrained(p, local_files_only=True)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok
