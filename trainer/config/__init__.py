"""Typed experiment configuration: OmegaConf structured configs validated at load.

A run is described by :class:`ExperimentConfig`. YAML files in ``configs/`` are
merged onto the schema (unknown keys and wrong types raise an error naming the
key), may compose other files through a ``defaults:`` list (paths relative to
the file, merged in order, then the file itself), and accept dotted command-line
overrides (``train.total_steps=3``). After the merge every section's
``validate()`` checks ranges and names the offending key.
"""

from __future__ import annotations

import copy
import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

import copc
from copc.presets import moved_field_hint
from seams.registry import RegistryError

from ..errors import ConfigError
from ..plugins import SEAMS, import_plugins, load_ref, registry, seam
from .learner_section import LearnerSection
from .sections import (  # noqa: F401 - re-exported: import sections from here
    CheckpointConfig,
    EvalConfig,
    LauncherConfig,
    LoggingConfig,
    ModelConfig,
    RolloutConfig,
    TaskConfig,
    TinyModelSpec,
    WarmStartConfig,
    moved_key_hint,
    require,
)
from .train_section import (  # noqa: F401 - re-exported: the staleness settings types and parser
    OLD_STALENESS_KEYS,
    PRESET_STALENESS,
    BoundedStaleness,
    FixedStaleness,
    StalenessSettings,
    TrainConfig,
    parse_staleness,
)

_ALGORITHM_FIELDS = frozenset(f.name for f in dataclasses.fields(copc.AlgorithmConfig))


