"""How much of the update's teacher-forced pass is the prompt, at a GRPO shape (issue 26 item 3).

The update's forward + backward scores ``prompts × n`` rows of P + R tokens; the n rows of a group repeat the
same P prompt tokens (the vision tower already runs once per group: `VisionInputs.concat_shared`). A
shared-prefix layout would run the language model over each prompt once and only the R response tokens per
row. This script times, on the same weights:

- ``as today``: `response_logprobs` with grad, loss = −mean log-prob, backward, over every row;
- ``bound``: the same over the distinct prompts alone (B/n rows × P) plus the responses alone (B rows × R,
  text only) — the work a shared-prefix pass would do, without its prompt → response attention (so a lower
  bound on its time).

    PYTHONPATH=src python benchmarks/teacher_forced_prompt.py [--preset tiny-qwen2-vl-20m] [--shape realistic]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from vlrl.data import generate
from vlrl.models import collate, load_policy, response_logprobs
from vlrl.rollout import HFEngine

SHAPES = {"today": dict(prompts=8, n=4, new=32, side=112), "realistic": dict(prompts=4, n=8, new=64, side=448)}


def fwd_bwd(policy, prompts, responses, visions) -> float:
    batch = collate(prompts, responses, visions, pad_token_id=policy.pad_token_id)
    start = time.perf_counter()
    logp, _ = response_logprobs(policy.model, policy.adapter, batch)
    (-(logp.sum() / batch.response_mask.sum())).backward()
    policy.model.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="tiny-qwen2-vl")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="realistic")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    shape = SHAPES[args.shape]
    policy = load_policy(args.preset, max_pixels=shape["side"] ** 2)
    engine = HFEngine(policy)
    requests = [engine.encode(s) for s in generate("shapes", shape["prompts"], tasks=["count"], image_size=shape["side"])]
    n, R = shape["n"], shape["new"]
    torch.manual_seed(0)
    ordinary = [t for t in range(len(policy.tokenizer)) if t not in set(policy.adapter.special_token_ids())]
    rows = [r for r in requests for _ in range(n)]
    responses = [[ordinary[int(i)] for i in torch.randint(len(ordinary), (R,))] for _ in rows]
    P = len(requests[0].prompt_ids)
    today = lambda: fwd_bwd(policy, [r.prompt_ids for r in rows], responses, [r.vision for r in rows])  # noqa: E731

    def bound() -> float:
        prompt_part = fwd_bwd(policy, [r.prompt_ids[:-1] for r in requests], [r.prompt_ids[-1:] for r in requests],
                              [r.vision for r in requests])
        return prompt_part + fwd_bwd(policy, [[resp[0]] for resp in responses], [resp[1:] for resp in responses],
                                     [None] * len(rows))

    today()
    times = {"as today": [], "bound": []}
    for _ in range(args.repeats):
        times["as today"].append(today())
        times["bound"].append(bound())
    a, b = (statistics.median(v) for v in times.values())
    print(f"{args.preset} ({policy.num_parameters() / 1e6:.1f}M), {args.shape}: {shape['prompts']} prompts × n {n}, "
          f"P = {P} prompt tokens, R = {R}; prompt share of the scored tokens {P / (P + R):.0%}; {args.threads} thread(s)")
    print(f"forward+backward as today {a:.2f} s, shared-prefix bound {b:.2f} s: at most {a / b:.2f}x faster")


if __name__ == "__main__":
    main()
