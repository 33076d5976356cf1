"""Experiment: what raising ε_high does to entropy when nothing but the clip differs — a tabular GRPO bandit.

    python benchmarks/exp_clip_bandit.py            # every setting, 10 seeds each (about a minute of CPU)
    python benchmarks/exp_clip_bandit.py --quick    # 2 seeds, 2 settings (15 s of CPU)

The companion of `exp_clip_higher.py` (docs/experiments/clip_higher_dynamic_sampling.md). There the tiny VLM
showed no entropy difference between clip-higher and symmetric clipping; this strips the question down to
the clip itself, with many seeds, so that the direction of the effect can be read without model noise:

- the policy is a table of logits, one softmax over ``K`` answers per prompt (a one-token response — the
  shapes answers are one word); ``M`` of the answers are correct (reward 1) — or, with ``reward=random``,
  every answer is rewarded 1 with probability 1/2 (the random-reward setting of Park et al. 2025,
  "Clip-Low Increases Entropy and Clip-High Decreases Entropy in RL of LLMs", arXiv:2509.26114);
- each step samples ``n`` answers for each of ``prompts`` prompts, takes vlrl's own ``grpo`` advantages and
  ``ppo_clip`` loss with ``token_mean`` aggregation, and makes ``minibatches × epochs`` Adam (or SGD) steps
  on the batch, as the VLM runs do (16 per rollout step);
- every arm of a seed shares the initial logits, the prompt order and the generator seed; arms differ only
  in (ε_low, ε_high): ``symmetric`` 0.2/0.2, ``clip-higher`` 0.2/0.28 (DAPO), ``no-upper`` 0.2/∞, and two arms
  that tell ε_high's part from the asymmetry's — ``wide`` 0.28/0.28 and ``lower-wider`` 0.28/0.2.

Entropy is the mean over all prompts of the exact entropy of the policy's answer distribution (no sampling
noise in the metric). Printed per setting: entropy at the start and end, the run-mean entropy difference to
``symmetric`` (mean over seeds, and in how many seeds it was positive), the same for the expected reward,
and the share of positive-advantage samples the upper clip stopped.
"""

from __future__ import annotations

import argparse
import time

import torch

from vlrl.algos import AdvantageInputs, PolicyLossInputs, aggregate, get_advantage, get_policy_loss

ARMS = {"symmetric": (0.2, 0.2), "clip-higher": (0.2, 0.28), "no-upper": (0.2, 1e9), "wide": (0.28, 0.28), "lower-wider": (0.28, 0.2)}

# (name, reward, init, optimizer, lr): init "spread" = logits ~ N(0, 1.5²); "peaked-wrong" = logits ~ N(0, 0.5²)
# with +3 on one wrong answer and +1.5 on the (first) correct one — confidently wrong, correct answer the
# runner-up, the state of an SFT model with pass@1 well below pass@8.
SETTINGS = (
    ("one correct, spread, Adam 0.05", "correct", "spread", "adam", 0.05),
    ("one correct, spread, Adam 0.2", "correct", "spread", "adam", 0.2),
    ("one correct, peaked-wrong, Adam 0.05", "correct", "peaked-wrong", "adam", 0.05),
    ("three correct, spread, Adam 0.05", "correct3", "spread", "adam", 0.05),
    ("one correct, spread, SGD 10", "correct", "spread", "sgd", 10.0),
    ("random reward, spread, Adam 0.05", "random", "spread", "adam", 0.05),
    ("random reward, peaked-wrong, Adam 0.05", "random", "peaked-wrong", "adam", 0.05),
    ("random reward, spread, SGD 10", "random", "spread", "sgd", 10.0),
)


