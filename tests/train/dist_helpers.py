"""Helpers shared by the distributed tests and their torchrun worker (`dist_worker.py` imports this file by
path, so it holds no relative imports): child-process plumbing and the fixed SFT batch both sides use."""

import os
import re
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from vlrl.config import SFTStage
from vlrl.data import generate
from vlrl.train.distributed import unwrap
from vlrl.train.sft import encode_sft

REPO = Path(__file__).resolve().parents[2]


def quiet_env(**extra):
    """Environment of a child process: one torch thread (2 shared cores), no tokenizer threads."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def torchrun(nproc: int, *args: str) -> list[str]:
    """A torchrun command line on loopback; --standalone picks a free rendezvous port."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]


# A rank killed by SIGABRT from native code in torch/gloo, not from anything the test checks. Seen on the shared
# 2-core machines and in CI (2026-11-24), about once in six 2-rank jobs: glibc's heap check ("malloc(): unaligned
# fastbin chunk detected") and std::terminate ("terminate called without an active exception"); 16 runs of
# dist_dynamic_worker.py in a row did not reproduce it alone.
NATIVE_ABORT = re.compile(r"unaligned (fastbin|tcache) chunk|malloc\(\)|free\(\): |double free|corrupted (size|double-linked)"
                          r"|terminate called without an active exception")


def run_checked(cmd: list[str], *, timeout: float = 300, retry_native_abort: bool = False,
                env_extra: dict[str, str] | None = None, real_torchrun: bool = False,
                cwd=None) -> subprocess.CompletedProcess:
    """Run ``cmd`` quietly; AssertionError with its output tails when it fails. A `torchrun` or ``python -m
    vlrl.cli`` command runs on processes forked from an already-imported one (tests/forked_runs.py: vlrl's code,
    torchrun's environment, ~5 CPU-s less a process) unless ``real_torchrun``. ``retry_native_abort``: a job
    whose outputs start from nothing (a fresh directory) runs again once when a rank died in a `NATIVE_ABORT`,
    said in the warnings summary; a second abort, or any other failure, fails."""
    import forked_runs  # noqa: PLC0415 (tests/ is on sys.path under pytest; a rank never launches)

    env = quiet_env(**(env_extra or {}))
    if real_torchrun:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=cwd)
    else:
        proc = forked_runs.run(cmd, env=env, cwd=cwd, timeout=timeout)
    if proc.returncode == 0:
        return proc
    message = (f"{' '.join(cmd)} exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n"
               f"--- stderr\n{proc.stderr[-6000:]}")
    aborted = "SIGABRT" in proc.stderr and NATIVE_ABORT.search(proc.stderr)
    if not (retry_native_abort and aborted):
        raise AssertionError(message)
    warnings.warn(f"a rank aborted in native code; ran the job again once:\n{message[-2000:]}", stacklevel=2)
    return run_checked(cmd, timeout=timeout, env_extra=env_extra, real_torchrun=real_torchrun, cwd=cwd)


