"""How much memory a run needs, estimated before any model is loaded (issue 45, item 4).

:func:`estimate_memory` adds up, in bytes, what the learner process and the rollout engines hold
at the peak of a training step, from the model's shape (:class:`ModelDims`, read from its
``config.json`` or the tiny model's spec) and the run's settings (:class:`MemoryPlan`):

* **weights**: every parameter at ``model.dtype`` (``param_bytes``); the actor's and, with full
  fine-tuning, the critic's own copy (a LoRA critic shares the actor's frozen base,
  :meth:`trainer.learner.critic.ValueModel.from_causal_lm`);
* **trainable state**: per trainable parameter its gradient and AdamW's two moments (``exp_avg``,
  ``exp_avg_sq``) at the parameter's dtype (torch's AdamW keeps no float32 master copy: the
  trainable parameters of a LoRA run are float32, those of a full fine-tune are at ``model.dtype``);
  with LoRA the trainable parameters are the adapters, ``rank * (in + out)`` per adapted linear
  layer, plus the critic's value head;
* **activations** of one micro-batch of ``micro_batch`` rows of ``seq_len`` tokens (actor and
  critic run one after the other, so one backbone's worth), at ``act_bytes`` per element:
  without gradient checkpointing every decoder layer keeps ``8h + 3 kv + 4i`` elements per token
  (the tensors a Llama / Qwen2 layer saves for backward, counted: two RMSNorm inputs and outputs,
  q/k/v and the rotated q/k, the attention output and ``o_proj``'s input, the residual, and the
  SwiGLU MLP's gate, up, activation and product; ``h`` hidden, ``kv`` key/value width, ``i``
  intermediate), and eager attention keeps the ``B x H x T x T`` probabilities of every layer (the
  sdpa kernel keeps only its ``B x H x T`` log-sum-exp); with checkpointing each layer keeps its
  input (``h`` per token) and one layer's full set is live during its recomputation; the backward
  pass holds one more layer's worth of activation gradients; the chunked LM head holds
  ``3 x chunk x V`` float32 (logits, log-softmax, gradient). **Mixed precision** (float32 weights
  computed under bfloat16 autocast, ``mixed_precision``: the warm-start's full fine-tune) keeps
  ``6h + 2 kv`` float32 elements per token and layer (the residual stream and both RMSNorms' input
  and output, ``4h``; the rotary embedding's products with its float32 cos/sin, ``2 (h + kv)``) and
  ``3h + 2 kv + 4i`` bfloat16 ones (the cast inputs of q/k/v and ``o_proj``, q/k/v, the MLP's four),
  plus the bfloat16 copy of every layer weight autocast saves for backward; counted with torch's
  saved-tensor hooks on a tiny Llama (``tests/trainer/app/test_sft_memory_check.py``). Its peak RSS is
  higher than what is saved by :data:`MIXED_TRANSIENT_FRACTION` of the layers' count: freed cast
  temporaries the allocator keeps (measured, not derived);
* **engines**: each rollout engine's own copy of the weights at ``model.dtype`` and its KV cache
  (``slots x engine_seq_len x layers x 2 x kv`` elements at ``param_bytes``);
* **runtime**: ``RUNTIME_BYTES`` per process (Python, torch, tokenizers: measured ~0.4-0.5 GiB).

The formula for the layer activations follows Korthikanti et al., "Reducing Activation
Recomputation in Large Transformer Models" (2022), section 4.1, recounted for a Llama-style layer
without dropout. Checked against measured peak RSS: ``tests/trainer/models/test_memory_estimate.py``
and ``docs/models.md``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GIB = 1024 ** 3
#: Resident memory of one Python process with torch and transformers imported (bytes).
RUNTIME_BYTES = GIB // 2
#: Under mixed precision, peak RSS beyond the counted terms, as a fraction of the decoder layers'
#: saved activations: 0.53-0.66 measured on SmolLM2's warm-start (4 and 16 rows of 641 tokens, bf16
#: autocast on float32 weights, 2026-12-07; docs/models.md), rounded up within that range.
MIXED_TRANSIENT_FRACTION = 0.6
#: Bytes per element of each ``model.dtype`` / activation dtype.
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class ModelDims:
    """The shape of a Llama / Qwen2-style decoder (what the estimate needs of a ``config.json``).

    Attributes:
        vocab: vocabulary size. hidden: ``hidden_size``. intermediate: the MLP's width.
        layers: decoder layers. heads / kv_heads: attention heads and key/value heads.
        tied: input and output embeddings shared. qkv_bias: q/k/v projections have a bias (Qwen2).
    """

    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    tied: bool = True
    qkv_bias: bool = False

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> ModelDims:
        """The dims of a transformers ``config.json`` mapping.

        Raises:
            KeyError: a field the estimate needs is missing (``hidden_size``, ...).
            ValueError: such a field is not a positive integer (``null``, a string, 0), named.
        """
        def field(key: str) -> int:
            value = config[key]
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"config.json {key}={value!r} is not a positive integer")
            return value

        heads = field("num_attention_heads")
        kv_heads = field("num_key_value_heads") if config.get("num_key_value_heads") is not None else heads
        return cls(vocab=field("vocab_size"), hidden=field("hidden_size"),
                   intermediate=field("intermediate_size"), layers=field("num_hidden_layers"),
                   heads=heads, kv_heads=kv_heads,
                   tied=bool(config.get("tie_word_embeddings", True)),
                   qkv_bias=config.get("model_type") == "qwen2" or bool(config.get("attention_bias", False)))

    @classmethod
    def from_model_dir(cls, path: str | Path) -> ModelDims:
        """The dims of the ``config.json`` in the model directory ``path``."""
        return cls.from_hf_config(json.loads((Path(path) / "config.json").read_text()))

    @property
    def kv(self) -> int:
        """Key/value width: ``kv_heads * hidden / heads``."""
        return self.kv_heads * (self.hidden // self.heads)

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """``name -> (in, out)`` of each decoder layer's linear layers."""
        h, kv, i = self.hidden, self.kv, self.intermediate
        return {"q_proj": (h, h), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (h, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    @property
    def params(self) -> int:
        """All parameters: embeddings (twice when untied), the layers' linears, biases and norms."""
        per_layer = sum(a * b for a, b in self.linear_shapes().values()) + 2 * self.hidden
        if self.qkv_bias:
            per_layer += self.hidden + 2 * self.kv
        embed = self.vocab * self.hidden * (1 if self.tied else 2)
        return embed + self.layers * per_layer + self.hidden

    def lora_params(self, rank: int, targets: tuple[str, ...]) -> int:
        """Adapter parameters of LoRA with ``rank`` on the linear layers named in ``targets``
        (``rank * (in + out)`` per adapted layer, every decoder layer)."""
        shapes = self.linear_shapes()
        return self.layers * sum(rank * sum(shapes[t]) for t in targets if t in shapes)


@dataclass(frozen=True)
class MemoryPlan:
    """The settings the estimate reads (built from the experiment config in ``trainer/app``).

    Attributes:
        dims: the model's shape. param_bytes: bytes per parameter (``model.dtype``).
        act_bytes: bytes per activation element (2 with a bfloat16 base or bfloat16 autocast).
        mixed_precision: float32 weights computed under bfloat16 autocast (the per-layer count
            of the module docstring's "Mixed precision"; ``act_bytes`` is then not read).
        lora_rank / lora_targets: the actor's adapter (rank 0: full fine-tuning).
        critic_lora_rank / critic_lora_targets: the critic's adapter (rank 0: full fine-tuning).
        critic: the preset trains a critic.
        micro_batch: rows per learner micro-batch. seq_len: the longest row (tokens).
        gradient_checkpointing: decoder layers recomputed in backward. attn: ``eager`` | ``sdpa`` | ...
        chunk_tokens: the LM head's chunk (``learner.backend_settings.logprob_chunk_tokens``).
        engines: rollout engines holding their own weights and KV cache (0: none counted).
        engine_slots: KV-cache slots per engine. engine_seq_len: tokens per slot.
        processes: processes each paying :data:`RUNTIME_BYTES`.
    """

    dims: ModelDims
    param_bytes: int = 4
    act_bytes: int = 4
    mixed_precision: bool = False
    lora_rank: int = 0
    lora_targets: tuple[str, ...] = ()
    critic_lora_rank: int = 0
    critic_lora_targets: tuple[str, ...] = ()
    critic: bool = True
    micro_batch: int = 1
    seq_len: int = 512
    gradient_checkpointing: bool = False
    attn: str = "eager"
    chunk_tokens: int = 512
    engines: int = 1
    engine_slots: int = 40
    engine_seq_len: int = 512
    processes: int = 1


@dataclass(frozen=True)
class MemoryEstimate:
    """The estimate's parts (bytes) and their sum; :meth:`line` is its one-line summary."""

    parts: dict[str, int]

    @property
    def total(self) -> int:
        """The sum of the parts, bytes."""
        return sum(self.parts.values())

    def line(self) -> str:
        """``"12.3 GiB (weights 0.5, trainable state 1.6, activations 9.1, ...)"``."""
        parts = ", ".join(f"{k} {v / GIB:.2f}" for k, v in self.parts.items())
        return f"{self.total / GIB:.1f} GiB ({parts} GiB)"


def _states(dims: ModelDims, rank: int, targets: tuple[str, ...], param_bytes: int,
            own_base: bool) -> tuple[int, int]:
    """``(weights, trainable state)`` bytes of one model: its own base weights when ``own_base``,
    and gradient + two AdamW moments per trainable parameter (float32 adapters with LoRA)."""
    weights = dims.params * param_bytes if own_base else 0
    if rank:
        n = dims.lora_params(rank, targets)
        return weights + n * 4, n * 4 * 3
    return weights, dims.params * param_bytes * 3


def _layer_bytes_per_token(plan: MemoryPlan) -> int:
    """Bytes one decoder layer saves for backward per token (see the module docstring)."""
    d = plan.dims
    if plan.mixed_precision:
        return 4 * (6 * d.hidden + 2 * d.kv) + 2 * (3 * d.hidden + 2 * d.kv + 4 * d.intermediate)
    return (8 * d.hidden + 3 * d.kv + 4 * d.intermediate) * plan.act_bytes


def activation_bytes(plan: MemoryPlan) -> int:
    """Peak activation bytes of one micro-batch's forward + backward (see the module docstring)."""
    d, b, t = plan.dims, plan.micro_batch, plan.seq_len
    tokens = b * t
    low = 2 if plan.mixed_precision else plan.act_bytes  # attention's dtype
    layer_saved = tokens * _layer_bytes_per_token(plan)
    per_layer = layer_saved
    if plan.attn == "eager":
        per_layer += b * d.heads * t * t * low
    else:  # a fused kernel: output (counted above) and a float32 log-sum-exp per row and head
        per_layer += b * d.heads * t * 4
    resid = 4 if plan.mixed_precision else plan.act_bytes  # a checkpointed layer keeps its input
    kept = tokens * d.hidden * resid * d.layers + per_layer if plan.gradient_checkpointing \
        else per_layer * d.layers
    if plan.mixed_precision:
        live = 1 if plan.gradient_checkpointing else d.layers  # layers whose temporaries are live at once
        kept += int(MIXED_TRANSIENT_FRACTION * layer_saved * live)
    head = 3 * min(plan.chunk_tokens, tokens) * d.vocab * 4
    casts = 2 * (d.params - d.vocab * d.hidden * (1 if d.tied else 2)) if plan.mixed_precision else 0
    return kept + per_layer + head + casts  # + one layer's activation gradients in backward


def estimate_memory(plan: MemoryPlan) -> MemoryEstimate:
    """The memory ``plan`` needs at its peak (see the module docstring for what is counted).

    Returns:
        A :class:`MemoryEstimate` with the parts ``weights``, ``trainable state`` (gradients and
        AdamW moments), ``activations``, ``engines`` (weights + KV cache) and ``runtime``.
    """
    d = plan.dims
    weights, state = _states(d, plan.lora_rank, plan.lora_targets, plan.param_bytes, True)
    if plan.critic:  # a LoRA critic shares the actor's frozen base; a full one is a deep copy
        cw, cs = _states(d, plan.critic_lora_rank, plan.critic_lora_targets, plan.param_bytes,
                         own_base=not (plan.lora_rank and plan.critic_lora_rank))
        weights, state = weights + cw + (d.hidden + 1) * 4, state + cs + (d.hidden + 1) * 12
    kv_cache = plan.engine_slots * plan.engine_seq_len * d.layers * 2 * d.kv * plan.param_bytes
    return MemoryEstimate({"weights": weights, "trainable state": state,
                           "activations": activation_bytes(plan),
                           "engines": plan.engines * (d.params * plan.param_bytes + kv_cache),
                           "runtime": plan.processes * RUNTIME_BYTES})


def _read_int(path: str) -> int | None:
    """The integer in the file ``path``; None when absent, unreadable or ``max`` (no limit)."""
    try:
        text = Path(path).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


@dataclass(frozen=True)
class MachineMemory:
    """What this process may use: ``limit`` (bytes) it can never exceed and ``available`` (bytes)
    free for it now, with where the limit came from (``source``)."""

    limit: int
    available: int
    source: str


def machine_memory() -> MachineMemory:
    """This process's memory: the limit is its cgroup's (v2 ``memory.max``, v1
    ``memory.limit_in_bytes``) when one is set below the machine's ``MemTotal``, else ``MemTotal``;
    available is ``MemAvailable`` of ``/proc/meminfo``, or less when the cgroup's limit minus its
    current use is less.
    """
    info: dict[str, int] = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, rest = line.partition(":")
            info[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    total = info.get("MemTotal") or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    mem = MachineMemory(total, info.get("MemAvailable", total), "MemTotal")
    for limit_file, used_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                  ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                   "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        limit = _read_int(limit_file)
        if limit is not None and limit < total:
            left = limit - (_read_int(used_file) or 0)
            return MachineMemory(limit, min(mem.available, left), "cgroup memory limit")
    return mem
