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
            accuracy=float(accuracy[i]) if accuracy is not None else None,
        ))
    return out


class ScriptedEngine:
    """An `Engine` without a model: the responses to a sample are ``sample.metadata["responses"]`` (cycled),
    and its greedy response (temperature 0) is ``sample.metadata["greedy"]``; a text listed in
    ``sample.metadata["truncated"]`` comes back TRUNCATED (cut at the token budget). Counts generated prompts."""

    def __init__(self):
        self.weight_version = 0
        self.prompts_generated = 0

    def encode(self, sample):
        from vlrl.rollout import Request

        return Request(sample=sample, prompt_ids=[1, 2, 3])

    def generate(self, requests, sampling):
        out = []
        for i, request in enumerate(requests):
            meta = request.sample.metadata
            texts = [meta["greedy"]] * sampling.n if sampling.temperature == 0 else \
                [meta["responses"][j % len(meta["responses"])] for j in range(sampling.n)]
            for text in texts:
                n = max(1, len(text))
                status = Status.TRUNCATED if text in meta.get("truncated", ()) else Status.COMPLETED
                out.append(Trajectory(sample=request.sample, prompt_ids=torch.tensor(request.prompt_ids),
                                      response_ids=torch.arange(4, 4 + n), loss_mask=torch.ones(n, dtype=torch.long),
                                      behaviour_logp=-torch.ones(n), response_text=text, group_index=i,
                                      status=status))
        self.prompts_generated += len(requests)
        return out

    def update_weights(self, *, version, state_dict=None):
        self.weight_version = version


def scripted_samples(specs, reward="string_match"):
    """``specs``: (answer, responses, greedy) per sample; rewarded by exact string match."""
    return [Sample(id=f"q{k}", task="scripted", messages=[{"role": "user", "content": "q"}], answer=answer,
                   reward=reward, metadata={"responses": list(responses), "greedy": greedy})
            for k, (answer, responses, greedy) in enumerate(specs)]


def train_async(policy, engine, samples, stage, **kwargs):
    """`vlrl.train.loop.train_rl` with ``rollout.mode=async`` (the asynchronous feed) on a stage built without it."""
    from vlrl.train.loop import train_rl

    stage = stage.model_copy(update={"rollout": stage.rollout.model_copy(update={"mode": "async"})})
    return train_rl(policy, engine, samples, stage, **kwargs)
