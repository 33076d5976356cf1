"""What `vlrl serve` accepts: SGLang's request bodies (the subset vlrl implements, as strict as SGLang's schema), the
server's per-request limits (`ServeLimits`) and the errors that answer 400."""

from __future__ import annotations

import dataclasses
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from vlrl.rollout import dist_sync
from vlrl.rollout.types import SamplingParams

SAMPLING_NAMES = ("n", "temperature", "top_p", "top_k", "max_new_tokens", "stop", "stop_token_ids", "logit_bias")
SGLANG_TOP_K_OFF = 1 << 30  # SGLang's default top_k: the whole vocabulary
MAX_TEMPERATURE = 100.0  # beyond this every token is equally likely anyway; 1e308 overflowed to NaN probabilities


@dataclasses.dataclass(frozen=True)
class ServeLimits:
    """What one request may ask of `vlrl serve`; a request beyond them is refused before it is admitted (400
    naming the field; 413 for the body). The batcher's own bounds (``max_queued_requests`` samples,
    ``max_tokens_in_flight``) answer 400 for a request that could never fit and 503 while they are full."""

    max_new_tokens: int = 4096
    """``sampling_params.max_new_tokens`` at most this (``--max-new-tokens``); prompt + max_new_tokens must also
    fit the model's context (``max_position_embeddings``)."""
    max_body_bytes: int = 32 << 20
    """Request body size (``--max-body-mb``), counted on the bytes received (chunked bodies too): 413 beyond."""
    max_image_pixels: int = 16 << 20
    """Pixels of one image, read from its header before any decoding (``--max-image-pixels``)."""
    max_request_pixels: int = 128 << 20
    """Pixels of all the images of one request together (every prompt of a batch), read from their headers before
    any is decoded (``--max-request-pixels``); a decoded RGB pixel takes 3 bytes, so the default bounds one request's
    decoded images near 400 MB."""
    request_timeout: float = 600.0
    """Seconds from admission after which a request still queued or decoding is aborted at the next decode step
    (``--request-timeout``); its answer has ``finish_reason.type == "abort"``."""
    image_roots: tuple[str, ...] = ()
    """Directories whose files ``image_data`` may name by path (``--image-root``, repeatable). Empty (the
    default): server paths are refused, and no answer says whether a path exists."""
    drain_seconds: float = 30.0
    """On SIGTERM: stop accepting, give requests in flight this long, then abort the rest (``--drain-seconds``)."""
    max_inflight_body_bytes: int = 256 << 20
    """Request bytes held by the server at once, over every request being received or handled
    (``--max-inflight-body-mb``): a request whose body would pass it is answered 503. Bytes are reserved as they
    arrive: a declared ``Content-Length`` reserves nothing."""
    max_queued_pixels: int = 256 << 20
    """Pixels (from their headers) of the images of every request admitted and not yet answered, server-wide
    (``--max-queued-pixels``): reserved before any is decoded, released when the request is answered or its client
    goes; a request that would pass it is answered 503. Only the processor's outputs wait in the queue (the decoded
    images are dropped once processed). Default: two largest requests' worth (2 × ``max_request_pixels``)."""
    max_queued_pixels_per_client: int | None = None
    """Of ``max_queued_pixels``, what one client — its address and, on loopback, its process
    (`vlrl.serving.peer_identity`) — may hold (``--max-queued-pixels-per-client``); beyond it: 503. None: half
    of ``max_queued_pixels``, and at least one largest request (``max_request_pixels``)."""
    body_timeout: float = 60.0
    """Seconds a client may take to send one request's body (``--body-timeout``); past it: 408, the bytes freed."""
    first_byte_timeout: float = 10.0
    """Seconds within which the first byte of a declared body must arrive (``--first-byte-timeout``); past it: 408.
    A connection that declares a body and sends nothing holds nothing, and not for long."""
    join_timeout: float = 120.0
    """Seconds a ``/init_weights_update_group`` may wait for the group's other ranks (``--join-timeout``). Joins run
    one at a time on a thread of their own (a second while one waits: 409), never on the request path's threads."""


