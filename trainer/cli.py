"""The ``copc`` console script: a small registry of subcommand groups.

Each area registers a group with :func:`register_group` (name, help text and a
function that adds its sub-subcommands to an ``argparse`` sub-parser); the
registered function must set ``func`` (a callable taking the parsed
``argparse.Namespace`` and returning an exit code) on every leaf parser.
Groups are registered lazily in :data:`GROUPS` so ``copc --help`` does not
import heavy modules (torch, faiss) of groups that are not used.

Example: ``copc retriever build --corpus C --kind bm25 --out DIR``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from .parent_watch import stop_when_parent_dies


@dataclass(frozen=True)
class Group:
    """A ``copc <name> ...`` subcommand group.

    Attributes:
        name: the group's word on the command line (e.g. ``"retriever"``).
        help: one-line help shown by ``copc --help``.
        module: dotted module path exposing ``add_subcommands(subparsers)``, imported
            only when this group is invoked; a group without sub-subcommands (``copc train
            --config ...``) exposes ``add_arguments(parser, name)`` instead.
    """

    name: str
    help: str
    module: str


# Add new groups here (``train``, ``eval`` ...): one line each.
GROUPS: tuple[Group, ...] = (
    Group("retriever", "build retrieval indexes and serve them (Search-R1 API)", "retriever.cli"),
    Group("train", "train an agent: copc train --config PATH [key=value ...] [--resume]",
          "trainer.app.cli_train"),
    Group("eval", "evaluate: copc eval --model DIR|--checkpoint DIR|--endpoint URL --benchmarks nq,aime2025 "
          "[--k N] [--out DIR] [--resume], or a run: copc eval --config PATH [--checkpoint DIR]",
          "trainer.app.cli_train"),
    Group("analyze", "exact Prop. 2-3 bias/variance/MSE grid on a token tree (--out DIR)",
          "trainer.app.analyze"),
    Group("sweep", "grid of runs + heatmaps: copc sweep --config C --grid k=v1,v2", "trainer.sweep.command"),
    Group("env", "serve an env over OpenEnv: copc env serve --env NAME --port N", "environments.remote.cli"),
    Group("model", "pretrained models: copc model pull NAME (then model.path: NAME / --model NAME), "
          "copc model list", "trainer.models.pull.cli"),
    Group("view", "trajectory viewer: copc view RUN_OR_EVAL_DIR [--out FILE.html] [--serve]",
          "trainer.outputs.viewer.cli"),
)


def build_parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    """Build the top-level parser; only the group named in ``argv`` is imported.

    Args:
        argv: command-line arguments without the program name.

    Returns:
        The parser with one sub-parser per registered group.
    """
    parser = argparse.ArgumentParser(prog="copc", description="COPC command-line interface")
    sub = parser.add_subparsers(dest="group", metavar="GROUP", required=True)
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for group in GROUPS:
        gp = sub.add_parser(group.name, help=group.help, description=group.help)
        if group.name == chosen:
            mod = importlib.import_module(group.module)
            if hasattr(mod, "add_subcommands"):
                gsub = gp.add_subparsers(dest="command", metavar="COMMAND", required=True)
                mod.add_subcommands(gsub)
            else:
                mod.add_arguments(gp, group.name)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``copc``: parse ``argv`` and dispatch to the chosen subcommand.

    Args:
        argv: arguments (default ``sys.argv[1:]``).

    Returns:
        The subcommand's exit code (0 on success).
    """
    args_list = list(sys.argv[1:] if argv is None else argv)
    if not sys.stderr.isatty():  # a log file: no carriage-return bars of Hugging Face's loaders
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    stop_when_parent_dies()  # a child of copc sweep stops when the sweep is killed
    parser = build_parser(args_list)
    args = parser.parse_args(args_list)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
