"""Per-step metrics: an append-only ``metrics.jsonl`` plus optional TensorBoard scalars.

``metrics.jsonl`` has one JSON object per line and per training step:
``{"step": int, "time": unix_seconds, "<name>": value, ...}``. Values are numbers or
lists of numbers (e.g. a per-step ``staleness/hist`` of counts); non-finite floats are
written as the JSON extensions ``NaN`` / ``Infinity`` (what python's ``json`` reads
back), so no value is lost. Steps are strictly increasing within the file.

Resuming: open with ``resume=True`` (appends to the existing file), then call
``truncate_after(checkpoint_step)`` so that lines of steps that the crashed run logged
after its last checkpoint are dropped and the resumed run does not duplicate them.
TensorBoard events of those steps are purged as well (``SummaryWriter(purge_step=...)``).
A torn last line (a process killed in the middle of a write) is dropped on open, with
a warning.
"""

from __future__ import annotations

import json
import logging
import math
import numbers
import os
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
TB_DIR = "tensorboard"
_RESERVED = ("step", "time")


def _wait_for_a_later_event_file(tb_dir: Path) -> None:
    """Wait (at most ~1 s) until a new event file in ``tb_dir`` sorts after every existing one.

    TensorBoard reads a run's event files in name order, and a later file's purge applies only to
    the files before it. The name is ``events.out.tfevents.<unix s, 10 digits>.<host>.<pid>.<n>``
    with ``n`` a per-process counter, so two files opened in the same second sort by ``n`` as
    text (``.10`` before ``.9``): a purge would then hit the wrong file. A later second sorts
    after whatever ``n`` is.
    """
    stamps = [int(p.name.split(".")[3]) for p in tb_dir.glob("events.out.tfevents.*")
              if p.name.split(".")[3:4] and p.name.split(".")[3].isdigit()]
    deadline = time.monotonic() + 1.5  # a file stamped in the future (clock change): do not hang
    while stamps and int(time.time()) <= max(stamps) and time.monotonic() < deadline:
        time.sleep(0.05)


