# Every target sets up ./.venv first (idempotent), so each is one command on a fresh machine.
PY := .venv/bin/python
# Config overrides appended to `copc train`: make main-search ARGS='train.seed=1 output_dir=runs/s1'
# (quote the whole value: an unquoted second override would become a make variable; write $ as $$;
# give each seed its own output_dir). Set on the command line only: an ARGS in the environment is ignored.
ARGS =

.PHONY: setup main main-tiny main-search main-search-tiny main-math test lint bench clean

setup:
	@bash scripts/setup.sh

# The main job trains a real pretrained model (issue 45): the search job, the one that meets its bar
# (docs/search_main.md); the math job on the same model does not yet (docs/math_main.md).
main: main-search

main-search: setup
	$(PY) -m trainer.cli model pull smollm2-135m-instruct
	$(PY) -m trainer.cli train --config configs/search/cpu_smollm.yaml $(ARGS)

# The tiny from-scratch math job (~2 minutes): the loop end to end, no real model.
main-tiny: setup
	$(PY) -m trainer.cli train --config configs/math_tool/cpu_tiny.yaml $(ARGS)

# ReTool on GSM8K with the real model (work in progress: docs/math_main.md).
main-math: setup
	$(PY) -m trainer.cli model pull smollm2-135m-instruct
	$(PY) -m trainer.cli train --config configs/math_tool/cpu_smollm.yaml $(ARGS)

main-search-tiny: setup
	$(PY) -m trainer.cli train --config configs/search/cpu_tiny.yaml $(ARGS)

test:
	@bash scripts/setup.sh --test-models --vllm --sglang-types
	$(PY) -m ruff check .
	$(PY) scripts/check_imports.py
	$(PY) -m pytest -q

lint: setup
	$(PY) -m ruff check .
	$(PY) scripts/check_imports.py

bench: setup
	$(PY) benchmarks/run_all.py

clean:
	rm -rf .venv .pytest_cache .ruff_cache
