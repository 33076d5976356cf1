"""Padding-free vs padded SFT training step on a long-tail batch, tiny presets, CPU.

    python benchmarks/padding_free.py            # 3 presets × 3 repeats (a few minutes on one core)
    python benchmarks/padding_free.py --quick    # one preset, 2 repeats

One training step = forward + backward of the assistant-token loss over a batch of 32 samples + AdamW step.
Padded: `collate` pads every sequence to the batch's longest (prompts left, responses right). Packed: the
batch is planned into rows of at most the longest sequence's length with `pack_lengths` (the same offline
packer), each row holds several sequences with their own position ids and no attention across them
(`vlrl.models.packed`). Both give the same loss and gradients (tests/models/test_packed.py).

The batch is long-tailed like real SFT data: responses of lognormal length (median 48 tokens, σ 1.1, clipped
to [4, 1200]); for VLMs the shapes images are re-drawn at native resolution with sides lognormal around
160 px (max_pixels 448², so 4 to 256 vision tokens each). Prints real tokens per second of both, their ratio
per repeat (measured back to back), and the padding fraction of each layout. torch uses one thread.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from PIL import Image

from vlrl.data import generate
from vlrl.data.packing import pack_lengths
from vlrl.models import collate, load_policy, response_logprobs
from vlrl.models.packed import pack_sequences, packed_response_logprobs
from vlrl.models.policy import set_pixel_bounds
from vlrl.train.sft import encode_sft


def long_tail_batch(policy, n: int, seed: int):
    rng = np.random.default_rng(seed)
    vision = policy.is_vision
    samples = generate("shapes" if vision else "arith", n, split="bench", seed=seed)
    examples = []
    vocab = [t for t in range(200, min(900, len(policy.tokenizer)))]
    for sample in samples:
        if vision:
            side = np.clip(rng.lognormal(np.log(160), 0.7, size=2), 30, 900).astype(int)
            sample.images = [Image.new("RGB", (int(side[0]), int(side[1])), tuple(int(x) for x in rng.integers(0, 255, 3)))]
        example = encode_sft(policy, sample)
        length = int(np.clip(rng.lognormal(np.log(48), 1.1), 4, 1200))
        example.target_ids = [int(t) for t in rng.choice(vocab, size=length)] + example.target_ids[-1:]
        examples.append(example)
    return examples


def step(policy, optimizer, examples, packed: bool, rows=None) -> tuple[float, int]:
    prompts, targets, visions = [e.prompt_ids for e in examples], [e.target_ids for e in examples], [e.vision for e in examples]
    n_tokens = sum(len(t) for t in targets)
    start = time.perf_counter()
    if packed:
        batch = pack_sequences(policy.model, policy.adapter, prompts, targets, visions, pad_token_id=policy.pad_token_id,
                               rows=rows)
        logp, _ = packed_response_logprobs(policy.model, policy.adapter, batch)
        processed = batch.num_tokens
    else:
        batch = collate(prompts, targets, visions, pad_token_id=policy.pad_token_id)
        logp, _ = response_logprobs(policy.model, policy.adapter, batch)
        processed = batch.input_ids.numel()
    loss = -logp.sum() / n_tokens
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - start, processed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="tiny-qwen2-vl,tiny-qwen2.5-vl,tiny-qwen2")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="tiny-qwen2-vl only, 2 repeats")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    presets = ["tiny-qwen2-vl"] if args.quick else args.presets.split(",")
    repeats = 2 if args.quick else args.repeats
    print(f"{'preset':18s} {'tokens':>7s} {'padded tok/s':>13s} {'packed tok/s':>13s} {'speed-up':>9s}  "
          f"{'pad frac padded':>15s} {'pad frac packed':>15s}  rows padded → packed")
    for name in presets:
        policy = load_policy(name)
        if policy.is_vision:
            set_pixel_bounds(policy.image_processor, 56 * 56, 448 * 448)
        policy.model.train()
        optimizer = torch.optim.AdamW(policy.model.parameters(), lr=1e-4)
        examples = long_tail_batch(policy, args.batch, args.seed)
        lengths = np.array([e.length for e in examples])
        real = int(lengths.sum())
        plan = pack_lengths(lengths, int(lengths.max()), seed=args.seed)
        rows = [b.tolist() for b in plan.bins()]
        step(policy, optimizer, examples, True, rows)  # warm-up both paths
        step(policy, optimizer, examples, False)
        ratios, padded_rates, packed_rates = [], [], []
        for _ in range(repeats):
            t_pad, n_pad = step(policy, optimizer, examples, False)
            t_pack, n_pack = step(policy, optimizer, examples, True, rows)
            padded_rates.append(real / t_pad)
            packed_rates.append(real / t_pack)
            ratios.append(t_pad / t_pack)
        print(f"{name:18s} {real:>7d} {statistics.median(padded_rates):>13.0f} {statistics.median(packed_rates):>13.0f} "
              f"{statistics.median(ratios):>8.2f}x  {1 - real / n_pad:>15.1%} {1 - real / n_pack:>15.1%}  "
              f"{len(examples)} × {lengths.max()} → {len(rows)} × {lengths.max()}   "
              f"(per-repeat ratios {', '.join(f'{r:.2f}' for r in ratios)})")
    print("goal: packed ≥ 1.5× padded tokens/s")


if __name__ == "__main__":
    main()
