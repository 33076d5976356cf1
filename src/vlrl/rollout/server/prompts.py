"""From a ``/generate`` body to the batcher's `Request`s and back: the images of each prompt (checked from their
headers before any is decoded), the prompts (tokenized, image tokens expanded, checked against the model's context),
and each trajectory in the shape of SGLang's answer."""

from __future__ import annotations

import base64
import binascii
import collections.abc
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
from PIL import Image

from vlrl.data.sample import Sample, SampleError, image_size, load_image
from vlrl.models.policy import Policy
from vlrl.rollout.prompt_logprobs import input_token_logprobs
from vlrl.rollout.server.schema import BadRequest, GenerateBody, ImageItem, PromptBounds, ServeLimits
from vlrl.rollout.types import Request, SamplingParams, Status, Trajectory
from vlrl.rollout.versions import version_spans


def model_context(policy: Policy) -> int | None:
    """The model's context length (its text config's ``max_position_embeddings``), if it states one."""
    config = policy.model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    value = getattr(text, "max_position_embeddings", None)
    return int(value) if value else None


def longest_token_chars(tokenizer: Any) -> int:
    """The most characters one token of ``tokenizer`` can stand for (vocabulary and added tokens; a byte-level
    token's mapped characters count one per byte, which is at least the characters it decodes to)."""
    longest = max((len(piece.encode("utf-8", "replace")) for piece in tokenizer.get_vocab()), default=1)
    added = [str(t) for t in getattr(tokenizer, "all_special_tokens", [])]
    return max([longest, *(len(t) for t in added)])


def _check_unicode(value: str, field: str) -> None:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:
        raise BadRequest(f"field '{field}': not valid Unicode (a lone surrogate at character {err.start})") from None


def _server_path(item: str, roots: Sequence[str]) -> str | None:
    """``item`` as a file path when it resolves inside one of ``roots``, else None — decided on the path alone,
    so the answer for a path outside the roots never depends on whether it exists."""
    if not roots or not item.startswith("/") or len(item) > 4096 or "\0" in item:
        return None
    real = os.path.realpath(item)
    for root in roots:
        base = os.path.realpath(root)
        if real.startswith(base.rstrip(os.sep) + os.sep):
            return real
    return None


def _image_source(item: ImageItem, k: int, limits: ServeLimits) -> tuple[str | bytes, bool]:
    """(what `load_image` reads, whether it is a server file) of an ``image_data`` item, or `BadRequest`."""
    where = f"field 'image_data[{k}]'"
    if isinstance(item, bytes):
        return item, False
    if item.startswith(("http://", "https://")):
        raise BadRequest(f"{where}: URLs are not fetched; send a data URL or base64")
    path = _server_path(item, limits.image_roots)
    if path is not None:
        if not os.path.isfile(path):
            raise BadRequest(f"{where}: no such file under the server's image roots")
        return path, True
    payload = item.split(",", 1)[1] if item.startswith("data:") and "," in item else item
    try:
        return base64.b64decode(payload, validate=True), False
    except (binascii.Error, ValueError):
        hint = "" if limits.image_roots else "; the server takes no file paths (vlrl serve --image-root)"
        raise BadRequest(f"{where}: neither a data URL nor valid base64{hint}") from None


def prompt_image_items(body: GenerateBody) -> list[list[ImageItem]]:
    """The ``image_data`` items of each prompt of ``body``, in SGLang's shapes: one prompt takes an item or a list of
    items; a batch takes one entry per prompt — either all items (one image each, ``None`` for none) or, when its
    first entry is a list, all lists (``[]`` or ``None`` for none). SGLang's schema decides the form by the first
    entry, so a batch like ``[None, [url]]`` is refused here as it is there."""
    data = body.image_data
    if not is_batched(body):
        if isinstance(data, list) and not all(isinstance(item, (str, bytes)) for item in data):
            raise BadRequest("field 'image_data': one prompt takes a string or a list of strings")
        return [[data] if isinstance(data, (str, bytes)) else list(data or [])]
    B = prompt_count(body)
    if data is None:
        return [[] for _ in range(B)]
    if not isinstance(data, list) or len(data) != B:
        raise BadRequest(f"field 'image_data': a batch of {B} prompts takes a list of {B} items")
    if isinstance(data[0], list):
        for i, entry in enumerate(data):
            if entry is not None and not isinstance(entry, list):
                raise BadRequest(f"field 'image_data[{i}]': the batch's first entry is a list, so every entry must be "
                                 "a list of that prompt's images ([] or null for none), as SGLang reads it")
        return [[item for item in entry or [] if item is not None] for entry in data]
    for i, entry in enumerate(data):
        if isinstance(entry, list):
            raise BadRequest(f"field 'image_data[{i}]': a list, but the batch's first entry is not one: SGLang reads "
                             "this batch as one image per prompt (make every entry a list, [] for a text-only prompt)")
    return [[] if entry is None else [entry] for entry in data]


