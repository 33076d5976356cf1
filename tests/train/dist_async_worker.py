"""The asynchronous recipe on 2 ranks (and on 1): `train_rl` (the asynchronous feed) at η = 0 with a scripted asynchronous engine
(responses fixed per prompt) and the tiny policy, FSDP2 over gloo. Run by tests/train/test_async_ranks.py:

    torchrun --standalone --nproc_per_node 2 tests/train/dist_async_worker.py MODEL_DIR OUT_FILE [fail]

Rank 0 writes OUT_FILE: {"records": the logged metrics per step, "state": the final full weights, "initial": the
weights before training, "accounted": every drawn ticket accounted for in rank 0's final state}.
With ``fail`` the engine fails once the trainer published version 1: every rank writes the error it stopped with to
OUT_FILE.rank<r>.
"""

import asyncio
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from dist_dynamic_worker import TokenEngine  # noqa: E402
from fakes import scripted_samples, train_async  # noqa: E402

from vlrl.config import DistConfig, RLStage  # noqa: E402
from vlrl.models import load_policy  # noqa: E402
from vlrl.report import MetricsLogger  # noqa: E402
from vlrl.train.distributed import init_distributed, shutdown_distributed, unwrap, wrap_model  # noqa: E402
from vlrl.train.runtime import Runtime  # noqa: E402

STEPS = 3
# answer "a"; responses of 1–4 tokens, mixed right and wrong in most groups (non-zero advantages); 8 prompts, so
# the cursor goes around once within 3 steps of 4 prompts. 4 responses per prompt: 16 per step, 8 per rank, in
# micro-batches of 3 (3+3+3+3+3+1 on 1 rank, 3+3+2 on each of 2): the logged numbers must not care.
SPECS = [("a", ["a", "bb", "abc", "a"], "a"), ("a", ["b", "aaaa"], "b"), ("a", ["a", "ba", "bc", "c"], "a"),
         ("a", ["cab", "a"], "b"), ("a", ["b", "bb", "a", "aa"], "a"), ("a", ["ab", "a", "cc"], "a"),
         ("a", ["a", "bcb", "b"], "a"), ("a", ["ccc", "a", "b", "abab"], "b")]


class AsyncTokenEngine(TokenEngine):
    """`TokenEngine` with ``agenerate``: the responses carry the engine's weight version (what the trainer last
    published), as a server's would."""

    async def agenerate(self, requests, sampling):
        await asyncio.sleep(0)
        out = self.generate(requests, sampling)
        for t in out:
            t.weight_version = self.weight_version
        return out

    def close(self):
        pass


class FailingEngine(AsyncTokenEngine):
    """Generates for version 0, then every request fails (every rollout server gone)."""

    async def agenerate(self, requests, sampling):
        if self.weight_version >= 1:
            raise RuntimeError("every rollout server was dropped (scripted)")
        return await super().agenerate(requests, sampling)


def stage() -> RLStage:
    return RLStage.model_validate({
        "train": {"steps": STEPS, "prompts_per_step": 4, "micro_batch_size": 3, "log_every": 1},
        "rollout": {"n": 4, "max_new_tokens": 4, "mode": "async"}, "optim": {"lr": 1e-3}, "staleness": {"eta": 0}})


def full(module: torch.nn.Module) -> dict:
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()  # FSDP2: gathered
            for k, v in unwrap(module).state_dict().items()}


def run(model_dir: str, ctx, engine=None) -> dict:
    """One process when ``ctx`` is None; else the ranks of ``ctx`` (FSDP2)."""
    policy = load_policy(model_dir)
    initial = full(policy.model)
    cfg = DistConfig(strategy="fsdp")
    rt = Runtime(ctx, wrap_model(policy.model, ctx, cfg), cfg) if ctx is not None else None
    logger, state = MetricsLogger(None, quiet=True), {}
    train_async(policy, engine or AsyncTokenEngine(), scripted_samples(SPECS), stage(), logger=logger, seed=0,
                     state_out=state, runtime=rt)
    tickets = state.get("trained", []) + state.get("discarded", []) + state.get("buffered", []) + state.get("pending", [])
    accounted = bool(state) and sorted(tickets) == list(range(state["drawn"]))
    return {"records": logger.records, "state": full(rt.module if rt is not None else policy.model), "initial": initial,
            "accounted": accounted}


def main(model_dir: str, out_file: str, mode: str = "") -> None:
    ctx = init_distributed(DistConfig(strategy="fsdp"))
    if mode == "fail":
        try:
            run(model_dir, ctx, FailingEngine())
            error = "no error"
        except Exception as err:  # noqa: BLE001 — what each rank stopped with is the test's subject
            error = f"{type(err).__name__}: {err}"
        Path(f"{out_file}.rank{ctx.rank}").write_text(error)
        ctx.barrier()  # both ranks got here: neither waits for a batch that never comes
    else:
        result = run(model_dir, ctx)
        if ctx.rank == 0:
            torch.save(result, out_file)
    shutdown_distributed(ctx)


if __name__ == "__main__":
    main(*sys.argv[1:4])
