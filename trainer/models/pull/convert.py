"""Convert a GGUF file into a ``save_pretrained`` directory with transformers + ``gguf``, and check it.

transformers loads a GGUF checkpoint dequantised (``from_pretrained(dir, gguf_file=...)``) but
refuses to ``save_pretrained`` it ("quantized with gguf and is not serializable"): the config keeps
a ``quantization_config``. So a fresh model is built from the same config without it
(``type(config).from_dict``, ``AutoModelForCausalLM.from_config``), given the loaded state dict
(``strict=True``: every tensor, no extra ones) and saved with the GGUF tokenizer. The saved
directory is then loaded back the way every command loads a model
(:func:`trainer.models.loading.load_model_and_tokenizer`) and must give the same token ids for a
fixed chat prompt and bit-identical logits to the GGUF-loaded model (float32 on CPU, eager
attention in both: the same weights through the same code, so exact equality is the test).
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path
from typing import Any

from .errors import PullError

#: The fixed prompt of the check: a system and a user turn through the model's chat template.
CHECK_MESSAGES = ({"role": "system", "content": "You are a helpful assistant."},
                  {"role": "user", "content": "What is 12 × 7? Answer with <answer>84</answer>. Ünïcödé ok?"})


def _load_gguf(gguf: Path) -> tuple[Any, Any]:
    """``(model, tokenizer)`` read from ``gguf`` (float32, eager attention, eval mode)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # local_files_only explicit: the saved tokenizer_config.json records it, and left to
    # transformers it follows $HF_HUB_OFFLINE (the conversion would depend on the environment)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32,
                                                 attn_implementation="eager", local_files_only=True)
    return model.eval(), tok


def _save_plain_copy(model: Any, tok: Any, out: Path) -> None:
    """Save ``model`` (GGUF-loaded) as an ordinary safetensors checkpoint, and ``tok``, into ``out``."""
    import torch
    from transformers import AutoModelForCausalLM

    raw = model.config.to_dict()
    raw.pop("quantization_config", None)
    config = type(model.config).from_dict(raw)
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict(), strict=True)
    if getattr(model, "generation_config", None) is not None:
        plain.generation_config = model.generation_config
    plain.save_pretrained(out)
    tok.save_pretrained(out)
    del plain
    gc.collect()


def _prompt_ids(tok: Any) -> tuple[str, list[int]]:
    text = tok.apply_chat_template(list(CHECK_MESSAGES), tokenize=False, add_generation_prompt=True)
    return text, list(tok(text, add_special_tokens=False)["input_ids"])


def check_same_model(gguf_model: Any, gguf_tok: Any, out: Path) -> dict[str, Any]:
    """Compare the saved checkpoint in ``out`` with the GGUF-loaded model on the fixed chat prompt.

    Returns:
        ``{"prompt_tokens": n, "max_abs_logit_diff": 0.0, "vocab_size": V}``.

    Raises:
        PullError: the rendered prompt, its token ids or the (1, n, V) float32 logits differ.
    """
    import torch

    from ..loading import load_model_and_tokenizer

    saved, saved_tok = load_model_and_tokenizer(out)
    text, ids = _prompt_ids(gguf_tok)
    text2, ids2 = _prompt_ids(saved_tok)
    if text != text2 or ids != ids2:
        raise PullError(f"{out}: the saved tokenizer renders or encodes the check prompt differently from "
                        f"the GGUF's ({len(ids2)} vs {len(ids)} tokens)")
    with torch.no_grad():
        x = torch.tensor([ids])
        a, b = gguf_model(x).logits, saved(x).logits
    diff = float((a - b).abs().max())
    if not torch.equal(a, b):
        raise PullError(f"{out}: logits of the saved model differ from the GGUF-loaded model's on the check "
                        f"prompt (max |diff| {diff:.3g} over {len(ids)} tokens)")
    return {"prompt_tokens": len(ids), "max_abs_logit_diff": diff, "vocab_size": int(a.shape[-1])}


def convert_gguf(gguf: Path, out: Path) -> dict[str, Any]:
    """Write the ``save_pretrained`` checkpoint of ``gguf`` into ``out`` and check it (module docstring).

    Args:
        gguf: the GGUF file.
        out: an existing, empty directory (the pull's staging directory).

    Returns:
        The check's figures (:func:`check_same_model`).

    Raises:
        PullError: the check failed.
    """
    print(f"[pull] converting {gguf.name} with transformers + gguf (about a minute on 2 cores)",
          file=sys.stderr, flush=True)
    model, tok = _load_gguf(gguf)
    _save_plain_copy(model, tok, out)
    return check_same_model(model, tok, out)