class SamplingBody(BaseModel):
    """SGLang's ``sampling_params`` (the subset vlrl's server implements; others are rejected by name).
    ``logit_bias`` keys are token ids written as strings (SGLang's form); ``top_k`` -1 or SGLang's own default
    (2^30) mean off."""

    model_config = ConfigDict(extra="forbid", strict=True)
    n: int = Field(1, ge=1, le=1024)
    temperature: float = Field(1.0, ge=0, le=MAX_TEMPERATURE, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0, le=1, allow_inf_nan=False)
    top_k: int = Field(-1, ge=-1)
    max_new_tokens: int = Field(128, ge=0)  # 0: prefill only (SGLang's scoring request: input_token_logprobs)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = Field(None, max_length=4096)
    logit_bias: dict[str, float] | None = Field(None, max_length=1 << 20)

    def to_params(self, vocab: int | None = None) -> SamplingParams:
        """As a `SamplingParams`; token ids are checked against ``vocab`` (`BadRequest` naming the field)."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        bias: dict[int, float] = {}
        for key, value in (self.logit_bias or {}).items():
            if not key.strip().isdigit() or (vocab is not None and int(key) >= vocab):
                raise BadRequest(f"field 'sampling_params.logit_bias': key {key[:40]!r} is not a token id"
                                 + (f" in [0, {vocab})" if vocab is not None else ""))
            if value != value or abs(value) == float("inf"):
                raise BadRequest(f"field 'sampling_params.logit_bias': the bias of token {key} is not finite")
            bias[int(key)] = float(value)
        stop_ids = list(self.stop_token_ids or [])
        if any(t < 0 or (vocab is not None and t >= vocab) for t in stop_ids):
            raise BadRequest(f"field 'sampling_params.stop_token_ids': token ids must lie in [0, {vocab})")
        top_k = self.top_k if 0 < self.top_k < SGLANG_TOP_K_OFF else 0
        return SamplingParams(n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=top_k,
                              max_new_tokens=self.max_new_tokens, stop=stop, stop_token_ids=stop_ids, logit_bias=bias)


ImageItem = str | bytes  # a data URL, base64, or a server path; bytes: already decoded by the body parser


class GenerateBody(BaseModel):
    """SGLang's ``GenerateReqInput``: one prompt, or a batch (``text`` / ``input_ids`` a list of prompts, then
    ``image_data`` and ``rid`` one item per prompt) sharing one ``sampling_params``. With ``return_logprob``,
    ``logprob_start_len`` ≥ 0 scores the prompt's tokens from there on (``meta_info.input_token_logprobs``;
    `vlrl.rollout.prompt_logprobs`), and ``max_new_tokens`` 0 prefills only — SGLang's scoring request."""

    model_config = ConfigDict(extra="forbid", strict=True)  # (SGLang's schema coerces nothing either: "1" is no id)
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    image_data: ImageItem | list[ImageItem | list[ImageItem | None] | None] | None = None
    sampling_params: SamplingBody = Field(default_factory=SamplingBody)
    return_logprob: bool = False
    return_prompt_token_ids: bool = False
    rid: str | list[str] | None = None
    stream: bool = False
    logprob_start_len: int | list[int] = -1  # (a batch: one per prompt, as SGLang takes it)
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False

    @field_validator("top_logprobs_num")
    @classmethod
    def _no_top_logprobs(cls, value: int) -> int:
        if value != 0:  # refused, never answered without them
            raise ValueError("vlrl's server does not compute each position's top log-probs (SGLang's "
                             "input/output_top_logprobs); send 0")
        return value


class UpdateWeightsBody(BaseModel):
    """SGLang's ``UpdateWeightFromDiskReqInput`` (fields vlrl does not need are accepted and ignored)."""

    model_config = ConfigDict(extra="forbid")
    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    flush_cache: bool = True
    is_async: bool = False
    torch_empty_cache: bool = False
    keep_pause: bool = False
    recapture_cuda_graph: bool = False


class InitWeightsGroupBody(BaseModel):
    """SGLang's ``InitWeightsUpdateGroupReqInput``: join the trainer's weight-update group."""

    model_config = ConfigDict(extra="forbid")
    master_address: str
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=1)
    world_size: int = Field(ge=2)
    group_name: str = dist_sync.GROUP_NAME
    backend: str = "nccl"


class UpdateDistributedBody(BaseModel):
    """SGLang's ``UpdateWeightsFromDistributedReqInput``: one bucket of tensors broadcast from the trainer."""

    model_config = ConfigDict(extra="forbid")
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = dist_sync.GROUP_NAME
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None
    torch_empty_cache: bool = False


class PauseBody(BaseModel):
    """SGLang's ``PauseGenerationReqInput`` (`ContinuousBatcher.pause` says what each mode does here)."""

    model_config = ConfigDict(extra="forbid")
    mode: Literal["abort", "retract", "in_place", "partial"] = "abort"  # partial: vlrl's own (partial rollout)


class ContinueBody(BaseModel):
    """SGLang's ``ContinueGenerationReqInput`` (``torch_empty_cache`` is accepted; vlrl serve has no cache to empty)."""

    model_config = ConfigDict(extra="forbid")
    torch_empty_cache: bool = True


class BeginSessionBody(BaseModel):
    """SGLang's ``BeginWeightUpdateReqInput``: open a weight-update session (``selector``: the runners it covers —
    vlrl serve has one)."""

    model_config = ConfigDict(extra="forbid")
    selector: Literal["target", "draft", "all"] = "all"


class EndSessionBody(BaseModel):
    """SGLang's ``EndWeightUpdateReqInput``: close the weight-update session (no fields)."""

    model_config = ConfigDict(extra="forbid")


class DestroyGroupBody(BaseModel):
    """SGLang's ``DestroyWeightsUpdateGroupReqInput``: leave a weight-update group."""

    model_config = ConfigDict(extra="forbid")
    group_name: str = dist_sync.GROUP_NAME


class BadRequest(ValueError):
    """A malformed request; the message names the field."""


class ServerBusy(RuntimeError):
    """A well-formed request the server cannot hold now (a server-wide budget is full): answered 503, retry later."""


@dataclasses.dataclass(frozen=True)
class PromptBounds:
    """What a prompt is checked against while it is built: the model's context (``None``: unknown), the longest
    text that could fit it (context × the most characters one token covers, so the check never refuses a text
    that fits), the request's ``max_new_tokens``, and the server's `ServeLimits`."""

    context: int | None
    max_text_chars: int | None
    max_new_tokens: int
    limits: ServeLimits



def explain(err) -> str:
    """One readable line per validation error, naming the field."""
    lines = []
    for e in err.errors():
        field = ".".join(str(p) for p in e["loc"] if p != "body") or "(body)"
        if e["type"] == "extra_forbidden":
            hint = f" (sampling parameters: {', '.join(SAMPLING_NAMES)})" if field.startswith("sampling_params") else ""
            lines.append(f"field '{field}': not supported by vlrl's server{hint}")
        elif field == "(body)":
            lines.append("the body must be a JSON object sent with Content-Type: application/json")
        elif e["type"] == "json_invalid":
            lines.append(f"invalid JSON: {e['msg']}")
        else:
            lines.append(f"field '{field}': {e['msg']}")
    return "; ".join(lines)
