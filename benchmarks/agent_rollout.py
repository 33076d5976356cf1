"""Multi-turn rollout throughput: the batched agent loop (`multi_turn`, one engine call per turn for all
episodes) against one episode at a time (`per_sample`), side by side on the tiny Qwen2-VL, same prompts.

    PYTHONPATH=src python benchmarks/agent_rollout.py [--prompts 8] [--n 4] [--turns 3]
"""

from __future__ import annotations

import argparse
import time

import torch

from vlrl.data import generate
from vlrl.models import load_policy
from vlrl.rollout import HFEngine, SamplingParams
from vlrl.rollout.agent import AgentSettings, agent_metrics, multi_turn, per_sample
from vlrl.rollout.env import env_factory


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    engine = HFEngine(load_policy("tiny-qwen2-vl"))
    requests = [engine.encode(s) for s in generate("shapes", args.prompts, tasks=["color", "count"])]
    sampling = SamplingParams(n=args.n, max_new_tokens=args.max_new_tokens)
    agent = AgentSettings(env=env_factory("shapes_feedback", {"zoom": True}), max_turns=args.turns)
    multi_turn(engine, requests[:1], sampling, agent=agent)  # warm-up
    results = {}
    for name, fn in (("multi_turn (batched)", multi_turn), ("per_sample (one by one)", per_sample)):
        start = time.perf_counter()
        trajectories = fn(engine, requests, sampling, agent=agent)
        seconds = time.perf_counter() - start
        m = agent_metrics(trajectories)
        results[name] = seconds
        print(f"{name:26s} {len(trajectories)} episodes in {seconds:6.2f} s = {len(trajectories) / seconds:6.1f} episodes/s"
              f"  (turns {m['agent/turns_mean']:.2f}, images/episode {m['agent/images_per_trajectory']:.2f},"
              f" action/obs tokens {m['agent/action_tokens_mean']:.1f}/{m['agent/observation_tokens_mean']:.1f})")
    batched, single = results.values()
    print(f"speed-up of the batched loop: {single / batched:.1f}x")


if __name__ == "__main__":
    main()
