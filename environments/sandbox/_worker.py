"""Fork-server worker that runs *inside* the sandbox (stdlib only, started by ``pool.py``).

Protocol on the inherited pipes (fd 0 = requests in, fd 1 = replies out): every message is
a 4-byte big-endian length followed by that many bytes of UTF-8 JSON.

Start-up: the worker optionally drops privileges (``--drop-uid``), preloads modules, then
writes a ``hello`` message describing what it verified about its own confinement (uid,
effective capabilities, network interfaces). Then, per request ``{"code", "timeout_s",
"memory_mb", ...}`` it forks one child which becomes the untrusted program: its own session
and process group, an unprivileged uid, ``no_new_privs``, rlimits (CPU seconds, address space
bytes, file size bytes, processes), stdin = /dev/null, stdout/stderr = pipes, cwd = a fresh
private directory under /tmp. The worker enforces the wall-clock deadline, kills every process
left in the PID namespace afterwards and replies with stdout, stderr, exit status, timing and
a kill reason.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import json
import os
import resource
import selectors
import shutil
import signal
import struct
import sys
import time
import traceback

PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_SET_NO_NEW_PRIVS = 38
_LIBC = ctypes.CDLL(None, use_errno=True)
_HEADER = struct.Struct(">I")


def _prctl(option: int, arg: int) -> None:
    if _LIBC.prctl(option, arg, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl({option}) failed: {os.strerror(err)}")


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


def _drop(uid: int, gid: int) -> None:
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)


def _cap_eff() -> str:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("CapEff:"):
                return line.split()[1]
    return "unknown"


def _net_interfaces() -> list[str]:
    try:
        with open("/proc/net/dev") as f:
            return [ln.split(":")[0].strip() for ln in f.readlines()[2:]]
    except OSError:
        return ["unknown"]


def _child(ctl_r: int, out_w: int, err_w: int, drop: tuple[int, int] | None,
           tmp_root: str) -> None:
    """Pre-forked untrusted-program process: confine itself, wait for the request, run it.

    Never returns. Everything that does not depend on the request (session, uid drop,
    no_new_privs, fds, private cwd) happens before the request arrives, off the latency path.
    """
    code = 1
    workdir = None
    try:
        os.setsid()
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if drop is not None:
            _drop(*drop)
        _prctl(PR_SET_NO_NEW_PRIVS, 1)
        devnull = os.open("/dev/null", os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        ctl = os.dup2(ctl_r, 3)
        os.closerange(4, 65536)
        workdir = f"{tmp_root}/run-{os.getpid()}"
        os.mkdir(workdir, 0o700)
        os.chdir(workdir)
        sys.stdin = open(0, closefd=False)  # noqa: SIM115
        sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115
        try:
            req = _recv(ctl)
        except EOFError:  # the worker is recycling us without a request
            os._exit(0)
        os.close(ctl)
        limits = [
            (resource.RLIMIT_AS, int(req["memory_mb"]) * 1024 * 1024),
            (resource.RLIMIT_CPU, int(req["cpu_s"])),
            (resource.RLIMIT_FSIZE, int(req["max_file_bytes"])),
            (resource.RLIMIT_NPROC, int(req["max_processes"])),
            (resource.RLIMIT_CORE, 0),
            (resource.RLIMIT_NOFILE, 256),
        ]
        for which, value in limits:
            hard = value + 1 if which == resource.RLIMIT_CPU else value
            resource.setrlimit(which, (value, hard))
        os.environ.clear()
        os.environ.update(req.get("env", {}))
        os.environ.update({"HOME": workdir, "TMPDIR": workdir, "PWD": workdir})
        sys.argv = ["<code>"]
        sys.path[:0] = [workdir]
        namespace = {"__name__": "__main__", "__builtins__": __builtins__}
        code = 0
        try:
            compiled = compile(req["code"], "<code>", "exec")
            exec(compiled, namespace)
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
        os.chdir("/")
        try:
            os.rmdir(workdir)
        except OSError:
            shutil.rmtree(workdir, ignore_errors=True)
    except BaseException:
        with contextlib.suppress(BaseException):
            os.write(2, traceback.format_exc().encode(errors="replace"))
    os._exit(code)


class _Prefork:
    """A forked, confined child waiting for its request (see :func:`_child`)."""

    def __init__(self, drop: tuple[int, int] | None, tmp_root: str) -> None:
        ctl_r, self.ctl_w = os.pipe()
        self.out_r, out_w = os.pipe()
        self.err_r, err_w = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:
            os.close(self.ctl_w)
            os.close(self.out_r)
            os.close(self.err_r)
            _child(ctl_r, out_w, err_w, drop, tmp_root)
        for fd in (ctl_r, out_w, err_w):
            os.close(fd)
        self.pidfd = os.pidfd_open(self.pid)


def _sweep(can_kill_all: bool, pgid: int) -> None:
    """Kill what the call left behind: the whole PID namespace except us, or its group."""
    for _ in range(50):
        try:
            if can_kill_all:
                os.kill(-1, signal.SIGKILL)
            else:
                os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            return
        try:
            while os.waitpid(-1, os.WNOHANG)[0] > 0:
                pass
        except ChildProcessError:
            pass
        time.sleep(0.001)


def _clean_tmp(drop: tuple[int, int] | None, tmp_root: str) -> None:
    if not os.listdir(tmp_root):
        return
    if drop is None:
        for name in os.listdir(tmp_root):
            p = os.path.join(tmp_root, name)
            shutil.rmtree(p, ignore_errors=True)
            if os.path.lexists(p):
                os.unlink(p)
        return
    pid = os.fork()
    if pid == 0:  # files belong to the unprivileged uid: remove them as that uid
        try:
            _drop(*drop)
            for name in os.listdir(tmp_root):
                p = os.path.join(tmp_root, name)
                if os.path.isdir(p) and not os.path.islink(p):
                    for root, dirs, _files in os.walk(p):
                        for d in dirs:
                            os.chmod(os.path.join(root, d), 0o700)
                    shutil.rmtree(p, ignore_errors=True)
                else:
                    os.unlink(p)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)


def _run_one(req: dict, child: _Prefork, in_pid_ns: bool) -> dict:
    pid, out_r, err_r, pidfd = child.pid, child.out_r, child.err_r, child.pidfd
    t0 = time.perf_counter()
    with contextlib.suppress(OSError):  # a child that died early: its status says why
        _send(child.ctl_w, req)
    os.close(child.ctl_w)
    limit = int(req["max_output_bytes"])
    deadline = t0 + float(req["timeout_s"])
    bufs = {out_r: bytearray(), err_r: bytearray()}
    sel = selectors.DefaultSelector()
    for fd in bufs:
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ)
    sel.register(pidfd, selectors.EVENT_READ)
    status = None
    rusage = None
    reason = None
    truncated = False
    open_fds = set(bufs)
    while True:
        if status is None:
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                reason = "timeout"
                break
        else:
            remaining = 0.05  # child gone: drain what is left, then sweep
            if not open_fds:
                break
        events = sel.select(remaining)
        if status is not None and not events:
            break
        for key, _ in events:
            fd = key.fd
            if fd == pidfd:
                _, status, rusage = os.wait4(pid, 0)
                sel.unregister(pidfd)
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
        if reason == "output_limit":
            break
    if status is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
        _, status, rusage = os.wait4(pid, 0)
    duration = time.perf_counter() - t0
    _sweep(in_pid_ns, pid)
    sel.close()
    for fd in (out_r, err_r, pidfd):
        os.close(fd)
    out, err = bytes(bufs[out_r]), bytes(bufs[err_r])
    if truncated:
        keep_out = min(len(out), limit)
        out, err = out[:keep_out], err[: max(0, limit - keep_out)]
    exit_code = os.waitstatus_to_exitcode(status)
    return {
        "stdout": out.decode("utf-8", errors="replace"),
        "stderr": err.decode("utf-8", errors="replace"),
        "exit_code": exit_code,
        "reason": reason,
        "truncated": truncated,
        "duration_s": duration,
        "cpu_s": (rusage.ru_utime + rusage.ru_stime) if rusage else 0.0,
        "max_rss_kb": rusage.ru_maxrss if rusage else 0,
    }


def main() -> None:
    """Entry point: ``python -I _worker.py [--drop-uid UID GID] [--pid-ns] [--preload a,b]``."""
    args = sys.argv[1:]
    drop = None
    in_pid_ns = "--pid-ns" in args
    if "--drop-uid" in args:
        i = args.index("--drop-uid")
        drop = (int(args[i + 1]), int(args[i + 2]))
    preload = []
    if "--preload" in args:
        preload = [m for m in args[args.index("--preload") + 1].split(",") if m]
    in_fd = os.dup(0)
    out_fd = os.dup(1)
    devnull = os.open("/dev/null", os.O_RDWR)
    for fd in (0, 1):
        os.dup2(devnull, fd)
    os.set_inheritable(in_fd, False)
    os.set_inheritable(out_fd, False)
    _prctl(PR_SET_DUMPABLE, 0)
    hello: dict = {"hello": True, "pid": os.getpid(), "uid": os.getuid()}
    for mod in preload:
        try:
            __import__(mod)
        except Exception as e:
            hello.setdefault("preload_errors", []).append(f"{mod}: {e!r}")
    # warm the paths every call uses (compiler, exec, traceback) so forked children inherit them
    exec(compile("x = [i * 2 for i in range(3)]\nstr(x)", "<warm-up>", "exec"), {})
    traceback.format_exception(ValueError, ValueError("warm-up"), None)
    gc.collect()
    gc.freeze()  # collections in children then do not touch (and copy) the worker's objects
    if drop is not None:  # check the drop really works and leaves no capabilities behind
        pid = os.fork()
        if pid == 0:
            try:
                _drop(*drop)
                ok = os.getuid() == drop[0] and _cap_eff() == "0000000000000000"
            except BaseException:
                ok = False
            os._exit(0 if ok else 1)
        _, st = os.waitpid(pid, 0)
        hello["child_uid"] = drop[0] if st == 0 else None
    else:
        hello["child_uid"] = os.getuid()
    hello["child_cap_eff"] = "0000000000000000" if drop is not None else _cap_eff()
    hello["net_interfaces"] = _net_interfaces()
    hello["pid_ns_init_visible"] = os.getpid() <= 3
    _send(out_fd, hello)
    tmp_root = "/tmp"
    if "--tmp-root" in args:
        tmp_root = args[args.index("--tmp-root") + 1]
    child = _Prefork(drop, tmp_root)
    while True:
        try:
            req = _recv(in_fd)
        except EOFError:
            return
        try:
            reply = _run_one(req, child, in_pid_ns)
        except Exception:
            reply = {"error": traceback.format_exc()}
        _send(out_fd, reply)
        _clean_tmp(drop, tmp_root)
        child = _Prefork(drop, tmp_root)


if __name__ == "__main__":
    main()
