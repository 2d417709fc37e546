#!/usr/bin/env bash
# Create (or reuse) ./.venv and install COPC with every CPU extra.
# Idempotent: re-running with unchanged pyproject.toml / constraints is a no-op (~1 s).
# torch is pinned to the CPU build through constraints/cpu.txt (no multi-GB CUDA download).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
EXTRAS=${COPC_EXTRAS:-envs,search,train,ray,openenv,mcp,megatron,dev}

if [ ! -x .venv/bin/python ]; then
    echo "[setup] creating .venv with $($PY --version)"
    "$PY" -m venv .venv
fi

stamp=.venv/.copc-setup-stamp
want=$(cat pyproject.toml constraints/cpu.txt scripts/setup.sh | sha256sum | cut -c1-16)-$EXTRAS
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    exit 0
fi

# OS-level sandbox for the math tool environment (Debian package bubblewrap).
if ! command -v bwrap >/dev/null 2>&1; then
    if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
        echo "[setup] installing bubblewrap (apt-get)"
        (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap) >/dev/null 2>&1 \
            || echo "[setup] WARNING: could not install bubblewrap; install it with 'apt-get install bubblewrap'"
    else
        echo "[setup] WARNING: bwrap not found; install it with 'sudo apt-get install bubblewrap'"
    fi
fi

echo "[setup] installing copc[$EXTRAS] into .venv (torch pinned by constraints/cpu.txt)"
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -c constraints/cpu.txt -e ".[$EXTRAS]"
echo "$want" > "$stamp"
echo "[setup] done"
