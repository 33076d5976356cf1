"""Resumable checkpoints: weights and optimizer sharded with `torch.distributed.checkpoint` (DCP), the loop's
state in ``trainer_state.json``, an optional export in the transformers layout; atomic by rename.

Layout of ``OUT/checkpoints/step_00000012/``:

    dcp/                 model + optimizer: one shard file per rank and a .metadata file. DCP reshards on load,
                         so a checkpoint written by 2 ranks loads on 1 and vice versa (any DDP/FSDP2 mix).
    trainer_state.json   stage, step, data cursor, scheduler, the RNG states of every rank, the position of
                         metrics.jsonl
    carry_over/          each rank's loop state beyond the weights (torch.save of the recipe's typed record,
                         `vlrl.train.state.SyncState` / `AsyncState`): the RL shapers' states (e.g. an EMA
                         baseline), dynamic-sampling leftovers, the critic; the async recipe's undrained groups,
                         re-queued and in-flight draws and ticket ledger
    hf/                  (checkpoint.export_hf) config + safetensors + tokenizer + image processor, which plain
                         transformers, vLLM and SGLang load

A save fills ``step_….partial/`` and renames it once every rank has written its shards (DCP's save ends with a
collective) and rank 0 has written and fsynced ``trainer_state.json``. A crash during a save therefore leaves
the previous checkpoint the latest complete one: `latest_checkpoint` never returns a partial directory.

Exactness: restoring weights, optimizer moments and step counts, scheduler, data cursor and every rank's RNG
(python, numpy, torch CPU and CUDA) makes the resumed steps identical to the uninterrupted run's, as long as
the world size is the same (with a different one the data order is kept; the sampling randomness is not).
"""

from __future__ import annotations

import base64
import json
import logging
import os
import random
import re
import shutil
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vlrl.config import CheckpointConfig
from vlrl.train.distributed import DistContext, unwrap

log = logging.getLogger(__name__)

STATE_FILE = "trainer_state.json"
FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"^step_(\d+)$")


# ----------------------------------------------------------------------------------------------- finding checkpoints
def latest_checkpoint(checkpoint_dir: str | Path) -> Path | None:
    """The complete checkpoint (``step_N`` with a trainer_state.json) of the highest step, or None."""
    root = Path(checkpoint_dir)
    if not root.is_dir():
        return None
    complete = [(int(m.group(1)), p) for p in root.iterdir()
                if (m := _STEP_DIR.match(p.name)) and (p / STATE_FILE).is_file() and (p / "dcp").is_dir()]
    return max(complete)[1] if complete else None


def resolve_resume(cfg: CheckpointConfig, out: str | Path) -> Path | None:
    """The checkpoint ``checkpoint.resume`` asks for: ``auto`` → the latest under OUT/checkpoints (None when
    there is none: a fresh start), a directory → that checkpoint, unset → None."""
    if cfg.resume is None:
        return None
    if cfg.resume == "auto":
        return latest_checkpoint(Path(out) / "checkpoints")
    path = Path(cfg.resume)
    if not (path / STATE_FILE).is_file() or not (path / "dcp").is_dir():
        raise FileNotFoundError(f"checkpoint.resume: {path} is not a complete checkpoint (no {STATE_FILE} and dcp/)")
    return path


def metrics_offset(resume_from: Path | None) -> int | None:
    """Length of metrics.jsonl when checkpoint ``resume_from`` was written (None for a fresh start)."""
    if resume_from is None:
        return None
    return int((read_trainer_state(resume_from).get("metrics") or {}).get("bytes", 0))


def read_trainer_state(path: str | Path) -> dict[str, Any]:
    file = Path(path) / STATE_FILE
    try:
        state = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"{file}: unreadable trainer state ({err})") from err
    if state.get("format") != FORMAT_VERSION:
        raise ValueError(f"{file}: format {state.get('format')!r}, this vlrl reads format {FORMAT_VERSION}")
    return state


# ----------------------------------------------------------------------------------------------- RNG states
def rng_state() -> dict[str, Any]:
    """This process's RNG states as JSON-able data (python, numpy, torch CPU, every CUDA device)."""
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "python": [version, list(internal), gauss],
        "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "torch": _b64(torch.get_rng_state()),
    }
    if torch.cuda.is_available():
        state["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(_unb64(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_unb64(s) for s in state["cuda"]])


def _b64(tensor: torch.Tensor) -> str:
    return base64.b64encode(tensor.cpu().numpy().tobytes()).decode("ascii")


def _unb64(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


# ----------------------------------------------------------------------------------------------- export
def export_hf(policy, module: torch.nn.Module, out_dir: str | Path, ctx: DistContext) -> Path:
    """Write the full weights in the transformers layout (safetensors) + tokenizer + image processor.
    Collective under DDP/FSDP2: every rank takes part in gathering the full state dict; rank 0 writes."""
    out_dir = Path(out_dir)
    if not ctx.enabled:
        return policy.save(out_dir)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))  # rank 0 only
    if ctx.is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
        unwrap(module).save_pretrained(out_dir, state_dict=full)
        policy.tokenizer.save_pretrained(out_dir)
        if policy.image_processor is not None:
            policy.image_processor.save_pretrained(out_dir)
    ctx.barrier()
    return out_dir


