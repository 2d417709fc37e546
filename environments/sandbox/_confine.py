"""Kernel confinement primitives for the sandbox worker (stdlib + ctypes only; runs inside it).

* :func:`fresh_call_namespaces` — a new mount and IPC namespace for one call, with fresh
  size- and inode-limited tmpfs mounts on ``/tmp`` and ``/dev/shm`` (nothing a call writes,
  and no System V IPC object it creates, can outlive its processes);
* :func:`drop_privileges` — empty capability bounding set, then uid/gid change (which clears
  the permitted/effective sets), ``no_new_privs``;
* :func:`install_seccomp` — a seccomp filter that refuses every way of making a namespace
  (``unshare``, ``setns``, ``clone`` with a ``CLONE_NEW*`` flag, ``clone3``) and the kernel
  keyrings (kept per uid, so they would carry state from one call to the next).
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import platform
import socket
import struct

_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong,
                        ctypes.c_char_p]
_LIBC.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]

PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_CAPBSET_DROP = 24
PR_SET_SECCOMP = 22
PR_SET_CHILD_SUBREAPER = 36
PR_SET_NO_NEW_PRIVS = 38
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4
CLONE_NEWNS = 0x00020000
CLONE_NEWCGROUP = 0x02000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND = 1, 2, 4, 8, 32, 4096
MS_REC, MS_PRIVATE = 0x4000, 1 << 18
MNT_DETACH = 2
CAP_LAST_CAP_MAX = 63
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1


def _check(ret: int, what: str) -> int:
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return ret


def prctl(option: int, arg2: int = 0, arg3: int = 0) -> int:
    """``prctl(2)``; raises OSError on failure."""
    return _check(_LIBC.prctl(option, ctypes.c_ulong(arg2), ctypes.c_ulong(arg3), 0, 0),
                  f"prctl({option})")


def mount(source: str | None, target: str, fstype: str | None, flags: int,
          data: str | None = None) -> None:
    """``mount(2)``; raises OSError naming the target."""
    def enc(text: str | None) -> bytes | None:
        return None if text is None else text.encode()

    _check(_LIBC.mount(enc(source), target.encode(), enc(fstype), flags, enc(data)),
           f"mount {target}")


def umount(target: str) -> None:
    """Lazily detach ``target`` (``umount2(MNT_DETACH)``)."""
    _check(_LIBC.umount2(target.encode(), MNT_DETACH), f"umount {target}")


def loopback_up() -> None:
    """Bring ``lo`` of the calling process's (new, empty) network namespace up
    (``SIOCGIFFLAGS`` / ``SIOCSIFFLAGS``; needs ``CAP_NET_ADMIN``).

    Raises:
        OSError: an ioctl failed.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        req = struct.pack("16sH14s", b"lo", 0, b"")
        flags = struct.unpack("16sH14s", fcntl.ioctl(s.fileno(), SIOCGIFFLAGS, req))[1]
        fcntl.ioctl(s.fileno(), SIOCSIFFLAGS, struct.pack("16sH14s", b"lo", flags | IFF_UP, b""))


#: Host identifiers in the call's ``/proc``, covered by ``/dev/null`` (a program reads nothing).
HIDDEN_PROC_FILES = ("/proc/cmdline", "/proc/sys/kernel/random/boot_id")


def fresh_call_namespaces(tmp_bytes: int, inodes: int, keep: tuple[str, ...] = ()) -> None:
    """Move the calling process into a new mount + IPC + network + cgroup namespace with fresh
    tmpfs mounts and only a loopback interface (so no socket state, e.g. a TIME_WAIT connection
    or a bound port, outlives the call), and a ``/proc`` of its own that hides other uids'
    processes (``hidepid=2``, "invisible": the fork server's counters are not readable) and the
    host's boot id and kernel command line (:data:`HIDDEN_PROC_FILES`). The cgroup namespace is
    rooted at the call's slot cgroups (entered before), so ``/proc/self/cgroup`` shows ``/``,
    not the pool's cgroup names (which carry the pool's host pid).

    ``/tmp`` and ``/dev/shm`` become new, empty tmpfs instances of ``tmp_bytes`` bytes and
    ``inodes`` inodes each (mode 1777); the read-only binds in ``keep`` (interpreter prefixes
    under ``/tmp``) are bound again, read-only, inside the new ``/tmp``.
    Mount events do not propagate back to the worker. When the last
    process of the call exits, the namespaces and with them every file and IPC object die.

    Raises:
        OSError: a step failed (the caller reports a sandbox failure, not a program error).
    """
    _check(_LIBC.unshare(CLONE_NEWNS | CLONE_NEWIPC | CLONE_NEWNET | CLONE_NEWCGROUP),
           "unshare(NEWNS|NEWIPC|NEWNET|NEWCGROUP)")
    loopback_up()
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    opts = f"size={tmp_bytes},nr_inodes={inodes},mode=1777"
    kept = [(os.open(p, os.O_PATH), p) for p in keep]
    for target in ("/tmp", "/dev/shm"):
        mount("tmpfs", target, "tmpfs", MS_NOSUID | MS_NODEV, opts)
    # a proc instance of the call's own: other uids' processes (the fork server) are invisible,
    # so their counters (page faults, peak RSS) cannot carry what earlier calls did ("2" is
    # "invisible" on kernels >= 5.8 and understood by older ones too)
    mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, "hidepid=2")
    for path in HIDDEN_PROC_FILES:  # the host's identifiers: read as empty
        mount("/dev/null", path, None, MS_BIND)
    for fd, path in kept:
        os.makedirs(path, exist_ok=True)
        mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC)
        mount(None, path, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
        os.close(fd)


def drop_privileges(uid: int, gid: int) -> None:
    """Empty the bounding and ambient capability sets, become ``uid``/``gid`` with no
    supplementary groups (which clears the permitted and effective sets), empty the
    inheritable set, set ``no_new_privs``."""
    for cap in range(CAP_LAST_CAP_MAX + 1):
        try:
            prctl(PR_CAPBSET_DROP, cap)
        except OSError as e:
            if e.errno != 22:  # EINVAL: past the kernel's last capability
                raise
            break
    prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL)
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this thread
    data = (ctypes.c_uint32 * 6)()  # effective, permitted, inheritable (x2): all empty
    _check(_LIBC.capset(header, data), "capset")
    prctl(PR_SET_NO_NEW_PRIVS, 1)


