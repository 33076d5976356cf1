"""The weight versions a server's answer reports, read into what a `Trajectory` carries: `answer_version`, the
version an answer is tagged with (SGLang's ``meta_info.weight_version`` / ``weight_versions`` spans, vLLM's
``weight_versions`` per choice). Shared by the SGLang-API client (`vlrl.rollout.http_engine`) and the vLLM one
(`vlrl.rollout.vllm_client`)."""

from __future__ import annotations

from typing import Any


def answer_version(meta: dict[str, Any], version_at_start: int) -> int:
    """The weight version an answer is tagged with: the oldest of SGLang's ``weight_versions`` spans (a request
    that lived through an update — paused ``retract`` / ``in_place`` — holds tokens of both), else its
    ``weight_version``. A version that is no integer (SGLang's ``--weight-version`` default ``default``, or any
    label a server was started with) or none at all counts as the version current when the request started —
    the oldest the server can have used, so staleness is never under-estimated."""
    spans = meta.get("weight_versions") or []
    reported = [span.get("version") if isinstance(span, dict) else span[0] if isinstance(span, list) and span else None
                for span in spans] or [meta.get("weight_version")]
    versions = []
    for value in reported:
        try:
            versions.append(int(value))
        except (TypeError, ValueError):
            versions.append(version_at_start)
    return min(versions)