def load_request_images(body: GenerateBody, bounds: PromptBounds, adapter: Any,
                        reserve: Callable[[int], None] | None = None) -> list[list[Image.Image]]:
    """Every prompt's decoded images. Before any pixel is decoded, each image's format and size are read from its
    header and checked (`read_image_headers`), and ``reserve(pixels)`` is called with the request's pixels (the
    server-wide budget of queued pixels: it raises to refuse)."""
    sources, total = read_image_headers(body, bounds, adapter)
    if reserve is not None and total:
        reserve(total)
    return decode_images(body, sources, bounds)


def decode_images(body: GenerateBody, sources: list[list[tuple]], bounds: PromptBounds) -> list[list[Image.Image]]:
    """The images `read_image_headers` found, decoded (each within ``max_image_pixels``)."""
    out = []
    for i, found in enumerate(sources):
        prefix = f"prompt {i} of the batch: " if is_batched(body) else ""
        images = []
        for k, (source, server_file) in enumerate(found):
            try:
                images.append(load_image(source, max_pixels=bounds.limits.max_image_pixels))
            except SampleError as err:
                raise BadRequest(f"{prefix}field 'image_data[{k}]': {_image_problem(err, server_file)}") from None
        out.append(images)
    return out


def read_image_headers(body: GenerateBody, bounds: PromptBounds, adapter: Any) -> tuple[list[list[tuple]], int]:
    """(each prompt's (source, is a server file) pairs, the pixels of all), every image's format and size read from
    its header (nothing decoded) and checked — each against ``max_image_pixels``, all of them together against
    ``max_request_pixels``, each prompt's vision tokens (from the sizes) against the context."""
    limits, batched = bounds.limits, is_batched(body)
    per_prompt = prompt_image_items(body)
    sources, total = [], 0
    for i, items in enumerate(per_prompt):
        prefix = f"prompt {i} of the batch: " if batched else ""
        found, vision_tokens = [], 0
        for k, item in enumerate(items):
            where = f"{prefix}field 'image_data[{k}]'"
            try:
                source, server_file = _image_source(item, k, limits)
                width, height = image_size(source)
            except BadRequest as err:
                raise BadRequest(f"{prefix}{err}") from None
            except SampleError as err:
                raise BadRequest(f"{where}: {_image_problem(err, server_file)}") from None
            if width * height > limits.max_image_pixels:
                raise BadRequest(f"{where}: {width}x{height} has more than the server's limit of "
                                 f"{limits.max_image_pixels} pixels (--max-image-pixels)")
            total += width * height
            if total > limits.max_request_pixels:
                count = sum(len(x) for x in per_prompt)
                raise BadRequest(f"field 'image_data': the request's {count} image(s) hold more than the server's limit "
                                 f"of {limits.max_request_pixels} pixels in all (--max-request-pixels); send fewer or "
                                 "smaller images per request")
            try:
                vision_tokens += adapter.image_token_count(width, height)
            except ValueError as err:  # a text-only model
                raise BadRequest(f"{where}: {err}") from None
            found.append((source, server_file))
        if bounds.context is not None and vision_tokens + bounds.max_new_tokens > bounds.context:
            raise BadRequest(f"{prefix}field 'image_data': {len(items)} image(s) take {vision_tokens} vision tokens; "
                             f"with sampling_params.max_new_tokens = {bounds.max_new_tokens} that exceeds the model "
                             f"context of {bounds.context} tokens")
        sources.append(found)
    return sources, total