def _scalar(value: Any, where: str) -> int | float:
    """A python int/float from a python/numpy number or a one-element tensor/array."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    if callable(getattr(value, "item", None)):  # numpy array / torch tensor with one element
        try:
            item = value.item()
        except (TypeError, ValueError, RuntimeError):
            item = None
        if isinstance(item, numbers.Real):
            return _scalar(item, where)
    raise ValueError(
        f"{where} must be a number or a list of numbers, got {type(value).__name__}: {value!r:.80}"
    )


def _metric_value(value: Any, where: str) -> int | float | list[int | float]:
    if isinstance(value, list | tuple):
        return [_scalar(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if hasattr(value, "tolist") and getattr(value, "ndim", 0) == 1:  # 1-d numpy array / tensor
        return [_scalar(v, f"{where}[{i}]") for i, v in enumerate(value.tolist())]
    return _scalar(value, where)


def _parse_lines(text: str, path: Path) -> tuple[list[dict], bool]:
    """Parse JSONL text; returns (records, torn) where torn means an unterminated, unparsable last line.

    Raises:
        ValueError: a line other than the last one is not a JSON object with an int ``step``.
    """
    lines = text.split("\n")
    tail = lines.pop()  # "" if the text ends with a newline
    records, torn = [], False
    for i, line in enumerate([*lines, tail], start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            if i == len(lines) + 1:  # unterminated last line: a write interrupted by a crash
                torn = True
                continue
            raise ValueError(f"{path}:{i}: not valid JSON: {line[:80]!r}") from None
        if not isinstance(rec, dict) or not isinstance(rec.get("step"), int):
            raise ValueError(f"{path}:{i}: expected a JSON object with an int 'step', got {line[:80]!r}")
        records.append(rec)
    return records, torn


def _atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` via a fsync-ed temporary sibling and ``os.replace``."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class MetricsLogger:
    """Appends one JSON line per step to ``<output_dir>/metrics.jsonl`` and mirrors scalars to TensorBoard.

    Args:
        output_dir: run directory (created if missing).
        tensorboard: also write TensorBoard event files under ``<output_dir>/tensorboard``.
        resume: keep and append to an existing ``metrics.jsonl``. Without ``resume``, an
            existing non-empty file is renamed to ``metrics.<unix_s>[-n].jsonl.old`` (with a
            warning) rather than overwritten, so no earlier run's data is lost.

    Usable as a context manager (``close()`` on exit).
    """

    def __init__(self, output_dir: str | Path, tensorboard: bool = True, resume: bool = False) -> None:
        self.output_dir = Path(output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.output_dir / METRICS_FILE
        self.tensorboard = bool(tensorboard)
        self._writer = None
        self._purge_step: int | None = None
        self._last_step: int | None = None
        if self.path.exists() and self.path.stat().st_size > 0:
            if resume:
                records, torn = _parse_lines(self.path.read_text(), self.path)
                if torn:
                    log.warning("%s: dropping a torn last line (interrupted write)", self.path)
                    self._rewrite(records)
                self._last_step = max((r["step"] for r in records), default=None)
            else:
                stamp, n = int(time.time()), 0
                old = self.path.with_name(f"metrics.{stamp}.jsonl.old")
                while old.exists():
                    n += 1
                    old = self.path.with_name(f"metrics.{stamp}-{n}.jsonl.old")
                log.warning("%s exists and resume=False: moving it to %s", self.path, old.name)
                os.replace(self.path, old)
        self._file = open(self.path, "a")  # noqa: SIM115 - kept open for the run; closed in close()

    # ----------------------------------------------------------------- writing
    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """Append ``{"step": step, "time": now, **metrics}`` and flush; add scalars to TensorBoard.

        Args:
            step: training step, int >= 0, strictly greater than the last logged step.
            metrics: name -> number (python/numpy/0-d tensor) or list of numbers. Lists go
                to the JSONL only, not to TensorBoard.

        Raises:
            ValueError: bad step (not int, negative, not increasing), a reserved name
                (``step``/``time``), or a value that is not a number / list of numbers.
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be an int >= 0, got {step!r}")
        if self._last_step is not None and step <= self._last_step:
            raise ValueError(
                f"step {step} is not after the last logged step {self._last_step} "
                f"(one line per step; call truncate_after() when resuming)"
            )
        record: dict[str, Any] = {"step": step, "time": time.time()}
        for name, value in metrics.items():
            if not isinstance(name, str) or name in _RESERVED:
                raise ValueError(f"metric name {name!r} is invalid (must be a str, not one of {_RESERVED})")
            record[name] = _metric_value(value, f"metric {name!r}")
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        self._last_step = step
        if self.tensorboard:
            writer = self._tb()
            for name, value in record.items():
                if name not in _RESERVED and not isinstance(value, list):
                    writer.add_scalar(name, value, global_step=step, walltime=record["time"])
            writer.flush()

    def _tb(self):
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter  # imported lazily: slow import

            _wait_for_a_later_event_file(self.output_dir / TB_DIR)
            self._writer = SummaryWriter(log_dir=str(self.output_dir / TB_DIR), purge_step=self._purge_step)
        return self._writer

    def truncate_after(self, step: int) -> None:
        """Drop every line (and TensorBoard event) of a step > ``step``; later ``log`` calls may reuse them.

        Args:
            step: the step of the checkpoint being resumed (int >= 0).

        Raises:
            ValueError: if ``step`` is not an int >= 0.
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be an int >= 0, got {step!r}")
        self._file.flush()
        records, _ = _parse_lines(self.path.read_text(), self.path)
        kept = [r for r in records if r["step"] <= step]
        self._file.close()
        self._rewrite(kept)
        self._file = open(self.path, "a")  # noqa: SIM115
        self._last_step = max((r["step"] for r in kept), default=None)
        # TensorBoard: a writer opened with purge_step=s makes readers discard events with step >= s.
        self._purge_step = step + 1
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self.tensorboard:
            self._tb().flush()

    def _rewrite(self, records: list[dict]) -> None:
        _atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in records))

    # ----------------------------------------------------------------- reading
    def read(self) -> list[dict]:
        """All records in the file, in order (a torn last line is skipped).

        Raises:
            ValueError: a line (other than a torn last one) is not a valid record.
        """
        self._file.flush()
        return read_metrics(self.output_dir)

    def close(self) -> None:
        """Flush and close the JSONL file and the TensorBoard writer (idempotent)."""
        if not self._file.closed:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_metrics(output_dir: str | Path) -> list[dict]:
    """Records of ``<output_dir>/metrics.jsonl`` (``[]`` if the file does not exist).

    Raises:
        ValueError: a line (other than a torn last one) is not a valid record.
    """
    path = Path(output_dir) / METRICS_FILE
    if not path.exists():
        return []
    return _parse_lines(path.read_text(), path)[0]


def _jsonable(obj: Any, where: str) -> Any:
    """Plain JSON types from dicts/lists/tuples/str/None/numbers/Paths/numpy or tensor scalars."""
    if obj is None or isinstance(obj, str | bool):
        return obj
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            if not isinstance(k, str | int | float | bool):
                raise TypeError(f"{where}: key {k!r} is not a str/number")
            out[k] = _jsonable(v, f"{where}[{k!r}]")
        return out
    if isinstance(obj, list | tuple):
        return [_jsonable(v, f"{where}[{i}]") for i, v in enumerate(obj)]
    if hasattr(obj, "tolist"):  # numpy arrays/scalars, tensors
        return _jsonable(obj.tolist(), where)
    if isinstance(obj, numbers.Integral):
        return int(obj)
    if isinstance(obj, numbers.Real):
        return float(obj)
    raise TypeError(f"{where} is not JSON-serialisable: {type(obj).__name__}")


def write_summary(output_dir: str | Path, summary: dict[str, Any]) -> Path:
    """Write ``<output_dir>/summary.json`` atomically (temporary file, fsync, ``os.replace``).

    Args:
        output_dir: run directory (created if missing).
        summary: JSON-able dict; numpy/torch scalars and arrays become numbers/lists,
            ``Path`` becomes str. Non-finite floats are written as ``NaN``/``Infinity``.

    Returns:
        The path of ``summary.json``.

    Raises:
        TypeError: a value cannot be represented (the message names where); an existing
            ``summary.json`` is then left unchanged.
    """
    if not isinstance(summary, dict):
        raise TypeError(f"summary must be a dict, got {type(summary).__name__}")
    data = _jsonable(summary, "summary")
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / SUMMARY_FILE
    _atomic_write_text(path, json.dumps(data, indent=2, sort_keys=False) + "\n")
    return path


def is_metric_number(v: Any) -> bool:
    """Whether a record value is a number to plot or average (int or float, not bool)."""
    return isinstance(v, int | float) and not isinstance(v, bool)


def metric_series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the records that have a number under ``key``, in record order;
    non-finite values become NaN (a gap in a plot)."""
    xs, ys = [], []
    for rec in records:
        v = rec.get(key)
        if is_metric_number(v):
            xs.append(rec["step"])
            ys.append(float(v) if math.isfinite(v) else math.nan)
    return xs, ys


