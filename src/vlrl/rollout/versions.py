"""The weight versions a server's answer reports, read into what a `Trajectory` carries: `answer_version`, the
version an answer is tagged with (SGLang's ``meta_info.weight_version`` / ``weight_versions`` spans, vLLM's
``weight_versions`` per choice), and `token_versions`, the version of each of its tokens (vlrl serve and vLLM report
spans ``{"version", "start", "end"}`` over the output tokens; an answer continued across an update holds several). Shared by the SGLang-API client (`vlrl.rollout.http_engine`) and the vLLM one
(`vlrl.rollout.vllm_client`)."""

from __future__ import annotations

from typing import Any

import torch


def answer_version(meta: dict[str, Any], version_at_start: int) -> int:
    """The weight version an answer is tagged with: the oldest of SGLang's ``weight_versions`` spans (a request
    that lived through an update — paused ``retract`` / ``in_place`` — holds tokens of both), else its
    ``weight_version``. A version that is no integer (SGLang's ``--weight-version`` default ``default``, or any
    label a server was started with) or none at all counts as the version current when the request started —
    the oldest the server can have used, so staleness is never under-estimated."""
    spans = meta.get("weight_versions") or []
    reported = [span.get("version") if isinstance(span, dict) else span[0] if isinstance(span, list) and span else None
                for span in spans] or [meta.get("weight_version")]
    return min(_version(value, version_at_start) for value in reported)


def token_versions(meta: dict[str, Any], length: int, version_at_start: int) -> torch.Tensor | None:
    """(length,) long: the version of each of an answer's ``length`` output tokens, from spans
    ``{"version", "start", "end"}`` (``end`` exclusive) that cover every token; None when the answer reports no such
    spans (its tokens are then all `answer_version`'s) or they do not cover it."""
    spans = [s for s in meta.get("weight_versions") or [] if isinstance(s, dict) and "start" in s and "end" in s]
    if not spans:
        return None
    versions = torch.full((length,), -1, dtype=torch.long)
    for span in spans:
        versions[int(span["start"]) : int(span["end"])] = _version(span.get("version"), version_at_start)
    return versions if length and bool((versions >= 0).all()) else None


def version_spans(versions: torch.Tensor) -> list[dict[str, Any]]:
    """The runs of equal versions in ``versions`` (R,) as spans ``{"version": "3", "start": 0, "end": 12}`` (the
    form vLLM and vlrl serve report; `token_versions` reads it back)."""
    spans: list[dict[str, Any]] = []
    for position, version in enumerate(versions.tolist()):
        if spans and spans[-1]["version"] == str(version):
            spans[-1]["end"] = position + 1
        else:
            spans.append({"version": str(version), "start": position, "end": position + 1})
    return spans


def _version(value: Any, version_at_start: int) -> int:
    """A reported version as vlrl's integer; a label that is no integer (or none) counts as ``version_at_start``."""
    try:
        return int(value)
    except (TypeError, ValueError):
        return version_at_start
