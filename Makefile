# Two commands do everything on a fresh machine: `make demo` and `make test`.
# torch is installed first, pinned, so that pip never pulls a multi-GB CUDA build on CPU machines;
# override it for your hardware, e.g. `make test TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"`.
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
RUN ?= runs/demo
# The demo's own environment: packages pinned by constraints/demo.txt (the versions its README numbers come
# from), with the report extra (matplotlib: report.html's charts), and a fixed torch thread count (results are
# deterministic per count, not across counts; the README's table is at one thread).
DEMO_VENV := .venv-demo
DEMO_BIN := $(DEMO_VENV)/bin
DEMO_PINS := constraints/demo.txt
DEMO_THREADS ?= 1
SEEDS ?= 0 1 2
# The lock `make test` installs from: every package of vlrl[dev] at one version, resolved under the demo's pins
# (so the suite and the demo run the same transformers, tokenizers, numpy, ...). `make lock` rewrites it.
LOCK := constraints/test.txt

.PHONY: demo demo-seeds test test-floor test-latest lock lint clean

$(BIN)/.vlrl-installed: pyproject.toml $(LOCK)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c $(LOCK) $(TORCH)
	$(BIN)/python -m pip install -q -c $(LOCK) -e '.[dev]'
	touch $@

$(DEMO_BIN)/.vlrl-installed: pyproject.toml $(DEMO_PINS)
	$(PYTHON) -m venv $(DEMO_VENV)
	$(DEMO_BIN)/python -m pip install -q --upgrade pip
	$(DEMO_BIN)/python -m pip install -q -c $(DEMO_PINS) $(TORCH)
	$(DEMO_BIN)/python -m pip install -q -c $(DEMO_PINS) -e '.[report]'
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

# The lock, resolved afresh (newest releases within pyproject.toml's bounds and constraints/demo.txt's pins) by pip in
# a scratch venv without installing anything: `make lock`, then `make test`, then commit constraints/test.txt.
lock:
	rm -rf .venv-lock
	$(PYTHON) -m venv .venv-lock
	.venv-lock/bin/python -m pip install -q --upgrade pip
	.venv-lock/bin/python -m pip install -q --dry-run --ignore-installed --report .venv-lock/report.json \
		-c $(DEMO_PINS) $(TORCH) -e '.[dev]'
	.venv-lock/bin/python constraints/pins.py lock .venv-lock/report.json > $(LOCK)
	rm -rf .venv-lock

# Both ends of pyproject.toml's bounds, before a release, on the fast subset: no end-to-end run, no torchrun/Ray ranks
# (`ranks`, tests/conftest.py). test-floor: every direct dependency at its declared floor (constraints/pins.py floor),
# the rest as pip resolves it. test-latest: the newest releases the bounds admit, nothing pinned — torch included
# (on a machine without a local CPU build that is a CUDA build: TORCH_LATEST="torch --index-url ..." picks another).
# Each builds its venv afresh. Raise a ceiling by editing it in pyproject.toml, then `make test-latest`.
FAST := -m "not e2e and not ranks"
TORCH_LATEST ?=
test-floor:
	rm -rf .venv-floor
	$(PYTHON) -m venv .venv-floor
	.venv-floor/bin/python -m pip install -q --upgrade pip
	.venv-floor/bin/python constraints/pins.py floor > .venv-floor/floor.txt
	.venv-floor/bin/python -m pip install -q -c .venv-floor/floor.txt $(TORCH)
	.venv-floor/bin/python -m pip install -q -c .venv-floor/floor.txt -e '.[dev]'
	.venv-floor/bin/python -m pip list --format=freeze > .venv-floor/installed.txt
	.venv-floor/bin/python -m pytest -q $(FAST) -n $(WORKERS) --dist loadfile --no-loadscope-reorder

test-latest:
	rm -rf .venv-latest
	$(PYTHON) -m venv .venv-latest
	.venv-latest/bin/python -m pip install -q --upgrade pip
	$(if $(TORCH_LATEST),.venv-latest/bin/python -m pip install -q $(TORCH_LATEST))
	.venv-latest/bin/python -m pip install -q --upgrade --upgrade-strategy eager -e '.[dev]'
	.venv-latest/bin/python -m pip list --format=freeze > .venv-latest/installed.txt
	.venv-latest/bin/python -m pytest -q $(FAST) -n $(WORKERS) --dist loadfile --no-loadscope-reorder

lint: $(BIN)/.vlrl-installed
	$(BIN)/ruff check src tests benchmarks

clean:
	rm -rf $(VENV) $(DEMO_VENV) .venv-floor .venv-latest .venv-lock runs .pytest_cache
