"""Benchmark kinds: how a benchmark's rows are read, its episodes scored and its metrics named.

A kind is a :class:`BenchmarkKind` subclass registered in :data:`BENCHMARK_KINDS` (the house's
:class:`seams.registry.Registry`) with its settings dataclass (a :class:`KindSettings`
subclass)::

    @dataclass(frozen=True)
    class MCQSettings(KindSettings):
        letters: str = "ABCD"

    BENCHMARK_KINDS.register("mcq", MCQKind, settings=MCQSettings)

Built in: ``math`` (correct = reward > 0.5; avg@n, pass@k, maj@n; default 4 samples at
temperature 1) and ``qa`` (correct = exact match; EM, F1, cover-EM; greedy, one sample).
A kind's settings come from its dataclass's defaults, overridden by ``eval.kind_settings.<kind>``
(validated by :func:`make_kind`, the message naming the key).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from seams.registry import Registry

from .stats import default_ks, maj_at_k, pass_at_k

if TYPE_CHECKING:
    from ..rollout.trajectory import Trajectory

#: Per-question values of each metric a kind reports: metric name → values (one per question).
PerQuestion = dict[str, list[float]]


@dataclass(frozen=True)
class KindSettings:
    """Settings every kind has (subclass to add a kind's own; validated on creation).

    Attributes:
        default_k: samples per question when neither the benchmark nor ``--k`` says.
        default_temperature: sampling temperature likewise (0 = greedy).

    Raises:
        ValueError: naming the field.
    """

    default_k: int = 1
    default_temperature: float = 0.0

    def __post_init__(self) -> None:
        """Validate."""
        k, t = self.default_k, self.default_temperature
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"default_k={k!r}: must be an int >= 1")
        if isinstance(t, bool) or not isinstance(t, int | float) or not (math.isfinite(t) and t >= 0):
            raise ValueError(f"default_temperature={t!r}: must be a number >= 0")


class BenchmarkKind:
    """A benchmark kind (the base class scores by reward, like ``math``, and reads plain JSONL).

    Args:
        name: the registered name. settings: its settings (the registered dataclass).

    Attributes:
        name, settings: as given.
    """

    #: the fields a row of this kind's JSONL file must have (used to infer the kind of a file).
    row_fields: ClassVar[tuple[str, ...]] = ()

    def __init__(self, name: str, settings: KindSettings) -> None:
        self.name, self.settings = name, settings

    def load_rows(self, data: str, data_dir: str, limit: int | None) -> list[dict[str, Any]]:
        """The rows of dataset ``data`` (a JSONL path, absolute or relative to ``data_dir``).

        Raises:
            FileNotFoundError: no such file. ValueError: a malformed row (file and line named).
        """
        from environments.data import iter_jsonl, resolve_data_path

        path = resolve_data_path(data if data.endswith(".jsonl") else f"{data}.jsonl", data_dir)
        return [dict(row, id=row.get("id", no)) for no, row in iter_jsonl(path, self.row_fields, limit)]

    def gold(self, row: Mapping[str, Any]) -> Any:
        """The row's reference answer, recorded beside the model's (``EpisodeRecord.gold``): the
        base class reads ``answer``, else ``golden_answers`` (None when neither is there)."""
        return row.get("answer", row.get("golden_answers"))

    def score(self, tr: Trajectory) -> tuple[bool, dict[str, Any]]:
        """``(correct, score_components)`` of an episode: reward > 0.5 and the environment's
        ``reward_components``."""
        return tr.reward > 0.5, dict(tr.info.get("reward_components") or {})

    def headline(self, n: int) -> str:
        """The headline metric's name for a nominal ``n`` samples per question."""
        return f"avg@{n}"

    def metrics(self, groups: Sequence[Sequence[Mapping[str, Any]]], n: int,
                ks: Sequence[int] | None) -> tuple[PerQuestion, dict[str, Any]]:
        """``(per-question values of each metric, extra summary fields)`` of the scored records
        ``groups`` (one list per question, episode order); ``n`` is the nominal samples per
        question, ``ks`` the caller's pass@k ks (None: the kind's default). The base class:
        ``avg@n`` = the mean of ``correct``."""
        return {f"avg@{n}": [sum(bool(r.get("correct")) for r in g) / len(g) for g in groups]}, {}

    def outcomes(self, metric: str) -> str | None:
        """What a per-question value of ``metric`` is, which picks its interval
        (:func:`trainer.evaluate.metrics.summarize_benchmark`): ``"episodes"`` — the fraction of
        the question's scored episodes with a 0/1 outcome of 1 (a proportion, ``m_i`` = its
        episodes); ``"question"`` — one 0/1 outcome per question; ``None`` — not a proportion (a
        score such as F1 or pass@k: percentile bootstrap). The base class: ``avg@*`` is
        ``"episodes"``."""
        return "episodes" if metric.startswith("avg@") else None


class MathKind(BenchmarkKind):
    """``math``: rows of :func:`environments.math_tool.load_math`; avg@n, pass@k, maj@n."""

    row_fields = ("problem", "answer")

    def load_rows(self, data: str, data_dir: str, limit: int | None) -> list[dict[str, Any]]:
        """:func:`environments.math_tool.load_math` (``id``, ``problem``, ``answer`` as str)."""
        from environments.math_tool import load_math

        return load_math(data, data_dir, limit)

    def metrics(self, groups: Sequence[Sequence[Mapping[str, Any]]], n: int,
                ks: Sequence[int] | None) -> tuple[PerQuestion, dict[str, Any]]:
        """``avg@n`` = mean_i c_i / n_i; ``pass@k`` = mean over questions with n_i >= k of
        :func:`~trainer.evaluate.stats.pass_at_k` (``pass@k_questions`` counts them when some
        are skipped); ``maj@n`` = mean_i :func:`~trainer.evaluate.stats.maj_at_k`."""
        correct = [[bool(r.get("correct")) for r in g] for g in groups]
        per: PerQuestion = {f"avg@{n}": [sum(c) / len(c) for c in correct]}
        extra: dict[str, Any] = {}
        for k in ks if ks is not None else default_ks(min((len(c) for c in correct), default=0)):
            per[f"pass@{k}"] = [pass_at_k(len(c), sum(c), k) for c in correct if len(c) >= k]
            if len(per[f"pass@{k}"]) < len(correct):
                extra[f"pass@{k}_questions"] = len(per[f"pass@{k}"])
        per[f"maj@{n}"] = [maj_at_k([r.get("answer") for r in g], c)
                           for g, c in zip(groups, correct, strict=True)]
        return per, extra

    def outcomes(self, metric: str) -> str | None:
        """``avg@*``: ``"episodes"``; ``maj@*`` (the majority answer right or not):
        ``"question"``; ``pass@*`` (an estimator, not a proportion): None."""
        return "question" if metric.startswith("maj@") else super().outcomes(metric)


#: QA metric name -> the environment's score component it averages.
QA_COMPONENTS = {"em": "em", "f1": "f1", "cover_em": "substring_em"}


class QAKind(BenchmarkKind):
    """``qa``: rows of :func:`environments.search.env.load_qa`; correct = EM; EM, F1, cover-EM."""

    row_fields = ("golden_answers",)

    def load_rows(self, data: str, data_dir: str, limit: int | None) -> list[dict[str, Any]]:
        """:func:`environments.search.env.load_qa` (``id``, ``question``, ``golden_answers``)."""
        from environments.search.env import load_qa

        return load_qa(data, data_dir, limit)

    def score(self, tr: Trajectory) -> tuple[bool, dict[str, Any]]:
        """Exact match (``em == 1``); an episode that never answered (cut by a budget) scores 0
        on every component."""
        comps = {"em": 0.0, "substring_em": 0.0, "f1": 0.0, **(tr.info.get("reward_components") or {})}
        return comps["em"] >= 1.0, comps

    def headline(self, n: int) -> str:
        """``em``."""
        return "em"

    def metrics(self, groups: Sequence[Sequence[Mapping[str, Any]]], n: int,
                ks: Sequence[int] | None) -> tuple[PerQuestion, dict[str, Any]]:
        """Per question the mean over its episodes of the components of :data:`QA_COMPONENTS`
        (``em`` falls back to ``correct`` when absent).

        Raises:
            ValueError: a record lacks the ``f1`` or ``substring_em`` component.
        """
        per: PerQuestion = {m: [] for m in QA_COMPONENTS}
        for g in groups:
            for metric, comp in QA_COMPONENTS.items():
                vals = []
                for r in g:
                    v = (r.get("score_components") or {}).get(comp)
                    if v is None and metric == "em":
                        v = bool(r.get("correct"))
                    if v is None:
                        raise ValueError(f"scored QA record (sample_index={r['sample_index']}, "
                                         f"episode={r.get('episode')}) lacks score component {comp!r}")
                    vals.append(float(v))
                per[metric].append(sum(vals) / len(vals))
        return per, {}

    def outcomes(self, metric: str) -> str | None:
        """``em`` and ``cover_em`` (0/1 per episode): ``"episodes"``; ``f1``: None."""
        return "episodes" if metric in ("em", "cover_em") else None


@dataclass(frozen=True)
class MathSettings(KindSettings):
    """``math``: 4 samples at temperature 1 unless the benchmark says."""

    default_k: int = 4
    default_temperature: float = 1.0


@dataclass(frozen=True)
class QASettings(KindSettings):
    """``qa``: one greedy sample."""


#: The benchmark kinds: name → :class:`BenchmarkKind` subclass, each registered with its settings
#: dataclass (a :class:`KindSettings` subclass); a :class:`seams.registry.Registry`.
BENCHMARK_KINDS: Registry[type[BenchmarkKind]] = Registry("benchmark kind", key="eval.kind_settings")
BENCHMARK_KINDS.register("math", MathKind, settings=MathSettings)
BENCHMARK_KINDS.register("qa", QAKind, settings=QASettings)


def kind_names() -> list[str]:
    """The registered kinds, sorted."""
    return BENCHMARK_KINDS.names()


def make_kind(name: str, overrides: Mapping[str, Any] | None = None, where: str = "eval.kind_settings"
              ) -> BenchmarkKind:
    """The kind ``name`` with its settings: the registered dataclass's defaults, overridden by
    ``overrides`` (built by :meth:`seams.registry.Registry.build_settings`).

    Raises:
        ValueError: unknown kind (``kind must be one of [...]``), or a setting the dataclass does
            not have, of the wrong type, or that it rejects (the message names
            ``<where>.<name>.<key>``).
    """
    if name not in BENCHMARK_KINDS:
        raise ValueError(f"kind must be one of {kind_names()}, got {name!r}")
    if BENCHMARK_KINDS.settings_type(name) is None:
        raise ValueError(f"benchmark kind {name!r} was registered without a settings dataclass "
                         "(register it with settings=<a KindSettings subclass>)")
    settings = BENCHMARK_KINDS.build_settings(name, dict(overrides or {}), f"{where}.{name}")
    return BENCHMARK_KINDS.get(name)(name, settings)


def kind_of_row(row: Mapping[str, Any]) -> str | None:
    """The kind a data row looks like: the first registered kind (``qa`` before ``math``, then
    the others in name order) whose ``row_fields`` the row has; None when none fits."""
    order = ["qa", "math"] + [n for n in kind_names() if n not in ("qa", "math")]
    for name in order:
        fields = BENCHMARK_KINDS.get(name).row_fields if name in BENCHMARK_KINDS else ()
        if fields and all(f in row for f in fields):
            return name
    return None


def infer_kind(path: str | Path) -> str:
    """The kind of a JSONL benchmark file: :func:`kind_of_row` of its first row.

    Raises:
        FileNotFoundError: no such file.
        ValueError: the file is empty, its first row is not a JSON object, or fits no kind.
    """
    from environments.data import iter_jsonl

    first = iter_jsonl(path, limit=1)  # the project's JSONL reader: same errors everywhere
    if not first:
        raise ValueError(f"benchmark file {str(Path(path))!r} has no rows")
    lineno, row = first[0]
    name = kind_of_row(row)
    if name is None:
        raise ValueError(f"{Path(path)}:{lineno}: cannot infer the benchmark kind: rows need "
                         "'golden_answers' (qa) or 'problem' and 'answer' (math); or name it: "
                         f"'{path}:<env>:<kind>' (kinds: {kind_names()})")
    return name


__all__ = ["BENCHMARK_KINDS", "QA_COMPONENTS", "BenchmarkKind", "KindSettings", "MathKind", "MathSettings",
           "QAKind", "QASettings", "infer_kind", "kind_names", "kind_of_row", "make_kind"]
