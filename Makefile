# Two commands do everything on a fresh clone:
#   make test   create .venv, install, run the test suite
#   make demo   create .venv, install, run the CPU demo
# `make test-fast` skips the tests marked `slow` (multi-rank, subprocess, over a second).
# `make gpu-check` runs the whole GPU check on a CUDA machine (docs/gpu.md; no venv there: the
# machine's python3 and the wheels in shared/wheels, which `make gpu-prepare` fetches beforehand);
# `make gpu-smoke` runs it on the CPU.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# Without a CUDA driver we install the CPU build of torch first, so the project's
# `torch>=2.3` range is already satisfied and pip pulls no multi-GB CUDA wheels.
# On a GPU machine pip resolves torch itself (or keeps the build you already have).
CPU_TORCH ?= torch==2.13.0
STAMP  := $(VENV)/.installed

.PHONY: setup test test-fast lint demo clean gpu-check gpu-smoke gpu-prepare

setup: $(STAMP)

$(STAMP): setup.py pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	if ! command -v nvidia-smi >/dev/null 2>&1 && ! $(BIN)/python -c "import torch" 2>/dev/null; then \
		$(BIN)/pip install -q "$(CPU_TORCH)"; fi
	$(BIN)/pip install -q -e '.[dev]'
	# DeepSpeed builds against the torch already installed (no isolated build env, no 2nd torch)
	$(BIN)/pip install -q --no-build-isolation "deepspeed>=0.14"
	touch $(STAMP)

# Two pytest workers (TEST_WORKERS), each taking whole test files, so a file's module-scoped
# fixtures are built once; many tests wait on process start-up, so two overlap well on 2 cores.
# The 15 slowest tests are listed at the end, to keep the suite's time in view.
TEST_WORKERS ?= 2

test: $(STAMP)
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --durations=15 tests

test-fast: $(STAMP)
	$(BIN)/python -m pytest -n $(TEST_WORKERS) tests -x -m "not slow"

lint: $(STAMP)
	$(BIN)/ruff check megatron tests tools bench *.py
	$(BIN)/ruff format --check megatron tests tools bench *.py

gpu-check:
	bash bench/gpu_check.sh

# On a machine with network, before a GPU call: the wheels and the training data into shared/.
gpu-prepare: $(STAMP)
	PYTHON=$(BIN)/python bash bench/gpu_check.sh --prepare

gpu-smoke: $(STAMP)
	PYTHON=$(BIN)/python bash bench/gpu_check.sh --smoke

demo: $(STAMP)
	PYTHON=$(BIN)/python bash examples/cpu_demo.sh

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache gpu_check_out
