"""LoRA adapters on ``transformers`` models, with ``peft``: settings, injection, adapter tensors, merging.

One adapter (peft's ``"default"``) is *injected in place* (:func:`peft.inject_adapter_in_model`):
the model keeps its class and forward (learner, engines and the chunked log-prob path see an
ordinary causal LM), each target ``nn.Linear`` becomes a ``peft`` LoRA layer computing
``W x + (alpha / rank) · B A dropout(x)``, and only the ``lora_A`` / ``lora_B`` matrices require
gradients.

What travels between the learner and the engines is an :class:`AdapterWeights`: the
:class:`LoraSettings` plus the adapter tensors under peft's saved names
(``model.layers.0.self_attn.q_proj.lora_A.weight``, i.e. :func:`peft.get_peft_model_state_dict`).
:meth:`AdapterWeights.save_peft_dir` writes the standard PEFT directory (``adapter_config.json``
+ ``adapter_model.safetensors`` with ``base_model.model.`` names) that ``PeftModel.from_pretrained``
and SGLang's ``/load_lora_adapter`` read. :func:`merged_state_dict` gives the full weights in
Hugging Face names, ``W + (alpha / rank) · B A`` per adapted layer (the HF export and
``copc eval --checkpoint`` evaluate a merged model), computed out of place: the base weights are
never modified.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import ConfigError
from .settings import (  # noqa: F401 - re-exported: LoraSettings and its names are defined without torch
    ALL_LINEAR,
    DEFAULT_TARGET_MODULES,
    EMBEDDING_TARGETS,
    LoraSettings,
)

Tensor = torch.Tensor

#: peft's adapter name (one adapter per model).
ADAPTER = "default"
#: Name prefix of the tensors in a PEFT adapter file (``PeftModel.save_pretrained``).
PEFT_PREFIX = "base_model.model."
ADAPTER_FILE, CONFIG_FILE = "adapter_model.safetensors", "adapter_config.json"


def is_lora_model(model: nn.Module) -> bool:
    """Whether ``model`` holds injected LoRA layers (``lora_A`` parameters)."""
    return any(".lora_A." in n for n, _ in model.named_parameters())


def linear_module_names(model: nn.Module) -> list[str]:
    """Sorted last name components of ``model``'s ``nn.Linear`` modules (``q_proj``, ``lm_head``, ...)."""
    return sorted({n.rpartition(".")[2] for n, m in model.named_modules() if isinstance(m, nn.Linear)})


def check_target_modules(model: nn.Module, settings: LoraSettings, key: str) -> None:
    """Refuse target modules that match no module of ``model`` (peft would silently skip them), that
    match a module other than an ``nn.Linear`` (an embedding: peft gives it ``lora_embedding_A/B``
    adapters that the learner does not train — it trains ``lora_A`` / ``lora_B`` — and saves the
    whole embedding matrix with the adapter, so every adapter-only sync would carry it; a
    convolution or a block neither :func:`merged_state_dict` nor the engines merge), or the output
    layer when it is tied to the input embeddings.

    Raises:
        ConfigError: one line naming ``key``: the unmatched entries and the model's linear layers,
            or the first non-linear module matched and its type, or the tied output layer.
    """
    if settings.target_modules == (ALL_LINEAR,):
        return
    names = [n for n, _ in model.named_modules() if n]

    def hits(t: str) -> list[str]:
        return [n for n in names if n == t or n.endswith(f".{t}")]

    missing = [t for t in settings.target_modules if not hits(t)]
    if missing:
        raise ConfigError(f"{key}: no module named {', '.join(map(repr, missing))} in the model "
                          f"({type(model).__name__}); its linear layers: "
                          f"{', '.join(linear_module_names(model))}")
    modules = dict(model.named_modules())
    for t in settings.target_modules:
        other = next((n for n in hits(t) if not isinstance(modules[n], nn.Linear)), None)
        if other is not None:
            raise ConfigError(f"{key}: {t!r} matches {other!r}, a {type(modules[other]).__name__}, not an "
                              "nn.Linear: LoRA here adapts linear layers only (an adapter there would not "
                              "be trained or merged)")
    out_emb = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    head = next((n for n, m in model.named_modules() if out_emb is not None and m is out_emb), None)
    if tied and head is not None and any(head in hits(t) for t in settings.target_modules):
        raise ConfigError(f"{key}: {head!r} is tied to the input embeddings (tie_word_embeddings); an "
                          "adapter on it could not be merged into one exported matrix")


