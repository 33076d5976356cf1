"""Reward shaping over the global batch (`GlobalRewardShaping`) on 2 ranks, run by
tests/train/test_syn_grpo_ranks.py:

    torchrun --standalone --nproc_per_node 2 tests/train/dist_shaping_worker.py OUT_FILE

Each rank shapes its half of `shaping_batch` (two steps, syn_diversity's EMA carried between them); rank 0 writes
OUT_FILE: {"values": both ranks' shaped rewards per step in batch order, "metrics": per step, "states": the chain's
state after each step, on each rank}.
"""

import sys

import torch


def shaping_batch(step: int):
    """8 responses, 4 prompts × 2: accuracies 1/0 (V = 1) or equal (V = 0), chosen per prompt and step so that the
    two halves of the batch (rank 0: prompts 0-1, rank 1: prompts 2-3) have different batch diversities."""
    from vlrl.data import Sample
    from vlrl.rollout import Trajectory

    spread = [(True, False, False, False), (True, True, False, True)][step]  # prompt → its 2 accuracies differ
    out = []
    for g, differ in enumerate(spread):
        for k in range(2):
            accuracy = float(k == 0) if differ else 1.0
            text = f"<diversity>{0.1 * (g + 2 * k + step)}</diversity><description>wall</description><answer>1</answer>"
            out.append(Trajectory(sample=Sample(f"p{g}", "t", []), prompt_ids=torch.tensor([1, 2]),
                                  response_ids=torch.tensor([3, 4, 5]), loss_mask=torch.ones(3),
                                  behaviour_logp=torch.zeros(3), response_text=text, group_index=g, reward=accuracy,
                                  accuracy=accuracy, reward_parts={"accuracy": accuracy}))
    return out


def shaping_inputs(trajectories, group_offset: int = 0, step: int = 0):
    from vlrl.algos.shaping import RewardShapingInputs

    return RewardShapingInputs(rewards=torch.tensor([t.reward for t in trajectories]),
                               group_index=torch.tensor([t.group_index - group_offset for t in trajectories]),
                               response_length=torch.full((len(trajectories),), 3), truncated=torch.zeros(len(trajectories), dtype=torch.bool),
                               max_new_tokens=8, trajectories=trajectories, step=step)


def chain():
    from vlrl.algos.shaping import get_reward_shaping
    from vlrl.config import ShapingSpec
    from vlrl.train.batch import ShapingChain

    return ShapingChain([ShapingSpec(name="syn_diversity", options={"gamma": 0.7})], get_reward_shaping, "rewards")


def main(out_file: str) -> None:
    from vlrl.config import DistConfig
    from vlrl.train.distributed import GlobalRewardShaping, init_distributed, shutdown_distributed

    ctx = init_distributed(DistConfig())
    shaping = GlobalRewardShaping.over(chain(), ctx)
    result = {"values": [], "metrics": [], "states": []}
    for step in range(2):
        mine = shaping_batch(step)[4 * ctx.rank : 4 * ctx.rank + 4]
        values, metrics = shaping.apply(shaping_inputs(mine, group_offset=2 * ctx.rank, step=step))
        result["values"].append(torch.cat(ctx.gather_objects(values)))
        result["metrics"].append(metrics)
        result["states"].append(ctx.gather_objects(shaping.states))
    if ctx.is_main:
        torch.save(result, out_file)
    shutdown_distributed(ctx)


if __name__ == "__main__":
    main(sys.argv[1])
