import functools
import importlib.util
import json
import os
import re
import resource
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# HF `datasets` writes its Arrow cache of every parquet file it reads (vlrl reads parquet through it), and transformers
# copies a checkpoint's own modelling code before importing it: both go to a temporary directory, not ~/.cache.
_HF_TMP = tempfile.mkdtemp(prefix="vlrl-tests-hf-")
os.environ.setdefault("HF_DATASETS_CACHE", os.path.join(_HF_TMP, "datasets"))
os.environ.setdefault("HF_MODULES_CACHE", os.path.join(_HF_TMP, "modules"))
os.environ.setdefault("VLRL_CACHE_DIR", os.path.join(_HF_TMP, "vlrl"))  # the CPU's best matmul rate (perf/mfu's peak)
# Under pytest-xdist (`make test` runs one worker per core) each worker keeps to one thread: two workers with two
# threads each would oversubscribe the cores.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // _WORKERS)))


# What each test file costs: CPU-seconds of its tests (the test process and every process it started and waited for:
# CLI runs, servers, torchrun ranks), measured by `make test-durations` — a measure that does not move with the load of
# a shared machine the way wall time does. Written by that target; read here to hand out files longest first.
DURATIONS = Path(__file__).with_name("durations.json")
ROOT = Path(__file__).resolve().parents[1]


@functools.cache
def file_costs() -> dict[str, float]:
    try:
        return {k: float(v) for k, v in json.loads(DURATIONS.read_text()).items()}
    except (OSError, ValueError):
        return {}


def file_cost(path: Path, e2e: bool) -> float:
    """A file's measured CPU-seconds (`DURATIONS`); a file not measured yet: by its kind (the demo's directory, a file
    with an end-to-end test or torch.distributed ranks, the rest)."""
    key = _key(path)
    if key in file_costs():
        return file_costs()[key]
    return 600.0 if path.parent.name == "e2e" else 120.0 if e2e else 5.0


def pytest_collection_modifyitems(config, items):
    """Longest files first, by their measured cost (`file_cost`), each file's tests in their own order. `make test`
    hands files to its workers in this order (`--dist loadfile --no-loadscope-reorder`), so the short files fill the
    gaps at the end instead of one worker finishing a long file alone (xdist's own reorder sorts by test count)."""
    heavy = {item.path for item in items if item.get_closest_marker("e2e")}
    for item in items:  # `make test-floor` / `make test-latest` leave these files out (-m "not ranks")
        if _starts_ranks(item.path):
            item.add_marker(pytest.mark.ranks)
            heavy.add(item.path)
    cost = {path: file_cost(path, path in heavy) for path in {item.path for item in items}}
    # The tests of `PER_TEST` files first, one to each worker: xdist gives a worker its next unit while it has 2 tests
    # or fewer pending, so a single-test unit behind a long file (or a second one behind the first) would wait for it.
    items.sort(key=lambda item: (_key(item.path) not in PER_TEST, -cost[item.path], str(item.path)))  # stable


# Files whose tests are independent runs of minutes each, sharing no fixture worth keeping: `make test` hands out
# their tests one by one instead of the whole file to one worker (the demo's two seeds run side by side, ~7 min each
# on a loaded core, where one worker ran both in turn while the other ran out of work).
PER_TEST = frozenset({"tests/e2e/test_demo.py"})


@functools.cache
def _key(path: Path) -> str:
    resolved = path.resolve()
    return resolved.relative_to(ROOT).as_posix() if resolved.is_relative_to(ROOT) else str(path)


if importlib.util.find_spec("xdist") is not None:
    def pytest_xdist_make_scheduler(config, log):
        """`--dist loadfile` (`make test`), with the files of `PER_TEST` split into their tests; the work units go out
        in collection order (`--no-loadscope-reorder`), which `pytest_collection_modifyitems` sorted longest first."""
        if config.getoption("dist") != "loadfile":
            return None
        from xdist.scheduler import LoadFileScheduling

        class FilesAndLongRuns(LoadFileScheduling):
            def _split_scope(self, nodeid: str) -> str:
                file = nodeid.split("::", 1)[0]
                return nodeid if file in PER_TEST else file

        return FilesAndLongRuns(config, log)


# `make test-durations`: every test's CPU-seconds and wall seconds (setup and teardown included, so a module fixture
# is charged to its file), one line per test in the file VLRL_TEST_CPU_LOG names (each xdist worker appends).
_CPU_LOG = os.environ.get("VLRL_TEST_CPU_LOG")


def _cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    forked = sys.modules.get("forked_runs")  # jobs on forked processes: their CPU is the zygote's children's
    return (own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime
            + (forked.CPU_SECONDS[0] if forked is not None else 0.0))


if _CPU_LOG:
    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        cpu, wall = _cpu_seconds(), time.perf_counter()
        yield
        with open(_CPU_LOG, "a", encoding="utf-8") as log:
            log.write(f"{item.nodeid}\t{_cpu_seconds() - cpu:.3f}\t{time.perf_counter() - wall:.3f}\n")


# A test file that starts torch.distributed ranks: torchrun (tests/train/dist_helpers.py, or torch.distributed.run
# itself), the shared 2-rank job (`two_ranks`), Ray actors (`local_ray`), or `vlrl launch` with two ranks.
_RANKS = re.compile(r"torchrun\(|torch\.distributed\.run|\btwo_ranks\b|\blocal_ray\b|nproc=2")


@functools.cache
def _starts_ranks(path) -> bool:
    return bool(_RANKS.search(path.read_text(encoding="utf-8")))


@pytest.fixture
def tiny_vlm():
    """A fresh tiny Qwen2-VL policy (random weights, deterministic)."""
    from vlrl.models import load_policy

    return load_policy("tiny-qwen2-vl")


@pytest.fixture
def tiny_lm():
    from vlrl.models import load_policy

    return load_policy("tiny-qwen2")


@pytest.fixture
def shapes_samples():
    from vlrl.data import generate

    return generate("shapes", 8, split="test", tasks=["count", "color", "locate", "ocr"])


@pytest.fixture(scope="session")
def tiny_vlm_dir(tmp_path_factory):
    """``tiny-qwen2-vl`` (init seed 0) saved once per session in the transformers layout: a subprocess or a
    rank loads it in ~0.1 s instead of rebuilding the preset (its tokenizer is trained on the fly)."""
    from vlrl.models import load_policy

    path = tmp_path_factory.mktemp("tiny-qwen2-vl")
    load_policy("tiny-qwen2-vl").save(path)
    return path


@pytest.fixture
def one_thread():
    """Torch single-threaded for one test. Tiny models gain nothing from a second intra-op thread, and where
    the test runs threads of its own (a trainer and a rollout worker, a server, a synthesis client) torch's
    threads on top of them oversubscribe the 2 cores (measured 10-15x slower steps under load). Modules opt in
    with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def prefills(monkeypatch):
    """The number of prompts each `vlrl.models.kv_cache.prefill` call ran, in order (the engine's group prefill
    and the shared-prefix teacher-forced pass both call it)."""
    from vlrl.models import kv_cache

    calls: list[int] = []
    real = kv_cache.prefill

    def spy(model, adapter, prompts, pad_token_id):
        calls.append(len(prompts))
        return real(model, adapter, prompts, pad_token_id)

    monkeypatch.setattr(kv_cache, "prefill", spy)
    return calls
