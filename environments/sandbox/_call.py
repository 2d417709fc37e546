"""One call's process in the sandbox worker (stdlib only; runs inside the sandbox).

:class:`Prefork` (in the fork server) has the zygote (``_zygote.py``) fork it ahead of the
request; in the child, :func:`child_main` confines it (the call's cgroups, then its own
session, a fresh mount + IPC + network + cgroup namespace, dropped privileges, the seccomp
filter: ``_confine.py``), reports ``R`` (set up), waits for the request, sets its limits,
reports ``G`` and runs the code (:func:`exec_code`) like ``python script.py`` would.
"""

from __future__ import annotations

import builtins
import contextlib
import os
import resource
import signal
import socket
import sys
import tempfile
import traceback

import _cgroups
import _confine
import _wire


def child_main(ctl_r: int, out_w: int, err_w: int, ready_w: int, opts: _wire.Options,
               cg: _cgroups.Cgroups) -> None:
    """Pre-forked untrusted-program process: confine itself, wait for the request, run it.

    Never returns. Everything that does not depend on the request happens before it arrives.
    It enters the slot's cgroups itself, before its cgroup namespace is made, so that its
    ``/proc/self/cgroup`` shows ``/`` (not the pool's cgroup names, which hold the host pid).
    """
    code = 1
    try:
        cg.enter(os.getpid())
        os.setsid()
        _confine.prctl(_confine.PR_SET_PDEATHSIG, signal.SIGKILL)
        devnull = os.open("/dev/null", os.O_RDONLY)
        for src, dst in ((devnull, 0), (out_w, 1), (err_w, 2), (ctl_r, 3), (ready_w, 4)):
            os.dup2(src, dst)
        os.closerange(5, 65536)
        if opts.namespaces:
            _confine.fresh_call_namespaces(opts.tmp_bytes, 16384, opts.keep)
            workdir = "/tmp"
        else:  # process isolation: an unpredictable private directory, created exclusively
            workdir = tempfile.mkdtemp(prefix="run-", dir=opts.tmp_root)
        os.chdir(workdir)
        if opts.drop is not None:
            _confine.drop_privileges(*opts.drop)
        else:
            _confine.prctl(_confine.PR_SET_NO_NEW_PRIVS, 1)
        if opts.namespaces:
            _confine.install_seccomp()
        os.write(4, b"R" + _wire.READY_PID.pack(os.getpid()))
    except BaseException:
        with contextlib.suppress(BaseException):
            os.write(4, b"E" + traceback.format_exc().encode(errors="replace")[-4000:])
        os._exit(1)
    try:
        req = _wire.recv(3)
    except EOFError:  # the worker is recycling us without a request
        os._exit(0)
    try:
        os.close(3)
        limits = [
            (resource.RLIMIT_AS, int(req["memory_mb"]) * 1024 * 1024),
            (resource.RLIMIT_CPU, int(req["cpu_s"])),
            (resource.RLIMIT_FSIZE, int(req["max_file_bytes"])),
            (resource.RLIMIT_NPROC, int(req["max_processes"])),
            (resource.RLIMIT_CORE, 0),
            (resource.RLIMIT_NOFILE, 256),
            (resource.RLIMIT_MSGQUEUE, 512 * 1024),
        ]
        for which, value in limits:
            hard = value + 1 if which == resource.RLIMIT_CPU else value
            resource.setrlimit(which, (value, hard))
        os.environ.clear()
        os.environ.update(req.get("env", {}))
        os.environ.update({"HOME": workdir, "TMPDIR": workdir, "PWD": workdir})
        sys.stdin = open(0, closefd=False)  # noqa: SIM115
        sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115
        sys.argv = ["<code>"]
        sys.path[:0] = [workdir]
        # the builtins module, as in a script run as __main__ (an imported module's __builtins__ is a dict)
        namespace = {"__name__": "__main__", "__builtins__": builtins}
        os.write(4, b"G")
        os.close(4)
    except BaseException:
        with contextlib.suppress(BaseException):
            os.write(4, b"E" + traceback.format_exc().encode(errors="replace")[-4000:])
        os._exit(1)
    code = exec_code(req["code"], namespace)
    os._exit(code)


def exec_code(source: str, namespace: dict) -> int:
    """Run ``source`` like ``python script.py`` would; return the exit status."""
    code = 0
    try:
        exec(compile(source, "<code>", "exec"), namespace)
    except SystemExit as e:
        if e.code is None:
            code = 0
        elif isinstance(e.code, int):
            code = e.code & 0xFF
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException as e:  # report like the interpreter would, minus our frames
        tb = e.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename != "<code>":
            tb = tb.tb_next
        sys.stderr.write("".join(traceback.format_exception(type(e), e, tb)))
        code = 1
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:
        code = code or 1
    return code


class Prefork:
    """A call process forked by the zygote, confined and waiting for its request (see
    :func:`child_main`); the fork server's ends of its pipes.

    Args:
        zygote: the fork server's end of the socket pair to the zygote (``_zygote.py``).
    """

    def __init__(self, zygote: socket.socket) -> None:
        ctl_r, self.ctl_w = os.pipe()
        self.out_r, out_w = os.pipe()
        self.err_r, err_w = os.pipe()
        self.ready_r, ready_w = os.pipe()
        self.setup_error: str | None = None
        self.ns_fds: list[int] = []
        self.pid = -1  # the call process says it with its ``R`` (no round trip here)
        try:
            socket.send_fds(zygote, [b"F"], [ctl_r, out_w, err_w, ready_w])
        except OSError as e:
            self.setup_error = f"cannot ask the zygote for the call process: {e}"
        finally:
            for fd in (ctl_r, out_w, err_w, ready_w):
                os.close(fd)

    def close(self) -> None:
        """Close the worker's ends of the child's pipes and its namespace handles."""
        for fd in (self.ctl_w, self.out_r, self.err_r, self.ready_r, *self.ns_fds):
            if fd >= 0:
                os.close(fd)
        self.ns_fds = []
