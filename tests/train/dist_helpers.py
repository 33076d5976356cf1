"""Helpers shared by the distributed tests and their torchrun worker (`dist_worker.py` imports this file by
path, so it holds no relative imports): child-process plumbing and the fixed SFT batch both sides use."""

import os
import signal
import subprocess
import sys
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


def run_checked(cmd: list[str], *, timeout: float = 300, **kwargs) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, env=quiet_env(), capture_output=True, text=True, timeout=timeout, **kwargs)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n"
                             f"--- stderr\n{proc.stderr[-6000:]}")
    return proc


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
    """8 examples with target lengths from 2 to 5 tokens (count and ocr answers), so each rank's token count
    differs and a per-rank normaliser would give a different gradient than the global one."""
    return [encode_sft(policy, s) for s in generate("shapes", 8, tasks=["count", "ocr"])]


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
