"""Command lines that start one sandboxed fork-server worker (bwrap or plain process)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from .config import SandboxConfig, SandboxUnavailableError

WORKER_SRC = Path(__file__).with_name("_worker.py")
#: The worker's own modules (stdlib only), bound read-only side by side into the sandbox's
#: :data:`WORKER_DIR_IN_SANDBOX`, where ``_worker.py`` imports the others as top-level modules.
WORKER_MODULES = ("_worker.py", "_wire.py", "_call.py", "_cgroups.py", "_confine.py", "_zygote.py")
WORKER_DIR_IN_SANDBOX = "/opt/copc-sandbox"
WORKER_IN_SANDBOX = f"{WORKER_DIR_IN_SANDBOX}/_worker.py"
#: Where an interpreter directory that lives under /tmp on the host is bound in the sandbox (this
#: folder + its host path), so that the calls' /tmp stays empty wherever the virtualenv lives.
PREFIX_IN_SANDBOX = "/opt/copc-python"
BWRAP_HINT = (
    "install bubblewrap ('apt-get install bubblewrap' on Debian/Ubuntu, or run "
    "scripts/setup.sh as root), or set SandboxConfig(isolation='process') to accept weaker "
    "isolation (rlimits + network namespace only)"
)


@dataclass(frozen=True)
class LaunchSpec:
    """How to start one worker: argv, host environment, and the /tmp root the code sees."""

    argv: list[str]
    env: dict[str, str]
    tmp_root: str
    host_tmp: str | None  # host directory to delete when the worker is gone (process mode)


@lru_cache(maxsize=8)
def _interpreter_dirs(python: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The directories an interpreter needs (``sys.prefix``, ``sys.base_prefix``, ..., its
    ``bin``), and those of the base installation when it is a virtualenv's; real paths.

    Raises:
        SandboxUnavailableError: the interpreter cannot be run.
    """
    try:
        out = subprocess.run(
            [python, "-I", "-c", "import sys,json;print(json.dumps([sys.prefix,sys.base_prefix,"
             "sys.exec_prefix,sys.base_exec_prefix]))"],
            capture_output=True, text=True, timeout=30, check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise SandboxUnavailableError(f"SandboxConfig.python={python!r} cannot run: {e}") from e
    prefix, base, exec_prefix, base_exec = (os.path.realpath(p) for p in json.loads(out))
    real = {prefix, base, exec_prefix, base_exec, os.path.realpath(os.path.dirname(python))}
    venv_base = {base, base_exec} - {prefix, exec_prefix}
    return tuple(sorted(real)), tuple(sorted(venv_base))


def sandbox_binds(cfg: SandboxConfig) -> tuple[tuple[str, str], ...]:
    """The read-only binds of a ``bwrap`` worker besides the system's: ``(host path, path in the
    sandbox)`` for the interpreter's directories and ``cfg.extra_ro_paths``, parents first.

    An interpreter directory under ``/tmp`` (a virtualenv in a checkout under ``/tmp``) is bound at
    :data:`PREFIX_IN_SANDBOX` + its host path, not at its own path: the calls' fresh ``/tmp`` would
    otherwise list its first folder (a virtualenv finds itself from where its ``bin/python`` is
    run). Kept at their own paths, and so visible in a call's ``/tmp``: ``extra_ro_paths`` (bound
    "at the same place" as documented) and the base installation of a virtualenv when that lies
    under ``/tmp`` (the virtualenv's ``pyvenv.cfg`` names it by its host path).

    Raises:
        SandboxUnavailableError: the interpreter cannot be run.
    """
    dirs, venv_base = _interpreter_dirs(cfg.python)
    binds = {(p, PREFIX_IN_SANDBOX + p if p.startswith("/tmp/") and p not in venv_base else p)
             for p in dirs}
    binds |= {(p, p) for p in cfg.extra_ro_paths}
    return tuple(sorted(((h, i) for h, i in binds if not h.startswith("/usr/")), key=lambda b: b[1]))


def _in_sandbox(path: str, binds: tuple[tuple[str, str], ...]) -> str:
    """Where host ``path`` is seen in the sandbox under ``binds`` (the deepest bind holding it)."""
    for host, inside in sorted(binds, key=lambda b: -len(b[0])):
        if path == host or path.startswith(host + "/"):
            return inside + path[len(host):]
    return path


def sandbox_python(python: str) -> str:
    """``python`` with its directory's symlinks resolved (the name itself kept, so a virtualenv's
    ``bin/python`` link still finds its ``pyvenv.cfg``): only real directories are bound into the
    sandbox, so a path through a symlinked directory would not exist there."""
    return os.path.join(os.path.realpath(os.path.dirname(python)), os.path.basename(python))


def _ancestors(path: str) -> list[str]:
    parts = Path(path).parts[1:-1]
    return ["/" + "/".join(parts[: i + 1]) for i in range(len(parts))]


def bwrap_argv(cfg: SandboxConfig, slot: int, uid: int | None = None,
               cgroups: dict[str, str] | None = None) -> LaunchSpec:
    """Build the ``bwrap`` command for worker ``slot``.

    Enforced per worker: new PID/network/IPC/UTS (and cgroup, where possible) namespaces; a
    root made of read-only binds of /usr and the interpreter's prefixes only; a scrubbed
    environment; ``--die-with-parent``; ``--new-session``. Per call (``_worker.py``): a fresh
    mount + IPC namespace with fresh tmpfs ``/tmp`` and ``/dev/shm``, the slot's cgroups,
    no capabilities, uid ``uid``, ``no_new_privs`` and a seccomp filter (no namespaces, no
    keyrings). As root, bwrap keeps SETUID/SETGID/KILL/SYS_ADMIN/SETPCAP for the fork server
    only (it needs them to make the per-call namespaces and to drop the call's privileges); as
    a normal user, a user namespace maps the code to uid 65534 (not exercised here).

    Args:
        uid: the uid the code runs as (root host; default ``uid_base + slot``).
        cgroups: ``{"memory": dir, "pids": dir[, "cpu": dir]}`` host cgroup directories of this
            slot.

    Raises:
        SandboxUnavailableError: ``bwrap`` is not installed.
    """
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise SandboxUnavailableError(f"isolation='bwrap' needs the 'bwrap' binary: {BWRAP_HINT}")
    # --as-pid-1: the worker's start-up process (the zygote every call is forked from) is the
    # namespace's init, so the fork server's kill(-1) sweep never reaches it
    argv = [bwrap, "--unshare-pid", "--as-pid-1", "--unshare-net", "--unshare-ipc", "--unshare-uts",
            "--unshare-cgroup-try", "--die-with-parent", "--new-session",
            "--hostname", "sandbox"]
    worker_args = ["--pid-ns", "--namespaces", "--tmp-bytes", str(cfg.tmp_size_mb << 20),
                   "--proc-scratch", "/run/copc-proc"]
    caps = ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID", "--cap-add", "CAP_KILL",
            "--cap-add", "CAP_SYS_ADMIN", "--cap-add", "CAP_SETPCAP",
            "--cap-add", "CAP_NET_ADMIN"]  # lo up in each call's own network namespace
    if os.geteuid() == 0:
        uid = cfg.uid_base + slot if uid is None else uid
        argv += ["--cap-drop", "ALL", *caps]
        worker_args += ["--drop-uid", str(uid), str(uid)]
    else:
        argv += ["--unshare-user", "--uid", "0", "--gid", "0", "--cap-drop", "ALL", *caps]
        worker_args += ["--drop-uid", "65534", "65534"]
    argv += ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib64", "/lib32"):
        if os.path.islink(top):
            argv += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            argv += ["--ro-bind", top, top]
    for f in ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/localtime", "/etc/nsswitch.conf"):
        argv += ["--ro-bind-try", f, f]
    # The worker's /tmp first: a bind under /tmp (an extra_ro_path there) is then bound on top of
    # it, and bound again in each call's /tmp; interpreter directories under /tmp are moved out.
    argv += ["--proc", "/proc", "--dev", "/dev", "--size", str(1 << 20), "--perms", "0755",
             "--tmpfs", "/tmp", "--dir", "/run/copc-proc"]
    made: set[str] = {"/", "/usr", "/etc", "/tmp", "/proc", "/dev"}
    binds = sandbox_binds(cfg)
    for host, path in binds:
        for anc in _ancestors(path):
            if anc not in made:
                argv += ["--perms", "0755", "--dir", anc]
                made.add(anc)
        argv += ["--ro-bind", host, path]
        made.add(path)
    keep = sorted({path for _, path in binds if path.startswith("/tmp/")})
    if keep:
        worker_args += ["--keep", ",".join(keep)]
    for ctl, path in sorted((cgroups or {}).items()):
        argv += ["--bind", path, f"/run/copc-cgroup/{ctl}"]
        worker_args += [f"--cgroup-{ctl}", f"/run/copc-cgroup/{ctl}"]
    for module in WORKER_MODULES:
        argv += ["--ro-bind", str(WORKER_SRC.with_name(module)), f"{WORKER_DIR_IN_SANDBOX}/{module}"]
    argv += ["--chdir", "/tmp", "--clearenv"]
    for k, v in cfg.env.items():
        argv += ["--setenv", k, v]
    argv += [_in_sandbox(sandbox_python(cfg.python), binds), "-I", "-B", WORKER_IN_SANDBOX, *worker_args]
    if cfg.preload_modules:
        argv += ["--preload", ",".join(cfg.preload_modules)]
    return LaunchSpec(argv=argv, env={"PATH": "/usr/bin:/bin"}, tmp_root="/tmp", host_tmp=None)


