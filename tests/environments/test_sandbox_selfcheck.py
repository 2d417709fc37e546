"""The call's /tmp: the start-up self-check's rule (environments/sandbox/selfcheck.py) and where the
interpreter is bound when it lives under /tmp (environments/sandbox/launch.py)."""

import shutil
import tempfile
import venv
from pathlib import Path

from environments.sandbox import Sandbox, SandboxConfig
from environments.sandbox.selfcheck import ZERO_CAPS, check_probe

GOOD = {"net_interfaces": ["lo"], "uid": 1234, "caps": {k: ZERO_CAPS for k in "abcde"}, "nnp": "1",
        "seccomp": "2", "user_namespaces": "disabled", "cgroup": ""}
HELLO = {"pid_ns_init_visible": True}


def test_interpreter_bound_under_tmp_is_the_only_entry_allowed():
    bound = ("/usr/lib/python3", "/tmp/pytest-of-root/t0/venv")  # a virtualenv in a checkout under /tmp
    assert check_probe({**GOOD, "tmp_entries": []}, HELLO, "rlimit", bound) == []
    assert check_probe({**GOOD, "tmp_entries": ["pytest-of-root"]}, HELLO, "rlimit", bound) == []
    left = check_probe({**GOOD, "tmp_entries": ["pytest-of-root", "run-7"]}, HELLO, "rlimit", bound)
    assert left == ["the call's /tmp is not fresh: ['run-7']"]
    # without that bind the same entry is a leftover
    assert check_probe({**GOOD, "tmp_entries": ["pytest-of-root"]}, HELLO, "rlimit") == \
        ["the call's /tmp is not fresh: ['pytest-of-root']"]


def test_interpreter_dirs_under_tmp_are_bound_elsewhere_extra_paths_and_a_venv_base_stay(monkeypatch):
    from environments.sandbox import launch

    dirs = ("/opt/py", "/tmp/x/.venv", "/tmp/x/.venv/bin", "/tmp/base", "/usr")
    monkeypatch.setattr(launch, "_interpreter_dirs", lambda python: (dirs, ("/tmp/base",)))
    binds = launch.sandbox_binds(SandboxConfig(python="/tmp/x/.venv/bin/python", extra_ro_paths=("/tmp/d",)))
    assert binds == (("/tmp/x/.venv", "/opt/copc-python/tmp/x/.venv"),  # parents first, by path inside
                     ("/tmp/x/.venv/bin", "/opt/copc-python/tmp/x/.venv/bin"), ("/opt/py", "/opt/py"),
                     ("/tmp/base", "/tmp/base"), ("/tmp/d", "/tmp/d"), ("/usr", "/usr"))
    assert launch._in_sandbox("/tmp/x/.venv/bin/python", binds) == "/opt/copc-python/tmp/x/.venv/bin/python"
    inside = tuple(i for _, i in binds)
    assert check_probe({**GOOD, "tmp_entries": ["base", "d"]}, HELLO, "rlimit", inside) == []
    assert check_probe({**GOOD, "tmp_entries": ["x"]}, HELLO, "rlimit", inside) == \
        ["the call's /tmp is not fresh: ['x']"]


def test_a_virtualenv_under_tmp_leaves_the_calls_tmp_empty():
    """A clone under /tmp with its virtualenv there: the call's /tmp is still empty (the venv is
    bound at /opt/copc-python/<its path>, where its python finds its pyvenv.cfg)."""
    root = Path(tempfile.mkdtemp(prefix="copc-venv-", dir="/tmp")).resolve()
    try:
        venv.create(root / "venv", with_pip=False, symlinks=True)
        cfg = SandboxConfig(workers=1, timeout_s=10.0, python=str(root / "venv" / "bin" / "python"))
        with Sandbox(cfg) as sb:
            r = sb.run("import os, sys\nprint(os.listdir('/tmp'), sys.prefix, sys.prefix != sys.base_prefix)")
            again = sb.run("import os\nopen('/tmp/f', 'w').close()\nprint(os.listdir('/tmp'))")
            last = sb.run("import os\nprint(os.listdir('/tmp'))")
    finally:
        shutil.rmtree(root)
    assert (r.status, r.stdout) == ("ok", f"[] /opt/copc-python{root}/venv True\n"), r
    assert (again.stdout, last.stdout) == ("['f']\n", "[]\n")
