"""The teacher-forced passes at a GRPO shape, plain vs shared prefix (issue 26 item 3; `vlrl.train.shared_prefix`).

The plain pass scores ``prompts × n`` rows of P + R tokens: the n rows of a group repeat the same P prompt tokens
(the vision tower already runs once per group: `VisionInputs.concat_shared`). The shared-prefix pass
(``train.shared_prefix``, on by default) runs each distinct prompt once: without gradients it prefills the prompt and
runs only the responses against its keys/values copied to the rows; with gradients (the update) it is one grouped
forward, the responses beside their prompt (`vlrl.models.grouped`). This script times, on the same weights and rows,
arms alternated, median of ``--repeats``:

- ``π_old / π_ref pass``: one no-grad teacher-forced pass over every row (eval mode), plain and shared — a step
  runs one (π_old, or π_ref) or two of them;
- ``update forward+backward``: log-probs with grad, loss = −mean log-prob, backward, plain and shared, each also
  with gradient checkpointing (``+ ckpt``: train.gradient_checkpointing);
- ``bound``: the update's forward+backward over the distinct prompts alone (B/n rows × P) plus the responses
  alone (B rows × R, text only) — the work a shared pass does without its prompt → response attention.

It prints max |Δ| of the log-probs between plain and shared (they must agree to < 1e-5) and the ratios.

    PYTHONPATH=src python benchmarks/teacher_forced_prompt.py [--presets tiny-qwen2-vl tiny-qwen2-vl-20m]
        [--shape realistic|today] [--threads 1] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from vlrl.data import generate
from vlrl.models import collate, load_policy, response_logprobs
from vlrl.models.forward import PassLayout, evaluating, teacher_forced
from vlrl.rollout import HFEngine

SHAPES = {"today": dict(prompts=8, n=4, new=32, side=112), "realistic": dict(prompts=4, n=8, new=64, side=448)}


def no_grad_pass(policy, rows, responses, *, shared: bool) -> tuple[float, torch.Tensor]:
    start = time.perf_counter()
    with evaluating(policy.model):
        logp = teacher_forced(policy.model, policy.adapter, [r.prompt_ids for r in rows], responses,
                              [r.vision for r in rows], pad_token_id=policy.pad_token_id,
                              layout=PassLayout(shared_prefix=shared)).logp
    return time.perf_counter() - start, logp


def update_pass(policy, rows, responses, *, shared: bool, checkpointing: bool = False) -> float:
    from vlrl.train.modules import gradient_checkpointing

    with gradient_checkpointing(policy.model, checkpointing):
        return _update_pass(policy, rows, responses, shared=shared)


def _update_pass(policy, rows, responses, *, shared: bool) -> float:
    policy.model.train()
    start = time.perf_counter()
    logp = teacher_forced(policy.model, policy.adapter, [r.prompt_ids for r in rows], responses,
                          [r.vision for r in rows], pad_token_id=policy.pad_token_id, with_entropy=True,
                          layout=PassLayout(shared_prefix=shared)).logp
    (-(logp.sum() / sum(len(r) for r in responses))).backward()
    seconds = time.perf_counter() - start
    policy.model.zero_grad(set_to_none=True)
    policy.model.eval()
    return seconds


def fwd_bwd(policy, prompts, responses, visions) -> float:
    batch = collate(prompts, responses, visions, pad_token_id=policy.pad_token_id)
    start = time.perf_counter()
    logp, _ = response_logprobs(policy.model, policy.adapter, batch)
    (-(logp.sum() / batch.response_mask.sum())).backward()
    policy.model.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def measure(preset: str, shape: dict, repeats: int) -> None:
    policy = load_policy(preset, max_pixels=shape["side"] ** 2)
    engine = HFEngine(policy)
    requests = [engine.encode(s) for s in generate("shapes", shape["prompts"], tasks=["count"], image_size=shape["side"])]
    n, R = shape["n"], shape["new"]
    torch.manual_seed(0)
    ordinary = [t for t in range(len(policy.tokenizer)) if t not in set(policy.adapter.special_token_ids())]
    rows = [r for r in requests for _ in range(n)]
    responses = [[ordinary[int(i)] for i in torch.randint(len(ordinary), (R,))] for _ in rows]
    P = len(requests[0].prompt_ids)

    def bound() -> float:
        prompt_part = fwd_bwd(policy, [r.prompt_ids[:-1] for r in requests], [r.prompt_ids[-1:] for r in requests],
                              [r.vision for r in requests])
        return prompt_part + fwd_bwd(policy, [[resp[0]] for resp in responses], [resp[1:] for resp in responses],
                                     [None] * len(rows))

    arms = {
        "π_old/π_ref pass, plain": lambda: no_grad_pass(policy, rows, responses, shared=False)[0],
        "π_old/π_ref pass, shared": lambda: no_grad_pass(policy, rows, responses, shared=True)[0],
        "update fwd+bwd, plain": lambda: update_pass(policy, rows, responses, shared=False),
        "update fwd+bwd, shared": lambda: update_pass(policy, rows, responses, shared=True),
        "update fwd+bwd, plain + ckpt": lambda: update_pass(policy, rows, responses, shared=False, checkpointing=True),
        "update fwd+bwd, shared + ckpt": lambda: update_pass(policy, rows, responses, shared=True, checkpointing=True),
        "update fwd+bwd, bound": bound,
    }
    _, plain = no_grad_pass(policy, rows, responses, shared=False)  # warm-up, and the values to compare
    _, shared = no_grad_pass(policy, rows, responses, shared=True)
    times: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(repeats):
        for name, arm in arms.items():
            times[name].append(arm())
    t = {name: statistics.median(v) for name, v in times.items()}
    print(f"\n{preset} ({policy.num_parameters() / 1e6:.1f}M): {shape['prompts']} prompts × n {n}, P = {P} prompt "
          f"tokens ({shape['side']}² images), R = {R}; prompt share of the scored tokens {P / (P + R):.0%}; "
          f"{torch.get_num_threads()} thread(s), median of {repeats}")
    print(f"  max |Δ log-prob| plain vs shared: {float((plain - shared).abs().max()):.2e}")
    for name, seconds in t.items():
        print(f"  {name:<26} {seconds:7.2f} s")
    print(f"  π_old/π_ref pass: shared {t['π_old/π_ref pass, plain'] / t['π_old/π_ref pass, shared']:.2f}x faster; "
          f"update: shared {t['update fwd+bwd, plain'] / t['update fwd+bwd, shared']:.2f}x faster "
          f"(bound {t['update fwd+bwd, plain'] / t['update fwd+bwd, bound']:.2f}x); with checkpointing: shared "
          f"{t['update fwd+bwd, plain + ckpt'] / t['update fwd+bwd, shared + ckpt']:.2f}x faster")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--presets", nargs="+", default=["tiny-qwen2-vl", "tiny-qwen2-vl-20m"])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="realistic")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for preset in args.presets:
        measure(preset, SHAPES[args.shape], args.repeats)


if __name__ == "__main__":
    main()
