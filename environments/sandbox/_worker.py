"""Fork-server worker that runs *inside* the sandbox (stdlib only, started by ``pool.py``).

Protocol on the inherited pipes (fd 0 = requests in, fd 1 = replies out): every message is
a 4-byte big-endian length followed by that many bytes of UTF-8 JSON.

Start-up: the worker preloads modules and warms the interpreter, then becomes the zygote
(``_zygote.py``) and forks the fork server, which writes a ``hello`` message and serves the
requests; the zygote never sees a request or a reply. Per call the server has the zygote
pre-fork one child (off the latency path) that becomes the untrusted program: the call's
cgroups (``--cgroup-memory`` / ``--cgroup-pids`` / ``--cgroup-cpu``, entered by the child), its
own session, a fresh mount, IPC, network and cgroup namespace with fresh tmpfs ``/tmp`` and
``/dev/shm`` (``--namespaces``), an empty capability bounding set, an
unprivileged uid (``--drop-uid``), ``no_new_privs`` and a seccomp filter that refuses namespaces
and keyrings (see ``_confine.py``). The child reports ``R`` (set up) and then ``G`` (limits set,
about to run the code) on a private pipe it closes before the code runs; a child that dies
without ``G`` is a failure of the sandbox, never the program's error. After the call the server
kills every process left in its PID namespace (the zygote, pid 1, reaps them and reports the
call's exit), resets the PID counter, and replies with stdout, stderr, exit status, timing and a
kill reason.

Its parts, bound beside it in the sandbox and imported as top-level modules: ``_wire.py`` (the
command line and the messages), ``_call.py`` (a call's process), ``_cgroups.py`` (the slot's
cgroups), ``_confine.py`` (the kernel primitives) and ``_zygote.py`` (the pristine forker).
"""

from __future__ import annotations

import contextlib
import gc
import os
import selectors
import shutil
import signal
import stat
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _confine
import _wire
import _zygote
from _call import Prefork
from _cgroups import Cgroups
from _wire import EXIT_MSG, READY_PID, Options, recv, send

READY_TIMEOUT_S = 10.0
SWEEP_TIMEOUT_S = 5.0
NS_LAST_PID = 100  # after each call the PID counter restarts here: every call gets pid 101


def _sweep(opts: Options, pgid: int) -> None:
    """Kill every process the call left (the whole PID namespace but us and the zygote, which
    reaps them), bounded: done when no process is left to signal.

    Raises:
        TimeoutError: processes are still there after ``SWEEP_TIMEOUT_S``.
    """
    end = time.monotonic() + SWEEP_TIMEOUT_S
    while time.monotonic() < end:
        try:
            if opts.in_pid_ns:
                os.kill(-1, signal.SIGKILL)  # never pid 1 (the zygote), never us
            else:
                os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            return
        time.sleep(0.0002)
    raise TimeoutError(f"processes of the call still alive {SWEEP_TIMEOUT_S:g} s after SIGKILL")


class Usage:
    """What the zygote reported of a reaped call process (``ru_*`` as in ``resource``)."""

    def __init__(self, utime: float, stime: float, maxrss: int) -> None:
        self.ru_utime, self.ru_stime, self.ru_maxrss = utime, stime, maxrss


def _exit_report(zygote, pid: int, timeout_s: float) -> tuple[int, Usage] | None:
    """The zygote's ``X`` report of call process ``pid``: ``(wait status, usage)``, or None
    when it did not come within ``timeout_s`` seconds.

    Raises:
        EOFError: the zygote is gone.
    """
    sel = selectors.DefaultSelector()
    sel.register(zygote, selectors.EVENT_READ)
    try:
        end = time.monotonic() + timeout_s
        while sel.select(max(0.0, end - time.monotonic())):
            msg = zygote.recv(64)
            if not msg:
                raise EOFError("the zygote exited")
            tag, got, status, utime, stime, maxrss = EXIT_MSG.unpack(msg)
            if tag == b"X" and got == pid:
                return status, Usage(utime, stime, maxrss)
        return None
    finally:
        sel.close()


def _kill_and_reap(opts: Options, pid: int, zygote) -> tuple[int, Usage]:
    """SIGKILL the call's main process ``pid`` and its group (in a PID namespace: every process
    but us and the zygote, so also a tracer outside the group) until the zygote reports ``pid``
    reaped; ``(status, usage)``.

    Raises:
        TimeoutError: ``pid`` not reaped ``SWEEP_TIMEOUT_S`` after the first SIGKILL.
    """
    end = time.monotonic() + SWEEP_TIMEOUT_S
    while True:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
        if opts.in_pid_ns:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(-1, signal.SIGKILL)
        got = _exit_report(zygote, pid, 0.005)
        if got:
            return got
        if time.monotonic() > end:
            raise TimeoutError(f"the call's process {pid} not reaped {SWEEP_TIMEOUT_S:g} s after SIGKILL")


