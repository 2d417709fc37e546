#!/usr/bin/env bash
# The prepared GPU check (docs/gpu_check.md): ≤ 8 minutes on one H200.
#
#   bash scripts/gpu_check.sh                      # on the GPU machine: OUT is set by the run tool
#   GPU_CHECK_DEVICE=cpu bash scripts/gpu_check.sh # here, on CPU with gloo (tests the logic)
#   bash scripts/gpu_check.sh --device cpu --budget-s 300 --run-steps 2   # flags go to gpu_check.py run
#
# 1. unpacks the carried wheels (.gpu_wheels/, made by scripts/gpu_wheels.sh) that this Python
#    lacks into a scratch site directory outside $OUT (the preinstalled torch is never touched);
# 2. runs scripts/gpu_check.py run: steps env, pytest_gpu, learner_steps, logprob_parity, run10,
#    each timed and guarded, one global budget (--budget-s, default 450 s);
# 3. leaves $OUT/gpu_check_summary.json, $OUT/gpu_check_summary.md and $OUT/logs/ (≤ 8 files).
# Exit status: 0 iff no step failed.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD

DEVICE=${GPU_CHECK_DEVICE:-cuda}
ARGS=()
while (($#)); do
  case "$1" in
    --device) DEVICE=$2; shift 2 ;;
    --device=*) DEVICE=${1#--device=}; shift ;;
    *) ARGS+=("$1"); shift ;;
  esac
done
if [[ -n "${GPU_CHECK_PYTHON:-}" ]]; then PY=$GPU_CHECK_PYTHON
elif [[ -x .venv/bin/python ]]; then PY=.venv/bin/python  # here (.venv is not carried to the GPU machine)
else PY=python3; fi

OUT=${OUT:-$(mktemp -d "${TMPDIR:-/tmp}/gpu_check_out.XXXXXX")}
mkdir -p "$OUT/logs"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check_work.XXXXXX")
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
SETUP_LOG="$OUT/logs/setup.log"
{
  echo "gpu_check: device=$DEVICE python=$PY ($("$PY" -V 2>&1)) repo=$REPO out=$OUT work=$WORK"
  echo "uname: $(uname -srm)"
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
} >"$SETUP_LOG" 2>&1

# Wheels: unpack only the distributions this interpreter lacks (report → summary.wheels).
"$PY" scripts/gpu_check.py install --wheels "$REPO/.gpu_wheels" --target "$WORK/site" \
  --report "$WORK/wheels.json" >>"$SETUP_LOG" 2>&1 || echo "wheel install failed (see $SETUP_LOG)" >&2
export PYTHONPATH="$WORK/site:$REPO${PYTHONPATH:+:$PYTHONPATH}"

"$PY" scripts/gpu_check.py run --device "$DEVICE" --out "$OUT" --work "$WORK" \
  --wheel-report "$WORK/wheels.json" "${ARGS[@]}"
rc=$?
[[ "${GPU_CHECK_KEEP_WORK:-0}" == 1 ]] || rm -rf "$WORK"  # scratch: tiny models, the run's checkpoints
echo "summary: $OUT/gpu_check_summary.md"
exit $rc