@dataclass
class ExperimentConfig:
    """A whole run. ``preset`` names a :func:`copc.get_preset`; ``algorithm`` overrides its fields.

    Attributes:
        name: run name. output_dir: where checkpoints, metrics, plots and summary go.
        plugins: modules (dotted names or ``.py`` files) imported before validation and in
            every worker process; their imports register a user's environments, tasks,
            estimators, losses, engines or learner backends (:mod:`trainer.plugins`).
        preset: ``copc`` | ``copc_wo_rc`` | ``ppo`` | ``ppo_async`` | ``areal`` | ``sao`` |
            ``vtrace`` | ``dapo``.
        algorithm: :class:`copc.AlgorithmConfig` field overrides (e.g. ``{gamma: 0.99,
            estimator_settings: {eta_a: 0.25}}``; a ``*_settings`` mapping is merged over the
            preset's settings of the same estimator / loss);
            ``advantage_estimator``/``policy_loss`` may name a user's estimator or loss if it is
            registered in :data:`copc.ADVANTAGE_ESTIMATORS` / :data:`copc.POLICY_LOSSES` before
            the config is loaded (validation reads the registries and their metadata).
    """

    name: str = "copc"
    output_dir: str = "runs/copc"
    plugins: list[str] = field(default_factory=list)
    preset: str = "copc"
    algorithm: dict[str, Any] = field(default_factory=dict)
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    learner: LearnerSection = field(default_factory=LearnerSection)

    def algorithm_config(self) -> copc.AlgorithmConfig:
        """The validated :class:`copc.AlgorithmConfig` (preset + overrides).

        Raises:
            ConfigError: naming ``preset`` (unknown preset), ``algorithm.<field>`` (when the
                message starts with an :class:`copc.AlgorithmConfig` field, e.g. an unregistered
                ``algorithm.advantage_estimator``, listing the registered ones; a field that moved
                into a built-in's settings, with its new spelling) or ``algorithm``.
        """
        for name in self.algorithm:
            hint = moved_field_hint(str(name))
            if hint:
                raise ConfigError(f"algorithm.{hint}".replace(" moved to ", " moved to algorithm.", 1))
        try:
            return copc.get_preset(self.preset, **dict(self.algorithm))
        except ValueError as e:
            msg = str(e)
            first = re.match(r"\w+", msg)
            if "unknown preset" in msg:
                key = "preset"
            elif first and first.group() in _ALGORITHM_FIELDS:
                if first.group().endswith("_settings"):  # already a key: estimator_settings.x=1
                    raise ConfigError(f"algorithm.{msg}") from None
                key = f"algorithm.{first.group()}"
            else:
                key = "algorithm"
            raise ConfigError(f"{key}: {msg}") from None

    @property
    def staleness(self) -> StalenessSettings:
        """The effective staleness settings, resolved here and only here (read this, not ``train``'s).

        Returns:
            ``train.staleness`` as parsed at load (:attr:`TrainConfig.staleness_settings
            <trainer.config.train_section.TrainConfig.staleness_settings>`), its number replaced by
            the preset's own staleness when it fixes one
            (:data:`~trainer.config.train_section.PRESET_STALENESS`, ``ppo``: 0): in ``bounded``
            mode that is the bound, in ``fixed`` mode the exact lag.

        Raises:
            ConfigError: as :func:`parse_staleness`.
        """
        own = PRESET_STALENESS.get(self.preset)
        settings = self.train.staleness_settings
        if own is None:
            return settings
        # the preset's own staleness wins in either mode (``ppo``: 0)
        return BoundedStaleness(max=own) if settings.mode == "bounded" else \
            dataclasses.replace(settings, lag=own)

    @property
    def max_staleness(self) -> int:
        """The effective staleness number: the bound (``bounded``) or the exact lag (``fixed``) of
        :attr:`staleness`."""
        return self.staleness.versions

    def validate(self) -> ExperimentConfig:
        """Validate every section; return ``self``.

        Raises:
            ConfigError: naming the first bad key.
        """
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if hasattr(v, "validate"):
                v.validate()
        check_plugins(self)  # the named engine / backend / task: registered, settings, capabilities
        # a launcher that cannot host a distributed learner backend (capability metadata)
        kind, backend = self.launcher.kind, self.learner.backend
        if plugin_metadata(self, "learner.backend").get("distributed", False) \
                and not plugin_metadata(self, "launcher.kind")["distributed_learner"]:
            raise ConfigError(f"launcher.kind={kind!r} with learner.backend={backend!r}: not supported (the "
                              f"{kind} launcher hosts the learner in one process); use launcher.kind=local "
                              "with learner.backend_settings.launch=ray to run the learner ranks as Ray "
                              "actors")
        r = self.rollout  # the rule of trainer.logprobs.truncates, not imported: it loads torch
        if r.top_k != 1 and (r.top_k > 1 or r.top_p < 1) \
                and not plugin_metadata(self, "learner.backend").get("truncated_sampling", True):
            raise ConfigError(f"rollout.top_k={r.top_k!r} / rollout.top_p={r.top_p!r} with learner.backend="
                              f"{backend!r}: this backend's log-probs are untruncated and cannot replay the "
                              "sampler's top-k / top-p support; use top_k=-1 and top_p=1, or the torch / "
                              "fsdp backend")
        algo = self.algorithm_config()
        _ = self.staleness  # a preset's own staleness vs train.staleness
        n = self.rollout.n_samples_per_prompt
        if copc.ADVANTAGE_ESTIMATORS.metadata(algo.advantage_estimator)["needs_groups"]:
            require(n >= 2, "rollout.n_samples_per_prompt", n,
                     f"advantage estimator {algo.advantage_estimator!r} (preset {self.preset!r}) is "
                     "group-relative (needs_groups): needs >= 2")
        if self.train.filter_groups:
            require(n >= 2, "rollout.n_samples_per_prompt", n,
                     "train.filter_groups drops groups whose episodes all got one reward: needs >= 2")
        if algo.n_samples_per_prompt is not None:
            require(n == algo.n_samples_per_prompt, "rollout.n_samples_per_prompt", n,
                     f"preset {self.preset!r} is defined for exactly {algo.n_samples_per_prompt} "
                     "sample(s) per prompt (its n_samples_per_prompt)")
        return self


