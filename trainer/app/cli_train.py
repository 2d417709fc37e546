"""``copc train`` and ``copc eval``: run an experiment or evaluate one from a YAML config.

Usage::

    copc train --config configs/math_tool/cpu_tiny.yaml [key=value ...] [--resume]
    copc eval  --config configs/math_tool/cpu_tiny.yaml [key=value ...] [--checkpoint DIR]

``key=value`` are dotted overrides of :class:`trainer.config.ExperimentConfig`
(``train.total_steps=3 preset=ppo``). A bad config (missing file, unknown key,
wrong type, value out of range) prints one line naming the key to stderr and
exits with status 2, before anything heavy is imported. The training and
evaluation code (:mod:`trainer.app.run`) is imported only once the config is valid.
"""

from __future__ import annotations

import argparse
import contextlib
import shlex
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from trainer.config import ConfigError, ExperimentConfig, load_config

#: Exit status for a bad configuration (argparse uses the same for bad arguments).
EXIT_CONFIG_ERROR = 2
#: Exit status when the run stops on a failure (a rollout task raised, too many
#: infrastructure failures); the state after the last finished step is checkpointed.
EXIT_TRAINING_ERROR = 1
#: Exit status after Ctrl-C (128 + SIGINT), the shell convention.
EXIT_INTERRUPTED = 130
#: Exit status after SIGTERM (128 + SIGTERM), the shell convention.
EXIT_TERMINATED = 143


@dataclass
class SigtermState:
    """Whether a SIGTERM arrived within :func:`sigterm_as_interrupt` (``terminated``)."""

    terminated: bool = False


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[SigtermState]:
    """Within the block, SIGTERM stops a run as Ctrl-C does (same clean-up, same ``--resume``
    hint): the handler records it and raises SIGINT in this process, so an ``asyncio.run`` in
    progress cancels its main task through its own SIGINT handling (raising ``Terminated``
    directly inside asyncio's machinery left a task's exception unretrieved and printed its
    traceback). A process started with SIGINT ignored gets Python's default SIGINT handler for the
    block (else that SIGINT would be ignored). Yields the :class:`SigtermState` to read after a
    ``KeyboardInterrupt``. The earlier handlers are restored on exit; outside the main thread this
    does nothing."""
    state = SigtermState()

    def handler(signum: int, frame: object) -> None:
        state.terminated = True
        signal.raise_signal(signal.SIGINT)

    if threading.current_thread() is not threading.main_thread():
        yield state
        return
    previous = signal.signal(signal.SIGTERM, handler)
    # started with SIGINT ignored (in the background of a non-interactive shell, e.g. a CI script's
    # `cmd &`): Python installs no KeyboardInterrupt handler, asyncio.run none of its own, and the
    # SIGINT raised above would be ignored: the run went on training after SIGTERM
    ignored = signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    if ignored:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield state
    finally:
        signal.signal(signal.SIGTERM, previous)
        if ignored:
            signal.signal(signal.SIGINT, signal.SIG_IGN)


def add_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    """Add the options of the ``train`` or ``eval`` group to ``parser`` and set ``func``.

    Args:
        parser: the group's sub-parser (from :func:`trainer.cli.build_parser`).
        name: ``"train"`` or ``"eval"``.

    Raises:
        ValueError: for another ``name``.
    """
    if name not in ("train", "eval"):
        raise ValueError(f"trainer.app.cli_train serves the 'train' and 'eval' groups, not {name!r}")
    parser.add_argument("--config", required=(name == "train"), default=None, metavar="PATH",
                        help="YAML config (e.g. configs/math_tool/cpu_tiny.yaml)")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="dotted config overrides, e.g. train.total_steps=3 model.path=/ckpt")
    if name == "train":
        parser.add_argument("--resume", action="store_true",
                            help="continue the run in output_dir from its latest checkpoint")
        parser.set_defaults(func=train_command)
    else:
        parser.add_argument("--checkpoint", default=None, metavar="DIR",
                            help="model or checkpoint directory to evaluate (default: the run's "
                                 "latest checkpoint, else its warm-start / initial model)")
        from .cli_eval import add_benchmark_arguments

        add_benchmark_arguments(parser)
        parser.set_defaults(func=eval_command)


