"""The start-up self-check: a probe program run as an ordinary call, and what it must find."""

from __future__ import annotations

ZERO_CAPS = "0000000000000000"

#: Runs in every new worker through the normal call path; prints one JSON object (at most 16 /tmp
#: entries: a fresh /tmp has none or the bound ones, and with isolation="process" /tmp is the host's,
#: whose 2,000 entries made the line exceed max_output_bytes and the self-check fail).
PROBE = r"""
import ctypes, json, os
libc = ctypes.CDLL(None, use_errno=True)
st = dict(line.split(':', 1) for line in open('/proc/self/status'))
caps = {k: st[k].strip() for k in ('CapInh', 'CapPrm', 'CapEff', 'CapBnd', 'CapAmb')}
userns = 'disabled' if libc.unshare(0x10000000) != 0 else 'ENABLED'
try:
    ifaces = [ln.split(':')[0].strip() for ln in open('/proc/net/dev').readlines()[2:]]
except OSError:
    ifaces = ['unknown']
print(json.dumps({'uid': os.getuid(), 'caps': caps, 'nnp': st['NoNewPrivs'].strip(),
                  'seccomp': st['Seccomp'].strip(), 'user_namespaces': userns,
                  'net_interfaces': ifaces, 'cgroup': open('/proc/self/cgroup').read(),
                  'tmp_entries': sorted(os.listdir('/tmp'))[:16]}))
"""


def check_probe(probe: dict, hello: dict, memory_mode: str, bound: tuple[str, ...] = ()) -> list[str]:
    """What the probe of a ``bwrap`` worker found weaker than documented (empty: all holds).

    Args:
        bound: read-only paths bound into every call, as seen in the sandbox
            (:func:`~environments.sandbox.launch.sandbox_binds`); those still under ``/tmp`` (an
            ``extra_ro_paths`` entry there; not the interpreter, which is bound elsewhere) are bound
            again into each call's fresh ``/tmp``, so their first component is the one entry allowed.
    """
    problems = []
    allowed = {p.split("/")[2] for p in bound if p.startswith("/tmp/")}
    if probe.get("net_interfaces") != ["lo"]:
        problems.append(f"network not isolated (interfaces {probe.get('net_interfaces')})")
    if not probe.get("uid"):
        problems.append(f"code would run as uid {probe.get('uid')!r} (root)")
    caps = probe.get("caps", {})
    if any(v != ZERO_CAPS for v in caps.values()) or len(caps) != 5:
        problems.append(f"code keeps capabilities {caps}")
    if probe.get("nnp") != "1":
        problems.append("no_new_privs not set")
    if probe.get("seccomp") != "2" or probe.get("user_namespaces") != "disabled":
        problems.append(f"user namespaces not disabled (seccomp mode {probe.get('seccomp')!r}, "
                        f"unshare(CLONE_NEWUSER) {probe.get('user_namespaces')})")
    extra = sorted(set(probe.get("tmp_entries") or ()) - allowed)
    if extra:
        problems.append(f"the call's /tmp is not fresh: {extra}")
    if not hello.get("pid_ns_init_visible"):
        problems.append(f"no own PID namespace (worker pid {hello.get('pid')})")
    if memory_mode == "cgroup-v1":  # the fork server checks each call is in its slot's cgroups;
        lines = probe.get("cgroup", "").splitlines()  # the call's own cgroup namespace hides them
        for ctl in ("memory", "pids"):
            if not any(ctl in ln.split(":")[1].split(",") and ln.split(":", 2)[2] == "/" for ln in lines):
                problems.append(f"the call's {ctl} cgroup is not the root of its cgroup namespace "
                                f"(host cgroup names visible): {lines}")
    return problems
