"""Fork-server worker that runs *inside* the sandbox (stdlib only, started by ``pool.py``).

Protocol on the inherited pipes (fd 0 = requests in, fd 1 = replies out): every message is
a 4-byte big-endian length followed by that many bytes of UTF-8 JSON.

Start-up: the worker preloads modules and writes a ``hello`` message. Per call it pre-forks one
child (off the latency path) that becomes the untrusted program: its own session, a fresh mount
and IPC namespace with fresh tmpfs ``/tmp`` and ``/dev/shm`` (``--namespaces``), the call's
cgroups (``--cgroup-memory`` / ``--cgroup-pids``), an empty capability bounding set, an
unprivileged uid (``--drop-uid``), ``no_new_privs`` and a seccomp filter that refuses namespaces
and keyrings (see ``_confine.py``). The child reports ``R`` (set up) and then ``G`` (limits set,
about to run the code) on a private pipe it closes before the code runs; a child that dies
without ``G`` is a failure of the sandbox, never the program's error. After the call the worker
kills every process left in its PID namespace (it is their subreaper), resets the PID counter,
and replies with stdout, stderr, exit status, timing and a kill reason.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import resource
import selectors
import shutil
import signal
import stat
import struct
import sys
import tempfile
import time
import traceback
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _confine

_HEADER = struct.Struct(">I")
READY_TIMEOUT_S = 10.0
SWEEP_TIMEOUT_S = 5.0
NS_LAST_PID = 100  # after each call the PID counter restarts here: every call gets pid 101


def _read_exact(fd: int, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return bytes(buf)


def _recv(fd: int) -> dict:
    (n,) = _HEADER.unpack(_read_exact(fd, 4))
    return json.loads(_read_exact(fd, n))


def _send(fd: int, msg: dict) -> None:
    data = json.dumps(msg).encode()
    _write_all(fd, _HEADER.pack(len(data)) + data)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


class Options:
    """The worker's command-line settings (see :func:`main`)."""

    def __init__(self, args: list[str]) -> None:
        def value(flag: str, n: int = 1) -> list[str] | None:
            if flag not in args:
                return None
            i = args.index(flag)
            return args[i + 1:i + 1 + n]

        drop = value("--drop-uid", 2)
        self.drop = (int(drop[0]), int(drop[1])) if drop else None
        self.in_pid_ns = "--pid-ns" in args
        self.namespaces = "--namespaces" in args
        self.tmp_root = (value("--tmp-root") or ["/tmp"])[0]
        self.tmp_bytes = int((value("--tmp-bytes") or [str(64 << 20)])[0])
        self.cg_memory = (value("--cgroup-memory") or [None])[0]
        self.cg_pids = (value("--cgroup-pids") or [None])[0]
        self.proc = (value("--proc-scratch") or [None])[0]
        self.preload = [m for m in (value("--preload") or [""])[0].split(",") if m]
        self.keep = tuple(p for p in (value("--keep") or [""])[0].split(",") if p)


def _child(ctl_r: int, out_w: int, err_w: int, ready_w: int, opts: Options) -> None:
    """Pre-forked untrusted-program process: confine itself, wait for the request, run it.

    Never returns. Everything that does not depend on the request happens before it arrives.
    """
    code = 1
    try:
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
        os.write(4, b"R")
    except BaseException:
        with contextlib.suppress(BaseException):
            os.write(4, b"E" + traceback.format_exc().encode(errors="replace")[-4000:])
        os._exit(1)
    try:
        req = _recv(3)
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
        namespace = {"__name__": "__main__", "__builtins__": __builtins__}
        os.write(4, b"G")
        os.close(4)
    except BaseException:
        with contextlib.suppress(BaseException):
            os.write(4, b"E" + traceback.format_exc().encode(errors="replace")[-4000:])
        os._exit(1)
    code = _exec_code(req["code"], namespace)
    os._exit(code)


def _exec_code(source: str, namespace: dict) -> int:
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