def _wait_ready(child: Prefork) -> str | None:
    """Wait (bounded) for the child's ``R`` and its pid (``child.pid``); return why it is not
    ready, or None."""
    if child.setup_error:
        return child.setup_error
    sel = selectors.DefaultSelector()
    sel.register(child.ready_r, selectors.EVENT_READ)
    try:
        if not sel.select(READY_TIMEOUT_S):
            return f"call process not ready after {READY_TIMEOUT_S:g} s"
    finally:
        sel.close()
    first = os.read(child.ready_r, 1)
    if first == b"R":  # written at once with its pid (4 bytes), a single pipe write
        (child.pid,) = READY_PID.unpack(_wire.read_exact(child.ready_r, READY_PID.size))
        return None
    rest = b""
    with contextlib.suppress(OSError):
        rest = os.read(child.ready_r, 8192)
    return "call set-up failed: " + (rest.decode(errors="replace") or "process died")


def _run_one(req: dict, child: Prefork, cg: Cgroups, opts: Options, zygote) -> dict:
    """Run request ``req`` in the pre-forked ``child``; the reply (or ``{"error": why}``)."""
    out_r, err_r = child.out_r, child.err_r
    t0 = time.perf_counter()
    not_ready = _wait_ready(child)
    if not_ready:
        return {"error": not_ready}
    pid = child.pid
    outside = cg.missing(pid)
    if outside:
        return {"error": f"the call process is not in its {'/'.join(outside)} cgroup(s)"}
    if opts.namespaces:  # the worker then tears the call's mounts down after replying
        with contextlib.suppress(OSError):
            child.ns_fds.append(os.open(f"/proc/{pid}/ns/mnt", os.O_RDONLY))
    cg.set_limit(int(req["memory_mb"]))
    cg.oom_events()
    with contextlib.suppress(OSError):  # a child that died early: its status says why
        send(child.ctl_w, req)
    os.close(child.ctl_w)
    child.ctl_w = -1
    limit = int(req["max_output_bytes"])
    deadline = t0 + float(req["timeout_s"])
    bufs = {out_r: bytearray(), err_r: bytearray()}
    go = bytearray()
    sel = selectors.DefaultSelector()
    os.set_blocking(child.ready_r, False)  # read once the call is over (no wake-ups)
    for fd in (out_r, err_r):
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ)
    sel.register(zygote, selectors.EVENT_READ)
    if cg.efd is not None:
        sel.register(cg.efd, selectors.EVENT_READ)
    status = rusage = reason = None
    truncated = False
    open_fds = set(bufs)
    while reason is None and (status is None or open_fds):
        remaining = deadline - time.perf_counter()
        if remaining <= 0:  # also while draining: a leftover process may write forever
            reason = "timeout"
            break
        for key, _ in sel.select(remaining):
            fd = key.fd
            if fd == zygote.fileno():  # the zygote reaped the call's process
                got = _exit_report(zygote, pid, 0.0)
                if got:
                    status, rusage = got
                    sel.unregister(zygote)
                continue
            if fd == cg.efd:
                if cg.oom_events():
                    reason = "memory"
                continue
            try:
                chunk = os.read(fd, 65536)
            except BlockingIOError:
                continue
            if not chunk:
                sel.unregister(fd)
                open_fds.discard(fd)
                continue
            bufs[fd] += chunk
            if len(bufs[out_r]) + len(bufs[err_r]) > limit:
                truncated = True
                reason = "output_limit"
    if status is None:
        status, rusage = _kill_and_reap(opts, pid, zygote)
    duration = time.perf_counter() - t0
    with contextlib.suppress(BlockingIOError, OSError):
        go += os.read(child.ready_r, 8192)  # "G", or "E" and why the set-up failed
    sel.close()
    _sweep(opts, pid)
    if cg.oom_events():
        reason = "memory"
    if not go.startswith(b"G"):
        return {"error": "call set-up failed: " + (go[1:].decode(errors="replace")
                                                   or f"process died (status {status})")}
    return _reply(bytes(bufs[out_r]), bytes(bufs[err_r]), limit if truncated else None, status,
                  rusage, reason, duration)


def _reply(out: bytes, err: bytes, cut_at: int | None, status: int, rusage: Usage | None,
           reason: str | None, duration: float) -> dict:
    """The reply of a finished call; ``cut_at``: the output limit it went over (None: kept whole)."""
    if cut_at is not None:
        keep_out = min(len(out), cut_at)
        out, err = out[:keep_out], err[: max(0, cut_at - keep_out)]
    return {
        "stdout": out.decode("utf-8", errors="replace"),
        "stderr": err.decode("utf-8", errors="replace"),
        "exit_code": os.waitstatus_to_exitcode(status),
        "reason": reason,
        "truncated": cut_at is not None,
        "duration_s": duration,
        "cpu_s": (rusage.ru_utime + rusage.ru_stime) if rusage else 0.0,
        "max_rss_kb": rusage.ru_maxrss if rusage else 0,
    }


