"""Moving weights from the trainer to rollout servers: write, read, copy in place, checksum.

The trainer writes each weight version as a transformers directory (``config.json`` + ``model.safetensors``
in the checkpoint layout, exactly what ``save_pretrained`` writes and what SGLang's
``/update_weights_from_disk`` loads). vlrl's server does not build a new model per version: it reads the
safetensors file and copies the tensors into a spare copy of its model (`copy_weights`), which the batcher
swaps in at the next batch boundary (`ContinuousBatcher.load_in_place`). This is the reference server's
version of SGLang's in-place ``update_weights_from_disk`` (``ModelRunner.update_weights_from_disk`` loads the
new tensors into the existing parameters instead of re-initialising the model).

Checkpoint names can differ from the in-memory ones (transformers 5 renames e.g. Qwen2-VL's
``model.layers.*`` to ``model.language_model.layers.*`` on load). `checkpoint_names` finds the renaming
once per model by asking transformers for its reverse conversion (the one ``save_pretrained`` applies); a
model whose conversion is more than a renaming (tensors merged or split) gets ``None`` and the server falls
back to ``from_pretrained``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"


class WeightLoadError(ValueError):
    """A weights directory does not fit the served model (missing, unknown or mis-shaped tensors)."""


class WeightSyncError(RuntimeError):
    """A rollout engine failed to load the trainer's weights, or loaded different ones (checksum mismatch)."""


class ChecksumCheck:
    """The trainer's side of the checksum comparison: a server's reported checksum of the weights it loaded against
    the one the trainer predicted. A mismatch raises `WeightSyncError` (the run stops); a server that reports none
    (e.g. SGLang) is warned about once. ``expected`` None: the trainer computed none for that server
    (``rollout.weight_sync.verify_checksum`` off, or the server reported no checksum at start)."""

    def __init__(self) -> None:
        self.unverified: set[str] = set()  # servers warned about

    def __call__(self, url: str, loaded: str | None, version: int, expected: str | None) -> None:
        if loaded is None:
            if url not in self.unverified:
                self.unverified.add(url)
                log.warning("%s reports no weight checksum (not a vlrl server): its weights are not verified", url)
        elif expected is None:
            return
        elif loaded != expected:
            raise WeightSyncError(f"{url} loaded weights with checksum {loaded[:12]} for version {version}, "
                                  f"the trainer's are {expected[:12]}: stopping")


@contextlib.contextmanager
def quiet_transformers():
    """No progress bars while weights are saved or loaded every step."""
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


def weight_checksum(weights: torch.nn.Module | Mapping[str, torch.Tensor], *, dtype: torch.dtype | None = None) -> str:
    """SHA-256 over one line ``name|dtype|shape|crc32(bytes)`` per tensor of a state dict, in name order.

    Every tensor's bytes go through CRC-32 (zlib; ~10× faster than SHA-256 over the bytes on these CPUs and
    without a copy), which detects any change confined to 32 bits and misses a random one with probability
    2⁻³² per tensor: it is a consistency check between trainer and server (wrong version, dtype, partial
    load), not a defence against tampering. ``dtype`` casts floating-point tensors first, so a trainer in
    float32 can predict the checksum of a server that loaded the same weights in bfloat16.
    """
    state = weights.state_dict() if isinstance(weights, torch.nn.Module) else weights
    digest = hashlib.sha256()
    for name in sorted(state):
        tensor = state[name].detach()
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        flat = tensor.cpu().contiguous().reshape(-1)
        crc = zlib.crc32(memoryview(flat.view(torch.uint8).numpy()))
        digest.update(f"{name}|{flat.dtype}|{tuple(state[name].shape)}|{crc:08x}\n".encode())
    return digest.hexdigest()


def checkpoint_names(model: torch.nn.Module, state: dict[str, torch.Tensor] | None = None) -> dict[str, str] | None:
    """{checkpoint name → state-dict name} for every tensor ``save_pretrained`` writes (tied copies are
    written once), or None when the model's checkpoint conversion is more than a renaming. ``state``: the tensors
    to name, if not the model's own state dict (a LoRA policy's merged weights, under the transformers names)."""
    state = model.state_dict() if state is None else state
    by_storage = {(t.data_ptr(), tuple(t.shape)): name for name, t in state.items()}
    from vlrl.compat import checkpoint_state

    try:
        saved = checkpoint_state(model, state)
    except Exception:
        return None
    names = {}
    for saved_name, tensor in saved.items():
        name = by_storage.get((tensor.data_ptr(), tuple(tensor.shape)))
        if name is None:  # a converted (merged or split) tensor, not a renamed one
            return None
        names[saved_name] = name
    return names


def read_weights(path: str | Path, names: Mapping[str, str]) -> dict[str, torch.Tensor] | None:
    """The safetensors weights of the transformers directory ``path`` under their state-dict names (via
    ``names`` from `checkpoint_names`; names already in state-dict form pass through). None when the
    directory holds no safetensors file (other formats go through ``from_pretrained``)."""
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path} is not a directory")
    if (path / SAFETENSORS_INDEX).is_file():
        index = json.loads((path / SAFETENSORS_INDEX).read_text())
        files = sorted(set(index["weight_map"].values()))
    elif (path / SAFETENSORS).is_file():
        files = [SAFETENSORS]
    else:
        return None
    out: dict[str, torch.Tensor] = {}
    for file in files:
        for saved_name, tensor in load_file(path / file).items():
            out[names.get(saved_name, saved_name)] = tensor
    return out


