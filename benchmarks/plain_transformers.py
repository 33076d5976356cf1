"""A vlrl checkpoint run in plain transformers, as the README's "Run a checkpoint in plain transformers" does it,
with and without ``mm_token_type_ids``, beside vlrl's own greedy evaluation of the same prompts.

    python benchmarks/plain_transformers.py CHECKPOINT [N]      # N procedural shapes/count test prompts (40)

Prints three greedy scores out of N. Measured numbers: README.
"""

from __future__ import annotations

import sys

import torch
from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

from vlrl.config import EvalConfig
from vlrl.data import generate, load_image
from vlrl.eval import evaluate
from vlrl.models import load_policy
from vlrl.rewards import compose
from vlrl.rollout import HFEngine


def main(path: str, n: int) -> None:
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    image_processor = AutoImageProcessor.from_pretrained(path, backend="pil")
    samples = generate("shapes", n, split="test", tasks=["count"])

    def answer(sample, with_types: bool) -> str:
        text = tokenizer.apply_chat_template(sample.messages, tokenize=False, add_generation_prompt=True)
        vision = image_processor(images=[load_image(src) for src in sample.images], return_tensors="pt")
        image_tokens = int(vision["image_grid_thw"][0].prod()) // image_processor.merge_size**2
        text = text.replace("<|image_pad|>", "<|image_pad|>" * image_tokens)
        inputs = tokenizer(text, return_tensors="pt", add_special_tokens=False)
        if with_types:
            inputs["mm_token_type_ids"] = (inputs["input_ids"] == model.config.image_token_id).int()
        output = model.generate(**inputs, **vision, max_new_tokens=8, do_sample=False)
        return tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)

    for with_types in (True, False):
        right = sum(compose(answer(s, with_types), s.answer, s.reward, s.metadata).parts["accuracy"] for s in samples)
        print(f"plain transformers, mm_token_type_ids {'passed' if with_types else 'omitted'}: {int(right)}/{n}")
    result = evaluate(HFEngine(load_policy(path)), samples, EvalConfig(samples=1, max_new_tokens=8))
    print(f"vlrl greedy: {round(result['greedy']['mean'] * n)}/{n}")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 40)