def inject_lora(model: nn.Module, settings: LoraSettings, key: str = "learner.lora.target_modules"
                ) -> nn.Module:
    """Inject a LoRA adapter into ``model`` in place; afterwards only adapter parameters require grad.

    ``lora_B`` starts at zero (peft's initialisation), so the adapted model computes exactly what the
    base model did until it is trained. The adapter is float32 whatever the base's dtype (peft's
    ``autocast_adapter_dtype``): on a bfloat16 base an update of ``lr · g ≈ 1e-6`` would round away
    (bf16 keeps 8 significant bits); peft's layers cast the input to the adapter's dtype and the sum
    back to the base's.

    Raises:
        ConfigError: a target module that does not exist, or one peft cannot adapt (naming ``key``).
        ValueError: ``model`` already holds a LoRA adapter.
    """
    if is_lora_model(model):
        raise ValueError(f"{type(model).__name__} already holds a LoRA adapter")
    check_target_modules(model, settings, key)
    from peft import inject_adapter_in_model

    try:
        inject_adapter_in_model(settings.peft_config(), model, adapter_name=ADAPTER)
    except ValueError as e:  # e.g. a target that is not a layer type LoRA supports
        raise ConfigError(f"{key}: {str(e).splitlines()[0]}") from None
    for name, p in model.named_parameters():
        is_adapter = ".lora_A." in name or ".lora_B." in name
        p.requires_grad_(is_adapter)
        if is_adapter and p.dtype != torch.float32:  # a bf16/fp16 base: float32 adapter (peft's autocast)
            p.data = p.data.float()
    return model


def adapter_tensors(model: nn.Module) -> dict[str, Tensor]:
    """The adapter's tensors under peft's saved names (detached views of the live parameters)."""
    from peft import get_peft_model_state_dict

    return {k: v.detach() for k, v in get_peft_model_state_dict(model, adapter_name=ADAPTER).items()}


def load_adapter_tensors(model: nn.Module, tensors: Mapping[str, Tensor]) -> None:
    """Copy ``tensors`` (:func:`adapter_tensors` names) into ``model``'s adapter, all of them or none.

    Raises:
        ValueError: a name the adapter lacks, an adapter tensor not given, or a shape mismatch.
    """
    from peft import set_peft_model_state_dict

    expected = set(adapter_tensors(model))
    unknown, absent = sorted(set(tensors) - expected), sorted(expected - set(tensors))
    if unknown or absent:
        raise ValueError(f"adapter tensors do not match the model's adapter: unexpected {unknown[:3]}, "
                         f"missing {absent[:3]}")
    with torch.no_grad():
        try:
            set_peft_model_state_dict(model, dict(tensors), adapter_name=ADAPTER)
        except RuntimeError as e:  # size mismatch
            raise ValueError(f"adapter tensors do not match the model's adapter: {e}") from None


