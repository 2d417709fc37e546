"""Sweep grids: parse ``key=v1,v2,...`` tokens and YAML specs, expand the Cartesian product into cells.

A grid maps dotted :class:`~trainer.config.ExperimentConfig` keys
(``algorithm.policy_loss_settings.eta_p``) to ordered lists of scalar values (int, float, bool or
str). Values are parsed exactly as ``copc train`` parses a ``key=value`` override (OmegaConf's
YAML dotlist rules: ``0.25`` is a float, ``8`` an int, ``true`` a bool, ``abc`` a string), so a
cell runs with the very values it was declared with. Every cell has a readable id made of the
keys' last dotted component and the value, ``algorithm.policy_loss_settings.eta_p=0.25,
algorithm.estimator_settings.eta_a=0.5`` → ``eta_p0.25_eta_a0.5``.
"""

from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from trainer.errors import ConfigError

#: A grid value: what one ``key=value`` override sets.
Scalar = int | float | bool | str

_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
_ID_UNSAFE = re.compile(r"[^A-Za-z0-9._+-]")
#: Keys the sweep sets itself for every run (seeds come from ``--seeds``).
RESERVED_KEYS = ("output_dir", "train.seed")


def parse_value(key: str, token: str) -> Scalar:
    """Parse one value token exactly as ``copc train key=token`` would (OmegaConf dotlist).

    Args:
        key: the dotted key (for error messages).
        token: the value text, e.g. ``"0.25"``, ``"8"``, ``"true"``, ``"fixed"``.

    Returns:
        An int, float, bool or str.

    Raises:
        ConfigError: an empty token, text YAML cannot parse, or a non-scalar (null, list, mapping);
            the message names the key and the token.
    """
    if not token.strip():
        raise ConfigError(f"--grid {key}: empty value")
    try:
        value = OmegaConf.from_dotlist([f"v={token}"])["v"]
    except (yaml.YAMLError, OmegaConfBaseException) as e:
        raise ConfigError(f"--grid {key}: value {token!r} is not a valid YAML scalar "
                          f"({str(e).splitlines()[0]}); quote it") from None
    return check_scalar(key, value, token)


