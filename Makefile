# Two set-up commands: `make run` and `make test`. Both create .venv on first use and reuse it after.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# torch is pinned here, in the install step only: our machines take the CPU wheel on disk, a user's
# GPU machine gets PyPI's CUDA build of the same release. The package itself needs torch >= 2.5.
TORCH := torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: run test test-all lint clean

$(STAMP): pyproject.toml Makefile
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else "error: gpuwise needs Python >= 3.10 (hint: make PYTHON=python3.12 ...)")'
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check "$(TORCH)" -e ".[dev]"
	@touch $(STAMP)

# The main job on built-in defaults: check the stack, then plan GPT-2 training (micro-batch 8 x 1024
# tokens, bf16 autocast, AdamW) and show which GPUs it fits. The plan runs even when doctor finds a
# failure (it needs no GPU); the exit status is doctor's, or the plan's if that fails.
run: $(STAMP)
	@$(BIN)/gpuwise doctor; status=$$?; $(BIN)/gpuwise plan --model gpt2 --batch 8 && exit $$status

# The suite CI runs: every test not marked slow, the 25 slowest listed at the end and the 15 costliest in CPU time
# with the total (tests/cpu_report.py). A test marked slow costs over ~10 s of CPU and has a cheaper sibling in this
# suite (a real two-process DDP run stands for FSDP's, eager resume for compiled resume) or a benchmark that runs the
# same case; `make test-all` runs them too.
PYTEST_ARGS ?= -m "not slow"
test: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 --durations=25 --cpu-report=15 $(PYTEST_ARGS)

test-all: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 --durations=25 --cpu-report=15

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks scripts

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache build src/*.egg-info