def has_images(body: GenerateBody) -> bool:
    """Whether any prompt of ``body`` names an image (a text-only request never waits on the image thread)."""
    return any(prompt_image_items(body))


def encode_request_images(body: GenerateBody, bounds: PromptBounds, adapter: Any,
                          reserve: Callable[[int], None] | None = None) -> list[Any]:
    """Every prompt's processor outputs (`VisionInputs` or None): decoded (`load_request_images`), processed, and
    the decoded images dropped — only the processor's tensors wait in the queue."""
    return process_images(body, load_request_images(body, bounds, adapter, reserve), adapter)


def process_images(body: GenerateBody, images: list[list[Image.Image]], adapter: Any) -> list[Any]:
    """Each prompt's decoded images through the family's processor (`VisionInputs`, or None for no image)."""
    out = []
    for i, prompt_images in enumerate(images):
        try:
            out.append(adapter.encode_images(prompt_images))
        except ValueError as err:
            prefix = f"prompt {i} of the batch: " if is_batched(body) else ""
            raise BadRequest(f"{prefix}field 'image_data': {err}") from None
    return out


def _image_problem(err: SampleError, server_file: bool) -> str:
    """What is wrong with an image, without echoing a server file's bytes (Pillow's messages can quote them)."""
    message = str(err)
    if "is not accepted" in message:
        return message.split(": ", 1)[-1] if not server_file else "format " + message.split("format ", 1)[-1]
    if server_file:
        return "the file is not a decodable PNG, JPEG, WEBP, BMP or GIF image"
    return "not a decodable PNG, JPEG, WEBP, BMP or GIF image" + (f" ({message.split(': ', 1)[-1][:200]})" if ": " in message else "")


def is_batched(body: GenerateBody) -> bool:
    """Whether ``body`` holds a batch of prompts (SGLang: ``text`` or ``input_ids`` is a list of prompts)."""
    return isinstance(body.text, list) or bool(body.input_ids and isinstance(body.input_ids[0], list))


def prompt_count(body: GenerateBody) -> int:
    if not is_batched(body):
        return 1
    return len(body.text) if body.text is not None else len(body.input_ids)


def build_requests(policy: Policy, body: GenerateBody, rids: collections.abc.Iterator[str],
                   bounds: PromptBounds | None = None, visions: list[Any] | None = None) -> list[Request]:
    """Turn a `GenerateBody` into its `Request` (one prompt) or requests (a batch), in order; a prompt
    without ``rid`` is named by ``rids``. With ``bounds``, every prompt is checked against the context (text
    length before tokenizing, prompt + max_new_tokens after). ``visions``: each prompt's processed images, from
    `encode_request_images` (made here when not given)."""
    bounds = bounds or PromptBounds(None, None, 0, ServeLimits())
    if (body.text is None) == (body.input_ids is None):
        raise BadRequest("give exactly one of 'text' or 'input_ids'")
    if body.stream:
        raise BadRequest("field 'stream': streaming is not supported")
    stops = [body.sampling_params.stop] if isinstance(body.sampling_params.stop, str) else body.sampling_params.stop or []
    for k, stop in enumerate(stops):
        _check_unicode(stop, f"sampling_params.stop[{k}]")
    if is_batched(body) and any(isinstance(p, int) for p in body.input_ids or []):
        raise BadRequest("field 'input_ids': a batch is a list of token-id lists")
    if visions is None:
        visions = encode_request_images(body, bounds, policy.adapter)
    if not is_batched(body):
        if isinstance(body.rid, list):
            raise BadRequest("field 'rid': one prompt takes one string")
        return [build_request(policy, body.text, body.input_ids, visions[0], body.rid or next(rids), bounds)]
    prompts = body.text if body.text is not None else body.input_ids
    B = len(prompts)
    rid = body.rid if body.rid is not None else [next(rids) for _ in range(B)]
    if not isinstance(rid, list) or len(rid) != B:
        raise BadRequest(f"field 'rid': a batch of {B} prompts takes a list of {B} items")
    out = []
    for i, prompt in enumerate(prompts):
        try:
            text, ids = (prompt, None) if body.text is not None else (None, prompt)
            out.append(build_request(policy, text, ids, visions[i], rid[i], bounds))
        except BadRequest as err:
            raise BadRequest(f"prompt {i} of the batch: {err}") from None
    return out


