"""Resumable checkpoints: weights and optimizer sharded with `torch.distributed.checkpoint` (DCP), the loop's
state in ``trainer_state.json`` and ``carry_over/``, an optional export in the transformers layout, a manifest of
checksums; atomic by rename, verified before use.

Layout of ``OUT/checkpoints/step_00000012/``:

    dcp/                 model + optimizer: one shard file per rank and a .metadata file. DCP reshards on load,
                         so a checkpoint written by 2 ranks loads on 1 and vice versa (any DDP/FSDP2 mix).
    trainer_state.json   stage, step, data cursor, scheduler, the RNG states of every rank, the position of
                         metrics.jsonl
    carry_over/          each rank's loop state beyond the weights, the recipe's typed record
                         (`vlrl.train.state.RLState`: the learner's and the feed's) as rank_N.json + rank_N.safetensors
                         (`vlrl.train.carry`): the RL shapers' states (e.g. an EMA baseline), dynamic-sampling
                         leftovers, the critic; the async recipe's undrained groups, re-queued and in-flight draws
                         and ticket ledger
    hf/                  (checkpoint.export_hf) config + safetensors + tokenizer + image processor, which plain
                         transformers, vLLM and SGLang load
    manifest.json        size and sha256 of every other file, written last

A save fills ``step_….partial/`` and renames it once every rank has written its shards (DCP's save ends with a
collective) and rank 0 has written and fsynced ``trainer_state.json`` and then ``manifest.json``. A crash or a
failed write (a full disk) during a save therefore leaves the previous checkpoint the latest complete one; the
error names the file being written and the cause.

Trust: loading runs no code from the checkpoint. The carry-over is safetensors + JSON decoded into an allow-list
of record types; DCP's ``.metadata`` (a pickle) is read by an unpickler that admits only DCP's own metadata
classes, and DCP's non-tensor values (optimizer hyper-parameters) by ``torch.load(weights_only=True)``. Before a
checkpoint is used every file is checked against the manifest: a missing, truncated, altered or unlisted file
is reported by name, and ``checkpoint.resume=auto`` falls back to the previous complete checkpoint.

Exactness: restoring weights, optimizer moments and step counts, scheduler, data cursor and every rank's RNG
(python, numpy, torch CPU and CUDA) makes the resumed steps identical to the uninterrupted run's, as long as
the world size is the same (with a different one the data order is kept; the sampling randomness is not).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import re
import shutil
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from vlrl import compat
from vlrl.config import CheckpointConfig
from vlrl.train.carry import read_carry_over, write_carry_over
from vlrl.train.distributed import DistContext, unwrap
from vlrl.train.rng import rng_state, set_rng_state

log = logging.getLogger(__name__)

STATE_FILE = "trainer_state.json"
MANIFEST_FILE = "manifest.json"
FORMAT_VERSION = 2  # 1: pickled carry-over, no manifest (refused)
_STEP_DIR = re.compile(r"^step_(\d+)$")
_CHUNK = 1 << 20


class CheckpointError(ValueError):
    """A checkpoint that cannot be used or written; the message names the file and the cause."""


# ----------------------------------------------------------------------------------------------- finding checkpoints
def _step_dirs(root: Path) -> list[tuple[int, Path]]:
    """``step_N`` directories under ``root`` — and symbolic links so named, which `resolve_resume` refuses —
    newest first."""
    if not root.is_dir():
        return []
    return sorted(((int(m.group(1)), p) for p in root.iterdir()
                   if (m := _STEP_DIR.match(p.name)) and (p.is_dir() or p.is_symlink())), reverse=True)


def latest_checkpoint(checkpoint_dir: str | Path) -> Path | None:
    """The complete checkpoint (``step_N`` with a manifest, i.e. a save that finished) of the highest step, or
    None; a symbolic link is none. Not verified: see `verify_checkpoint` / `resolve_resume`."""
    return next((p for _, p in _step_dirs(Path(checkpoint_dir))
                 if not p.is_symlink() and (p / MANIFEST_FILE).is_file()), None)


def _refuse_links(root: Path) -> None:
    """A ``step_N`` under ``root`` that is a symbolic link: `CheckpointError` (a run's checkpoints are directories it
    wrote; a link would resume from elsewhere, and every later save over it would fail)."""
    for _, path in _step_dirs(root):
        if path.is_symlink():
            raise CheckpointError(f"{path} is a symbolic link (to {os.readlink(path)}), not a checkpoint this run "
                                  "wrote: refused; remove the link, or name the checkpoint with checkpoint.resume=DIR")


def resolve_resume(cfg: CheckpointConfig, out: str | Path) -> Path | None:
    """The checkpoint ``checkpoint.resume`` asks for, verified against its manifest: ``auto`` → the newest intact
    one under OUT/checkpoints (a corrupt or incomplete newer one is reported and skipped; None when there is
    none at all: a fresh start), a directory → that checkpoint (an error if it is not intact), unset → None."""
    if cfg.resume is None:
        return None
    if cfg.resume != "auto":
        path = Path(cfg.resume)
        verify_checkpoint(path, what="checkpoint.resume")
        return path
    root = Path(out) / "checkpoints"
    _refuse_links(root)
    problems = []
    for _, path in _step_dirs(root):
        try:
            verify_checkpoint(path)
        except CheckpointError as err:
            problems.append(str(err))
            log.warning("%s; skipping it", err)
            continue
        if problems:
            log.warning("resuming from %s, the newest intact checkpoint", path)
        return path
    if problems:
        raise CheckpointError(f"checkpoint.resume=auto: no intact checkpoint under {root} ({len(problems)} refused; "
                              f"the newest: {problems[0]})")
    return None


def verify_checkpoint(path: str | Path, *, what: str = "checkpoint") -> dict[str, Any]:
    """Check every file of checkpoint ``path`` against its manifest (present, size, sha256; no unlisted file) and
    read its trainer state, whose step must be the one a ``step_N`` name says. Raises `CheckpointError` naming
    the first bad file and why (a symbolic link inside the checkpoint included); returns the state."""
    path = Path(path)
    manifest_file = path / MANIFEST_FILE
    if not path.is_dir():
        raise CheckpointError(f"{what}: {path} is not a directory")
    for folder, dirs, names in os.walk(path):  # (os.walk does not follow links to directories)
        linked = sorted(n for n in [*dirs, *names] if os.path.islink(os.path.join(folder, n)))
        if linked:
            raise CheckpointError(f"{os.path.join(folder, linked[0])}: a symbolic link inside a checkpoint (a save "
                                  "writes none): refused")
    if not manifest_file.is_file():
        raise CheckpointError(f"{what}: {path} is incomplete: no {MANIFEST_FILE} (its save did not finish, or it was "
                              f"written by a vlrl without manifests)")
    try:
        manifest = json.loads(manifest_file.read_text(encoding="utf-8"))
        files = manifest["files"]
        assert isinstance(files, dict) and manifest.get("format") == FORMAT_VERSION
    except (OSError, ValueError, KeyError, TypeError, AssertionError) as err:
        raise CheckpointError(f"{manifest_file}: unreadable or not a format-{FORMAT_VERSION} manifest ({err})") from None
    on_disk = {str(p.relative_to(path)) for p in path.rglob("*") if p.is_file() and p.name != MANIFEST_FILE}
    unlisted = sorted(on_disk - set(files))
    if unlisted:
        raise CheckpointError(f"{path / unlisted[0]}: not listed in {MANIFEST_FILE} (not written by the save)")
    for name, entry in sorted(files.items()):
        file = path / name
        if name not in on_disk:
            raise CheckpointError(f"{file}: missing (listed in {MANIFEST_FILE})")
        size = file.stat().st_size
        if size != entry.get("bytes"):
            raise CheckpointError(f"{file}: {size} bytes, the manifest says {entry.get('bytes')} (truncated or altered)")
        if _sha256(file) != entry.get("sha256"):
            raise CheckpointError(f"{file}: sha256 differs from the manifest (the file changed after the save)")
    state = read_trainer_state(path)
    named = _STEP_DIR.match(path.resolve().name)
    if named and int(named.group(1)) != state.get("step"):
        raise CheckpointError(f"{path / STATE_FILE}: step {state.get('step')!r}, but the directory is named for step "
                              f"{int(named.group(1))}: refused (renamed or moved)")
    return state


def write_manifest(path: str | Path) -> Path:
    """Checksum every file of checkpoint ``path`` into ``manifest.json`` (written to a temporary name, fsynced,
    renamed: a manifest is either complete or absent). The save calls it last; a test that edits a checkpoint
    on purpose calls it again."""
    path = Path(path)
    files = {str(p.relative_to(path)): {"bytes": p.stat().st_size, "sha256": _sha256(p)}
             for p in sorted(path.rglob("*")) if p.is_file() and p.name != MANIFEST_FILE}
    temporary = path / (MANIFEST_FILE + ".tmp")
    _write_durably(temporary, json.dumps({"format": FORMAT_VERSION, "files": files}, indent=1) + "\n")
    os.replace(temporary, path / MANIFEST_FILE)
    _fsync_dir(path)
    return path / MANIFEST_FILE


def _sha256(file: Path) -> str:
    digest = hashlib.sha256()
    with open(file, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def metrics_offset(resume_from: Path | None) -> int | None:
    """Length of metrics.jsonl when checkpoint ``resume_from`` was written (None for a fresh start)."""
    if resume_from is None:
        return None
    return int((read_trainer_state(resume_from).get("metrics") or {}).get("bytes", 0))


def read_trainer_state(path: str | Path) -> dict[str, Any]:
    file = Path(path) / STATE_FILE
    try:
        state = json.loads(file.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{file}: unreadable trainer state ({err})") from err
    if not isinstance(state, dict) or state.get("format") != FORMAT_VERSION:
        found = state.get("format") if isinstance(state, dict) else None
        raise CheckpointError(f"{file}: format {found!r}, this vlrl reads format {FORMAT_VERSION}")
    return state


# ----------------------------------------------------------------------------------------------- carry-over files
def carry_over_files(path: str | Path, rank: int = 0) -> tuple[Path, Path]:
    """(JSON, safetensors) of ``rank``'s carry-over in checkpoint ``path``."""
    stem = Path(path) / "carry_over" / f"rank_{rank:05d}"
    return stem.with_suffix(".json"), stem.with_suffix(".safetensors")


