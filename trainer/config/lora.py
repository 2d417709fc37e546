"""The LoRA settings of the ``learner`` section: ``learner.lora`` (actor) and ``learner.critic_lora``.

::

    learner:
      lora:                  # null (default): the actor is fully fine-tuned
        rank: 8
        alpha: 16.0
        dropout: 0.0
        target_modules: [q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj]  # or [all-linear]
      critic_lora:           # null (default): the critic takes the actor's learner.lora (or none)
        rank: 4              # a key set here overrides the actor's value for the critic
        enabled: true        # false: the critic is fully fine-tuned while the actor uses LoRA

Validated at load (:meth:`LoraSection.settings`, :meth:`CriticLoraSection.settings`) into the typed
:class:`~trainer.models.lora.LoraSettings` the learner gets; a bad value raises one line naming the
key (``learner.lora.rank=0: must be an int >= 1``). Whether the target modules exist is checked when
the model is loaded (:func:`~trainer.models.lora.check_target_modules`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import ConfigError
from ..models.settings import DEFAULT_TARGET_MODULES, LoraSettings


def _settings(key: str, **values) -> LoraSettings:
    """:class:`LoraSettings` of ``values``; its ValueError becomes a ConfigError prefixed with ``key``."""
    try:
        return LoraSettings(**values)
    except ValueError as e:
        raise ConfigError(f"{key}.{e}") from None


@dataclass
class LoraSection:
    """``learner.lora``: the actor's LoRA adapter (fields: :class:`~trainer.models.lora.LoraSettings`)."""

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: list(DEFAULT_TARGET_MODULES))

    def settings(self, key: str = "learner.lora") -> LoraSettings:
        """The validated settings.

        Raises:
            ConfigError: naming ``learner.lora.<field>``.
        """
        return _settings(key, rank=self.rank, alpha=self.alpha, dropout=self.dropout,
                         target_modules=tuple(self.target_modules))


@dataclass
class CriticLoraSection:
    """``learner.critic_lora``: the critic's adapter; every unset (null) field is the actor's
    ``learner.lora`` value (the :class:`LoraSection` default when the actor has none).

    Attributes:
        enabled: false trains the critic fully (its own copy of the backbone) whatever the actor does.
    """

    enabled: bool = True
    rank: int | None = None
    alpha: float | None = None
    dropout: float | None = None
    target_modules: list[str] | None = None

    def settings(self, actor: LoraSection | None, key: str = "learner.critic_lora") -> LoraSettings | None:
        """The critic's validated settings (None when ``enabled`` is false).

        Raises:
            ConfigError: naming ``learner.critic_lora.<field>``.
        """
        if not self.enabled:
            return None
        base = actor or LoraSection()
        pick = {k: getattr(self, k) if getattr(self, k) is not None else getattr(base, k)
                for k in ("rank", "alpha", "dropout", "target_modules")}
        pick["target_modules"] = tuple(pick["target_modules"])
        return _settings(key, **pick)


def resolve_lora(actor: LoraSection | None, critic: CriticLoraSection | None
                 ) -> tuple[LoraSettings | None, LoraSettings | None]:
    """``(actor, critic)`` LoRA settings of the two keys (None = full fine-tuning).

    The critic follows the actor when ``learner.critic_lora`` is null.

    Raises:
        ConfigError: naming the bad key.
    """
    a = actor.settings() if actor is not None else None
    if critic is None:
        return a, (a if actor is not None else None)
    return a, critic.settings(actor)
