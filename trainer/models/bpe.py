"""A byte-level BPE tokenizer trained at run time (``model.tiny.tokenizer: bpe``).

A byte-level tiny model spends one token per byte: a Search-R1 episode (prompt, query, one
100-word ``<information>`` passage, answer) is ~900 tokens, too long to train on 2 CPU cores in
minutes. This module trains a byte-level BPE with the ``tokenizers`` library on the task's own
text (the retriever corpus, the training questions, the prompt) so the same episode is ~4x
shorter, and adds the task's tool tags (``<search>``, ``</information>``, ...) as single tokens.

Properties (tested in ``tests/trainer/models/test_bpe_tokenizer.py``):

* lossless: every string round-trips (``decode(encode(s)) == s``), any Unicode included: the
  alphabet is all 256 bytes (GPT-2's byte <-> unicode map), so nothing is ever unknown;
* a tag is one token wherever it appears (``AddedToken``, not special: it decodes to its text,
  so ``skip_special_tokens`` never drops it);
* it is saved with ``save_pretrained`` like any real tokenizer; the engine and the learner load
  it from the model directory with :func:`trainer.models.loading.load_tokenizer` (its
  ``tokenizer.json`` verbatim: no normalizer is added).

Pre-tokenisation is Qwen2's split pattern followed by byte-level mapping (Yang et al. 2024,
Qwen2 technical report; byte-level BPE: Radford et al. 2019, GPT-2), so merges never cross a
word / digit / punctuation boundary.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from .tiny import SPECIAL_TOKENS

#: Qwen2's pre-tokenizer split pattern (contractions, letters with one leading non-letter, single
#: digits, punctuation runs keeping trailing newlines, newline runs, spaces).
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
#: Smallest vocabulary accepted: 256 byte tokens, the special tokens and room for merges.
MIN_VOCAB = 512


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int, tags: Sequence[str] = (),
                        min_frequency: int = 2) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on ``texts`` with ``tags`` as single (non-special) tokens.

    Args:
        texts: training strings (any Unicode; streamed once by the ``tokenizers`` trainer).
        vocab_size: total vocabulary in tokens (bytes + merges + special tokens + tags), >= 512.
        tags: strings that must each be one token (e.g. ``"<search>"``); empty or duplicated
            tags are rejected.
        min_frequency: a pair must occur this often to be merged.

    Returns:
        A ``PreTrainedTokenizerFast`` with EOS ``<|endoftext|>`` and pad ``<|pad|>`` (the byte
        tokenizer's special tokens, :data:`trainer.models.tiny.SPECIAL_TOKENS`), no BOS, and
        ``clean_up_tokenization_spaces=False`` (decoding is exact).

    Raises:
        ValueError: ``vocab_size`` < 512, an empty tag, a duplicated tag, a tag that is a
            special token, or a tag the byte-level decoder would not give back (e.g. ``"é"``).
    """
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < MIN_VOCAB:
        raise ValueError(f"train_bpe_tokenizer: vocab_size={vocab_size!r} must be an int >= {MIN_VOCAB}")
    tags = list(tags)
    if any(not t for t in tags) or len(set(tags)) != len(tags) or set(tags) & set(SPECIAL_TOKENS):
        raise ValueError(f"train_bpe_tokenizer: tags={tags!r} must be distinct non-empty strings, "
                         f"none of them a special token {SPECIAL_TOKENS}")
    garbled = [t for t in tags if decoders.ByteLevel().decode([t]) != t]  # added tokens are decoded too
    if garbled:
        raise ValueError(f"train_bpe_tokenizer: tags={garbled!r} would not decode to themselves: a character "
                         "of the byte-level alphabet other than printable ASCII (e.g. 'é', 'Ġ') is read as "
                         "a byte")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(tags), min_frequency=min_frequency, show_progress=False,
        special_tokens=list(SPECIAL_TOKENS), initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in tags])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=SPECIAL_TOKENS[0],
                                   pad_token=SPECIAL_TOKENS[1], clean_up_tokenization_spaces=False)


__all__ = ["MIN_VOCAB", "QWEN2_SPLIT", "train_bpe_tokenizer"]