def make_problem(reward: str, init: str, num_prompts: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Initial logits (P, K) and the correct-answer mask (P, K); fixed across seeds and arms."""
    g = torch.Generator().manual_seed(123)
    scale = 1.5 if init == "spread" else 0.5
    logits = torch.randn(num_prompts, k, generator=g) * scale  # (P, K)
    m = 3 if reward == "correct3" else 1
    order = torch.rand(num_prompts, k, generator=g).argsort(dim=1)  # (P, K) a random permutation per prompt
    correct = torch.zeros(num_prompts, k, dtype=torch.bool)
    correct.scatter_(1, order[:, :m], True)
    if init == "peaked-wrong":
        rows = torch.arange(num_prompts)
        logits[rows, order[:, m]] += 3.0  # a wrong answer becomes the mode
        logits[rows, order[:, 0]] += 1.5  # the correct one the runner-up
    return logits, correct


def run_arm(logits0, correct, *, clip, reward, optimizer, lr, seeds, steps, prompts, n, minibatches, epochs):
    """``seeds`` independent GRPO runs on the table, batched: every seed has its own copy of the logits and its
    own samples, and its loss only reaches its own copy (Adam and SGD act per element, so this is exactly
    ``seeds`` separate runs). Returns per seed and step the entropy, the expected reward and the share of
    positive-advantage samples the upper clip stopped; each a (S, steps) tensor."""
    advantage_fn, loss_fn = get_advantage("grpo"), get_policy_loss("ppo_clip")
    g = torch.Generator().manual_seed(0)
    num_prompts, k = logits0.shape
    S, B = seeds, prompts * n
    logits = logits0.expand(S, num_prompts, k).clone().requires_grad_(True)  # (S, P, K)
    opt = torch.optim.Adam([logits], lr=lr) if optimizer == "adam" else torch.optim.SGD([logits], lr=lr)
    seed_rows = torch.arange(S)[:, None]  # (S, 1)
    groups = torch.arange(S * prompts).repeat_interleave(n)  # (S·B,) a group never spans two seeds
    mask = torch.ones(S * B, 1)  # (S·B, 1): a one-token response
    entropy, expected_reward, clip_share = (torch.zeros(S, steps) for _ in range(3))
    for step in range(steps):
        with torch.no_grad():
            probs = logits.softmax(-1)  # (S, P, K)
            entropy[:, step] = -(probs * probs.clamp_min(1e-30).log()).sum(-1).mean(-1)
            expected_reward[:, step] = (probs * correct).sum(-1).mean(-1)
            prompt_ids = torch.randint(0, num_prompts, (S, prompts), generator=g).repeat_interleave(n, dim=1)  # (S, B)
            answers = torch.multinomial(probs[seed_rows, prompt_ids].reshape(S * B, k), 1, generator=g)  # (S·B, 1)
            answers = answers.reshape(S, B)
            if reward == "random":
                rewards = (torch.rand(S, B, generator=g) < 0.5).float()  # (S, B)
            else:
                rewards = correct[prompt_ids, answers].float()  # (S, B)
            adv = advantage_fn(AdvantageInputs(token_rewards=rewards.reshape(-1, 1), loss_mask=mask,
                                               group_index=groups)).advantages.reshape(S, B)
            old_logp = probs[seed_rows, prompt_ids, answers].log()  # (S, B)
        clipped, positive = torch.zeros(S), torch.zeros(S)
        for _ in range(epochs):
            for cols in torch.randperm(B, generator=g).chunk(minibatches):
                b = len(cols)
                logp = logits[seed_rows, prompt_ids[:, cols]].log_softmax(-1)  # (S, b, K)
                logp = logp.gather(2, answers[:, cols, None]).reshape(S * b, 1)  # (S·b, 1)
                out = loss_fn(PolicyLossInputs(logp=logp, old_logp=old_logp[:, cols].reshape(-1, 1),
                                               advantages=adv[:, cols].reshape(-1, 1), loss_mask=mask[: S * b]),
                              clip_low=clip[0], clip_high=clip[1])
                # token_mean per seed (its minibatch of b tokens is its optimiser batch), summed over seeds
                loss = aggregate(out.per_token_loss, mask[: S * b], "token_mean", normaliser=b)
                opt.zero_grad()
                loss.backward()
                opt.step()
                clipped += out.metrics["clip_high"].reshape(S, b).sum(1)
                positive += (adv[:, cols] > 0).sum(1)
        clip_share[:, step] = clipped / positive.clamp_min(1.0)
    return entropy, expected_reward, clip_share


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument("--answers", type=int, default=10, help="K, the answers per prompt")
    parser.add_argument("--prompts", type=int, default=16, help="prompts per step")
    parser.add_argument("--n", type=int, default=8, help="samples per prompt")
    parser.add_argument("--minibatches", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    settings = SETTINGS[::4] if args.quick else SETTINGS
    seeds = 2 if args.quick else args.seeds
    t0 = time.time()
    print(f"{args.steps} steps × {args.prompts} prompts × {args.n} samples, {args.minibatches} minibatches × "
          f"{args.epochs} epochs; {args.num_prompts} prompts × {args.answers} answers; {seeds} seeds")
    header = ("setting", "arm", "H start", "H end", "ΔH run-mean vs sym (seeds >0)", "ΔH end vs sym (seeds >0)",
              "R end", "ΔR run-mean vs sym", "upper clip / A>0")
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for name, reward, init, optimizer, lr in settings:
        logits0, correct = make_problem(reward, init, args.num_prompts, args.answers)
        runs = {arm: run_arm(logits0, correct, clip=clip, reward=reward, optimizer=optimizer, lr=lr, seeds=seeds,
                             steps=args.steps, prompts=args.prompts, n=args.n, minibatches=args.minibatches,
                             epochs=args.epochs) for arm, clip in ARMS.items()}
        h0, r0 = runs["symmetric"][0], runs["symmetric"][1]

        def versus(d: torch.Tensor, arm: str) -> str:  # d: (S,) arm − symmetric, per seed
            return f"{d.mean():+.4f} ({int((d > 0).sum())}/{seeds})" if arm != "symmetric" else ""

        for arm, (h, r, c) in runs.items():
            h_mean, h_end, r_mean = h.mean(1) - h0.mean(1), h[:, -1] - h0[:, -1], r.mean(1) - r0.mean(1)  # (S,)
            cells = [f"{h[0, 0]:.3f}", f"{h[:, -1].mean():.3f}", versus(h_mean, arm), versus(h_end, arm),
                     f"{r[:, -1].mean():.3f}", f"{r_mean.mean():+.4f}" if arm != "symmetric" else "", f"{c.mean():.3f}"]
            print(f"| {name} | {arm} | " + " | ".join(cells) + " |", flush=True)
    print(f"total {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()
