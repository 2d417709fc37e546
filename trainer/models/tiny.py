"""Tiny offline models: a byte-level tokenizer and a randomly initialised causal LM.

Nothing is downloaded: the tokenizer is built locally with the ``tokenizers``
library (one token per UTF-8 byte, plus special tokens) and the model from a small
``transformers`` config (Qwen2 or Llama architecture). Both are written with
``save_pretrained`` so tiny and real checkpoints load through the same
``model.path`` code path (:func:`trainer.models.loading.load_model_and_tokenizer`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

SPECIAL_TOKENS = ("<|endoftext|>", "<|pad|>")


@dataclass(frozen=True)
class TinyModelConfig:
    """Size of a tiny model (validated).

    Attributes:
        arch: ``"qwen2"`` or ``"llama"``.
        hidden_size, intermediate_size: widths. num_layers: transformer blocks.
        num_heads, num_kv_heads: attention heads (``num_heads % num_kv_heads == 0``).
        max_position_embeddings: longest sequence in tokens.
        seed: initialisation seed.
    """

    arch: str = "qwen2"
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    max_position_embeddings: int = 4096
    seed: int = 0

    def __post_init__(self) -> None:
        """Validate."""
        if self.arch not in ("qwen2", "llama"):
            raise ValueError(f"TinyModelConfig.arch={self.arch!r}: must be 'qwen2' or 'llama'")
        for k in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                  "max_position_embeddings"):
            if getattr(self, k) < 1:
                raise ValueError(f"TinyModelConfig.{k}={getattr(self, k)!r}: must be >= 1")
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError("TinyModelConfig: hidden_size % num_heads and num_heads % num_kv_heads "
                             f"must be 0, got {self.hidden_size}, {self.num_heads}, {self.num_kv_heads}")


def build_byte_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer needing no download: 256 byte tokens + special tokens.

    Ids 0..255 are the bytes (through GPT-2's byte↔unicode map), then
    ``<|endoftext|>`` (EOS) and ``<|pad|>``. Any text round-trips exactly, and
    tokenising two strings separately equals tokenising their concatenation.
    """
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_map = _bytes_to_unicode()
    vocab = {byte_map[b]: b for b in range(256)}
    assert set(vocab) == set(alphabet)
    for i, tok in enumerate(SPECIAL_TOKENS):
        vocab[tok] = 256 + i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=SPECIAL_TOKENS[0],
                                   pad_token=SPECIAL_TOKENS[1], clean_up_tokenization_spaces=False)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte → printable unicode map (used by ByteLevel pre-tokenizers)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


def build_tiny_model(cfg: TinyModelConfig, vocab_size: int, eos_token_id: int, pad_token_id: int
                     ) -> torch.nn.Module:
    """A randomly initialised causal LM of the given architecture (float32, eager attention)."""
    common = dict(vocab_size=vocab_size, hidden_size=cfg.hidden_size,
                  intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
                  num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
                  max_position_embeddings=cfg.max_position_embeddings, eos_token_id=eos_token_id,
                  pad_token_id=pad_token_id, bos_token_id=eos_token_id, tie_word_embeddings=True)
    torch.manual_seed(cfg.seed)
    if cfg.arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    else:
        model = LlamaForCausalLM(LlamaConfig(**common))
    return model.float().eval()


def save_tiny_checkpoint(out_dir: str | Path, cfg: TinyModelConfig | None = None,
                         tokenizer: PreTrainedTokenizerFast | None = None) -> Path:
    """Build a tiny model for ``tokenizer`` (default: the byte tokenizer) and ``save_pretrained``
    both into ``out_dir``.

    Args:
        out_dir: directory to create (or overwrite).
        cfg: model size (default :class:`TinyModelConfig`).
        tokenizer: the tokenizer (e.g. a run-time BPE, :mod:`trainer.models.bpe`); it needs EOS
            and pad tokens. The model's vocabulary is ``len(tokenizer)``.

    Returns:
        The checkpoint directory (load it with ``load_model_and_tokenizer(path)``).
    """
    cfg = cfg or TinyModelConfig()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = tokenizer if tokenizer is not None else build_byte_tokenizer()
    model = build_tiny_model(cfg, len(tok), tok.eos_token_id, tok.pad_token_id)
    model.config.update({"copc_tiny": asdict(cfg)})
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out
