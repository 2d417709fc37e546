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
WORKER_IN_SANDBOX = "/opt/copc-sandbox/worker.py"
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
def python_prefixes(python: str) -> tuple[str, ...]:
    """Return the directories an interpreter needs (``sys.prefix``, ``sys.base_prefix``, ...).

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
    real = {os.path.realpath(p) for p in json.loads(out)}
    real.add(os.path.realpath(os.path.dirname(python)))
    return tuple(sorted(real))


def _ancestors(path: str) -> list[str]:
    parts = Path(path).parts[1:-1]
    return ["/" + "/".join(parts[: i + 1]) for i in range(len(parts))]


def bwrap_argv(cfg: SandboxConfig, slot: int) -> LaunchSpec:
    """Build the ``bwrap`` command for worker ``slot``.

    Enforced: new PID/network/IPC/UTS (and cgroup, where possible) namespaces; a root made of
    read-only binds of /usr and the interpreter's prefixes only; a private size-limited tmpfs
    /tmp; a scrubbed environment; ``--die-with-parent``; ``--new-session``. As root, all
    capabilities are dropped except SETUID/SETGID/KILL in the fork server, which runs code
    as ``uid_base + slot`` (no capabilities, ``no_new_privs``); as a normal user, a user
    namespace maps the code to uid 65534.

    Raises:
        SandboxUnavailableError: ``bwrap`` is not installed.
    """
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise SandboxUnavailableError(f"isolation='bwrap' needs the 'bwrap' binary: {BWRAP_HINT}")
    argv = [bwrap, "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
            "--unshare-cgroup-try", "--die-with-parent", "--new-session",
            "--hostname", "sandbox"]
    worker_args = ["--pid-ns"]
    if os.geteuid() == 0:
        uid = cfg.uid_base + slot
        argv += ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID",
                 "--cap-add", "CAP_KILL"]
        worker_args += ["--drop-uid", str(uid), str(uid)]
    else:
        argv += ["--unshare-user", "--uid", "65534", "--gid", "65534", "--cap-drop", "ALL"]
    argv += ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib64", "/lib32"):
        if os.path.islink(top):
            argv += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            argv += ["--ro-bind", top, top]
    for f in ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/localtime", "/etc/nsswitch.conf"):
        argv += ["--ro-bind-try", f, f]
    # The private /tmp first: an interpreter prefix under /tmp (e.g. a virtualenv in a
    # checkout under /tmp) is then bound on top of it instead of being hidden by it.
    argv += ["--proc", "/proc", "--dev", "/dev",
             "--size", str(cfg.tmp_size_mb * 1024 * 1024), "--perms", "1777", "--tmpfs", "/tmp"]
    made: set[str] = {"/", "/usr", "/etc", "/tmp", "/proc", "/dev"}
    binds = [p for p in (*python_prefixes(cfg.python), *cfg.extra_ro_paths)
             if not p.startswith("/usr/")]
    for path in sorted(set(binds)):
        for anc in _ancestors(path):
            if anc not in made:
                argv += ["--perms", "0755", "--dir", anc]
                made.add(anc)
        argv += ["--ro-bind", path, path]
        made.add(path)
    argv += ["--ro-bind", str(WORKER_SRC), WORKER_IN_SANDBOX, "--chdir", "/tmp", "--clearenv"]
    for k, v in cfg.env.items():
        argv += ["--setenv", k, v]
    argv += [cfg.python, "-I", "-B", WORKER_IN_SANDBOX, *worker_args]
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


def process_argv(cfg: SandboxConfig, slot: int) -> LaunchSpec:
    """Build the weaker ``process`` isolation command: rlimits, a scrubbed environment, a
    private temp dir and a network namespace where ``unshare`` is permitted. No read-only file
    system view, no PID namespace and no uid change (as root, RLIMIT_NPROC is then ignored, so
    fork bombs are only stopped by the wall-clock timeout)."""
    host_tmp = tempfile.mkdtemp(prefix="copc-sandbox-")
    os.chmod(host_tmp, 0o1777)
    del slot  # every process worker runs as the caller's uid
    argv = [*_unshare_net_prefix(), cfg.python, "-I", "-B", str(WORKER_SRC),
            "--tmp-root", host_tmp]
    if cfg.preload_modules:
        argv += ["--preload", ",".join(cfg.preload_modules)]
    return LaunchSpec(argv=argv, env=dict(cfg.env), tmp_root=host_tmp, host_tmp=host_tmp)