def read_checkpoint_carry_over(path: str | Path, rank: int = 0) -> Any:
    """``rank``'s carry-over state of checkpoint ``path`` (None when it holds none)."""
    json_path, tensors_path = carry_over_files(path, rank)
    return read_carry_over(json_path, tensors_path) if json_path.is_file() else None


def write_checkpoint_carry_over(path: str | Path, value: Any, rank: int = 0) -> None:
    """Write ``rank``'s carry-over state into checkpoint directory ``path`` (no manifest update)."""
    json_path, tensors_path = carry_over_files(path, rank)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    write_carry_over(value, json_path, tensors_path)
    for file in (json_path, tensors_path):
        _fsync_file(file)


# ----------------------------------------------------------------------------------------------- DCP without pickle
_DCP_METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "TensorStorageMetadata", "TensorProperties", "ChunkStorageMetadata", "BytesStorageMetadata",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
     ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
     ("pathlib", "PurePosixPath"), ("pathlib", "PureWindowsPath"), ("collections", "OrderedDict")}


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's ``.metadata`` is a pickle: admit only DCP's metadata classes, torch.Size, dtypes and layouts."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _DCP_METADATA_CLASSES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.memory_format)):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a checkpoint's DCP metadata")


def _safe_dcp_reader(path: Path):
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any):
            file = compat.dcp_metadata_path(self, kwargs.get("rank"))
            try:
                with open(file, "rb") as handle:
                    metadata = _MetadataUnpickler(handle).load()
            except (pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError) as err:
                raise CheckpointError(f"{file}: refused ({err})") from None
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(str(path))


