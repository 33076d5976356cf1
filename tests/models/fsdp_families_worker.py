"""The 2-rank torchrun worker of test_families_cli.py: every family, FSDP2-sharded by `wrap_model`, on the same
batch as an unsharded copy (both ranks take the whole batch, so FSDP2's averaged gradients equal the copy's).

    torchrun --nproc_per_node 2 fsdp_families_worker.py OUT_JSON DIR [DIR ...]

Per family it records the largest |Δ| of the response log-probs and of every full gradient between the sharded
model and the copy, and whether greedy generation on the sharded model (every rank steps until all finish)
gives the copy's tokens.
"""

import json
import sys

import torch

from vlrl.config import DistConfig
from vlrl.data import generate
from vlrl.models import collate, load_policy, response_logprobs
from vlrl.rollout import HFEngine, SamplingParams
from vlrl.train.distributed import init_distributed, shutdown_distributed, wrap_model


def _loss(policy, tokens):
    logp, _ = response_logprobs(policy.model, policy.adapter, tokens)
    return logp, -logp.sum()


def main(out: str, dirs: list[str]) -> None:
    cfg = DistConfig(strategy="fsdp")
    ctx = init_distributed(cfg)
    results = {}
    for path in dirs:
        single, sharded = load_policy(path), load_policy(path)
        engine = HFEngine(single)
        a, b = [engine.encode(s) for s in generate("shapes", 2, tasks=["count", "color"])]
        words = single.adapter.encode_text("<answer>3</answer>")
        tokens = collate([a.prompt_ids, b.prompt_ids, a.prompt_ids], [words, words[:2], words[:3]],
                         [a.vision, b.vision, a.vision], pad_token_id=single.pad_token_id)  # rows 0, 2 share an image
        logp_1, loss_1 = _loss(single, tokens)
        loss_1.backward()
        greedy = SamplingParams(temperature=0, max_new_tokens=4)
        tokens_1 = [t.response_ids.tolist() for t in engine.generate([a, b], greedy)]
        sharded.model = wrap_model(sharded.model, ctx, cfg)
        logp_2, loss_2 = _loss(sharded, tokens)
        loss_2.backward()
        grad_gap = 0.0
        reference = dict(single.model.named_parameters())
        for name, param in sharded.model.named_parameters():
            full = param.grad.full_tensor() if param.grad is not None else None
            if reference[name].grad is None or full is None:
                assert reference[name].grad is None and full is None, name
                continue
            grad_gap = max(grad_gap, float((full - reference[name].grad).abs().max()))
        tokens_2 = [t.response_ids.tolist() for t in HFEngine(sharded).generate([a, b], greedy)]
        results[path] = {"logp_gap": float((logp_1 - logp_2).abs().max()), "grad_gap": grad_gap,
                         "grad_scale": max(float(p.grad.abs().max()) for p in reference.values() if p.grad is not None),
                         "same_tokens": tokens_1 == tokens_2}
    if ctx.rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    shutdown_distributed(ctx)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(sys.argv[1], sys.argv[2:])
