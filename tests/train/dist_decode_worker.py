"""The 2-rank side of tests/train/test_decode_ranks.py: in-process generation on an FSDP2-sharded tiny VLM where
each rank's rows end at different steps (a stop set of 200 token ids at temperature 3: every step ends ~20 % of
the rows). Prints one line per batch: the rank and its rows' response lengths."""

import sys

import torch
import torch.distributed as dist

from vlrl.config import DistConfig
from vlrl.data import generate
from vlrl.models import load_policy
from vlrl.rollout import HFEngine
from vlrl.rollout.types import SamplingParams
from vlrl.train.distributed import init_distributed, shutdown_distributed, wrap_model

ctx = init_distributed(DistConfig())
policy = load_policy(sys.argv[1])
policy.model = wrap_model(policy.model, ctx, DistConfig())
engine = HFEngine(policy, max_batch_size=4)  # two batches per call: the second's prefill follows the first's steps
samples = generate("shapes", 16, tasks=["count"], split="test")[ctx.rank * 8 : (ctx.rank + 1) * 8]
requests = [engine.encode(s) for s in samples]
torch.manual_seed(ctx.rank)
stops = list(range(200, 400))
for _ in range(3):
    out = engine.generate(requests, SamplingParams(n=1, temperature=3.0, max_new_tokens=16, stop_token_ids=stops))
    print(f"rank {ctx.rank} lengths {[len(t.response_ids) for t in out]}\n", end="", flush=True)  # one write
dist.barrier()
shutdown_distributed(ctx)
