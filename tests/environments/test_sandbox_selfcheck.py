"""The start-up self-check's rule for the call's /tmp (environments/sandbox/selfcheck.py)."""

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