def check_scalar(key: str, value: Any, shown: Any = None) -> Scalar:
    """Return ``value`` if it is an int, float, bool or non-empty str.

    Raises:
        ConfigError: naming ``key`` and the value (``shown`` if given) otherwise.
    """
    shown = value if shown is None else shown
    if isinstance(value, DictConfig | ListConfig | dict | list | tuple) or value is None:
        raise ConfigError(f"--grid {key}: value {shown!r} must be a scalar (int, float, bool or string), "
                          f"got {type(value).__name__}")
    if not isinstance(value, int | float | str):
        raise ConfigError(f"--grid {key}: value {shown!r} has unsupported type {type(value).__name__}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"--grid {key}: value {shown!r} is not finite")
    if isinstance(value, str) and not value:
        raise ConfigError(f"--grid {key}: empty value")
    return value


def format_value(value: Scalar) -> str:
    """The override text of ``value``: ``parse_value(k, format_value(v)) == v`` with the same type.

    Strings that YAML would read as something else (``"1"``, ``"true"``) are single-quoted.

    Raises:
        ConfigError: a string that cannot be written back unambiguously (holds both quote kinds).
    """
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    text = value
    try:
        back = OmegaConf.from_dotlist([f"v={text}"])["v"]
    except (yaml.YAMLError, OmegaConfBaseException):
        back = None
    if isinstance(back, str) and back == value:
        return text
    if "'" not in value:
        return f"'{value}'"
    if '"' not in value and "\\" not in value:
        return f'"{value}"'
    raise ConfigError(f"grid value {value!r} cannot be written as one override (holds both quote kinds)")


def _same(a: Scalar, b: Scalar) -> bool:
    """Equal values of the same type (``True`` and ``1`` differ, ``0.5`` and ``0.50`` do not)."""
    return type(a) is type(b) and a == b


def check_key(key: str, where: str = "--grid") -> str:
    """Return ``key`` if it is a dotted identifier not reserved by the sweep.

    Raises:
        ConfigError: naming the key (``output_dir`` / ``train.seed`` are set by the sweep).
    """
    if not _KEY_RE.match(key):
        raise ConfigError(f"{where} {key!r}: not a dotted config key (e.g. train.actor_lr)")
    if key in RESERVED_KEYS:
        why = "use --seeds" if key == "train.seed" else "the sweep sets it to <out>/cells/<id>/seed<S>"
        raise ConfigError(f"{where} {key}: set by the sweep itself ({why})")
    return key


def check_values(key: str, values: list[Scalar], shown: list[str] | None = None) -> list[Scalar]:
    """Reject an empty value list and duplicates (naming the key and both spellings).

    Raises:
        ConfigError: as above.
    """
    if not values:
        raise ConfigError(f"--grid {key}: no values")
    shown = shown or [format_value(v) for v in values]
    for i, v in enumerate(values):
        for j in range(i):
            if _same(values[j], v):
                raise ConfigError(f"--grid {key}: duplicate value {v!r} ({shown[j]!r} and {shown[i]!r})")
    return values


def parse_grid_arg(token: str) -> tuple[str, list[Scalar]]:
    """Parse one ``--grid key=v1,v2,...`` argument.

    Args:
        token: e.g. ``"algorithm.policy_loss_settings.eta_p=0.25,0.5,0.75"``. Values may not contain commas.

    Returns:
        ``(key, values)``, values in the given order, each parsed by :func:`parse_value`.

    Raises:
        ConfigError: no ``=``, a bad key, an empty value (``0.25,,0.5``), a value that is not a
            scalar, or a duplicate value; the message names the key and the bad token.
    """
    key, eq, rest = token.partition("=")
    if not eq:
        raise ConfigError(f"--grid {token!r}: expected key=v1,v2,...")
    key = check_key(key.strip())
    parts = rest.split(",")
    for i, p in enumerate(parts):
        if not p.strip():
            raise ConfigError(f"--grid {key}: empty value at position {i + 1} in {rest!r}")
    values = [parse_value(key, p.strip()) for p in parts]
    return key, check_values(key, values, [p.strip() for p in parts])


def parse_seeds(text: str | list[Any]) -> list[int]:
    """Parse ``"0,1,2"`` (or a YAML list) into distinct ints >= 0.

    Raises:
        ConfigError: an empty list, a token that is not an int >= 0, or a duplicate (named).
    """
    tokens = [t.strip() for t in text.split(",")] if isinstance(text, str) else list(text)
    seeds: list[int] = []
    for t in tokens:
        if isinstance(t, bool) or not (isinstance(t, int) or (isinstance(t, str) and t.isdigit())):
            raise ConfigError(f"--seeds: {t!r} is not an int >= 0")
        s = int(t)
        if s in seeds:
            raise ConfigError(f"--seeds: duplicate seed {s}")
        seeds.append(s)
    if not seeds:
        raise ConfigError("--seeds: no seeds")
    return seeds


@dataclass(frozen=True)
class Cell:
    """One grid point.

    Attributes:
        id: readable directory name (``eta_p0.25_eta_a0.5``).
        values: ``{key: value}`` in grid-key order.
    """

    id: str
    values: dict[str, Scalar]

    def overrides(self) -> list[str]:
        """``key=value`` overrides setting this cell (values written by :func:`format_value`)."""
        return [f"{k}={format_value(v)}" for k, v in self.values.items()]

    def label(self, key: str) -> str:
        """The value of ``key`` as text (``format_value``), for tables and tick labels."""
        return format_value(self.values[key])


def short_names(keys: list[str]) -> dict[str, str]:
    """Shortest distinct dotted suffix of every key (``algorithm.policy_loss_settings.eta_p`` →
    ``eta_p``; ``train.seed`` and ``warm_start.seed`` → themselves)."""
    parts = {k: k.split(".") for k in keys}
    out = {}
    for k in keys:
        for n in range(1, len(parts[k]) + 1):
            suffix = ".".join(parts[k][-n:])
            if all(".".join(parts[o][-n:]) != suffix for o in keys if o != k):
                break
        out[k] = suffix
    return out


@dataclass
class Grid:
    """An ordered grid ``{key: [values]}``.

    Attributes:
        axes: key → values, insertion order = column order in tables and ids.
    """

    axes: dict[str, list[Scalar]] = field(default_factory=dict)

    @property
    def keys(self) -> list[str]:
        """The grid keys, in order."""
        return list(self.axes)

    def add(self, key: str, values: list[Scalar]) -> None:
        """Set (or replace) an axis after checking the key and the values.

        Raises:
            ConfigError: as :func:`check_key` / :func:`check_values` / :func:`check_scalar`.
        """
        check_key(key)
        self.axes[key] = check_values(key, [check_scalar(key, v) for v in values])

    def cells(self) -> list[Cell]:
        """The Cartesian product, the last key varying fastest.

        Raises:
            ConfigError: an empty grid, or two cells whose ids coincide after replacing characters
                unsafe in file names (e.g. ``a/b`` and ``a-b``).
        """
        if not self.axes:
            raise ConfigError("the sweep has no grid (give --grid key=v1,v2,... or a spec's grid:)")
        names = short_names(self.keys)
        cells, seen = [], {}
        for combo in itertools.product(*self.axes.values()):
            values = dict(zip(self.keys, combo, strict=True))
            cid = "_".join(f"{names[k]}{_ID_UNSAFE.sub('-', format_value(v))}" for k, v in values.items())
            if cid in seen:
                raise ConfigError(f"grid cells {seen[cid]} and {values} share the id {cid!r}; "
                                  "use values that differ in letters, digits or . _ + -")
            seen[cid] = values
            cells.append(Cell(cid, values))
        return cells


@dataclass
class SweepSpec:
    """What ``copc sweep`` runs (a spec file's fields, CLI flags merged on top).

    Attributes:
        config: the base YAML config. grid: the grid. seeds: ``train.seed`` values (None: the
        base config's seed). out: sweep directory (None: ``runs/sweeps/<config name>``).
        overrides: ``key=value`` applied to every cell. metric: eval metric (None: ``em`` for the
        search task, else ``accuracy``, i.e. avg@k). x_key / y_key / panel_key: heatmap axes
        (None: defaults, see :func:`heatmap_axes`). parallel: runs at once.
        eval_checkpoints: evaluate every kept checkpoint post hoc.
    """

    config: str | None = None
    grid: Grid = field(default_factory=Grid)
    seeds: list[int] | None = None
    out: str | None = None
    overrides: list[str] = field(default_factory=list)
    metric: str | None = None
    x_key: str | None = None
    y_key: str | None = None
    panel_key: str | None = None
    parallel: int = 1
    eval_checkpoints: bool = False


_SPEC_FIELDS = ("config", "grid", "seeds", "out", "overrides", "metric", "x_key", "y_key", "panel_key",
                "parallel", "eval_checkpoints")


def _spec_overrides(raw: Any, path: Path) -> list[str]:
    if raw is None:
        return []
    if isinstance(raw, dict):
        return [f"{check_key(str(k), f'{path}: overrides:')}={format_value(check_scalar(str(k), v))}"
                for k, v in raw.items()]
    if isinstance(raw, list) and all(isinstance(o, str) and "=" in o for o in raw):
        return list(raw)
    raise ConfigError(f"{path}: overrides must be a list of 'key=value' strings or a mapping, got {raw!r}")


def load_spec(path: str | Path) -> SweepSpec:
    """Read a sweep spec YAML: ``{config, grid: {key: [values]}, seeds, out, overrides, metric,
    x_key, y_key, panel_key, parallel, eval_checkpoints}`` (all but ``config`` and ``grid`` optional).

    ``config`` is resolved against the current directory, else against the spec's folder.

    Raises:
        ConfigError: a missing file, unknown field, or a bad grid / seeds / overrides (named).
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--spec {str(path)!r}: no such file")
    try:
        # OmegaConf's YAML loader, the one that parses ``copc train key=value`` and config files: it
        # reads ``1e-4`` as a float (YAML 1.2), where PyYAML's 1.1 safe_load gives the string "1e-4"
        raw = OmegaConf.to_container(OmegaConf.create(path.read_text() or "{}"), resolve=False)
    except (yaml.YAMLError, OmegaConfBaseException) as e:
        raise ConfigError(f"--spec {path}: not valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"--spec {path}: top level must be a mapping")
    unknown = sorted(set(raw) - set(_SPEC_FIELDS))
    if unknown:
        raise ConfigError(f"--spec {path}: unknown field(s) {unknown}; known: {list(_SPEC_FIELDS)}")
    spec = SweepSpec()
    if raw.get("config") is not None:
        cfg = Path(str(raw["config"]))
        spec.config = str(cfg if cfg.is_absolute() or cfg.exists() or not (path.parent / cfg).exists()
                          else path.parent / cfg)
    grid = raw.get("grid") or {}
    if not isinstance(grid, dict):
        raise ConfigError(f"--spec {path}: grid must be a mapping {{key: [values]}}, got {grid!r}")
    for k, vs in grid.items():
        if not isinstance(vs, list):
            raise ConfigError(f"--spec {path}: grid.{k} must be a list of values, got {vs!r}")
        spec.grid.add(str(k), vs)
    if raw.get("seeds") is not None:
        spec.seeds = parse_seeds(raw["seeds"] if isinstance(raw["seeds"], list) else str(raw["seeds"]))
    spec.out = None if raw.get("out") is None else str(raw["out"])
    spec.overrides = _spec_overrides(raw.get("overrides"), path)
    for k in ("metric", "x_key", "y_key", "panel_key"):
        setattr(spec, k, None if raw.get(k) is None else str(raw[k]))
    if raw.get("parallel") is not None:
        spec.parallel = raw["parallel"]
    spec.eval_checkpoints = bool(raw.get("eval_checkpoints", False))
    return spec


def heatmap_axes(keys: list[str], x_key: str | None = None, y_key: str | None = None,
                 panel_key: str | None = None) -> tuple[str, str | None, str | None, list[str]]:
    """``(x, y, panel, rest)`` keys: given ones first, then the grid keys in order fill
    y, x, panel (so ``eta_p, eta_a, fixed_lag`` → y = eta_p, x = eta_a, panels = fixed_lag).

    Raises:
        ConfigError: a given key that is not a grid key, or the same key twice.
    """
    given = {"x_key": x_key, "y_key": y_key, "panel_key": panel_key}
    for name, k in given.items():
        if k is not None and k not in keys:
            raise ConfigError(f"--{name.replace('_', '-')} {k!r}: not a grid key; grid keys: {keys}")
    chosen = [k for k in given.values() if k is not None]
    if len(set(chosen)) != len(chosen):
        raise ConfigError(f"heatmap axes must be distinct grid keys, got x={x_key}, y={y_key}, "
                          f"panel={panel_key}")
    free = [k for k in keys if k not in chosen]
    y = y_key or (free.pop(0) if len(free) >= 2 or (free and x_key) else None)
    if x_key is None and not free:
        raise ConfigError(f"heatmap: no grid key left for the x axis (y={y}, panel={panel_key})")
    x = x_key or free.pop(0)
    panel = panel_key or (free.pop(0) if free else None)
    return x, y, panel, free