def _wipe(root: str) -> None:
    """Remove everything under ``root`` (process isolation only), iteratively: directories
    whose permissions the code removed are opened up first, any depth; never raises."""
    with contextlib.suppress(OSError):
        for entry in os.listdir(root):
            path = os.path.join(root, entry)
            stack = [path]
            while stack:
                top = stack[-1]
                try:
                    if not stat.S_ISDIR(os.lstat(top).st_mode):
                        os.unlink(top)
                        stack.pop()
                        continue
                    os.chmod(top, 0o700)
                    subs = [os.path.join(top, n) for n in os.listdir(top)]
                except OSError:
                    stack.pop()
                    continue
                if subs:
                    stack.extend(subs)
                else:
                    with contextlib.suppress(OSError):
                        os.rmdir(top)
                    stack.pop()
            shutil.rmtree(path, ignore_errors=True)


def _proc_handle(opts: Options) -> int | None:
    """A writable handle on this PID namespace's ``ns_last_pid`` (a private proc mount)."""
    if opts.proc is None:
        return None
    _confine.mount("proc", opts.proc, "proc",
                   _confine.MS_NOSUID | _confine.MS_NODEV | _confine.MS_NOEXEC)
    try:
        return os.open(os.path.join(opts.proc, "sys/kernel/ns_last_pid"), os.O_WRONLY)
    finally:
        _confine.umount(opts.proc)


def main() -> None:
    """Entry point: ``python -I _worker.py [--drop-uid UID GID] [--pid-ns] [--namespaces]
    [--tmp-bytes N] [--cgroup-memory DIR] [--cgroup-pids DIR] [--cgroup-cpu DIR] [--proc-scratch DIR]
    [--tmp-root DIR] [--preload a,b]``."""
    opts = Options(sys.argv[1:])
    in_fd, out_fd = os.dup(0), os.dup(1)
    devnull = os.open("/dev/null", os.O_RDWR)
    for fd in (0, 1):
        os.dup2(devnull, fd)
    os.set_inheritable(in_fd, False)
    os.set_inheritable(out_fd, False)
    _confine.prctl(_confine.PR_SET_DUMPABLE, 0)
    if opts.in_pid_ns:
        _confine.prctl(_confine.PR_SET_CHILD_SUBREAPER, 1)
    hello: dict = {"hello": True, "pid": os.getpid(), "uid": os.getuid()}
    for mod in opts.preload:
        try:
            __import__(mod)
        except Exception as e:
            hello.setdefault("preload_errors", []).append(f"{mod}: {e!r}")
    # warm the paths every call uses (compiler, exec, traceback) so forked children inherit them
    exec(compile("x = [i * 2 for i in range(3)]\nstr(x)", "<warm-up>", "exec"), {})
    traceback.format_exception(ValueError, ValueError("warm-up"), None)
    try:
        last_pid = _proc_handle(opts)
        cg = Cgroups(opts)
    except OSError as e:
        hello["setup_error"] = f"{type(e).__name__}: {e}"
        send(out_fd, hello)
        return
    gc.collect()
    gc.freeze()  # collections in children then do not touch (and copy) the worker's objects
    # from here this process is the zygote (it never sees a request); the fork server goes on
    zygote = _zygote.start(opts, cg, close=(in_fd, out_fd, last_pid))
    hello.update(pid=os.getpid(), pid_ns_init_visible=os.getpid() <= 3)
    send(out_fd, hello)
    _serve(opts, in_fd, out_fd, cg, last_pid, zygote)


def _serve(opts: Options, in_fd: int, out_fd: int, cg: Cgroups, last_pid: int | None,
           zygote) -> None:
    """The fork server's loop: one request at a time, each in a call process the zygote forked
    before the request arrived; returns on EOF or after a failure of the machinery."""
    child = Prefork(zygote)
    while True:
        try:
            req = recv(in_fd)
        except EOFError:
            return
        try:
            reply = _run_one(req, child, cg, opts, zygote)
        except Exception:
            reply = {"error": traceback.format_exc()}
        if not opts.namespaces:
            _wipe(opts.tmp_root)
        if last_pid is not None and "error" not in reply:
            try:
                os.pwrite(last_pid, str(NS_LAST_PID).encode(), 0)
            except OSError as e:
                reply = {"error": f"cannot reset the PID counter: {e}"}
        send(out_fd, reply)
        if "error" in reply:
            return  # a broken worker is replaced by the pool, never reused
        child.close()  # the finished call's mount namespace (and its tmpfs) dies here
        child = Prefork(zygote)


if __name__ == "__main__":
    main()
