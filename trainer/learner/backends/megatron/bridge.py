"""Hugging Face ↔ Megatron-core models through mbridge: the actor and the critic as ``GPTModel`` s.

* :func:`make_bridge` reads a ``save_pretrained`` directory's config and returns an mbridge
  ``Bridge`` adjusted by :func:`~.shims.prepare_bridge` (``parallel_state`` must be initialised:
  the bridge reads the tensor-parallel layout from it).
* :func:`build_actor` builds the actor ``GPTModel`` and loads the Hugging Face weights
  (mbridge ``load_weights``: tensor-parallel rank 0 reads, then scatters the shards).
* :func:`build_critic` builds the same backbone with :class:`ValueHead` in place of the LM head:
  the torch backend's :class:`~trainer.learner.critic.ValueModel` (``Linear(hidden, 1)``, zero
  weight and bias), so both backends start from the same critic.
* :func:`export_actor` / :func:`export_critic` yield full (tensor-parallel gathered) tensors under
  the names of the torch backend: the actor's Hugging Face ``state_dict`` names (``lm_head.weight``
  included when tied, as ``transformers`` lists it), the critic's :class:`ValueModel` names
  (``backbone.<HF name without 'model.'>``, ``value_head.weight``, ``value_head.bias``). The same
  functions export gradients (``grads=True``: Megatron DDP's ``main_grad``).

Architectures: those mbridge registers (Qwen2, Qwen3, Llama and more), dense ones tested
(:data:`TESTED_ARCHS`); the default RoPE only.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ....errors import ConfigError
from . import shims

Tensor = torch.Tensor

#: Hugging Face ``model_type`` s whose round trip and log-probs are tested on CPU.
TESTED_ARCHS = ("qwen2", "qwen3", "llama")


def load_hf_config(model_dir: str | Path) -> Any:
    """The ``transformers`` config of a ``save_pretrained`` directory (no download)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(model_dir), local_files_only=True)


def check_model_parallel(hf_config: Any, tp_size: int, pp_size: int) -> None:
    """Model-dependent checks of the parallel sizes for Megatron.

    Raises:
        ConfigError: ``learner.backend_settings.pipeline_parallel_size`` ≠ 1 (pipeline schedules are
            not wired in this backend); ``learner.backend_settings.tensor_parallel_size`` not dividing
            the attention heads, the key/value heads or the vocabulary (Megatron shards heads and the
            vocabulary); an architecture mbridge does not know (``model.path``).
    """
    from mbridge import AutoBridge

    if pp_size != 1:
        raise ConfigError(f"learner.backend_settings.pipeline_parallel_size={pp_size}: the megatron "
                          "backend runs pipeline size 1 only (tensor and data parallel); use "
                          "tensor_parallel_size for model parallelism")
    known = AutoBridge.list_supported_models()
    if hf_config.model_type not in known:
        raise ConfigError(f"model.path: architecture {hf_config.model_type!r} is not supported by mbridge "
                          f"(known: {sorted(known)})")
    for count, what in ((hf_config.num_attention_heads, "attention heads"),
                        (getattr(hf_config, "num_key_value_heads", hf_config.num_attention_heads),
                         "key/value heads"), (hf_config.vocab_size, "vocabulary entries")):
        if count % tp_size:
            raise ConfigError(f"learner.backend_settings.tensor_parallel_size={tp_size}: must divide the "
                              f"model's {count} {what}")


def make_bridge(model_dir: str | Path, dtype: torch.dtype) -> Any:
    """An mbridge ``Bridge`` for the model in ``model_dir``, adjusted to this machine.

    Args:
        model_dir: ``save_pretrained`` directory (config + safetensors weights).
        dtype: parameter dtype of the Megatron models.

    Raises:
        ConfigError: as :func:`check_model_parallel` (sizes read from ``parallel_state``).
    """
    from mbridge import AutoBridge
    from megatron.core import parallel_state as ps

    hf = shims.hf_config_for_mbridge(load_hf_config(model_dir))
    check_model_parallel(hf, ps.get_tensor_model_parallel_world_size(),
                         ps.get_pipeline_model_parallel_world_size())
    return shims.prepare_bridge(AutoBridge.from_config(hf, dtype=dtype))


def build_actor(bridge: Any, model_dir: str | Path, device: torch.device) -> nn.Module:
    """The actor ``GPTModel`` on ``device`` with the Hugging Face weights of ``model_dir``.

    Collective over the tensor-parallel group (the shards are scattered from its rank 0).
    """
    model = shims.instantiate_model(bridge, device)
    bridge.load_weights([model], str(model_dir))
    return model