def kill_process_tree(pid: int) -> None:
    """SIGKILL every process group of ``pid`` and its descendants (torchrun starts each worker in a session
    of its own, so killing the launcher's group alone would orphan the ranks)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry.name))
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo.extend(children.get(p, []))
    groups, own = set(), os.getpgid(0)
    for p in tree:
        try:
            groups.add(os.getpgid(p))
        except ProcessLookupError:
            pass
    for group in groups - {own}:
        try:
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:
            pass


MICRO = 3  # a rank's 4 examples run as micro-batches of 3 + 1: accumulation, gradients synced on the last only


def sft_stage() -> SFTStage:
    return SFTStage.model_validate({"optim": {"lr": 1e-3}, "train": {"steps": 1, "batch_size": 8, "micro_batch_size": MICRO}})


def sft_batch(policy):
    """8 units of one example each, target lengths from 2 to 5 tokens (count and ocr answers), so each rank's
    token count differs and a per-rank normaliser would give a different gradient than the global one."""
    return [[encode_sft(policy, s)] for s in generate("shapes", 8, tasks=["count", "ocr"])]


def grads_of(module) -> dict[str, torch.Tensor]:
    """Full gradients by parameter name (FSDP2 shards are gathered: a collective, every rank calls it)."""
    out = {}
    for name, p in unwrap(module).named_parameters():
        if p.grad is not None:
            grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            out[name] = grad.detach().clone()
    return out


def full_state(model, optimizer):
    return get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


# ----------------------------------------------------------------------------------------------- RL
RL_MICRO = 2  # a rank's 4 responses as micro-batches of 2 + 2


def rl_settings(mode: str):
    from vlrl.algos import get_policy_loss
    from vlrl.train.update import UpdateSettings

    return UpdateSettings(loss_fn=get_policy_loss("ppo_clip"), loss_agg=mode, kl_coef=0.0, kl_estimator="k3",
                          temperature=1.0, micro_batch_size=RL_MICRO, minibatches=1, ppo_epochs=1, grad_clip=1.0)


def rl_trajectories(policy):
    """4 prompts × 2 sampled responses, cut to lengths 2..6 with distinct rewards (every advantage non-zero,
    every rank's token count different): the fixed batch of the RL gradient test."""
    from vlrl.rollout import HFEngine, SamplingParams

    torch.manual_seed(0)
    engine = HFEngine(policy)
    samples = generate("shapes", 4, tasks=["count", "color"])
    trajectories = engine.generate([engine.encode(s) for s in samples], SamplingParams(n=2, max_new_tokens=6))
    for k, t in enumerate(trajectories):
        n = 2 + k % 5
        t.response_ids, t.loss_mask, t.behaviour_logp = t.response_ids[:n], t.loss_mask[:n], t.behaviour_logp[:n]
        t.reward = 0.1 * k * (-1) ** k
    return trajectories


def rl_update_batch(policy, trajectories, runtime=None):
    """The `UpdateBatch` of ``trajectories`` (GRPO advantages over all ranks' responses under a runtime)."""
    from vlrl.config import RLStage
    from vlrl.train.batch import build_algorithm, prepare_batch
    from vlrl.train.distributed import GlobalAdvantage

    stage = RLStage.model_validate({"rollout": {"n": 2}, "train": {"prompts_per_step": 4}})
    algorithm = build_algorithm(stage, policy, apply_behaviour_weight=False)
    if runtime is not None:
        algorithm.advantage_fn = GlobalAdvantage(algorithm.advantage_fn, runtime.ctx)
    return prepare_batch(algorithm, policy, trajectories, step=0, max_new_tokens=6)


# the issue-25 losses on 2 ranks: loss → options making its mechanism act on this 8-response batch (28 tokens)
RL_LOSSES = {"gspo": {}, "cispo": {}, "gmpo": {}, "entropy_bonus": {"coef": 0.1}, "entropy_advantage": {},
             "clip_cov": {"fraction": 0.2, "cov_low": 0.0}, "kl_cov": {"fraction": 0.2}}


def rl_loss_batch(policy, trajectories, loss: str, *, first_row: int = 0, runtime=None):
    """(settings, `UpdateBatch`) of ``trajectories`` for ``loss`` bound from config, with π_old moved off π_θ by
    0.3 · sin(7 · global row + column) (as at a later minibatch: ratios ≠ 1, so clips and KL-Cov's |Δ| act) —
    the same numbers for a row whether it sits on rank 0, rank 1 or in the 1-rank batch (``first_row``)."""
    import dataclasses

    from vlrl.config import RLStage
    from vlrl.train.batch import build_algorithm, prepare_batch
    from vlrl.train.distributed import GlobalAdvantage

    stage = RLStage.model_validate({"rollout": {"n": 2}, "train": {"prompts_per_step": 4}, "algo": {
        "policy_loss": loss, "policy_loss_options": RL_LOSSES[loss], "loss_agg": "seq_mean_token_mean"}})
    algorithm = build_algorithm(stage, policy, apply_behaviour_weight=False)
    if runtime is not None:
        algorithm.advantage_fn = GlobalAdvantage(algorithm.advantage_fn, runtime.ctx)
    algorithm.settings = dataclasses.replace(algorithm.settings, micro_batch_size=RL_MICRO)
    batch = prepare_batch(algorithm, policy, trajectories, step=0, max_new_tokens=6)
    from vlrl.models.forward import score

    old = batch.old_logp if batch.old_logp is not None else score(policy.model, policy, trajectories, 1.0)
    rows = torch.arange(old.shape[0], dtype=old.dtype).unsqueeze(1) + first_row
    cols = torch.arange(old.shape[1], dtype=old.dtype).unsqueeze(0)
    batch.old_logp = old + 0.3 * torch.sin(7 * rows + cols)
    return algorithm.settings, batch


# ----------------------------------------------------------------------------------------------- runs to kill
COMMON_ARGS = ["data.n_test=2", "train.log_every=1", "checkpoint.every=1", "report.html=false", "check.enabled=false",
               "eval.samples=1", "eval.max_new_tokens=2"]
SFT_ARGS = ["data.n_train=48", "data.tasks=[count,ocr]", "train.steps=5", "train.batch_size=8",
            "train.micro_batch_size=4", *COMMON_ARGS]
RL_ARGS = ["train.steps=4", "train.prompts_per_step=4", "rollout.n=4", "rollout.max_new_tokens=6",
           "train.micro_batch_size=8", "algo.kl_coef=0.05", *COMMON_ARGS]
COMPARED = {"sft": ("sft/loss", "sft/grad_norm", "sft/lr"),
            "rl": ("reward/mean", "reward/std", "policy/loss", "policy/grad_norm", "policy/entropy", "policy/kl_ref",
                   "response/length_mean")}


def write_rl_data(path: Path) -> Path:
    """Shapes count prompts scored by DAPO's soft overlong punishment on characters (a dense reward: an untrained
    model's responses of different lengths get different rewards, so every group has non-zero advantages)."""
    from vlrl.data import write_samples

    samples = generate("shapes", 16, tasks=["count"])
    for s in samples:
        s.reward = {"overlong": 1.0}
        s.metadata = {"max_length": 14, "cache_length": 12, "unit": "chars"}
    return write_samples(samples, path)


def run_args(recipe: str, model_dir, data: Path | None, *, nproc: int) -> list[str]:
    strategy = ["dist.strategy=fsdp" if recipe == "sft" else "dist.strategy=ddp"] if nproc > 1 else []
    files = [f"data.train={data}", f"data.test={data}"] if data is not None else []
    return [f"model.path={model_dir}", *files, *(SFT_ARGS if recipe == "sft" else RL_ARGS), *strategy]


# ----------------------------------------------------------------------------------------------- LoRA
LORA_STEPS = 2


def lora_policy(model_dir):
    """The tiny VLM with r=4 adapters (model.lora), A and B set to seeded noise ×0.05 — the same in every process
    (peft draws A from the global RNG, and starts B at 0, where every gradient of A is 0 and a missing reduction
    of it would go unseen)."""
    from vlrl.config import LoraConfig
    from vlrl.models import load_policy
    from vlrl.models.lora import apply_lora

    policy = apply_lora(load_policy(str(model_dir)), LoraConfig(r=4, alpha=8))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if ".lora_" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=generator))
    return policy