def _compose(path: Path, seen: tuple[Path, ...] = ()) -> DictConfig:
    """Load a YAML file, resolving its ``defaults:`` list (relative paths) depth-first."""
    path = path.resolve()
    if path in seen:
        raise ConfigError(f"config composition cycle: {' -> '.join(str(p) for p in (*seen, path))}")
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    raw = OmegaConf.load(path)
    if not isinstance(raw, DictConfig):
        raise ConfigError(f"{path}: top level must be a mapping")
    defaults = raw.pop("defaults", [])
    merged = OmegaConf.create({})
    for d in defaults:
        merged = _merge(merged, _compose(path.parent / str(d), (*seen, path)))
    return _merge(merged, raw, where=f"{path}: ")


def _merge(base: DictConfig, layer: DictConfig, where: str = "") -> DictConfig:
    """``OmegaConf.merge(base, layer)``, except that ``train.staleness`` is one discriminated section.

    A layer that sets ``train.staleness.mode`` to another mode than ``base``'s replaces the whole
    section (the keys of the old mode do not carry over: ``{mode: fixed, lag: 2}`` over
    ``{mode: bounded, max: 8}`` is ``{mode: fixed, lag: 2}``); the same mode merges key by key.

    Raises:
        ConfigError: ``layer`` uses a staleness key of before the section (``train.max_staleness``,
            ``train.staleness_mode``, ``train.fixed_lag``), naming it and the new spelling; or
            ``layer`` puts a list where ``base`` has a mapping, or the reverse (``where`` first).
    """
    train = layer.get("train") if isinstance(layer, DictConfig) else None
    if isinstance(train, DictConfig):
        for key, spelling in OLD_STALENESS_KEYS.items():
            if key in train:
                value = OmegaConf.select(train, key)
                raise ConfigError(f"{where}train.{key}={value!r}: replaced by the train.staleness section; "
                                  f"write {spelling.format(v=value)}")
        new = train.get("staleness")
        old = OmegaConf.select(base, "train.staleness", default=None)
        if isinstance(new, DictConfig) and isinstance(old, DictConfig) and "mode" in new \
                and new.get("mode") != old.get("mode"):
            base = copy.deepcopy(base)
            base.train.staleness = {}
    try:
        return OmegaConf.merge(base, layer)
    except TypeError as e:  # omegaconf: a list over a mapping (or the reverse) is a bare TypeError
        raise _ContainerMismatchError(f"{where}{e}: a mapping (e.g. task.settings, launcher.settings) takes "
                                 "key: value entries, a list takes a list") from None


class _ContainerMismatchError(ConfigError):
    """A config layer puts a list where the config has a mapping, or the reverse."""


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> ExperimentConfig:
    """Load ``path`` (composed), apply dotted ``overrides``, validate, return the typed config.

    Args:
        path: YAML file (None: schema defaults only).
        overrides: ``["train.total_steps=3", "preset=ppo", ...]`` (OmegaConf dotlist syntax).

    Returns:
        A validated :class:`ExperimentConfig`.

    Raises:
        ConfigError: for a missing file, an unknown key, a wrong type or a bad value; the
            message names the key.
    """
    schema = OmegaConf.structured(ExperimentConfig)
    try:
        cfg = schema
        if path is not None:
            cfg = _merge(cfg, _compose(Path(path)), where=f"{path}: ")
        if overrides:
            bad = [o for o in overrides if "=" not in o]
            if bad:
                raise ConfigError(f"override {bad[0]!r} must look like key=value")
            for o in overrides:  # one at a time, so a value YAML cannot parse names its key
                try:
                    dot = OmegaConf.from_dotlist([o])
                except yaml.YAMLError as e:
                    key, _, value = o.partition("=")
                    raise ConfigError(f"{key}={value!r}: not a valid YAML value "
                                      f"({str(e).splitlines()[0]}); quote it") from None
                try:
                    cfg = _merge(cfg, dot)
                except _ContainerMismatchError as e:
                    raise ConfigError(f"{o.partition('=')[0]}={o.partition('=')[2]}: {e}") from None
        obj = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None)
        msg = str(e).split("\n")[0]
        moved = moved_key_hint(key)  # a key that moved into a task's settings: say the new spelling
        raise ConfigError(moved or (f"{key}: {msg}" if key else msg)) from None
    assert isinstance(obj, ExperimentConfig)
    import_plugins(obj.plugins)  # they may register what the config names (estimators, engines...)
    return obj.validate()