def build_request(policy: Policy, text: str | None, input_ids: list[int] | None, vision: Any, rid: str,
                  bounds: PromptBounds | None = None) -> Request:
    """One prompt as a `Request`: tokenize ``text`` and expand its image placeholders by ``vision`` (its images'
    processor outputs, `VisionInputs` or None; a list of decoded images is processed here)."""
    bounds = bounds or PromptBounds(None, None, 0, ServeLimits())
    _check_unicode(rid, "rid")
    if text is not None:
        if bounds.max_text_chars is not None and len(text) > bounds.max_text_chars:
            raise BadRequest(f"field 'text': {len(text)} characters cannot fit the model context of {bounds.context} "
                             "tokens")
        _check_unicode(text, "text")
    adapter = policy.adapter
    try:
        if isinstance(vision, list):
            vision = adapter.encode_images(vision)
        if text is not None:
            ids = adapter.encode_text(adapter.expand_image_tokens(text, vision) if vision is not None else text)
        else:
            ids = _expand_ids(policy, list(input_ids), vision)
    except ValueError as err:
        raise BadRequest(f"field 'image_data': {err}") from None
    if not ids:
        raise BadRequest("the prompt is empty")
    vocab = policy.model.get_input_embeddings().num_embeddings
    if min(ids) < 0 or max(ids) >= vocab:
        raise BadRequest(f"field 'input_ids': token ids must lie in [0, {vocab})")
    check_vision_tokens(policy, ids, vision, "text" if text is not None else "input_ids")
    if bounds.context is not None and len(ids) + bounds.max_new_tokens > bounds.context:
        raise BadRequest(f"field 'sampling_params.max_new_tokens': {len(ids)} prompt tokens + max_new_tokens "
                         f"{bounds.max_new_tokens} exceed the model context of {bounds.context} tokens")
    sample = Sample(id=rid, task="serve", messages=[{"role": "user", "content": ""}])
    return Request(sample=sample, prompt_ids=ids, vision=vision, images=[])  # (decoded images not kept queued)


def check_vision_tokens(policy: Policy, ids: list[int], vision: Any, field: str) -> None:
    """A prompt whose vision tokens do not match its images is refused here, at admission (`BadRequest` naming
    ``field``), instead of failing the decode batch it would join: the tokens image features are scattered into
    must be exactly those of its images' markup, no video token may appear (the server takes no videos), and the
    family's own positions must build for it (Qwen's M-RoPE finds each image by its ``<|vision_start|>``)."""
    adapter = policy.adapter
    scattered = getattr(adapter, "image_token_id", None)
    scattered = scattered if scattered is not None else getattr(adapter, "image_placeholder_id", None)
    video = getattr(adapter, "video_token_id", None)
    if video is not None and video in ids:
        raise BadRequest(f"field '{field}': the prompt holds {ids.count(video)} video token(s) "
                         f"({policy.tokenizer.convert_ids_to_tokens(video)}); this server takes images only")
    if scattered is None:
        return
    want = sum(adapter.encode_text(r).count(scattered) for r in vision.replacements) if vision is not None else 0
    if ids.count(scattered) != want:
        raise BadRequest(f"field '{field}': the prompt holds {ids.count(scattered)} image token(s) "
                         f"({policy.tokenizer.convert_ids_to_tokens(scattered)}) but its "
                         f"{0 if vision is None else vision.num_images} image(s) take {want}")
    if vision is not None:
        try:
            adapter.segment_position_ids(policy.model, torch.tensor(ids), vision)
        except Exception as err:  # noqa: BLE001  (whatever the family's code raises on a malformed layout)
            raise BadRequest(f"field '{field}': the prompt's image markup does not fit its images (each image's "
                             f"placeholder must stand in the family's markup): {type(err).__name__}: "
                             f"{str(err)[:200]}") from None


def _expand_ids(policy: Policy, ids: list[int], vision) -> list[int]:
    """Token ids with image tokens already expanded pass through; one placeholder per image is expanded (by the
    family's adapter: each image's markup as its processor expands it)."""
    return policy.adapter.expand_ids(ids, vision)


