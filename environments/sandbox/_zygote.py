"""The zygote: the pristine process every call is forked from (stdlib only; runs inside the sandbox).

The worker's start-up process becomes the zygote (pid 1 of the worker's PID namespace under
``bwrap --as-pid-1``) once the interpreter is warm, *before* any request exists: it forks the
fork server (``_worker._serve``), which talks to the pool and holds every request and reply,
and from then on only forks call processes on the server's behalf and reaps them. A call
process is therefore a copy of a state that never held another call's source, environment or
output: neither its frames (``sys._getframe().f_back`` ends in :func:`serve`) nor its heap or
readable memory contain an earlier call.

Messages on the ``SOCK_SEQPACKET`` pair (one datagram each):

* server -> zygote: ``F`` with the four pipe ends of a new call (``ctl_r``, ``out_w``,
  ``err_w``, ``ready_w``) as ``SCM_RIGHTS``; the zygote forks :func:`_call.child_main` on them;
* (no answer: the call process writes ``R`` and its pid on its ready pipe once set up; when
  ``fork`` fails the zygote writes ``E`` and why there instead);
* zygote -> server: ``X`` + pid, wait status, user and system CPU seconds and peak RSS (KiB)
  when that call process has been reaped. Every other process that ends up as the zygote's
  child (orphans, as pid 1 of the namespace) is reaped silently.

The zygote exits when the server's end closes (the server exited), which in a PID namespace
kills whatever is left.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket

import _call
from _wire import EXIT_MSG


def start(opts, cg, close: tuple[int | None, ...] = ()) -> socket.socket:
    """Fork the fork server off this process, which becomes the zygote (and closes the fds in
    ``close``: the pool's pipes and other handles only the server uses).

    Returns:
        In the fork server (the child): its end of the socket pair to the zygote. In this
        process nothing returns: it serves the zygote loop until the server is gone.
    """
    server_end, zygote_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    pid = os.fork()
    if pid == 0:
        zygote_end.close()
        return server_end
    server_end.close()
    for fd in close:
        if fd is not None:
            os.close(fd)
    serve(zygote_end, opts, cg)
    os._exit(0)


def _noop(*_args: object) -> None:
    """SIGCHLD handler: the wake-up fd does the work."""


def serve(sock: socket.socket, opts, cg) -> None:
    """Fork call processes when asked, reap every child, report the call's exit; returns when
    the server's end of ``sock`` is closed."""
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.signal(signal.SIGCHLD, _noop)
    signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
    calls: set[int] = set()
    while True:
        ready, _, _ = select.select([sock, wake_r], [], [])
        if wake_r in ready:
            with contextlib.suppress(BlockingIOError):
                while os.read(wake_r, 4096):
                    pass
        _reap(sock, calls)
        if sock not in ready:
            continue
        msg, fds, _flags, _addr = socket.recv_fds(sock, 16, 4)
        if not msg:
            return
        pid = _fork_call(fds, opts, cg, (sock.fileno(), wake_r, wake_w))
        if pid > 0:
            calls.add(pid)


def _fork_call(fds: list[int], opts, cg, own: tuple[int, ...]) -> int:
    """Fork one call process on the pipe ends ``fds`` (``ctl_r``, ``out_w``, ``err_w``,
    ``ready_w``); its pid, or -1 when it failed (then ``E`` and why went to ``ready_w``)."""
    try:
        if len(fds) != 4:
            raise OSError(22, f"expected 4 pipe ends, got {len(fds)}")
        pid = os.fork()
    except OSError as e:
        if fds:
            with contextlib.suppress(OSError):
                os.write(fds[-1], f"Ethe zygote could not fork the call process: {e}".encode())
        pid = -1
    if pid == 0:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in own:
            os.close(fd)
        _call.child_main(*fds, opts, cg)
    for fd in fds:
        os.close(fd)
    return pid


def _reap(sock: socket.socket, calls: set[int]) -> None:
    """Reap every child that has exited; report the call processes among them."""
    while True:
        try:
            pid, status, ru = os.wait4(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        if pid in calls:
            calls.discard(pid)
            sock.send(EXIT_MSG.pack(b"X", pid, status, ru.ru_utime, ru.ru_stime, ru.ru_maxrss))