def lora_steps(policy, trajectories, module, runtime=None) -> tuple[dict, dict]:
    """`LORA_STEPS` GRPO updates (token_mean, a k3 KL term to the adapter-free base, AdamW lr 1e-3) of ``module`` on
    ``trajectories``: (the first step's gradients, the adapter weights after the last), by parameter name."""
    import dataclasses

    from vlrl.algos import normaliser_for
    from vlrl.config import OptimConfig, RLStage
    from vlrl.train.batch import build_algorithm, prepare_batch
    from vlrl.train.common import clip_and_step, make_optimizer
    from vlrl.train.distributed import GlobalAdvantage
    from vlrl.train.update import accumulate

    stage = RLStage.model_validate({"rollout": {"n": 2}, "train": {"prompts_per_step": 4}, "algo": {"kl_coef": 0.05}})
    algorithm = build_algorithm(stage, policy, apply_behaviour_weight=False)  # π_ref: AdaptersOff
    if runtime is not None:
        algorithm.advantage_fn = GlobalAdvantage(algorithm.advantage_fn, runtime.ctx)
    batch = prepare_batch(algorithm, policy, trajectories, step=0, max_new_tokens=6)
    assert batch.ref_logp is not None
    settings = dataclasses.replace(rl_settings("token_mean"), kl_coef=0.05)
    optimizer, scheduler = make_optimizer(module, OptimConfig(lr=1e-3, warmup_steps=0))
    module.train()
    first = None
    for _ in range(LORA_STEPS):
        count = normaliser_for("token_mean", batch.loss_mask)
        normaliser = runtime.global_normaliser(count) if runtime is not None else count
        accumulate(policy, batch, range(len(trajectories)), settings, normaliser=normaliser, runtime=runtime)
        first = first if first is not None else grads_of(module)
        clip_and_step(module, optimizer, scheduler, 1.0, ctx=runtime.ctx if runtime is not None else None)
    adapters = {n: p.detach().clone() for n, p in unwrap(module).named_parameters() if ".lora_" in n}
    return first, adapters