class _Prefork:
    """A forked, confined child waiting for its request (see :func:`_child`)."""

    def __init__(self, opts: Options, cg: _Cgroups) -> None:
        ctl_r, self.ctl_w = os.pipe()
        self.out_r, out_w = os.pipe()
        self.err_r, err_w = os.pipe()
        self.ready_r, ready_w = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:
            for fd in (self.ctl_w, self.out_r, self.err_r, self.ready_r):
                os.close(fd)
            _child(ctl_r, out_w, err_w, ready_w, opts)
        for fd in (ctl_r, out_w, err_w, ready_w):
            os.close(fd)
        self.pidfd = os.pidfd_open(self.pid)
        self.setup_error: str | None = None
        self.ns_fds: list[int] = []
        try:
            cg.enter(self.pid)
        except OSError as e:
            self.setup_error = f"cannot move the call into its cgroups: {e}"

    def close(self) -> None:
        """Close the worker's ends of the child's pipes and its namespace handles."""
        for fd in (self.ctl_w, self.out_r, self.err_r, self.ready_r, self.pidfd, *self.ns_fds):
            if fd >= 0:
                os.close(fd)
        self.ns_fds = []


#: cgroup v1's separate limit of the TCP socket buffers (unaccounted until set): ``memory_mb`` too.
TCP_LIMIT = "memory.kmem.tcp.limit_in_bytes"


class _Cgroups:
    """The worker's handles on its slot's cgroups (opened once at start-up, after which the
    cgroup mounts are detached, so no call's mount namespace contains them): moving a call
    in, its memory limit and its OOM notifications."""

    def __init__(self, opts: Options) -> None:
        self.limit: int | None = None
        self.efd = None
        self.fds: dict[str, int] = {}
        self.procs = []
        for path in (opts.cg_memory, opts.cg_pids):
            if path is not None:
                self.procs.append(os.open(os.path.join(path, "cgroup.procs"), os.O_WRONLY))
        if opts.cg_memory is not None:
            for name in ("memory.limit_in_bytes", "memory.memsw.limit_in_bytes", TCP_LIMIT):
                with contextlib.suppress(FileNotFoundError):  # memsw: only with swap accounting
                    self.fds[name] = os.open(os.path.join(opts.cg_memory, name), os.O_WRONLY)
            self.efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
            oom_fd = os.open(os.path.join(opts.cg_memory, "memory.oom_control"), os.O_RDONLY)
            with open(os.path.join(opts.cg_memory, "cgroup.event_control"), "w") as f:
                f.write(f"{self.efd} {oom_fd}")
        for path in (opts.cg_memory, opts.cg_pids):
            if path is not None:
                _confine.umount(path)

    def enter(self, pid: int) -> None:
        """Move process ``pid`` (a new call) into the slot's cgroups."""
        for fd in self.procs:
            os.pwrite(fd, str(pid).encode(), 0)

    def set_limit(self, memory_mb: int) -> None:
        """Limit the call's memory (all processes, tmpfs, shared memory, kernel objects) to
        ``memory_mb``, and its TCP socket buffers (charged apart by cgroup v1) to as much."""
        new = memory_mb * 1024 * 1024
        if not self.fds or new == self.limit:
            return
        order = ["memory.limit_in_bytes"]
        if "memory.memsw.limit_in_bytes" in self.fds:  # memory+swap >= memory at every step
            grow = self.limit is not None and new > self.limit  # (unset: unlimited)
            memsw = "memory.memsw.limit_in_bytes"
            order = [memsw, *order] if grow else [*order, memsw]
        if TCP_LIMIT in self.fds:  # cgroup v1 accounts socket buffers apart, only once limited
            order.append(TCP_LIMIT)
        for name in order:
            os.pwrite(self.fds[name], str(new).encode(), 0)
        self.limit = new

    def oom_events(self) -> int:
        """OOM events in the call's memory cgroup since the last read."""
        if self.efd is None:
            return 0
        try:
            return os.eventfd_read(self.efd)
        except BlockingIOError:
            return 0


def _sweep(opts: Options, pgid: int) -> None:
    """Kill and reap every process the call left (the whole PID namespace but us), bounded.

    Raises:
        TimeoutError: processes are still there after ``SWEEP_TIMEOUT_S``.
    """
    end = time.monotonic() + SWEEP_TIMEOUT_S
    while time.monotonic() < end:
        alive = True
        try:
            if opts.in_pid_ns:
                os.kill(-1, signal.SIGKILL)
            else:
                os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            alive = False
        try:
            while os.waitpid(-1, os.WNOHANG)[0] > 0:
                pass
        except ChildProcessError:
            if not alive or not opts.in_pid_ns:
                return
        if not alive:
            return
        time.sleep(0.0005)
    raise TimeoutError(f"processes of the call still alive {SWEEP_TIMEOUT_S:g} s after SIGKILL")


