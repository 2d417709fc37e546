"""``copc env serve`` and ``copc env list`` (registered in ``trainer/cli.py``).

Examples::

    copc env serve --env math_tool                        # 127.0.0.1:8100, no token
    copc env serve --env search retriever_url=http://127.0.0.1:8000 limits.max_turns=4
    copc env serve --env math_tool --host 0.0.0.0 --token-file /run/secrets/env-token

Environment settings are ``key=value`` words after the options: dotted keys build nested
mappings, values are YAML (``limits.max_turns=4``, ``reward.mode=math_verify``,
``"prompt_template='Q: {problem}'"``), as ``copc train`` overrides. A bad setting, an unknown
environment, an unreadable token file, a ``--port`` in use or a non-loopback ``--host`` without
a token print one line naming the option and exit with status 2; an environment whose services
cannot start (its sandbox, an MCP server that exits or never answers) prints one line and exits
with status 1.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

#: Exit status for bad options (as argparse and ``copc train``).
EXIT_USAGE = 2
#: The option of each :class:`~environments.remote.server.ServerConfig` field, for messages.
OPTION_OF = {"ServerConfig.env=": "--env=", "ServerConfig.port=": "--port=",
             "ServerConfig.max_sessions=": "--max-sessions=",
             "ServerConfig.idle_timeout_s=": "--idle-timeout=",
             "ServerConfig.max_request_bytes=": "--max-request-bytes=",
             "ServerConfig.sandbox_workers=": "--sandbox-workers=",
             "ServerConfig.token=": "--token-file: token="}


def parse_env_kwargs(items: list[str]) -> dict[str, Any]:
    """``["limits.max_turns=4", "reward.mode=math_verify"]`` →
    ``{"limits": {"max_turns": 4}, "reward": {"mode": "math_verify"}}`` (values parsed as YAML).

    Raises:
        ValueError: an item without ``=``, an empty key part, a value that is not YAML, or a key
            given both as a value and as a mapping (the message quotes the item).
    """
    import yaml

    out: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        parts = key.split(".")
        if not sep or not all(parts):
            raise ValueError(f"env setting {item!r}: expected key=value (dotted keys for nested settings)")
        try:
            value = yaml.safe_load(text) if text else ""
        except yaml.YAMLError as e:
            raise ValueError(f"env setting {item!r}: the value is not YAML ({e})") from None
        node = out
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ValueError(f"env setting {item!r}: {p!r} was already given a value")
        if isinstance(node.get(parts[-1]), dict):
            raise ValueError(f"env setting {item!r}: {key!r} already has nested settings")
        node[parts[-1]] = value
    return out


def add_subcommands(sub: argparse._SubParsersAction) -> None:
    """Add the ``serve`` and ``list`` parsers to ``sub`` (each sets ``func``)."""
    from .config import DEFAULT_PORT

    s = sub.add_parser("serve", help="serve a registered environment with the OpenEnv protocol "
                                     "(HTTP + /ws WebSocket sessions)")
    s.add_argument("--env", required=True, help="registered env id, or package.module:id / file.py:id")
    s.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1); any non-loopback address needs --token-file")
    s.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"TCP port (default {DEFAULT_PORT})")
    s.add_argument("--max-sessions", type=int, default=256, help="most sessions open at once (default 256)")
    s.add_argument("--idle-timeout", type=float, default=600.0, metavar="S",
                   help="close a session after S seconds without a request (default 600)")
    s.add_argument("--token-file", default=None, metavar="F",
                   help="file holding the bearer token clients must send (Authorization: Bearer ...)")
    s.add_argument("--allow-origin", action="append", default=[], metavar="URL",
                   help="without a token, also answer web pages of this origin (http://host:port; "
                        "repeatable); by default only the server's own origin")
    s.add_argument("--max-request-bytes", type=int, default=0,
                   help="largest HTTP body / WebSocket message (default: 12 bytes per action character "
                        "+ 64 KiB)")
    s.add_argument("--sandbox-workers", type=int, default=2,
                   help="workers of the shared sandbox pool of environments that run code (default 2)")
    s.add_argument("--sandbox-isolation", choices=("bwrap", "process", "docker"), default="bwrap",
                   help="isolation of that pool (default bwrap; 'process' is weaker: docs/environments.md)")
    s.add_argument("--no-reuse-envs", action="store_true",
                   help="build a new environment for every session (default: reuse them, reset-cleared)")
    s.add_argument("--parent-pid", type=int, default=0, help="exit when this process is gone")
    s.add_argument("--log-level", default="warning")
    s.add_argument("env_kwargs", nargs="*", metavar="key=value", help="environment settings (YAML values)")
    s.set_defaults(func=serve_command)

    ls = sub.add_parser("list", help="list the registered environment ids")
    ls.set_defaults(func=list_command)


def serve_command(args: argparse.Namespace) -> int:
    """Run ``copc env serve``; returns the exit status (2 for bad options)."""
    from environments.errors import InfrastructureError
    from environments.sandbox import SandboxUnavailableError

    from .auth import read_token_file
    from .config import ServerConfig

    if args.parent_pid:
        _exit_with_parent(args.parent_pid)
    try:
        token = read_token_file(args.token_file) if args.token_file else None
        cfg = ServerConfig(env=args.env, env_kwargs=parse_env_kwargs(args.env_kwargs), host=args.host,
                           port=args.port, max_sessions=args.max_sessions, idle_timeout_s=args.idle_timeout,
                           token=token, allowed_origins=tuple(args.allow_origin),
                           max_request_bytes=args.max_request_bytes,
                           reuse_envs=not args.no_reuse_envs, sandbox_workers=args.sandbox_workers,
                           sandbox_isolation=args.sandbox_isolation,
                           log_level=args.log_level)
        from retriever.access import check_port

        check_port(cfg.host, cfg.port)  # one line, before the env is built and "serving on" printed
        from .server import serve  # heavy (openenv imports gradio): only once the options are valid

        serve(cfg)
    except ValueError as e:
        msg = str(e)
        for field, option in OPTION_OF.items():
            msg = msg.replace(field, option)
        print(f"copc env serve: {msg}", file=sys.stderr)
        return EXIT_USAGE
    except SandboxUnavailableError as e:
        print(f"copc env serve: the environment's sandbox cannot start: {e}", file=sys.stderr)
        return 1
    except InfrastructureError as e:  # e.g. an MCP server that exits or never answers at start
        print(f"copc env serve: env {args.env!r} could not be built (a service it needs failed): {e}",
              file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


def _exit_with_parent(parent_pid: int, poll_s: float = 1.0) -> None:
    """End this process soon after ``parent_pid`` is gone (even killed by SIGKILL): a daemon
    thread watches ``os.getppid()`` (re-parenting changes it)."""
    import os
    import threading
    import time

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(poll_s)
        os._exit(0)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def list_command(args: argparse.Namespace) -> int:
    """Print the registered environment ids, one per line."""
    import environments

    print("\n".join(environments.names()))
    return 0


__all__ = ["EXIT_USAGE", "add_subcommands", "list_command", "parse_env_kwargs", "serve_command"]


if __name__ == "__main__":  # python -m environments.remote.cli serve --env ... (without the copc script)
    _parser = argparse.ArgumentParser(prog="python -m environments.remote.cli")
    add_subcommands(_parser.add_subparsers(dest="command", metavar="COMMAND", required=True))
    _args = _parser.parse_args()
    raise SystemExit(_args.func(_args))
