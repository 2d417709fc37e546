"""LoRA in the learner: adapters on the actor and the critic, their trainable parameters, their state.

:func:`prepare_models` turns the loaded actor (and the critic built from it) into the models a backend
trains, per :attr:`~trainer.learner.settings.LearnerConfig.lora` /
:attr:`~trainer.learner.settings.LearnerConfig.critic_lora`: the target modules are checked first
(one line naming the key, before anything is copied), then the adapters are injected
(:func:`~trainer.models.lora.inject_lora`). When both models use LoRA the critic's backbone shares the
actor's frozen base weights (one copy in memory); its adapter and value head are its own.

Only parameters with ``requires_grad`` are optimised (:func:`trainable_parameters`) and checkpointed
(:func:`role_state` / :func:`load_role_state`): a LoRA model's adapter (and the critic's value head),
a fully fine-tuned model's whole ``state_dict``. A checkpoint records each model's LoRA settings, so
resuming with other ones fails naming the key instead of loading mismatched tensors.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..errors import ConfigError
from ..models.lora import LoraSettings, check_target_modules, inject_lora, is_lora_model
from .critic import ValueModel
from .settings import LearnerConfig

Tensor = torch.Tensor

#: The config key of each role's adapter.
LORA_KEYS = {"actor": "learner.lora", "critic": "learner.critic_lora"}


def _checkpointed(model: nn.Module) -> bool:
    """Whether activation checkpointing is on in some module of ``model``."""
    return any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())


def prepare_models(actor: nn.Module, cfg: LearnerConfig, use_critic: bool,
                   critic: ValueModel | None = None) -> tuple[nn.Module, ValueModel | None]:
    """The actor and the critic (built from the actor when not given and ``use_critic``) with the
    adapters of ``cfg`` injected; models without LoRA are returned as they are.

    Raises:
        ConfigError: a target module the model does not have (``learner.lora.target_modules`` /
            ``learner.critic_lora.target_modules``), checked before any copy or injection.
        ValueError: an actor that holds an adapter already, without its critic.
    """
    a, c = cfg.lora, (cfg.critic_lora if use_critic else None)
    if a is not None and is_lora_model(actor):  # injected already (a backend wrapping another's models)
        if use_critic and critic is None:
            raise ValueError("prepare_models: the actor already holds a LoRA adapter; pass its critic too")
        a = None
    if a is not None:
        check_target_modules(actor, a, f"{LORA_KEYS['actor']}.target_modules")
    if c is not None:
        body = critic.backbone if critic is not None else actor.get_decoder()
        check_target_modules(body, c, f"{LORA_KEYS['critic']}.target_modules")
    if use_critic and critic is None:
        critic = ValueModel.from_causal_lm(actor, share_parameters=a is not None and c is not None)
    if c is not None and not is_lora_model(critic.backbone):
        inject_lora(critic.backbone, c, f"{LORA_KEYS['critic']}.target_modules")
        critic.value_head.float()  # trained: float32 on a bfloat16 backbone, as the adapters
        if _checkpointed(critic.backbone):  # frozen inputs: reentrant checkpointed blocks need input grads
            critic.backbone.enable_input_require_grads()
    if a is not None:
        inject_lora(actor, a, f"{LORA_KEYS['actor']}.target_modules")  # after the critic's copy
        if _checkpointed(actor):
            actor.enable_input_require_grads()
    return actor, (critic if use_critic else None)


def check_trainable_dtype(model: nn.Module, role: str, dtype_key: str = "model.dtype") -> None:
    """Raise when a parameter that is trained is not float32: AdamW's update ``lr · m / sqrt(v)``
    (``~1e-6`` at the usual actor learning rate) rounds away in bfloat16 / float16 weights, so the
    model would silently not learn. LoRA keeps a low-precision base frozen with float32 adapters.

    Raises:
        ConfigError: naming ``dtype_key`` and the first such parameter.
    """
    for name, p in model.named_parameters():
        if p.requires_grad and p.dtype != torch.float32:
            raise ConfigError(
                f"{dtype_key}: the {role}'s trained parameter {name} is {str(p.dtype)[6:]}; this backend "
                "updates float32 weights only: use learner.lora (a frozen low-precision base, float32 "
                "adapters) or learner.backend=fsdp (mixed precision)")


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """``model``'s parameters that require grad (all of a fully fine-tuned model's)."""
    return [p for p in model.parameters() if p.requires_grad]


def trainable_state(model: nn.Module) -> dict[str, Tensor]:
    """``{name: tensor}`` of the parameters that require grad (detached views)."""
    return {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}


def role_state(role: str, model: nn.Module, settings: LoraSettings | None) -> dict[str, Any]:
    """A model's checkpoint entries: ``{role: state_dict}`` when fully fine-tuned, else
    ``{f"{role}_lora": {"settings": ..., "tensors": trainable_state}}`` (adapter and value head only)."""
    if settings is None:
        return {role: model.state_dict()}
    return {f"{role}_lora": {"settings": settings.to_dict(), "tensors": trainable_state(model)}}


def load_role_state(role: str, model: nn.Module, settings: LoraSettings | None,
                    state: dict[str, Any]) -> None:
    """Restore :func:`role_state` output into ``model`` (exactly: every trainable tensor, none else).

    Raises:
        ConfigError: the checkpoint was trained with other LoRA settings (or with / without LoRA),
            naming ``learner.lora`` / ``learner.critic_lora`` and what the checkpoint holds.
    """
    key, saved = LORA_KEYS[role], state.get(f"{role}_lora")
    if settings is None:
        if saved is not None:
            raise ConfigError(f"{key}: the checkpoint's {role} is a LoRA adapter {saved['settings']}; "
                              f"resume with {key} set to it")
        model.load_state_dict(state[role])
        return
    if saved is None:
        raise ConfigError(f"{key}: the checkpoint's {role} was fully fine-tuned; resume without {key}")
    if LoraSettings.from_dict(saved["settings"]) != settings:
        raise ConfigError(f"{key}={settings.to_dict()}: the checkpoint's {role} adapter has "
                          f"{saved['settings']}; resume with those")
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    tensors = saved["tensors"]
    if set(tensors) != set(params):
        raise ConfigError(f"{key}: the checkpoint's {role} tensors do not match the model's adapter "
                          f"(unexpected {sorted(set(tensors) - set(params))[:3]}, missing "
                          f"{sorted(set(params) - set(tensors))[:3]})")
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(tensors[n])
