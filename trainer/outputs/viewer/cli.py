"""``copc view RUN_OR_EVAL_DIR [--out FILE.html] [--serve] [--port N]``: write the viewer page
(:func:`~.page.write_page` of :func:`~.load.load_episodes`); ``--serve`` then serves that page,
and only it, on 127.0.0.1 until interrupted (:mod:`.serve`)."""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

from retriever.access import check_port

from .load import load_episodes
from .page import write_page
from .serve import make_server


def add_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    """Add the ``copc view`` options to ``parser`` and set ``func``.

    Raises:
        ValueError: for another ``name`` than ``"view"``.
    """
    if name != "view":
        raise ValueError(f"trainer.outputs.viewer.cli serves the 'view' group, not {name!r}")
    a = parser.add_argument
    a("directory", help="a copc train run directory (runs/<name>) or a copc eval --out directory")
    a("--out", default=None, help="the HTML file to write (default DIR/view.html)")
    a("--serve", action="store_true", help="then serve it on http://127.0.0.1:PORT/ until Ctrl-C")
    a("--port", type=int, default=8765, help="--serve's port (default 8765; 0: any free one)")
    a("--limit", type=int, default=5000, help="most episodes in the page (default 5000; the first ones)")
    parser.set_defaults(func=run_view)


def run_view(args: argparse.Namespace) -> int:
    """Write the page; print its path (and the URL with ``--serve``). Exit status 2 with one line
    when the directory holds no episodes' sources, or when ``--serve``'s ``--port`` is in use
    (checked before the page is written)."""
    try:
        if args.serve:
            check_port("127.0.0.1", args.port)
        episodes = load_episodes(args.directory)
    except (FileNotFoundError, ValueError) as e:
        print(f"copc view: {e}", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else Path(args.directory) / "view.html"
    write_page(episodes[:max(0, args.limit)], f"COPC · {Path(args.directory).resolve().name}", out)
    print(f"wrote {out} ({min(len(episodes), args.limit)} episodes)")
    if args.serve:
        with make_server(out, args.port) as srv:
            print(f"serving http://127.0.0.1:{srv.server_address[1]}/{out.name} (Ctrl-C stops)", flush=True)
            with contextlib.suppress(KeyboardInterrupt):
                srv.serve_forever()
    return 0