class WeightWriter:
    """Writes tensors into ``model``'s own tensors in place, in parts (a distributed update arrives bucket by bucket):
    each part's names and shapes are checked before any of it is copied (`WeightLoadError` naming the tensor), and
    `finish` checks that every tensor was written — a copy of a tied tensor counts as written with it."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.state = model.state_dict()
        self.written: set[str] = set()

    def check(self, weights: Mapping[str, torch.Tensor]) -> None:
        unknown = sorted(set(weights) - set(self.state))
        if unknown:
            raise WeightLoadError(f"{len(unknown)} tensor(s) the model does not have, e.g. {unknown[:3]}")
        for name, tensor in weights.items():
            if tuple(tensor.shape) != tuple(self.state[name].shape):
                raise WeightLoadError(f"tensor {name!r}: shape {tuple(tensor.shape)}, the model's is "
                                      f"{tuple(self.state[name].shape)}")

    def write(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Check ``weights`` (state-dict names), then copy them in (casting to the model's dtypes)."""
        self.check(weights)
        with torch.no_grad():
            for name, tensor in weights.items():
                self.state[name].copy_(tensor)
        self.written.update(weights)

    def written_in_place(self, names: Sequence[str]) -> None:
        """``names`` were filled another way (received straight into the model's storage: `FlatBuckets`)."""
        self.state = self.model.state_dict()  # (their tensors may have moved to a new storage)
        self.written.update(names)

    def missing(self, given: Mapping[str, torch.Tensor] | None = None) -> list[str]:
        """The model's tensors neither written nor in ``given`` (nor tied to one that is)."""
        done = self.written | set(given or {})
        pointers = {self.state[name].data_ptr() for name in done if name in self.state}
        return sorted(name for name, t in self.state.items() if name not in done and t.data_ptr() not in pointers)

    def finish(self) -> None:
        missing = self.missing()
        if missing:
            raise WeightLoadError(f"{len(missing)} tensor(s) of the model are missing, e.g. {missing[:3]}")


class FlatBuckets:
    """Receive-in-place storage for one model: for each bucket layout (names, dtypes, shapes) a server receives
    update after update, one flat byte tensor whose views *are* the model's tensors — a flattened bucket's broadcast
    then lands straight in the weights, with no copy. The first time a layout comes, `storage` gives a fresh flat
    tensor and, once the bucket is in it, `adopt` makes the model's tensors views of it (their old storage is freed:
    no extra memory). A layout that cannot be taken in place — a name the model lacks, another shape or dtype (the
    copy casts), an offset not a multiple of the dtype's size, a tensor sharing storage with another entry — gets
    None (the caller receives elsewhere and copies)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.flats: dict[tuple, torch.Tensor] = {}

    @staticmethod
    def key(names: Sequence[str], dtypes: Sequence[torch.dtype], shapes: Sequence[Sequence[int]]) -> tuple:
        return tuple(names), tuple(dtypes), tuple(tuple(s) for s in shapes)

    def storage(self, names: Sequence[str], dtypes: Sequence[torch.dtype],
                shapes: Sequence[Sequence[int]]) -> tuple[torch.Tensor, bool] | None:
        """(the flat tensor to receive the bucket into, whether it is fresh — `adopt` it once filled), or None."""
        key = self.key(names, dtypes, shapes)
        if key in self.flats:
            return self.flats[key], False
        state = self.model.state_dict()
        if len(set(names)) != len(names):
            return None
        offset = 0
        for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
            tensor = state.get(name)
            if tensor is None or tensor.dtype != dtype or tuple(tensor.shape) != tuple(shape) or not tensor.numel():
                return None
            if offset % tensor.element_size() or not self._sole_owner(state, name):
                return None
            offset += tensor.numel() * tensor.element_size()
        device = state[names[0]].device if names else torch.device("cpu")
        return torch.empty(offset, dtype=torch.uint8, device=device), True

    def adopt(self, names: Sequence[str], dtypes: Sequence[torch.dtype], shapes: Sequence[Sequence[int]],
              flat: torch.Tensor) -> None:
        """The model's tensors ``names`` become views of ``flat`` (which holds their new values, in order)."""
        offset = 0
        for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
            tensor = self._tensor(name)
            size = tensor.numel() * tensor.element_size()
            tensor.data = flat[offset : offset + size].view(dtype).view(tuple(shape))
            offset += size
        self.flats[self.key(names, dtypes, shapes)] = flat

    def _tensor(self, name: str) -> torch.Tensor:
        try:
            return self.model.get_parameter(name)
        except AttributeError:
            return self.model.get_buffer(name)

    def _sole_owner(self, state: Mapping[str, torch.Tensor], name: str) -> bool:
        """No other state-dict entry shares ``name``'s storage — unless it is the same tensor object (a tied
        parameter: moving it moves every name it has)."""
        pointer, owner = state[name].data_ptr(), None
        for other, tensor in state.items():
            if other != name and tensor.data_ptr() == pointer:
                try:
                    owner = owner or self._tensor(name)
                    if self._tensor(other) is not owner:
                        return False
                except AttributeError:
                    return False
        return True


def copy_weights(model: torch.nn.Module, weights: Mapping[str, torch.Tensor]) -> None:
    """Copy ``weights`` (state-dict names) into ``model``'s tensors in place (casting to their dtype).

    Every tensor of the state dict must be given, except copies of a tied tensor (one of them suffices);
    an unknown name or a shape mismatch raises `WeightLoadError` naming it, before anything is copied."""
    writer = WeightWriter(model)
    writer.check(weights)
    missing = writer.missing(weights)
    if missing:
        raise WeightLoadError(f"{len(missing)} tensor(s) of the model are missing, e.g. {missing[:3]}")
    writer.write(weights)
