"""What a GRPO rollout costs in the in-process engine, arm by arm, at two shapes (issue 26 items 1-2).

Arms, on the same prompts, alternated, each repeated ``--repeats`` times (median reported):

- ``generate``: transformers' `generate` over the n copies of every prompt (vlrl's engine before issue 26:
  logits processors, stopping criteria, ``output_logits``) — it prefills each prompt, vision tower included,
  n times;
- ``loop, prefill per row``: vlrl's sampling loop (`vlrl.rollout.decode`) with prompt sharing turned off —
  the per-token cost of the loop against `generate`'s;
- ``loop, prefill per group``: the engine as shipped — each prompt prefilled once, its cache expanded;
- ``loop, compiled step`` (``--compile``): the same with ``rollout.engine.compile`` — a static KV cache and one decode
  step under ``torch.compile`` (`decode.CompiledStep`); its first call (the compile) is timed apart and left out
  of the median. ``--no-generate`` leaves out the (slow) ``generate`` arm.

EOS is replaced by a suppressed token so every arm decodes exactly ``max_new_tokens`` steps; ``generate``'s
prefill is measured as a ``max_new_tokens=1`` call, so its per-token cost is (t(T) − t(1)) / (T − 1).

    PYTHONPATH=src python benchmarks/generation.py [--preset tiny-qwen2-vl] [--shape realistic] [--threads 1] \
        [--compile] [--no-generate] [--pairwise]

Shapes: ``today`` = 8 prompts × n 4 × 32 new tokens, 112×112 images (16 vision tokens); ``realistic`` = 4
prompts × n 8 × 64 new tokens, 448×448 images (256 vision tokens); ``demo`` = the demo's RL rollout, 64 count
prompts (one text) × n 8 × 8 new tokens, 112×112 images. ``--pairwise`` adds the arm ``loop, pairwise grouping``:
the shipped loop with the prompt grouping it had before 2026-11-28 (`pairwise_distinct_prompts`).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from vlrl.data import generate
from vlrl.data.sample import load_image
from vlrl.models import kv_cache, load_policy
from vlrl.models.adapters import VisionInputs
from vlrl.rollout import Request, SamplingParams, decode

SHAPES = {"today": dict(prompts=8, n=4, new=32, side=112), "realistic": dict(prompts=4, n=8, new=64, side=448),
          "demo": dict(prompts=64, n=8, new=8, side=112, tasks=["count"])}


def pairwise_distinct_prompts(requests):
    """`kv_cache.distinct_prompts` before 2026-11-28, for the ``--pairwise`` arm: each row compared (``torch.equal``)
    with every earlier prompt of the same token ids until one matched — quadratic when prompts share their text."""
    unique, by_ids, index = [], {}, []
    for request in requests:
        key = tuple(request.prompt_ids)
        match = next((k for k in by_ids.get(key, []) if _equal_vision(unique[k].vision, request.vision)), None)
        if match is None:
            match = len(unique)
            unique.append(request)
            by_ids.setdefault(key, []).append(match)
        index.append(match)
    return unique, index


def _equal_vision(a, b) -> bool:
    if a is b:
        return True
    if a is None or b is None:
        return False
    ta, tb = a.tensors, b.tensors
    return ta.keys() == tb.keys() and all(ta[k].shape == tb[k].shape and torch.equal(ta[k], tb[k]) for k in ta)


def hf_generate(policy, rows, sampling: SamplingParams, eos: int, suppress: list[int]) -> None:
    """The engine's pre-issue-26 path: `generate` on the left-padded rows (every copy prefilled)."""
    P = max(len(r.prompt_ids) for r in rows)
    input_ids = torch.full((len(rows), P), policy.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), P), dtype=torch.long)
    for k, r in enumerate(rows):
        input_ids[k, P - len(r.prompt_ids):] = torch.as_tensor(r.prompt_ids)
        mask[k, P - len(r.prompt_ids):] = 1
    kwargs = policy.adapter.generate_inputs(input_ids, mask, VisionInputs.concat([r.vision for r in rows]))
    policy.model.generate(**kwargs, do_sample=True, temperature=sampling.temperature, max_new_tokens=sampling.max_new_tokens,
                          eos_token_id=eos, pad_token_id=policy.pad_token_id, suppress_tokens=suppress,
                          output_logits=True, return_dict_in_generate=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="tiny-qwen2-vl")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="realistic")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--compile", action="store_true", help="add the compiled-step arm (rollout.engine.compile)")
    parser.add_argument("--no-generate", action="store_true", help="leave out the generate arm")
    parser.add_argument("--pairwise", action="store_true", help="add the arm with the old (pairwise) prompt grouping")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    shape = SHAPES[args.shape]
    side = shape["side"]
    policy = load_policy(args.preset, max_pixels=side * side)
    policy.model.eval()
    samples = generate("shapes", shape["prompts"], tasks=shape.get("tasks", ["count", "color"]),
                       image_size=side)
    requests = []
    for s in samples:
        encoded = policy.adapter.encode_prompt(s.messages, [load_image(i) for i in s.images])
        requests.append(Request(sample=s, prompt_ids=encoded.input_ids, vision=encoded.vision))
    rows = [r for r in requests for _ in range(shape["n"])]
    vision_tokens = requests[0].prompt_ids.count(policy.model.config.image_token_id)
    eos = policy.model.config.image_token_id  # suppressed: never sampled, so every row runs to max_new_tokens
    suppress = sorted(set(policy.adapter.special_token_ids()) - set(policy.eos_token_ids))
    sampling = SamplingParams(n=1, temperature=1.0, max_new_tokens=shape["new"])
    T = shape["new"]
    print(f"{args.preset} ({policy.num_parameters() / 1e6:.1f}M), shape {args.shape}: {shape['prompts']} prompts × n "
          f"{shape['n']} × {T} new tokens, {vision_tokens} vision tokens/image, prompt {len(requests[0].prompt_ids)} "
          f"tokens, {args.threads} thread(s)")

    def run_loop(share: bool | str, compiled: decode.CompiledStep | None = None) -> tuple[float, float, float]:
        real = kv_cache.distinct_prompts
        if not share:
            kv_cache.distinct_prompts = lambda rs: (list(rs), list(range(len(rs))))
        elif share == "pairwise":
            kv_cache.distinct_prompts = pairwise_distinct_prompts
        try:
            stats = decode.DecodeStats()
            start = time.perf_counter()
            decode.sample(policy.model, policy.adapter, rows, sampling, pad_token_id=policy.pad_token_id,
                          eos_token_ids=[eos], suppress=suppress, stats=stats, compiled=compiled)
            return time.perf_counter() - start, stats.prefill_seconds, stats.decode_seconds
        finally:
            kv_cache.distinct_prompts = real

    def run_generate() -> tuple[float, float, float]:
        start = time.perf_counter()
        with torch.no_grad():
            hf_generate(policy, rows, sampling, eos, suppress)
        total = time.perf_counter() - start
        start = time.perf_counter()
        with torch.no_grad():
            hf_generate(policy, rows, SamplingParams(n=1, max_new_tokens=1), eos, suppress)
        first = time.perf_counter() - start
        return total, first, total - first

    arms = {"generate": run_generate, "loop, prefill per row": lambda: run_loop(False),
            "loop, prefill per group": lambda: run_loop(True)}
    if args.no_generate:
        del arms["generate"]
    if args.pairwise:
        arms["loop, pairwise grouping"] = lambda: run_loop("pairwise")
    if args.compile:
        compiled = decode.CompiledStep()
        start = time.perf_counter()
        run_loop(True, compiled)  # the compile (and one rollout)
        print(f"compiled step: first rollout {time.perf_counter() - start:.1f} s (torch.compile included)")
        arms["loop, compiled step"] = lambda: run_loop(True, compiled)
    run_loop(True)  # warm-up
    results: dict[str, list[tuple[float, float, float]]] = {name: [] for name in arms}
    for _ in range(args.repeats):
        for name, fn in arms.items():  # alternated
            results[name].append(fn())
    tokens = len(rows) * T
    print(f"{'arm':26s} {'s/rollout':>9s} {'tokens/s':>9s} {'prefill s':>9s} {'decode s':>9s} {'ms/token step':>13s}")
    medians = {}
    for name, runs in results.items():
        total, prefill, steps = (statistics.median(r[i] for r in runs) for i in range(3))
        medians[name] = total
        print(f"{name:26s} {total:9.2f} {tokens / total:9.0f} {prefill:9.2f} {steps:9.2f} {1e3 * steps / (T - 1):13.1f}")
    base_name = "generate" if "generate" in medians else "loop, prefill per group"
    for name in arms:
        if name != base_name:
            print(f"speed-up of '{name}' over {base_name}: {medians[base_name] / medians[name]:.2f}x")


if __name__ == "__main__":
    main()