def to_yaml(cfg: ExperimentConfig) -> str:
    """The fully-resolved config as YAML (saved next to every run)."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


# -- the plug-ins a config names (read here, in the config layer; components below it get typed
# specs built from these: trainer/config/specs.py) -------------------------------------------

def _value(cfg: ExperimentConfig, dotted: str) -> Any:
    """The config value at the dotted key ``dotted`` (``"rollout.engine"``)."""
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


def plugin_name(cfg: ExperimentConfig, key: str) -> str | None:
    """The registry name the config names at ``key`` (``task.env`` resolved to an environment
    id), or None when it is not registered and the seam is optional.

    Raises:
        ConfigError: an unregistered name of a mandatory seam, listing the registered ones.
    """
    s, reg = seam(key), registry(key)
    name = _value(cfg, key)
    if s.resolve:
        try:
            name = load_ref(s.resolve)(name)
        except Exception:  # an unresolvable reference is reported where it is used (build_task)
            return None
    if name in reg:
        return name
    if s.optional:
        return None
    raise ConfigError(f"{key}={name!r}: not a registered {s.kind}; known: {reg.names()} (register it in a "
                      "module listed under plugins:)")


def plugin_settings(cfg: ExperimentConfig, key: str) -> Any:
    """The validated settings of the plug-in the config names at ``key``: an instance of the
    settings dataclass it was registered with (built from the config's settings section), or
    None when it takes none. A plug-in registered with metadata ``delegated_settings=True`` (the
    ``remote`` task: its settings are the served environment's task's) gets its section back as a
    plain dict, checked later by the plug-in it delegates to.

    Raises:
        ConfigError: an unregistered name; settings given to a plug-in that takes none; an
            unknown setting or a wrong type (one line naming ``<settings_key>.<field>`` and the
            value).
    """
    s = seam(key)
    name, raw = plugin_name(cfg, key), _value(cfg, s.settings_key)
    if name is None:
        if raw:
            raise ConfigError(f"{s.settings_key}={dict(raw)!r}: {key}={_value(cfg, key)!r} has no registered "
                              f"{s.kind} with settings")
        return None
    if registry(key).metadata(name).get("delegated_settings", False):  # another plug-in's, checked later
        return dict(raw or {})
    try:
        return registry(key).build_settings(name, raw, s.settings_key)
    except RegistryError as e:
        raise ConfigError(str(e)) from None


def plugin_metadata(cfg: ExperimentConfig, key: str) -> Mapping[str, Any]:
    """Capability metadata of the plug-in the config names at ``key`` (empty when an optional
    seam's name is not registered).

    Raises:
        ConfigError: an unregistered name of a mandatory seam.
    """
    name = plugin_name(cfg, key)
    return {} if name is None else registry(key).metadata(name)


def check_plugins(cfg: ExperimentConfig) -> None:
    """Validate every seam of ``cfg``: its name is registered and its settings section passes
    the plug-in's settings dataclass; then each section's ``check_plugin(metadata, registry)``
    (when it has one) checks the section against the plug-in's capability metadata.

    Raises:
        ConfigError: naming the first bad key.
    """
    for s in SEAMS:
        plugin_settings(cfg, s.key)
        section = getattr(cfg, s.key.split(".")[0])
        check = getattr(section, "check_plugin", None)
        if check is not None:
            check(plugin_metadata(cfg, s.key), registry(s.key))