@lru_cache(maxsize=1)
def _unshare_net_prefix() -> tuple[str, ...]:
    unshare = shutil.which("unshare")
    if unshare is None:
        return ()
    for prefix in ([unshare, "--net"], [unshare, "--map-root-user", "--net"]):
        try:
            if subprocess.run([*prefix, "true"], capture_output=True, timeout=10).returncode == 0:
                return tuple(prefix)
        except (OSError, subprocess.SubprocessError):
            continue
    return ()


def process_argv(cfg: SandboxConfig, slot: int, uid: int | None = None,
                 cgroups: dict[str, str] | None = None) -> LaunchSpec:
    """Build the weaker ``process`` isolation command: rlimits, a scrubbed environment, a
    private temp dir and a network namespace where ``unshare`` is permitted. No read-only file
    system view, no PID namespace and no uid change (as root, RLIMIT_NPROC is then ignored, so
    fork bombs are only stopped by the wall-clock timeout)."""
    host_tmp = tempfile.mkdtemp(prefix="copc-sandbox-")
    os.chmod(host_tmp, 0o1777)
    del slot, uid, cgroups  # every process worker runs as the caller's uid, no cgroups
    argv = [*_unshare_net_prefix(), cfg.python, "-I", "-B", str(WORKER_SRC),
            "--tmp-root", host_tmp]
    if cfg.preload_modules:
        argv += ["--preload", ",".join(cfg.preload_modules)]
    return LaunchSpec(argv=argv, env=dict(cfg.env), tmp_root=host_tmp, host_tmp=host_tmp)
