# Fresh-machine set-up is part of each target: .venv is created and filled on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast lint gpu-test clean

$(STAMP): requirements-cpu.txt requirements-dev.txt requirements-trained.txt pyproject.toml
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -r requirements-dev.txt
	$(BIN)/pip install -q --no-deps -r requirements-trained.txt
	$(BIN)/pip install -q --no-deps -e .
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/graphserve demo

# pytest-xdist workers: the CI box has 2 cores, and each worker starts its own servers and rank processes, so more
# workers than cores only wait on each other (`make test TEST_WORKERS=auto` on a larger machine). --dist loadfile
# keeps a module on one worker: its module-scoped servers and models are built once, not once per worker (on the
# 2-core box, shared with other jobs: 898 s against 1000 s for --dist load).
TEST_WORKERS ?= 2
XDIST := -n $(TEST_WORKERS) --dist loadfile

test: $(STAMP)
	$(BIN)/ruff check graphserve tests benchmarks
	$(BIN)/python -m pytest -q $(XDIST) tests --ignore=tests/gpu

# The CPU suite without the Triton-interpreter kernel tests (marked slow in tests/conftest.py): a quick check while
# working; `make test` (CI) runs them all.
test-fast: $(STAMP)
	$(BIN)/ruff check graphserve tests benchmarks
	$(BIN)/python -m pytest -q $(XDIST) tests --ignore=tests/gpu -m "not slow"

lint: $(STAMP)
	$(BIN)/ruff check graphserve tests benchmarks

# On a CUDA machine: python3 -m pytest -q tests/gpu
gpu-test:
	python3 -m pytest -q tests/gpu

clean:
	rm -rf $(VENV) build *.egg-info
