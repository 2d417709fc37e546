"""Child processes that do not outlive the process that started them.

``copc sweep`` starts each run as a ``copc train`` / ``copc eval`` subprocess; a rank learner is a
child of its driver. If the parent is killed (``kill -9``, an OOM kill, a lost terminal) its
children must stop too, or they keep writing into run directories nobody watches and hold their
locks. A daemon thread polls ``os.getppid()``: re-parenting (to init or a subreaper) changes it
the moment the parent dies, whatever killed it. (``PR_SET_PDEATHSIG`` would fire when the parent
*thread* that forked exits, and the sweep forks from worker threads.)

The environment variable :data:`ENV` carries the parent's pid across ``exec`` to a CLI child; the
child pops it, so its own children (ranks, servers) are not tied to the grandparent.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping

#: Set by a parent in its child's environment: the parent's pid.
ENV = "COPC_EXIT_WITH_PARENT"


def child_env(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` plus :data:`ENV` = this process's pid (the child then exits with this process)."""
    return {**env, ENV: str(os.getpid())}


def exit_with_parent(parent_pid: int, on_orphaned: Callable[[], None],
                     poll_s: float = 1.0) -> threading.Thread:
    """Call ``on_orphaned()`` once, from a daemon thread, as soon as ``parent_pid`` is no longer this
    process's parent (immediately when it already is not).

    Args:
        parent_pid: the pid that must stay this process's parent (> 0).
        on_orphaned: what to do then (e.g. ``lambda: os._exit(3)``).
        poll_s: seconds between checks (> 0).

    Returns:
        The started thread.

    Raises:
        ValueError: ``parent_pid <= 0`` or ``poll_s <= 0``.
    """
    if parent_pid <= 0 or not poll_s > 0:
        raise ValueError(f"exit_with_parent: parent_pid={parent_pid!r} must be > 0 and poll_s={poll_s!r} > 0")

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(poll_s)
        on_orphaned()

    t = threading.Thread(target=watch, name="copc-parent-watch", daemon=True)
    t.start()
    return t


def stop_when_parent_dies(grace_s: float = 60.0, poll_s: float = 1.0) -> bool:
    """In a CLI child started with :func:`child_env`: when the parent dies, say so on stderr and
    interrupt this process as Ctrl-C would (``SIGINT``: the run stops cleanly, its last checkpoint
    kept, ``--resume`` continues it); if it has not exited ``grace_s`` seconds later, exit with 3.

    Returns:
        True if :data:`ENV` was set (and is now removed from ``os.environ``), else False.

    Raises:
        ValueError: :data:`ENV` is set but not a positive integer.
    """
    raw = os.environ.pop(ENV, None)
    if raw is None:
        return False
    if not raw.isdigit() or int(raw) <= 0:
        raise ValueError(f"{ENV}={raw!r}: must be the parent's pid (a positive integer)")
    parent = int(raw)
    if threading.current_thread() is threading.main_thread() and \
            signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        # started with SIGINT ignored (a parent in the background of a non-interactive shell, nohup):
        # Python then installs no KeyboardInterrupt handler, and the SIGINT below would do nothing
        signal.signal(signal.SIGINT, signal.default_int_handler)

    def orphaned() -> None:
        print(f"copc: the parent process (pid {parent}) is gone; stopping this run "
              f"(continue it with --resume)", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(grace_s)
        os._exit(3)

    exit_with_parent(parent, orphaned, poll_s)
    return True
