import os

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


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
