"""`load_policy` from a directory: the PIL image processor, asked for the way transformers does not deprecate."""

import transformers

from vlrl.models import load_policy


def test_a_saved_vlm_loads_its_pil_image_processor_without_the_deprecated_use_fast(tiny_vlm_dir, monkeypatch):
    """transformers ≥ 5.4 logs a deprecation for ``use_fast`` at every model load; ``backend="pil"`` is its
    replacement (a regression test: vlrl passed ``use_fast=False``)."""
    calls = []
    real = transformers.AutoImageProcessor.from_pretrained.__func__

    def spy(cls, path, *args, **kwargs):
        calls.append(kwargs)
        return real(cls, path, *args, **kwargs)

    monkeypatch.setattr(transformers.AutoImageProcessor, "from_pretrained", classmethod(spy))
    policy = load_policy(str(tiny_vlm_dir))
    assert len(calls) == 1 and calls[0]["backend"] == "pil" and "use_fast" not in calls[0]
    assert calls[0].get("trust_remote_code") is False  # the model option's default, passed on
    assert type(policy.image_processor).__name__ == "Qwen2VLImageProcessorPil"
