"""Write exported policy weights as a Hugging Face checkpoint directory (``save_pretrained``)."""

from __future__ import annotations

import shutil
from collections.abc import Iterable
from pathlib import Path

import torch

#: Tokenizer / generation files copied from the template directory when present.
_SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
               "merges.txt", "tokenizer.model", "added_tokens.json", "chat_template.jinja",
               "generation_config.json")


def save_hf_weights(weights: Iterable[tuple[str, torch.Tensor]], template_dir: str | Path,
                    out_dir: str | Path) -> Path:
    """Save ``weights`` (Hugging Face names) as a checkpoint with ``template_dir``'s architecture.

    The model is instantiated on the ``meta`` device from ``template_dir/config.json`` (no
    memory for a second copy), the weights are assigned, and ``save_pretrained`` writes
    ``out_dir`` (tied weights handled by ``transformers``); tokenizer files are copied.

    Args:
        weights: ``(name, tensor)`` pairs, e.g. ``Learner.export_policy_weights()``.
        template_dir: a checkpoint directory of the same architecture (its ``config.json``).
        out_dir: destination (created).

    Returns:
        ``out_dir`` as a Path.

    Raises:
        RuntimeError: the weights do not match the architecture (missing/unexpected names).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    template, out = Path(template_dir), Path(out_dir)
    config = AutoConfig.from_pretrained(template, local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    state = {k: v.detach() for k, v in weights}
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    tied = set(getattr(model, "_tied_weights_keys", None) or [])
    missing = [k for k in missing if k not in tied]
    if missing or unexpected:
        raise RuntimeError(f"save_hf_weights: weights do not match {template}: missing {missing[:5]}, "
                           f"unexpected {unexpected[:5]}")
    if tied:
        model.tie_weights()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    for name in _SIDE_FILES:
        if (template / name).is_file():
            shutil.copy2(template / name, out / name)
    return out
