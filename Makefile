# Two commands do everything on a fresh machine: `make demo` and `make test`.
# torch is installed first, pinned, so that pip never pulls a multi-GB CUDA build on CPU machines;
# override it for your hardware, e.g. `make test TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"`.
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
RUN ?= runs/demo

.PHONY: demo test lint clean

$(BIN)/.vlrl-installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH)
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $@

demo: $(BIN)/.vlrl-installed
	$(BIN)/vlrl demo --out $(RUN)

# One pytest-xdist worker per core (a file's tests stay on one worker: its module fixtures are built once).
WORKERS ?= 2
test: $(BIN)/.vlrl-installed
	$(BIN)/python -m pytest -q -n $(WORKERS) --dist loadfile

lint: $(BIN)/.vlrl-installed
	$(BIN)/ruff check src tests benchmarks

clean:
	rm -rf $(VENV) runs .pytest_cache