def _adapted_layers(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``(module name, peft LoRA layer)`` of every adapted layer."""
    from peft.tuners.lora import LoraLayer

    for name, m in model.named_modules():
        if isinstance(m, LoraLayer):
            yield name, m


def merged_state_dict(model: nn.Module, tensors: Mapping[str, Tensor] | None = None,
                      settings: LoraSettings | None = None) -> dict[str, Tensor]:
    """The full weights of the adapted model in Hugging Face names, each adapted ``nn.Linear`` merged.

    ``W' = W + scaling · B A`` (peft's ``get_delta_weight`` for a plain linear layer), computed in
    float32 and cast to ``W``'s dtype; ``W`` itself is not modified. With ``tensors`` (and their
    ``settings``) the delta is that of another adapter version of the same shape (a kept fixed-lag
    version); default: the model's own adapter.

    Raises:
        ValueError: an adapted layer that is not a plain ``nn.Linear``, or ``tensors`` without
            ``settings``.
    """
    if tensors is not None and settings is None:
        raise ValueError("merged_state_dict: tensors need their LoraSettings (the scaling)")
    own = adapter_tensors(model) if tensors is None else dict(tensors)
    out: dict[str, Tensor] = {}
    for k, v in model.state_dict().items():
        if ".lora_" in k:
            continue
        out[k.replace(".base_layer.", ".")] = v
    for name, layer in _adapted_layers(model):
        base = layer.get_base_layer()
        if not isinstance(base, nn.Linear) or getattr(layer, "fan_in_fan_out", False):
            raise ValueError(f"merged_state_dict: {name} is a {type(base).__name__}, not a plain nn.Linear")
        scale = settings.scaling if settings is not None else float(layer.scaling[ADAPTER])
        a, b = own[f"{name}.lora_A.weight"].float(), own[f"{name}.lora_B.weight"].float()
        w = base.weight.detach()
        out[f"{name}.weight"] = (w.float() + (b.to(w.device) @ a.to(w.device)) * scale).to(w.dtype)
    return out


@dataclass
class AdapterWeights:
    """One policy version's LoRA adapter: what a learner sends to an engine instead of full weights.

    Attributes:
        settings: the adapter's :class:`LoraSettings` (the engine injects the same).
        tensors: ``lora_A`` / ``lora_B`` tensors under peft's saved names (no ``base_model.model.``
            prefix, no adapter name).
    """

    settings: LoraSettings
    tensors: dict[str, Tensor]

    @classmethod
    def of(cls, model: nn.Module, settings: LoraSettings) -> AdapterWeights:
        """The adapter of ``model`` (views of its parameters: :meth:`copy` to keep a version)."""
        return cls(settings, adapter_tensors(model))

    @property
    def nbytes(self) -> int:
        """Bytes of the tensors (what a sync moves)."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    @property
    def module_names(self) -> list[str]:
        """Sorted last name components of the adapted modules (``q_proj``, ``v_proj``, ...)."""
        return sorted({k.rsplit(".lora_", 1)[0].rpartition(".")[2] for k in self.tensors})

    def copy(self, device: str | torch.device = "cpu") -> AdapterWeights:
        """A detached copy on ``device`` (never a view of a live parameter)."""
        return AdapterWeights(self.settings,
                              {k: v.detach().to(device, copy=True) for k, v in self.tensors.items()})

    def state(self) -> dict[str, Any]:
        """Plain ``{"settings": dict, "tensors": dict}`` (checkpoints pickle no class of ours)."""
        return {"settings": self.settings.to_dict(), "tensors": dict(self.tensors)}

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> AdapterWeights:
        """The inverse of :meth:`state`."""
        return cls(LoraSettings.from_dict(state["settings"]), dict(state["tensors"]))

    def save_peft_dir(self, path: str | Path, base_model: str | Path = "") -> Path:
        """Write a standard PEFT adapter directory: ``adapter_config.json`` (peft's ``LoraConfig``,
        ``base_model_name_or_path`` = ``base_model``) and ``adapter_model.safetensors`` (names with
        peft's ``base_model.model.`` prefix), as ``PeftModel.save_pretrained`` does.

        Returns:
            ``path`` (created).
        """
        from safetensors.torch import save_file

        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        cfg = self.settings.peft_config()
        cfg.base_model_name_or_path = str(base_model)
        cfg.task_type = "CAUSAL_LM"
        cfg.save_pretrained(str(out))
        save_file({PEFT_PREFIX + k: v.detach().contiguous().cpu() for k, v in self.tensors.items()},
                  str(out / ADAPTER_FILE), metadata={"format": "pt"})
        return out


def adapter_of(source: Any) -> AdapterWeights | None:
    """``source.export_adapter()`` when the source has one (a LoRA learner, a kept adapter version),
    else None (full weights: ``source.export_policy_weights()``)."""
    export = getattr(source, "export_adapter", None)
    return export() if callable(export) else None