def _load(args: argparse.Namespace, command: str) -> ExperimentConfig | None:
    """The validated config, or None after printing ``copc <command>: config error: ...``."""
    try:
        return load_config(args.config, list(args.overrides))
    except ConfigError as e:
        print(f"copc {command}: config error: {e}", file=sys.stderr)
        return None


def _report(cfg: ExperimentConfig) -> None:
    """Print where the results are (the run itself prints its tables and progress)."""
    print(f"results in {cfg.output_dir}", file=sys.stderr)


def train_command(args: argparse.Namespace) -> int:
    """``copc train``: load the config and call :func:`trainer.app.run.run_experiment`.

    Args:
        args: ``config`` (path), ``overrides`` (list of ``key=value``), ``resume`` (bool).

    Returns:
        0 on success, 2 for a bad config, 1 when the run stopped on a failure
        (:class:`~trainer.orchestration.loop.TrainingError`), 130 after Ctrl-C, 143 after SIGTERM
        (both print the same ``--resume`` hint).
    """
    cfg = _load(args, "train")
    if cfg is None:
        return EXIT_CONFIG_ERROR
    from trainer.app.run import run_experiment  # heavy (torch, engines): only once the config is valid
    from trainer.errors import TrainingError

    term = SigtermState()
    try:
        with sigterm_as_interrupt() as term:
            run_experiment(cfg, resume=args.resume)
    except ConfigError as e:  # raised by the run for settings only checkable at start-up
        print(f"copc train: config error: {e}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    except TrainingError as e:  # the traceback of the cause is in the log above
        print(f"copc train: stopped: {e}", file=sys.stderr)
        return EXIT_TRAINING_ERROR
    except KeyboardInterrupt:
        sigterm = term.terminated
        what = "terminated (SIGTERM)" if sigterm else "interrupted"
        again = ["copc", "train", *(["--config", args.config] if args.config else []), *args.overrides,
                 "--resume"]
        print(f"copc train: {what}; continue with: {shlex.join(again)}", file=sys.stderr)
        return EXIT_TERMINATED if sigterm else EXIT_INTERRUPTED
    _report(cfg)
    return 0


def eval_command(args: argparse.Namespace) -> int:
    """``copc eval``: load the config and call :func:`trainer.app.run.run_evaluation`.

    Args:
        args: ``config`` (path), ``overrides`` (list of ``key=value``), ``checkpoint`` (dir or None).

    Returns:
        0 on success, 2 for a bad config, 130 after Ctrl-C.
    """
    if args.benchmarks is not None:  # standalone evaluation on named benchmarks
        from .cli_eval import benchmarks_command

        return _eval_guarded(lambda: benchmarks_command(args), "interrupted; continue with --resume")
    if args.config is None:
        print("copc eval: config error: --config is required (or use --benchmarks with --model / "
              "--checkpoint / --endpoint)", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    from .cli_eval import check_no_benchmark_options

    try:
        check_no_benchmark_options(args)  # the --config form would silently ignore them
    except ConfigError as e:
        print(f"copc eval: config error: {e}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    cfg = _load(args, "eval")
    if cfg is None:
        return EXIT_CONFIG_ERROR
    from trainer.app.run import run_evaluation  # heavy: only once the config is valid

    rc = _eval_guarded(lambda: run_evaluation(cfg, checkpoint=args.checkpoint), "interrupted")
    if rc == 0:
        _report(cfg)
    return rc


def _eval_guarded(run: Callable[[], object], interrupted: str) -> int:
    """Run an evaluation: 0, or 2 after printing its config error, or 130 after Ctrl-C."""
    try:
        run()
    except ConfigError as e:
        print(f"copc eval: config error: {e}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    except KeyboardInterrupt:
        print(f"copc eval: {interrupted}", file=sys.stderr)
        return EXIT_INTERRUPTED
    return 0
