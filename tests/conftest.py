import functools
import os
import re
import tempfile

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


def pytest_collection_modifyitems(config, items):
    """Longest files first: tests/e2e (the demo's two runs, ~6 min each), then every other file with an end-to-end
    test, then the rest, each group in collection order and each file's tests in their own order. `make test` hands
    files to its workers in this order (`--dist loadfile --no-loadscope-reorder`), so the short files fill the gaps
    at the end instead of one worker finishing the demo alone."""
    heavy = {item.path for item in items if item.get_closest_marker("e2e")}
    for item in items:  # `make test-floor` / `make test-latest` leave these files out (-m "not ranks")
        if _starts_ranks(item.path):
            item.add_marker(pytest.mark.ranks)

    def rank(item):
        return 0 if item.path.parent.name == "e2e" else 1 if item.path in heavy else 2

    items.sort(key=rank)  # stable: collection order within each rank


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
    """The number of prompts each `vlrl.rollout.decode.prefill` call ran, in order (the engine's group prefill
    and the shared-prefix teacher-forced pass both call it)."""
    from vlrl.rollout import decode

    calls: list[int] = []
    real = decode.prefill

    def spy(model, adapter, prompts, pad_token_id):
        calls.append(len(prompts))
        return real(model, adapter, prompts, pad_token_id)

    monkeypatch.setattr(decode, "prefill", spy)
    return calls
