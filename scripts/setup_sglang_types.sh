# SGLang's own request types for tests/trainer/engines/test_sglang_io_struct.py: ./.venv-sglang-types
# (sourced by scripts/setup.sh for --sglang-types; bash). The sglang release the SGLang client is checked
# against, installed --no-deps (its own dependencies are torch, triton, sgl-kernel and CUDA), plus pydantic
# (what FastAPI validates its request bodies with): ~70 MB and ~20 s once, instant when stamped.

# Keep test_sglang_io_struct.SGLANG_VERSION in step with the sglang pin.
SGLANG_TYPES=("sglang==0.5.6" "pydantic==2.14.4")
SGLANG_TYPES_VENV=.venv-sglang-types

setup_sglang_types() {  # create/refresh the venv unless stamped with SGLANG_TYPES; a failure is a WARNING
    local v=$SGLANG_TYPES_VENV py=${PYTHON:-python3}
    [ "$(cat "$v/.copc-stamp" 2>/dev/null)" = "${SGLANG_TYPES[*]}" ] && return 0
    echo "[setup] installing ${SGLANG_TYPES[*]} into $v (sglang --no-deps: its request types only)"
    if { [ -x "$v/bin/python" ] || "$py" -m venv "$v"; } \
            && "$v/bin/python" -m pip install -q "${SGLANG_TYPES[@]:1}" \
            && "$v/bin/python" -m pip install -q --no-deps "${SGLANG_TYPES[0]}"; then
        echo "${SGLANG_TYPES[*]}" > "$v/.copc-stamp"
    else
        SETUP_MISSING+=("$v (SGLang's request types; test_sglang_io_struct.py skips): pip failed; re-run 'bash scripts/setup.sh --sglang-types'")
        return 1
    fi
}