class ValueHead(nn.Module):
    """``Linear(hidden, 1)`` with zero weight and bias, in the place of ``GPTModel.output_layer``.

    Called like Megatron's output layer: ``(hidden [s, b, h], weight=None,
    runtime_gather_output=None) -> (values [s, b, 1], None)``. Its parameters are replicated on
    the tensor-parallel ranks (the hidden state entering it is complete on every rank).
    The init is :class:`~trainer.learner.critic.ValueModel`'s (zeros: ``V ≡ 0`` at start).
    """

    def __init__(self, hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1, hidden_size, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(1, dtype=dtype))

    def forward(self, hidden: Tensor, weight: Tensor | None = None, runtime_gather_output: bool | None = None
                ) -> tuple[Tensor, None]:
        """``(hidden @ weightᵀ + bias, None)``; ``weight`` / ``runtime_gather_output`` ignored."""
        del weight, runtime_gather_output
        return nn.functional.linear(hidden, self.weight, self.bias), None


def build_critic(bridge: Any, model_dir: str | Path, device: torch.device) -> nn.Module:
    """The critic: the actor's backbone (same Hugging Face weights) with a :class:`ValueHead`.

    Its forward (``labels=None``) returns ``(B, L, 1)`` values. Collective like :func:`build_actor`.
    """
    from megatron.core import tensor_parallel

    model = build_actor(bridge, model_dir, device)
    model.output_layer = ValueHead(int(bridge.hf_config.hidden_size), bridge.dtype).to(device)
    model.share_embeddings_and_output_weights = False
    for p in model.output_layer.parameters():
        tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(p)
    return model


class _NamedTensors:
    """Stands in for a ``GPTModel`` in mbridge's ``export_weights``: the model's parameter names
    and layer numbering, with other tensors (a subset of the parameters, or their gradients)."""

    def __init__(self, model: nn.Module, tensors: dict[str, Tensor]) -> None:
        self.decoder = model.decoder
        self._tensors = tensors

    def named_parameters(self) -> Iterator[tuple[str, Tensor]]:
        return iter(self._tensors.items())

    def state_dict(self) -> dict[str, Tensor]:
        return dict(self._tensors)


def _unwrap(model: nn.Module) -> nn.Module:
    while hasattr(model, "module") and not hasattr(model, "decoder"):
        model = model.module
    return model


def _local_tensors(model: nn.Module, grads: bool, skip_prefix: str | None = None) -> dict[str, Tensor]:
    """Parameter (or ``main_grad``) tensors by Megatron name, carrying the parameters' TP attributes."""
    out = {}
    for name, p in model.named_parameters():
        if skip_prefix and name.startswith(skip_prefix):
            continue
        t = p
        if grads:
            t = getattr(p, "main_grad", None)
            if t is None:
                t = p.grad
            if t is None:
                continue
        # detached: mbridge broadcasts each tensor in place (over the pipeline group), which
        # must not enter the parameters' autograd history
        t = t.detach()
        for attr in ("tensor_model_parallel", "partition_dim", "partition_stride"):
            if hasattr(p, attr):
                setattr(t, attr, getattr(p, attr))
        out[name] = t
    return out


def _to_cpu(t: Tensor) -> Tensor:
    return t.detach().to("cpu", copy=True)


def export_actor(bridge: Any, model: nn.Module, *, grads: bool = False) -> Iterator[tuple[str, Tensor]]:
    """The actor's full tensors as ``(Hugging Face name, CPU tensor)`` (``grads``: its gradients).

    Collective over the tensor-parallel group: every rank must exhaust the iterator. With tied
    embeddings the weights include ``lm_head.weight`` (= ``model.embed_tokens.weight``, as in
    the ``transformers`` ``state_dict``); gradients list each parameter once (``named_parameters``).
    """
    m = _unwrap(model)
    tensors = _local_tensors(m, grads)
    embed = None
    for name, t in bridge.export_weights([_NamedTensors(m, tensors)]):
        t = _to_cpu(t)
        if name == "model.embed_tokens.weight":
            embed = t
        yield name, t
    if not grads and getattr(bridge.hf_config, "tie_word_embeddings", False) and embed is not None:
        yield "lm_head.weight", embed


def export_critic(bridge: Any, model: nn.Module, *, grads: bool = False) -> Iterator[tuple[str, Tensor]]:
    """The critic's full tensors under :class:`~trainer.learner.critic.ValueModel` names.

    ``backbone.<Hugging Face name without 'model.'>`` for the backbone, then ``value_head.weight``
    ``(1, H)`` and ``value_head.bias`` ``(1,)``. Collective like :func:`export_actor`.
    """
    m = _unwrap(model)
    tensors = _local_tensors(m, grads, skip_prefix="output_layer.")
    for name, t in bridge.export_weights([_NamedTensors(m, tensors)]):
        yield "backbone." + name.removeprefix("model."), _to_cpu(t)
    for name, t in _local_tensors(m.output_layer, grads).items():
        yield f"value_head.{name}", _to_cpu(t)