# -- seccomp ---------------------------------------------------------------------------------------
_ARCHES = {  # machine -> (AUDIT_ARCH, syscall numbers)
    "x86_64": (0xC000003E, {"clone": 56, "clone3": 435, "unshare": 272, "setns": 308,
                            "add_key": 248, "request_key": 249, "keyctl": 250, "ptrace": 101,
                            "process_vm_readv": 310, "process_vm_writev": 311,
                            "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
                            "userfaultfd": 323, "personality": 135, "perf_event_open": 298,
                            "bpf": 321, "modify_ldt": 154}),
    "aarch64": (0xC00000B7, {"clone": 220, "clone3": 435, "unshare": 97, "setns": 268,
                             "add_key": 217, "request_key": 218, "keyctl": 219, "ptrace": 117,
                             "process_vm_readv": 270, "process_vm_writev": 271,
                             "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
                             "userfaultfd": 282, "personality": 92, "perf_event_open": 241,
                             "bpf": 280}),
}
#: Refused with EPERM whatever their arguments.
_REFUSED = ("unshare", "setns", "add_key", "request_key", "keyctl", "ptrace", "process_vm_readv",
            "process_vm_writev", "io_uring_setup", "io_uring_enter", "io_uring_register",
            "userfaultfd", "perf_event_open", "bpf", "modify_ldt")
_PERSONALITY_QUERY = 0xFFFFFFFF
_RET_ALLOW, _RET_KILL = 0x7FFF0000, 0x80000000
_EPERM, _ENOSYS = 0x00050000 | 1, 0x00050000 | 38
_LD_ABS, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06
_NS_FLAGS = (CLONE_NEWNS | CLONE_NEWCGROUP | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWUSER
             | CLONE_NEWPID | CLONE_NEWNET)


def seccomp_program(machine: str | None = None) -> bytes:
    """The filter as packed ``struct sock_filter`` instructions for ``machine``.

    Refused with EPERM: ``unshare``, ``setns``, ``clone`` with any ``CLONE_NEW*`` flag,
    ``add_key``, ``request_key``, ``keyctl``, ``ptrace`` / ``process_vm_readv`` /
    ``process_vm_writev`` (a program that traces its own main process keeps that process's
    zombie from the worker, which reaps it), ``io_uring_setup`` / ``io_uring_enter`` /
    ``io_uring_register``, ``userfaultfd``, ``perf_event_open``, ``bpf`` and (x86) ``modify_ldt``
    (large kernel attack surfaces no program here needs; perf and bpf are otherwise only as closed
    as the host's ``perf_event_paranoid`` / ``unprivileged_bpf_disabled`` sysctls), and
    ``personality`` except the query ``personality(0xffffffff)``; with ENOSYS:
    ``clone3`` (its flags live in memory a filter cannot read; libc falls back to ``clone``) and
    x32 system calls; a system call of another architecture (e.g. ``int 0x80``) kills the process.

    Raises:
        OSError: no syscall table for this machine.
    """
    machine = machine or platform.machine()
    if machine not in _ARCHES:
        raise OSError(95, f"no seccomp syscall table for machine {machine!r}")
    arch, nr = _ARCHES[machine]
    prog = [(_LD_ABS, 0, 0, 4), (_JEQ, 1, 0, arch), (_RET, 0, 0, _RET_KILL), (_LD_ABS, 0, 0, 0)]
    if machine == "x86_64":
        prog += [(_JGE, 0, 1, 0x40000000), (_RET, 0, 0, _ENOSYS)]
    prog += [(_JEQ, 0, 1, nr["clone3"]), (_RET, 0, 0, _ENOSYS)]
    for name in _REFUSED:
        if name in nr:  # modify_ldt exists on x86 only
            prog += [(_JEQ, 0, 1, nr[name]), (_RET, 0, 0, _EPERM)]
    # personality: only the query (0xffffffff, the low 32 bits of the first argument) is allowed
    prog += [(_JEQ, 0, 4, nr["personality"]), (_LD_ABS, 0, 0, 16), (_JEQ, 1, 0, _PERSONALITY_QUERY),
             (_RET, 0, 0, _EPERM), (_RET, 0, 0, _RET_ALLOW)]
    prog += [(_JEQ, 0, 3, nr["clone"]), (_LD_ABS, 0, 0, 16), (_JSET, 0, 1, _NS_FLAGS),
             (_RET, 0, 0, _EPERM), (_RET, 0, 0, _RET_ALLOW)]
    return b"".join(struct.pack("=HBBI", *ins) for ins in prog)


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def install_seccomp() -> None:
    """Install :func:`seccomp_program` on the calling thread (needs ``no_new_privs`` first).

    Raises:
        OSError: unknown machine or the kernel refused the filter.
    """
    code = seccomp_program()
    buf = ctypes.create_string_buffer(code, len(code))
    fprog = _SockFprog(len(code) // 8, ctypes.cast(buf, ctypes.c_void_p))
    _check(_LIBC.prctl(PR_SET_SECCOMP, ctypes.c_ulong(2), ctypes.byref(fprog), 0, 0),
           "prctl(PR_SET_SECCOMP)")