# ----------------------------------------------------------------------------------------------- the checkpointer
class Checkpointer:
    """Saves and loads the resumable checkpoints of one run directory.

    Args:
        root: ``OUT/checkpoints``.
        cfg: the ``checkpoint`` config section.
        ctx: the process context (all ranks call `save` and `load` together).
        policy: tokenizer and image processor for the ``hf/`` export.
        metrics_path: ``OUT/metrics.jsonl``, whose length is recorded so a resumed run continues it exactly.
        resume_from: the checkpoint to continue from (`resolve_resume`), or None.
    """

    def __init__(self, root: str | Path, cfg: CheckpointConfig, ctx: DistContext, *, policy=None,
                 metrics_path: str | Path | None = None, resume_from: Path | None = None) -> None:
        self.root, self.cfg, self.ctx, self.policy = Path(root), cfg, ctx, policy
        self.metrics_path = Path(metrics_path) if metrics_path is not None else None
        self.resume_from = resume_from

    def due(self, step: int) -> bool:
        return self.cfg.every > 0 and step % self.cfg.every == 0

    # --- save
    def save(self, step: int, *, stage: str, module: torch.nn.Module, optimizer, scheduler,
             cursor: dict[str, int], carry_over: Any = None) -> Path:
        """Write checkpoint ``step`` atomically (all ranks call this)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        final = self.root / f"step_{step:08d}"
        partial = self.root / f"step_{step:08d}.partial"
        if self.ctx.is_main:
            shutil.rmtree(partial, ignore_errors=True)  # left by a crash during an earlier save
            (partial / "carry_over").mkdir(parents=True)
        self.ctx.barrier()
        torch.save(carry_over, partial / "carry_over" / f"rank_{self.ctx.rank:05d}.pt")
        model_sd, optim_sd = get_state_dict(module, optimizer)
        with _single_process_quiet():
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=partial / "dcp", no_dist=not self.ctx.enabled)
        rngs = self.ctx.gather_objects(rng_state())
        if self.cfg.export_hf and self.policy is not None:
            export_hf(self.policy, module, partial / "hf", self.ctx)
        if self.ctx.is_main:
            state = {
                "format": FORMAT_VERSION, "stage": stage, "step": step, "world_size": self.ctx.world_size,
                "cursor": cursor, "scheduler": scheduler.state_dict(), "rng": rngs, "metrics": self._metrics_position(),
            }
            _write_durably(partial / STATE_FILE, json.dumps(state) + "\n")
            if final.exists():  # re-running a step from an older checkpoint: replace the newer leftovers
                shutil.rmtree(final)
            os.replace(partial, final)
            _fsync_dir(self.root)
            self._prune(keep=final)
        self.ctx.barrier()
        return final

    def _metrics_position(self) -> dict[str, Any] | None:
        if self.metrics_path is None or not self.metrics_path.exists():
            return None
        return {"file": self.metrics_path.name, "bytes": self.metrics_path.stat().st_size}

    def _prune(self, keep: Path) -> None:
        steps = sorted((int(m.group(1)), p) for p in self.root.iterdir() if (m := _STEP_DIR.match(p.name)))
        for _, path in steps[: max(0, len(steps) - self.cfg.keep)]:
            if path != keep:
                shutil.rmtree(path, ignore_errors=True)

    # --- load
    def load(self, path: str | Path, *, stage: str, module: torch.nn.Module, optimizer, scheduler) -> dict[str, Any]:
        """Restore weights, optimizer, scheduler and this rank's RNG from checkpoint ``path``; return its
        trainer state (step, cursor, and this rank's ``carry_over``). All ranks call this."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        path = Path(path)
        state = read_trainer_state(path)
        if state["stage"] != stage:
            raise ValueError(f"{path}: a checkpoint of stage {state['stage']!r}, cannot resume stage {stage!r}")
        saved = set(dcp.FileSystemReader(str(path / "dcp")).read_metadata().state_dict_metadata)
        model_sd, optim_sd = get_state_dict(module, optimizer)
        missing = [k for k in model_sd if f"model.{k}" not in saved]
        if missing:
            raise ValueError(f"{path}: the checkpoint lacks {len(missing)} weight(s) of this model, e.g. {missing[:3]}: "
                             "it was written for a different model")
        target = {"model": model_sd, "optim": optim_sd}
        # partial: parameters that never had a gradient have no optimizer state in the checkpoint
        with _single_process_quiet():
            dcp.load(target, checkpoint_id=path / "dcp", planner=dcp.DefaultLoadPlanner(allow_partial_load=True),
                     no_dist=not self.ctx.enabled)
        set_state_dict(module, optimizer, model_state_dict=target["model"], optim_state_dict=target["optim"])
        self._drop_unsaved_optimizer_state(module, optimizer, saved)
        scheduler.load_state_dict(state["scheduler"])
        rngs = state["rng"]
        if state["world_size"] != self.ctx.world_size:
            log.warning("%s: written by %d rank(s), resumed on %d: the data order is kept, the sampling randomness "
                        "is not the uninterrupted run's", path, state["world_size"], self.ctx.world_size)
        if self.ctx.rank < len(rngs):
            set_rng_state(rngs[self.ctx.rank])
        carry = path / "carry_over" / f"rank_{self.ctx.rank:05d}.pt"
        # the run's own file, holding plain data the loop wrote (shaper states may be any picklable object)
        state["carry_over"] = torch.load(carry, weights_only=False) if carry.is_file() else None
        return state

    @staticmethod
    def _drop_unsaved_optimizer_state(module: torch.nn.Module, optimizer, saved: set[str]) -> None:
        """`get_state_dict` initialises AdamW state for every parameter (a zero step); a parameter that had no
        state when saved (never had a gradient) must start fresh again, as it would have without the restart."""
        for name, param in unwrap(module).named_parameters():
            if param in optimizer.state and f"optim.state.{name}.step" not in saved:
                del optimizer.state[param]


@contextmanager
def _single_process_quiet() -> Iterator[None]:
    """DCP warns that it assumes one process when there is no process group: that is the intent here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _write_durably(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

