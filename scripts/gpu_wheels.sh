#!/usr/bin/env bash
# Download, here (where PyPI is reachable), every wheel that scripts/gpu_check.sh needs on a GPU
# machine that has only PyTorch, transformers and Triton (and their own dependencies), into
# .gpu_wheels/ (git-ignored; `carry` it: see docs/gpu_check.md).
#
# Pins: the versions of this project's venv (.venv/bin/python -m pip list) and pyproject.toml
# (megatron-core / mbridge are pinned there: the CPU shims were written against exactly these).
# Pure-Python wheels (py3-none-any) serve any Python; the compiled ones (megatron-core, rpds-py,
# pydantic-core) are fetched for CPython 3.10 to 3.13 (the GPU machine's Python was 3.12 when last
# seen), psutil as its abi3 wheel. On the GPU machine scripts/gpu_check.sh installs only the
# wheels whose distribution is not already there (so the machine's own packages are never
# shadowed), picking the one whose tags fit its Python.
#
# Usage: bash scripts/gpu_wheels.sh [DEST]   (DEST defaults to .gpu_wheels; re-running reuses files)
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${1:-.gpu_wheels}
PY=${GPU_WHEELS_PYTHON:-.venv/bin/python}
mkdir -p "$DEST"

# Pure wheels, by what needs them:
#  omegaconf + antlr4: trainer.config. gymnasium + cloudpickle + farama-notifications: environments.
#  jsonschema + attrs + referencing + jsonschema-specifications (+ rpds-py, compiled): the tool
#  schemas checked when environments.math_tool is imported. rich + markdown-it-py + mdurl + pygments:
#  trainer.app.run (console report). httpx + httpcore + h11 + anyio + idna + certifi: trainer.engines
#  .sglang, and fastapi + starlette + uvicorn + click + pydantic (+ pydantic-core, compiled) +
#  annotated-types + typing-inspection + annotated-doc + opentelemetry-api + typing-extensions: the SGLang
#  protocol stand-in that the gpu-marked test module (tests/trainer/engines/test_sglang.py) imports. pytest + pluggy + iniconfig + pytest-timeout
#  (+ exceptiongroup, tomli: Python 3.10 only): the gpu-marked tests. mbridge + einops (+ megatron-core,
#  psutil): the megatron backend.
PURE=(
  omegaconf==2.4.0 antlr4-python3-runtime==4.13.2
  gymnasium==1.4.0 cloudpickle==3.1.3 farama-notifications==0.0.6
  jsonschema==4.26.0 attrs==26.1.0 referencing==0.37.0 jsonschema-specifications==2025.9.1
  rich==15.0.0 markdown-it-py==4.3.0 mdurl==0.1.2 pygments==2.21.0
  httpx==0.28.1 httpcore==1.0.9 h11==0.16.0 anyio==4.16.0 idna==3.20 certifi==2026.10.19.post1
  fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 click==8.5.1 pydantic==2.14.4 annotated-types==0.8.0
  typing-inspection==0.4.5 annotated-doc==0.0.7 opentelemetry-api==1.45.2 typing-extensions==4.16.0
  pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 pytest-timeout==2.4.0 exceptiongroup==1.3.2
  mbridge==0.15.1 einops==0.8.2
)
COMPILED=(megatron-core==0.16.1 rpds-py==2026.9.1 pydantic-core==2.50.5)
RPDS_PY310=rpds-py==0.30.0  # rpds-py 2026.x needs Python >= 3.11 (jsonschema wants >= 0.25)
ABI3=(psutil==7.2.2)
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
           --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_12_x86_64
           --platform manylinux2010_x86_64 --platform manylinux1_x86_64)

dl() {  # (the "Location ... is ignored" lines are this machine's pip config, not errors)
  "$PY" -m pip download -q --no-deps --only-binary=:all: -d "$DEST" "$@" 2> >(grep -v "is ignored" >&2)
}

dl "${PURE[@]}"
dl --python-version 3.10 --implementation py --abi none --platform any tomli==2.5.0  # pure, not mypyc
dl --python-version 3.10 --implementation cp "${PLATFORMS[@]}" "${COMPILED[0]}" "$RPDS_PY310" "${COMPILED[2]}"
for v in 3.11 3.12 3.13; do
  dl --python-version "$v" --implementation cp "${PLATFORMS[@]}" "${COMPILED[@]}"
done
dl --python-version 3.10 --implementation cp --abi abi3 "${PLATFORMS[@]}" "${ABI3[@]}"

# The venv's versions should be the pinned ones (a mismatch means a pin above is stale).
for spec in "${PURE[@]}" "${COMPILED[@]}" "${ABI3[@]}" tomli==2.5.0; do
  name=${spec%%==*}; want=${spec##*==}
  have=$("$PY" -c "import importlib.metadata as m, sys
try: print(m.version(sys.argv[1]))
except m.PackageNotFoundError: print('-')" "$name")
  if [[ "$have" != "$want" && "$have" != "-" ]]; then
    echo "note: $name pinned $want here, the venv has $have" >&2
  fi
done

ls -1 "$DEST"
echo "$(ls -1 "$DEST"/*.whl | wc -l) wheels, $(du -sm "$DEST" | cut -f1) MiB in $DEST" \
     "($(du -sk "$DEST" | cut -f1) KiB; carry limit 64 MiB with the working tree)"
