"""Peak memory of a GRPO update with a real vocabulary: the full fp32 logits vs chunked log-probs (train.logprob_chunk).

    python benchmarks/logprob_memory.py                     # 2 rows of 1,024 tokens (256 prompt + 768 response)
    python benchmarks/logprob_memory.py --rows 1 --repeats 1

A tiny Qwen2 text model built from a config (hidden 64, 2 layers, tied embeddings) with Qwen's vocabulary of
151,936 tokens, random weights, fp32, and one GRPO group of ``--rows`` responses to one prompt (random token ids,
distinct advantages). Every arm runs the same `ppo_update` (one optimizer step, train.shared_prefix on as
shipped): the teacher-forced forward + backward of all rows as one micro-batch, then AdamW. The arms differ only in
``train.logprob_chunk``: 0 (the whole logits, as before: [rows × response tokens, V] in fp32 plus the log-softmax
and the entropy's temporaries) and ``auto`` (chunks of ⌊2^26 / V⌋ = 441 tokens, each recomputed in the backward).

Peak memory is torch's MemTracker on CPU (every tensor storage allocated, by category: parameters, gradients,
optimizer state, activations and temporaries) over the update's forward + backward, after a warm-up update so the
AdamW moments exist — a count of the tensors, independent of the machine's load and of the allocator. Time: the
median CPU seconds of this process over whole `ppo_update` calls (one torch thread; less load-dependent than wall
time on a shared machine, not free of it; the arms alternate).
"""

from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace

import torch

VOCAB = 151_936  # Qwen2 / Qwen2.5-VL / Qwen3-VL


def tiny_policy():
    """A Qwen2 causal LM of width 64 with the real vocabulary, wrapped as a vlrl `Policy` (no tokenizer needed:
    the token ids are drawn at random)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from vlrl.models.adapters import TextAdapter
    from vlrl.models.policy import Policy

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                         max_position_embeddings=4096)
    config._attn_implementation = "sdpa"
    model = Qwen2ForCausalLM(config).eval()
    tokenizer = SimpleNamespace(pad_token_id=0, eos_token_id=1)
    return Policy(model, tokenizer, None, TextAdapter(tokenizer), source="benchmark")


def group_batch(rows: int, prompt_len: int, response_len: int):
    """One prompt, ``rows`` responses of ``response_len`` tokens: the `UpdateBatch` of one GRPO group."""
    from vlrl.train.update import UpdateBatch

    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(2, VOCAB, (prompt_len,), generator=generator)
    trajectories = [SimpleNamespace(prompt_ids=prompt, response_ids=torch.randint(2, VOCAB, (response_len,),
                                                                                  generator=generator), vision=None)
                    for _ in range(rows)]
    mask = torch.ones(rows, response_len)
    advantages = torch.linspace(-1, 1, rows).unsqueeze(1).expand(rows, response_len).clone()
    return UpdateBatch(trajectories=trajectories, loss_mask=mask, behaviour_logp=torch.full_like(mask, -12.0),
                       advantages=advantages, old_logp=None, ref_logp=None, group_index=torch.zeros(rows, dtype=torch.long),
                       rewards=advantages[:, 0], token_rewards=torch.zeros_like(mask),
                       same_version=torch.ones(rows, dtype=torch.bool))


def settings_for(chunk, rows: int):
    from vlrl.algos import get_policy_loss
    from vlrl.train.update import UpdateSettings

    return UpdateSettings(loss_fn=get_policy_loss("ppo_clip"), loss_agg="token_mean", kl_coef=0.0, kl_estimator="k3",
                          temperature=1.0, micro_batch_size=rows, minibatches=1, ppo_epochs=1, grad_clip=1.0,
                          shared_prefix=True, logprob_chunk=chunk)


def peak_of_update(policy, batch, settings, optimizer) -> dict[str, float]:
    """MemTracker's peak (bytes by category) over the update's forward + backward of every row."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from vlrl.train.update import accumulate

    tracker = MemTracker()
    tracker.track_external(policy.model, optimizer)
    policy.model.train()
    with tracker:
        accumulate(policy, batch, range(len(batch.trajectories)), settings, normaliser=float(batch.loss_mask.sum()))
        optimizer.zero_grad(set_to_none=False)
    policy.model.eval()
    return {str(k).split(".")[-1].lower(): v for k, v in tracker.get_tracker_snapshot("peak")[torch.device("cpu")].items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2, help="responses in the group (rows of the micro-batch)")
    parser.add_argument("--prompt", type=int, default=256, help="prompt tokens")
    parser.add_argument("--response", type=int, default=768, help="response tokens per row")
    parser.add_argument("--repeats", type=int, default=2, help="timed updates per arm (median)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from vlrl.config import OptimConfig
    from vlrl.models.logprobs import chunk_tokens
    from vlrl.train.common import make_optimizer
    from vlrl.train.update import ppo_update

    policy = tiny_policy()
    batch = group_batch(args.rows, args.prompt, args.response)
    scored = args.rows * args.response
    print(f"Qwen2 text model, hidden 64, 2 layers, vocabulary {VOCAB:,} ({policy.num_parameters() / 1e6:.1f}M "
          f"parameters, fp32, torch {torch.__version__}); one group of {args.rows} rows × {args.prompt + args.response:,} "
          f"tokens ({args.prompt} prompt + {args.response} response), {scored:,} scored tokens: their fp32 logits are "
          f"{scored * VOCAB * 4 / 2**30:.2f} GiB; auto chunks of {chunk_tokens('auto', scored, VOCAB)} tokens")
    arms = {"whole logits (logprob_chunk=0)": 0, "chunked (logprob_chunk=auto)": "auto"}
    results = {}
    for name, chunk in arms.items():
        settings = settings_for(chunk, args.rows)
        optimizer, scheduler = make_optimizer(policy.model, OptimConfig(lr=1e-6, warmup_steps=0))
        ppo_update(policy, batch, settings, optimizer, scheduler, seed=0, step=0)  # warm-up: the moments exist
        results[name] = {"peak": peak_of_update(policy, batch, settings, optimizer), "seconds": [],
                         "state": (settings, optimizer, scheduler)}
    for r in range(args.repeats):  # alternated: both arms see the same load
        for result in results.values():
            settings, optimizer, scheduler = result["state"]
            start = time.process_time()
            ppo_update(policy, batch, settings, optimizer, scheduler, seed=0, step=1 + r)
            result["seconds"].append(time.process_time() - start)
    print(f"{'arm':<32s}{'peak GiB':>10s}{'activations + temporaries GiB':>31s}{'update CPU s':>14s}")
    for name, result in results.items():
        peak = result["peak"]
        print(f"{name:<32s}{peak['total'] / 2**30:10.2f}{peak.get('act', 0) / 2**30 + peak.get('temp', 0) / 2**30:31.2f}"
              f"{statistics.median(result['seconds']):14.2f}")
    (whole, chunked) = results.values()
    print(f"chunked vs whole: peak ÷{whole['peak']['total'] / chunked['peak']['total']:.2f}, update time "
          f"×{statistics.median(chunked['seconds']) / statistics.median(whole['seconds']):.2f}")


if __name__ == "__main__":
    main()
