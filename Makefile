# Two commands do everything on a fresh machine: `make demo` and `make test`.
# torch is installed first, pinned, so that pip never pulls a multi-GB CUDA build on CPU machines;
# override it for your hardware, e.g. `make test TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"`.
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
RUN ?= runs/demo
# The demo's own environment: packages pinned by constraints/demo.txt (the versions its README numbers come
# from) and a fixed torch thread count (results are deterministic per count, not across counts; the README's
# table is at one thread).
DEMO_VENV := .venv-demo
DEMO_BIN := $(DEMO_VENV)/bin
DEMO_PINS := constraints/demo.txt
DEMO_THREADS ?= 1
SEEDS ?= 0 1 2

.PHONY: demo demo-seeds test lint clean

$(BIN)/.vlrl-installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH)
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $@

$(DEMO_BIN)/.vlrl-installed: pyproject.toml $(DEMO_PINS)
	$(PYTHON) -m venv $(DEMO_VENV)
	$(DEMO_BIN)/python -m pip install -q --upgrade pip
	$(DEMO_BIN)/python -m pip install -q -c $(DEMO_PINS) $(TORCH)
	$(DEMO_BIN)/python -m pip install -q -c $(DEMO_PINS) -e .
	touch $@

demo: $(DEMO_BIN)/.vlrl-installed
	OMP_NUM_THREADS=$(DEMO_THREADS) $(DEMO_BIN)/vlrl demo --out $(RUN)

# The demo at several training seeds and both thread counts, and the README table (benchmarks/demo_seeds.py).
demo-seeds: $(DEMO_BIN)/.vlrl-installed
	$(DEMO_BIN)/python benchmarks/demo_seeds.py --seeds $(SEEDS) --threads 1 2 --out runs/demo_seeds

# One pytest-xdist worker per core (a file's tests stay on one worker: its module fixtures are built once). Files are
# handed out in the order tests/conftest.py puts them, longest first (xdist's own reorder sorts by test count, which
# left the demo's two 6-minute runs for last, alone on one worker).
WORKERS ?= 2
test: $(BIN)/.vlrl-installed
	$(BIN)/python -m pytest -q -n $(WORKERS) --dist loadfile --no-loadscope-reorder

lint: $(BIN)/.vlrl-installed
	$(BIN)/ruff check src tests benchmarks

clean:
	rm -rf $(VENV) $(DEMO_VENV) runs .pytest_cache
