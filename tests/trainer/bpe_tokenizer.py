"""A real byte-level BPE tokenizer trained in-test (Qwen2-style pre-tokenizer; no download).

Trained on a few hundred lines of ReTool-like text, so tags get merged tokens: ``</code>``
encodes canonically as ``</ code >`` (3 tokens), ``>\\n`` is one token, and non-ASCII
characters stay split into byte tokens. Every single byte (so every ASCII character) is
also a token of its own, which lets tests spell a string with non-canonical tokens.
"""

from __future__ import annotations

from functools import lru_cache

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

#: Qwen2's pre-tokenizer split pattern (punctuation keeps trailing newlines: ``>\n``).
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
SPECIAL = ("<|endoftext|>", "<|pad|>")


def corpus() -> list[str]:
    """Training text: code calls, interpreter replies and answers."""
    out = []
    for i in range(60):
        out.append(f"Let me compute {i} * {i + 3}.\n<code>\n```python\nx = {i} * {i + 3}\nprint(x)\n```\n"
                   "</code>\n")
        out.append(f"\n<interpreter>\n{i * (i + 3)}\n</interpreter>\n")
        out.append(f"The answer is \\boxed{{{i * (i + 3)}}}.\n")
    return out


@lru_cache(maxsize=1)
def bpe_tokenizer() -> PreTrainedTokenizerFast:
    """The trained tokenizer (cached; ~313 tokens; EOS ``<|endoftext|>``, pad ``<|pad|>``)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus(), trainers.BpeTrainer(
        vocab_size=400, special_tokens=list(SPECIAL), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=SPECIAL[0], pad_token=SPECIAL[1],
                                   clean_up_tokenization_spaces=False)


def token_of(tok: PreTrainedTokenizerFast, text: str) -> int:
    """The id of the single token whose text is ``text`` (raises if there is none)."""
    ids = [i for i in range(len(tok)) if tok.decode([i]) == text]
    if not ids:
        raise KeyError(f"no single token decodes to {text!r}")
    return ids[0]