def _safe_load_planner():
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class SafePlanner(DefaultLoadPlanner):
        """DCP's default planner unpickles non-tensor values with weights_only=False; these are numbers, strings,
        tuples and lists (optimizer hyper-parameters), which weights_only=True reads."""

        def load_bytes(self, read_item, value) -> None:
            loaded = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                _set_at(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
            else:
                self.state_dict[read_item.dest_index.fqn] = loaded

    # partial: parameters that never had a gradient have no optimizer state in the checkpoint
    return SafePlanner(allow_partial_load=True)


def _set_at(root: dict, path: tuple, value: Any) -> None:
    """``root[path[0]][path[1]]… = value``, making the dicts (str key next) and lists (int key next) on the way —
    where DCP's flattened key ``path`` (the planner's ``mappings``) puts a value back in the nested state dict."""
    node: Any = root
    for key, following in zip(path[:-1], path[1:], strict=True):
        empty = {} if isinstance(following, str) else []
        if isinstance(node, dict):
            node = node.setdefault(key, empty)
        else:
            node.extend([None] * (key + 1 - len(node)))
            if node[key] is None:
                node[key] = empty
            node = node[key]
    if isinstance(node, list):
        node.extend([None] * (path[-1] + 1 - len(node)))
    node[path[-1]] = value


# ----------------------------------------------------------------------------------------------- export
def export_hf(policy, module: torch.nn.Module, out_dir: str | Path, ctx: DistContext) -> Path:
    """Write the full weights in the transformers layout (safetensors) + tokenizer + image processor; with LoRA
    the merged weights and ``adapter/`` (`vlrl.models.policy.Policy.save`). Collective under DDP/FSDP2: every rank
    takes part in gathering the full state dict (LoRA: merged on the FSDP2 shards, `vlrl.models.lora`) onto rank 0's
    CPU; rank 0 writes."""
    out_dir = Path(out_dir)
    if not ctx.enabled:
        return policy.save(out_dir)
    adapter = None
    if policy.lora is not None:
        from vlrl.models.lora import full_adapter_state_dict, full_merged_state_dict

        full, adapter = full_merged_state_dict(policy), full_adapter_state_dict(policy)  # rank 0 only
    else:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))  # rank 0 only
    if ctx.is_main:
        policy.save(out_dir, state_dict=full, adapter_state_dict=adapter)
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
        """Write checkpoint ``step`` atomically (all ranks call this). A failed write raises `CheckpointError`
        naming the file and the cause (e.g. ``No space left on device``); the partial directory is removed and
        the previous checkpoint stays the latest."""
        final = self.root / f"step_{step:08d}"
        partial = self.root / f"step_{step:08d}.partial"
        writing = _Writing()
        try:
            error = None
            if self.ctx.is_main:
                shutil.rmtree(partial, ignore_errors=True)  # left by a crash during an earlier save
                try:
                    with writing(partial / "carry_over"):
                        (partial / "carry_over").mkdir(parents=True)
                except OSError as err:
                    error = err
            if self.ctx.any(error is not None):  # also the barrier: the directory exists for every rank
                raise error or CheckpointError(f"checkpoint step {step}: rank 0 could not create {partial}")
            self._write_ranks(partial, writing, module, optimizer, carry_over)
            rngs = self.ctx.gather_objects(rng_state())
            if self.cfg.export_hf and self.policy is not None:
                with writing(partial / "hf"):
                    export_hf(self.policy, module, partial / "hf", self.ctx)
            failed = False
            if self.ctx.is_main:
                state = {"format": FORMAT_VERSION, "stage": stage, "step": step, "world_size": self.ctx.world_size,
                         "cursor": cursor, "scheduler": scheduler.state_dict(), "rng": rngs,
                         "metrics": self._metrics_position()}
                try:
                    with writing(partial / STATE_FILE):
                        _write_durably(partial / STATE_FILE, json.dumps(state) + "\n")
                    with writing(partial / MANIFEST_FILE):
                        write_manifest(partial)
                    with writing(final):
                        if final.is_symlink():  # never followed: the link itself goes
                            final.unlink()
                        elif final.exists():  # re-running a step from an older checkpoint: replace the newer leftovers
                            shutil.rmtree(final)
                        os.replace(partial, final)
                        _fsync_dir(self.root)
                except BaseException:
                    failed = True
                    raise
                finally:
                    self.ctx.any(failed)  # the other ranks wait for this verdict below
                self._prune(keep=final)
            elif self.ctx.any(False):
                raise CheckpointError(f"checkpoint step {step}: rank 0 failed to write it (see its error)")
        except BaseException as err:
            cause = _cause(err, self.root) if writing.file and not isinstance(err, CheckpointError) else ""
            if self.ctx.is_main:  # after the cause: a full disk is measured before the partial files are freed
                shutil.rmtree(partial, ignore_errors=True)
            if not cause:
                raise
            previous = latest_checkpoint(self.root)
            raise CheckpointError(
                f"checkpoint step {step}: writing {writing.file} failed: {cause}; "
                + (f"the previous checkpoint {previous} is kept" if previous else "no earlier checkpoint exists")
            ) from err
        self.ctx.barrier()
        return final

    def _write_ranks(self, partial: Path, writing: _Writing, module: torch.nn.Module, optimizer, carry_over: Any) -> None:
        """This rank's carry-over and DCP shard (DCP's save is a collective). Every rank learns whether any
        failed before the collective, so none waits forever for a rank that gave up."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        error: BaseException | None = None
        try:
            with writing(carry_over_files(partial, self.ctx.rank)[0]):
                write_checkpoint_carry_over(partial, carry_over, self.ctx.rank)
        except BaseException as err:
            error = err
        if self.ctx.any(error is not None):
            raise error or CheckpointError("another rank failed to write its carry-over state (see its error)")
        model_sd, optim_sd = get_state_dict(module, optimizer)
        with writing(partial / "dcp"), _single_process_quiet():
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=partial / "dcp", no_dist=not self.ctx.enabled)
        for shard in (partial / "dcp").glob(f"__{self.ctx.rank}_*"):
            _fsync_file(shard)

    def _metrics_position(self) -> dict[str, Any] | None:
        if self.metrics_path is None or not self.metrics_path.exists():
            return None
        return {"file": self.metrics_path.name, "bytes": self.metrics_path.stat().st_size}

    def _prune(self, keep: Path) -> None:
        steps = sorted((int(m.group(1)), p) for p in self.root.iterdir() if (m := _STEP_DIR.match(p.name)))
        for _, path in steps[: max(0, len(steps) - self.cfg.keep)]:
            if path.is_symlink():
                path.unlink(missing_ok=True)
            elif path != keep:
                shutil.rmtree(path, ignore_errors=True)

    # --- load
    def load(self, path: str | Path, *, stage: str, module: torch.nn.Module, optimizer, scheduler) -> dict[str, Any]:
        """Restore weights, optimizer, scheduler and this rank's RNG from checkpoint ``path``; return its
        trainer state (step, cursor, and this rank's ``carry_over``). All ranks call this. Whatever in the
        checkpoint does not fit (a malformed carry-over or trainer state, shards of another model) is one
        `CheckpointError` line naming the checkpoint, never a traceback."""
        try:
            return self._load(Path(path), stage=stage, module=module, optimizer=optimizer, scheduler=scheduler)
        except CheckpointError:
            raise
        except Exception as err:  # noqa: BLE001  (the checkpoint's contents, not a bug of the caller: one line)
            raise CheckpointError(f"{path}: cannot be resumed from ({_first_line(err)})") from err

    def _load(self, path: Path, *, stage: str, module: torch.nn.Module, optimizer, scheduler) -> dict[str, Any]:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        state = read_trainer_state(path)
        if state["stage"] != stage:
            raise CheckpointError(f"{path}: a checkpoint of stage {state['stage']!r}, cannot resume stage {stage!r}")
        reader = _safe_dcp_reader(path / "dcp")
        saved = set(reader.read_metadata().state_dict_metadata)
        model_sd, optim_sd = get_state_dict(module, optimizer)
        missing = [k for k in model_sd if f"model.{k}" not in saved]
        if missing:
            raise CheckpointError(f"{path}: the checkpoint lacks {len(missing)} weight(s) of this model, e.g. {missing[:3]}: "
                             "it was written for a different model")
        target = {"model": model_sd, "optim": optim_sd}
        with _single_process_quiet():
            dcp.load(target, storage_reader=_safe_dcp_reader(path / "dcp"), planner=_safe_load_planner(),
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
        # Every rank writes the same loop state (the feeds hold the whole round on every rank: the shapers, the
        # critic and the synchronous feed's carried groups are identical copies; the asynchronous feed's rollout cut
        # is rank 0's, and only the rank-0 driver reads it), so a rank the checkpoint did not have (resumed on more
        # ranks) reads rank 0's — without it that rank would start its critic and shapers afresh while rank 0
        # restored them, and their collectives would no longer match (a hang).
        written = self.ctx.rank if self.ctx.rank < state["world_size"] else 0
        state["carry_over"] = read_checkpoint_carry_over(path, written)
        self._cut_metrics(state)
        return state

    def _cut_metrics(self, state: dict[str, Any]) -> None:
        """Once the load succeeded: cut metrics.jsonl back to where the checkpoint left it (rank 0). Cut only, never
        extended: a file shortened since (shorter than the checkpoint recorded) is kept up to its last whole line,
        with a warning."""
        position = int((state.get("metrics") or {}).get("bytes", 0))
        if not self.ctx.is_main or self.metrics_path is None or not self.metrics_path.exists():
            return
        with open(self.metrics_path, "r+b") as handle:
            size = handle.seek(0, os.SEEK_END)
            if size < position:
                handle.seek(max(0, size - _CHUNK))
                tail = handle.read()
                position = size - len(tail) + tail.rfind(b"\n") + 1  # after the last whole line (0: none)
                log.warning("%s: %d bytes, shorter than the %d the checkpoint recorded (shortened since): kept up to "
                            "its last whole line (%d bytes), the resumed run appends there", self.metrics_path, size,
                            int((state.get("metrics") or {}).get("bytes", 0)), position)
            handle.truncate(position)

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


class _Writing:
    """Which file a save is writing (``with writing(file):``), for the error message when a write fails."""

    def __init__(self) -> None:
        self.file = ""

    @contextmanager
    def __call__(self, file: Path) -> Iterator[None]:
        self.file = str(file)
        yield


def _cause(err: BaseException, root: Path) -> str:
    """The operating system's reason for a failed write (errno and text), found along the exception chain;
    DCP and torch.save wrap it (``enforce fail at inline_container.cc``): then a full disk is recognised by
    the free space left."""
    pending: list[BaseException] = [err]
    while pending:
        seen = pending.pop(0)
        if isinstance(seen, OSError) and seen.strerror:
            return f"[Errno {seen.errno}] {seen.strerror}"
        pending += [e for e in (seen.__cause__, seen.__context__) if e is not None]
        for failure in getattr(seen, "failures", {}).values():  # DCP's CheckpointException: rank → error
            failure = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(failure, BaseException):
                pending.append(failure)
    text = f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"
    try:
        free = shutil.disk_usage(root if root.exists() else root.parent).free
    except OSError:
        return text
    if free < 1 << 20:
        return f"No space left on device ({free} bytes free on {root}'s file system; {text})"
    return text


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:500]


def _write_durably(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