def _kill_and_reap(opts: Options, pid: int) -> tuple[int, Any]:
    """SIGKILL the call's main process ``pid`` and its group (in a PID namespace: every process
    but us, so also a tracer outside the group) until ``pid`` is reaped; ``(status, rusage)``.

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
        got, status, rusage = os.wait4(pid, os.WNOHANG)
        if got:
            return status, rusage
        if time.monotonic() > end:
            raise TimeoutError(f"the call's process {pid} not reaped {SWEEP_TIMEOUT_S:g} s after SIGKILL")
        time.sleep(0.0005)


def _wait_ready(child: _Prefork) -> str | None:
    """Wait (bounded) for the child's ``R``; return why it is not ready, or None."""
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
    if first == b"R":
        return None
    rest = b""
    with contextlib.suppress(OSError):
        rest = os.read(child.ready_r, 8192)
    return "call set-up failed: " + (rest.decode(errors="replace") or "process died")


def _run_one(req: dict, child: _Prefork, cg: _Cgroups, opts: Options) -> dict:
    pid, out_r, err_r, pidfd = child.pid, child.out_r, child.err_r, child.pidfd
    t0 = time.perf_counter()
    not_ready = _wait_ready(child)
    if not_ready:
        return {"error": not_ready}
    if opts.namespaces:  # the worker then tears the call's mounts down after replying
        with contextlib.suppress(OSError):
            child.ns_fds.append(os.open(f"/proc/{pid}/ns/mnt", os.O_RDONLY))
    cg.set_limit(int(req["memory_mb"]))
    cg.oom_events()
    with contextlib.suppress(OSError):  # a child that died early: its status says why
        _send(child.ctl_w, req)
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
    sel.register(pidfd, selectors.EVENT_READ)
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
            if fd == pidfd:  # exited; never block on it (a traced zombie is its tracer's first)
                got, st, ru = os.wait4(pid, os.WNOHANG)
                sel.unregister(pidfd)
                if got:
                    status, rusage = st, ru
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
        status, rusage = _kill_and_reap(opts, pid)
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
    out, err = bytes(bufs[out_r]), bytes(bufs[err_r])
    if truncated:
        keep_out = min(len(out), limit)
        out, err = out[:keep_out], err[: max(0, limit - keep_out)]
    return {
        "stdout": out.decode("utf-8", errors="replace"),
        "stderr": err.decode("utf-8", errors="replace"),
        "exit_code": os.waitstatus_to_exitcode(status),
        "reason": reason,
        "truncated": truncated,
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
    [--tmp-bytes N] [--cgroup-memory DIR] [--cgroup-pids DIR] [--proc-scratch DIR]
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
        cg = _Cgroups(opts)
    except OSError as e:
        hello["setup_error"] = f"{type(e).__name__}: {e}"
        _send(out_fd, hello)
        return
    gc.collect()
    gc.freeze()  # collections in children then do not touch (and copy) the worker's objects
    hello["pid_ns_init_visible"] = os.getpid() <= 3
    _send(out_fd, hello)
    _serve(opts, in_fd, out_fd, cg, last_pid)


def _serve(opts: Options, in_fd: int, out_fd: int, cg: _Cgroups, last_pid: int | None) -> None:
    child = _Prefork(opts, cg)
    while True:
        try:
            req = _recv(in_fd)
        except EOFError:
            return
        try:
            reply = _run_one(req, child, cg, opts)
        except Exception:
            reply = {"error": traceback.format_exc()}
        if not opts.namespaces:
            _wipe(opts.tmp_root)
        if last_pid is not None and "error" not in reply:
            try:
                os.pwrite(last_pid, str(NS_LAST_PID).encode(), 0)
            except OSError as e:
                reply = {"error": f"cannot reset the PID counter: {e}"}
        _send(out_fd, reply)
        if "error" in reply:
            return  # a broken worker is replaced by the pool, never reused
        child.close()  # the finished call's mount namespace (and its tmpfs) dies here
        child = _Prefork(opts, cg)


if __name__ == "__main__":
    main()
