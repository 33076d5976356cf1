"""What step-level credit costs per RL step, on the tiny preset's tokenizer and model.

    python benchmarks/step_credit_overhead.py            # 256 responses, batch of 64
    python benchmarks/step_credit_overhead.py --quick    # 32 responses, batch of 16

Prints, side by side in one run: the span mapping per response on its two paths (tokenizer offsets when
re-tokenisation round-trips; prefix decoding when it does not — forced here by encoding each response in
3-character pieces), the rule shaper on a batch (parse + match + inject + analysis record), and the
forward-proxy shaper on the same batch (two teacher-forced passes of the tiny model), next to one
generation of the same batch (what an RL step spends anyway).
"""

from __future__ import annotations

import argparse
import time
from types import SimpleNamespace

import torch

from vlrl.data import generate
from vlrl.models import load_policy
from vlrl.rollout import HFEngine, SamplingParams
from vlrl.train.step_credit import parse_options, parse_response_plan, shape_step_credit


def timed(fn, repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    n, batch = (32, 16) if args.quick else (256, 64)
    torch.set_num_threads(1)
    policy = load_policy("tiny-qwen2-vl")
    tokenizer = policy.tokenizer
    samples = generate("embodied", n, split="test", tasks=["pick_place", "cool"], list_actions=False)
    canonical = [tokenizer(s.response, add_special_tokens=False)["input_ids"] for s in samples]
    pieces = [[i for k in range(0, len(s.response), 3) for i in tokenizer(s.response[k:k + 3], add_special_tokens=False)["input_ids"]]
              for s in samples]
    t_tok = timed(lambda: [parse_response_plan(tokenizer, ids) for ids in canonical]) / n
    t_pre = timed(lambda: [parse_response_plan(tokenizer, ids) for ids in pieces]) / n
    paths = {parse_response_plan(tokenizer, canonical[0]).path, parse_response_plan(tokenizer, pieces[0]).path}
    engine = HFEngine(policy)
    requests = [engine.encode(s) for s in samples[:batch]]
    trajectories = []
    for request, ids in zip(requests, canonical[:batch], strict=True):
        trajectories.append(SimpleNamespace(sample=request.sample, prompt_ids=torch.tensor(request.prompt_ids),
                                            vision=request.vision, response_ids=torch.tensor(ids), reward=0.0,
                                            reward_parts={"accuracy": 0.0}, turns=[]))
    T = max(len(ids) for ids in canonical[:batch])
    mask = torch.zeros(batch, T)
    for b, ids in enumerate(canonical[:batch]):
        mask[b, : len(ids)] = 1
    episode = torch.randn(batch, 1) * mask
    rule = parse_options({"signal": "rule", "match": "prefix"})
    proxy = parse_options({"signal": "forward_proxy", "proxy": "residual_contrast"})
    t_rule = timed(lambda: shape_step_credit(episode, mask, trajectories, policy=policy, options=rule))
    t_proxy = timed(lambda: shape_step_credit(episode, mask, trajectories, policy=policy, options=proxy,
                                              teacher_model=policy.model), repeats=2)
    t_gen = timed(lambda: engine.generate(requests, SamplingParams(n=1, temperature=1.0, max_new_tokens=T)), repeats=1)
    print(f"step-credit overhead, tiny-qwen2-vl, {n} responses (pick_place + cool gold plans), batch {batch}, {T} tokens max")
    print(f"paths exercised: {sorted(paths)}")
    print("| what | seconds | per response (ms) |\n|---|---|---|")
    print(f"| span mapping, tokenizer offsets | {t_tok * n:.3f} | {1000 * t_tok:.2f} |")
    print(f"| span mapping, prefix decoding | {t_pre * n:.3f} | {1000 * t_pre:.2f} |")
    print(f"| rule shaper, batch of {batch} | {t_rule:.3f} | {1000 * t_rule / batch:.2f} |")
    print(f"| forward-proxy shaper (2 passes), batch of {batch} | {t_proxy:.3f} | {1000 * t_proxy / batch:.2f} |")
    print(f"| generation of the batch ({T} new tokens) | {t_gen:.3f} | {1000 * t_gen / batch:.2f} |")
    print(f"ratios: prefix decoding / tokenizer offsets = {t_pre / t_tok:.1f}x; rule shaper / generation = "
          f"{t_rule / t_gen:.3f}; forward proxy / generation = {t_proxy / t_gen:.2f}")


if __name__ == "__main__":
    main()