def logprob_starts(body: GenerateBody, requests: Sequence[Request]) -> list[int] | None:
    """Where each prompt's scored tokens start (SGLang's ``logprob_start_len``; -1: none, as its length), or None
    when ``return_logprob`` is off (SGLang ignores the field then). A start past the prompt is refused (SGLang
    aborts the request, naming the prompt's length)."""
    if not body.return_logprob:
        return None
    value, count = body.logprob_start_len, len(requests)
    if isinstance(value, list) and (not is_batched(body) or len(value) != count):
        raise BadRequest(f"field 'logprob_start_len': a list takes one start per prompt of a batch ({count} "
                         f"prompt(s), {len(value)} start(s))")
    starts = value if isinstance(value, list) else [value] * count
    out = []
    for i, (start, request) in enumerate(zip(starts, requests, strict=True)):
        length = len(request.prompt_ids)
        if not -1 <= start <= length:
            prefix = f"prompt {i} of the batch: " if is_batched(body) else ""
            raise BadRequest(f"{prefix}field 'logprob_start_len': {start} is not in [-1, {length}] (the prompt holds "
                             f"{length} tokens, its image tokens expanded)")
        out.append(length if start == -1 else start)
    return out


def sglang_output(policy: Policy, t: Trajectory, sampling: SamplingParams, *, return_logprob: bool,
                  abort_message: str = "aborted by a weight update", return_prompt_ids: bool = False,
                  logprob_start: int | None = None, return_text: bool = False) -> dict[str, Any]:
    """One trajectory in the shape of SGLang's ``/generate`` answer (``return_prompt_ids``: with SGLang's
    ``prompt_token_ids``, the ids it sampled from — the prompt with its image tokens expanded). With
    ``return_logprob``: ``output_token_logprobs`` and ``input_token_logprobs`` (from ``logprob_start``, scored in
    ``t.prompt_logp``; none scored: ``[]``); ``return_text``: each token's text in them (SGLang's
    ``return_text_in_logprobs``)."""
    ids = t.response_ids.tolist()
    text = policy.tokenizer.decode(ids, skip_special_tokens=True)
    if t.status is Status.ABORTED:
        finish: dict[str, Any] = {"type": "abort", "message": abort_message}
    elif t.status is Status.TRUNCATED:
        finish = {"type": "length", "length": len(ids)}
    elif ids and (ids[-1] in policy.eos_token_ids or ids[-1] in sampling.stop_token_ids):
        finish = {"type": "stop", "matched": ids[-1]}
    else:
        matched = next((s for s in sampling.stop if s in text), "")
        finish = {"type": "stop", "matched": matched}
        if matched:
            text = text[: text.rfind(matched)]  # SGLang trims the stop string from the text
    meta: dict[str, Any] = {"id": t.sample.id, "finish_reason": finish, "prompt_tokens": len(t.prompt_ids),
                            "completion_tokens": len(ids), "cached_tokens": 0, "weight_version": str(t.weight_version)}
    if t.token_versions is not None:  # continued across a weight update (pause mode partial): each span's version
        meta["weight_versions"] = version_spans(t.token_versions)
    if return_logprob:
        texts = (lambda tokens: [policy.tokenizer.decode([k]) for k in tokens]) if return_text else (lambda _: None)
        output_text = texts(ids) or [None] * len(ids)
        meta["output_token_logprobs"] = [[float(lp), int(i), x] for lp, i, x in
                                         zip(t.behaviour_logp.tolist(), ids, output_text, strict=True)]
        prompt = t.prompt_ids.tolist()
        start = len(prompt) if logprob_start is None else logprob_start
        if t.prompt_logp is None and start < len(prompt) - 1:  # not scored (aborted before its batch): none
            start = len(prompt)
        meta["input_token_logprobs"] = input_token_logprobs(prompt, t.prompt_logp, start, texts(prompt[start:]))
    out = {"text": text, "output_ids": ids, "meta_info": meta}
    if return_prompt_ids:
        out["prompt_token_ids"] = t.prompt_ids.tolist()
    return out

