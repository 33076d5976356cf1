"""Hand-made trajectories for step-level tests that need no model (rewards, lengths, statuses chosen by hand)."""

import torch

from vlrl.data import Sample
from vlrl.rollout import Status, Trajectory


def fake_trajectories(rewards, groups, lengths, *, statuses=None, accuracy=None, masks=None, task="fake/task"):
    """One `Trajectory` per reward: ``lengths[i]`` response tokens (all model tokens unless ``masks`` gives the
    loss mask), behaviour log-prob −1 per token, ``status`` COMPLETED unless given."""
    out = []
    for i, (r, g, n) in enumerate(zip(rewards, groups, lengths, strict=True)):
        sample = Sample(id=f"s{g}", task=task, messages=[{"role": "user", "content": "q"}])
        mask = torch.tensor(masks[i], dtype=torch.long) if masks is not None else torch.ones(n, dtype=torch.long)
        parts = {"accuracy": float(accuracy[i])} if accuracy is not None else {}
        out.append(Trajectory(
            sample=sample, prompt_ids=torch.tensor([1, 2, 3]), response_ids=torch.arange(4, 4 + n),
            loss_mask=mask, behaviour_logp=-torch.ones(n) * mask, status=statuses[i] if statuses else Status.COMPLETED,
            response_text="x" * n, group_index=g, reward=float(r), reward_parts=parts,
        ))
    return out