#: Metrics of the training steps whose mean over the run's last steps goes into ``summary.json``
#: (``train_tail``): what issue-style targets read ("invalid actions over the last 20 % of steps").
TAIL_METRICS = ("rollout/invalid_action_rate", "rollout/tool_calls", "rollout/reward_mean")


def last_steps_mean(records: list[dict], keys: tuple[str, ...] = TAIL_METRICS,
                    frac: float = 0.2) -> dict[str, Any]:
    """Mean of each metric over the last ``ceil(frac × n)`` training steps that logged it.

    A training step is a record with ``step >= 1`` holding the key (evaluation records hold
    ``eval/...`` keys only); a step logged twice (a resumed run re-doing it) counts once, its
    last record. Keys no step logged are left out.

    Args:
        records: ``metrics.jsonl`` records (:func:`read_metrics`), in order.
        keys: metric names to average.
        frac: share of the logged steps, in (0, 1].

    Returns:
        ``{"frac": frac, "steps": [first, last], "<key>": mean, ...}``; ``{}`` when no step
        logged any of ``keys``. E.g. 24 steps and ``frac=0.2``: the mean over steps 20–24.

    Raises:
        ValueError: ``frac`` outside (0, 1] (the message names it).
    """
    if not 0.0 < frac <= 1.0:
        raise ValueError(f"frac={frac!r}: must be in (0, 1]")
    out: dict[str, Any] = {}
    span: list[int] = []
    for key in keys:
        by_step = {int(st): v for st, v in zip(*metric_series(records, key), strict=True) if st >= 1}
        if not by_step:
            continue
        steps = sorted(by_step)[-math.ceil(frac * len(by_step)):]
        out[key] = sum(by_step[s] for s in steps) / len(steps)
        span = [steps[0], steps[-1]] if not span else [min(span[0], steps[0]), max(span[1], steps[-1])]
    return {"frac": frac, "steps": span, **out} if out else {}
